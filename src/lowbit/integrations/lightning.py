"""PyTorch Lightning: low-precision gradients with one callback, on CPU and GPU alike.

    from lowbit.integrations.lightning import LowbitCallback

    trainer = lightning.Trainer(strategy="ddp", devices=2, callbacks=[LowbitCallback(codec="qsgd:bits=4")])

Lightning registers comm hooks itself only on CUDA (``DDPStrategy(ddp_comm_hook=...)``), so passing
lowbit's hook there silently does nothing on CPU. The callback instead registers lowbit on the DDP model
Lightning built (``trainer.strategy.model``) when fitting starts, so it works on every accelerator. It
also keeps the error-feedback residuals in Lightning's checkpoints: every rank's state (they differ) is
gathered into the checkpoint that rank 0 writes, and each rank takes its own back on load.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch.distributed as dist

import lowbit.ddp
from lowbit.extras import require

pl = require("lightning.pytorch", "lightning", "lowbit.integrations.lightning")

__all__ = ["LowbitCallback"]


class LowbitCallback(pl.Callback):
    """Register lowbit's DDP comm hook on the model Lightning wraps, when fitting starts. The options are
    validated here, when the callback is built, so a typo fails before training does. ``state`` holds the
    :class:`lowbit.ddp.LowbitState` once fitting has started.

    Args:
        warn_after: steps after which a hook that was never called is warned about (the strategy bypassed it).
        config: a :class:`lowbit.ddp.DDPConfig`, instead of ``**options``.
        process_group: goes to :func:`lowbit.ddp.register`.
        **options: :class:`lowbit.ddp.DDPConfig`'s options (``codec``, ``policy``, ``algorithm``,
            ``error_feedback``, ...), keyword-only.

    Raises:
        ValueError: an option out of range (naming it), or ``config`` together with options.
        TypeError: an option :class:`lowbit.ddp.DDPConfig` does not have.
    """

    def __init__(self, *, warn_after: int = 10, config: lowbit.ddp.DDPConfig | None = None,
                 process_group: Any = None, **options: Any) -> None:
        self.config = lowbit.ddp.DDPConfig.of(config, **options)
        self.process_group = process_group
        self.warn_after = warn_after
        self.state: lowbit.ddp.LowbitState | None = None
        self._pending: dict[str, Any] | None = None
        self._warned = False

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        model = trainer.strategy.model
        if not hasattr(model, "register_comm_hook"):
            lowbit.ddp.warn_uncompressed(
                f"the Lightning strategy {type(trainer.strategy).__name__} ({trainer.world_size} process(es)) did "
                "not wrap the model in DistributedDataParallel: use strategy='ddp' with devices=2 or more "
                "(Lightning starts the processes), or run the script under torchrun --nproc-per-node N")
            return
        if self.state is None:
            self.state = lowbit.ddp.register(model, process_group=self.process_group, config=self.config)
        if self._pending is not None:
            self.state.load_state_dict(self._pending)
            self._pending = None

    def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
        s = self.state
        if s is not None and not self._warned and trainer.global_step >= self.warn_after and s.iter == 0:
            self._warned = True
            warnings.warn(f"lowbit: {trainer.global_step} steps and the comm hook has not been called once: "
                          "gradients are not being compressed", RuntimeWarning, stacklevel=2)

    def state_dict(self) -> dict[str, Any]:
        """Every rank's lowbit state, gathered (Lightning writes the checkpoint on rank 0 only)."""
        if self.state is None:
            return {}
        mine = self.state.state_dict()
        if dist.is_available() and dist.is_initialized():
            every: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(every, mine)
            return {"per_rank": every}
        return {"per_rank": [mine]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        per_rank = state_dict.get("per_rank")
        if not per_rank:
            return
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        if rank >= len(per_rank):
            raise ValueError(f"lowbit: the checkpoint holds {len(per_rank)} ranks' states, this is rank {rank}")
        mine = per_rank[rank]
        if self.state is not None:
            self.state.load_state_dict(mine)
        else:
            self._pending = mine  # restored when fitting starts and the hook exists
