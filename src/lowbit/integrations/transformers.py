"""Hugging Face Trainer: low-precision gradients with one line.

    from lowbit.integrations.transformers import register

    trainer = transformers.Trainer(model=model, args=args, train_dataset=data)
    register(trainer, codec="qsgd:bits=4")   # off: delete this line
    trainer.train()

The Trainer wraps the model (``accelerator.prepare``) inside ``train()``, and a callback's hooks receive
the *unwrapped* model; the wrapped one is ``trainer.model_wrapped``. So the callback holds the Trainer and,
when training begins, registers lowbit on what the Trainer built: :func:`lowbit.ddp.register` on a
``DistributedDataParallel`` (several processes, CPU or GPU), :func:`lowbit.fsdp.register` on an FSDP2 model
(``fsdp=...`` with ``fsdp_config={"version": 2}``, on GPU; on CPU Accelerate builds a DDP model instead,
and DDP's hook is registered). With one process, or a wrapper lowbit has no hook for (DeepSpeed, FSDP1),
it installs nothing and says so (rank 0, once).

The error-feedback residuals are not in the Trainer's checkpoints (it keeps callbacks' state as JSON):
after a resume they start again from zero, which costs one step's compression error, not correctness.
"""

from __future__ import annotations

import warnings
from typing import Any, Optional

from lowbit.comm.registration import LAUNCH_HINT, warn_uncompressed
from lowbit.extras import require
from lowbit.integrations._register import WRAPPERS, State, check_options, register_built

transformers = require("transformers", "transformers", "lowbit.integrations.transformers")

__all__ = ["LowbitCallback", "register"]


class LowbitCallback(transformers.TrainerCallback):
    """Register lowbit on the model ``trainer`` wraps, when training begins. The options are checked here,
    when the callback is built, so a typo fails before training does. ``state`` holds the
    :class:`lowbit.ddp.LowbitState` (or :class:`lowbit.fsdp.FSDPState`) once training has begun.

    Args:
        trainer: the ``transformers.Trainer`` whose wrapped model (``trainer.model_wrapped``) is registered.
        warn_after: steps after which a hook that was never called is warned about.
        config: a :class:`lowbit.ddp.DDPConfig` or :class:`lowbit.fsdp.FSDPConfig`, instead of ``**options``.
        process_group: goes to :func:`lowbit.ddp.register`.
        **options: the options of :func:`lowbit.ddp.register` or :func:`lowbit.fsdp.register` (``codec``,
            ``error_feedback``, ``policy``, ...), keyword-only.

    Raises:
        ValueError: an option out of range for both registers (naming it), or ``config`` with options.
        TypeError: an option neither register has.
    """

    def __init__(self, trainer: Any, *, warn_after: int = 10, config: Any = None, process_group: Any = None,
                 **options: Any) -> None:
        self.trainer = trainer
        self.options = check_options(config, options, "lowbit.integrations.transformers")
        self.process_group = process_group
        self.warn_after = warn_after
        self.state: Optional[State] = None
        self._model: Any = None
        self._warned = False

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        model = self.trainer.model_wrapped
        if self.state is not None and model is self._model:
            return  # train() again on the same wrapped model: its hook is in place
        self.state = register_built(model, self.options, process_group=self.process_group)
        self._model = model
        if self.state is None:
            what = LAUNCH_HINT if args.world_size <= 1 else WRAPPERS
            warn_uncompressed(f"the Hugging Face Trainer runs {args.world_size} process(es) and its model is a "
                              f"{type(model).__name__}, {what}")

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        s = self.state
        if s is not None and not self._warned and state.global_step >= self.warn_after and s.iter == 0:
            self._warned = True
            warnings.warn(f"lowbit: {state.global_step} steps and lowbit's exchange has not been called once: "
                          "gradients are not being compressed", RuntimeWarning, stacklevel=2)


def register(trainer: Any, *, config: Any = None, process_group: Any = None, **options: Any) -> LowbitCallback:
    """Add a :class:`LowbitCallback` to ``trainer`` (before ``trainer.train()``) and return it; its
    ``state`` is filled in when training begins.

    Args:
        trainer: a ``transformers.Trainer``.
        config: a :class:`lowbit.ddp.DDPConfig` or :class:`lowbit.fsdp.FSDPConfig`, instead of ``**options``.
        process_group: goes to :func:`lowbit.ddp.register`.
        **options: the options of :func:`lowbit.ddp.register` or :func:`lowbit.fsdp.register`, keyword-only.

    Returns:
        The callback (``callback.state``: the lowbit state once training has begun, None before, or when
        nothing is compressed).

    Raises:
        ValueError, TypeError: as :class:`LowbitCallback`.
    """
    cb = LowbitCallback(trainer, config=config, process_group=process_group, **options)
    trainer.add_callback(cb)
    return cb

