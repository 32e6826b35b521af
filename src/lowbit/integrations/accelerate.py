"""Hugging Face Accelerate (and so the Hugging Face Trainer): register lowbit on the prepared model.

    from accelerate import Accelerator
    from lowbit.integrations.accelerate import register

    accelerator = Accelerator()
    model, opt, loader = accelerator.prepare(model, opt, loader)
    state = register(accelerator, model, codec="qsgd:bits=4")

Accelerate's ``DistributedDataParallelKwargs(comm_hook=...)`` takes only its own enum of hooks and ignores
a callable; the prepared model is a plain ``DistributedDataParallel`` whenever several processes run, so
lowbit registers on it directly. With one process there is nothing to compress: ``None`` is returned,
with a warning (rank 0, once) that says so. Note that ``accelerate launch --cpu --num_processes N`` starts
*one* process (without ``--mpirun_hostfile``); ``accelerate launch --multi_gpu --num_processes N`` starts N,
on CPU too when the script builds ``Accelerator(cpu=True)`` (docs/ddp.md, "Launching several processes").
"""

from __future__ import annotations

from typing import Any

import lowbit.ddp
from lowbit.extras import require

require("accelerate", "accelerate", "lowbit.integrations.accelerate")

__all__ = ["register"]


def register(accelerator: Any, model: Any, *, config: lowbit.ddp.DDPConfig | None = None, process_group: Any = None,
             **options: Any) -> lowbit.ddp.LowbitState | None:
    """Install lowbit's comm hook on ``model`` as returned by ``accelerator.prepare``. The options are
    validated on every run, one process included, so a typo fails on a laptop too.

    Args:
        accelerator: the ``accelerate.Accelerator``.
        model: the model ``accelerator.prepare`` returned (a ``DistributedDataParallel`` when several
            processes run).
        config: a :class:`lowbit.ddp.DDPConfig`, instead of ``**options``.
        process_group: goes to :func:`lowbit.ddp.register`.
        **options: :class:`lowbit.ddp.DDPConfig`'s options, keyword-only.

    Returns:
        The :class:`lowbit.ddp.LowbitState`, or ``None`` (with a warning) when one process runs.

    Raises:
        ValueError: an option out of range (naming it), ``config`` together with options, or a model that
            is not a DDP model with several processes; :class:`lowbit.ddp.ConfigMismatchError` as
            :func:`lowbit.ddp.register`.
        TypeError: an option :class:`lowbit.ddp.DDPConfig` does not have.
    """
    config = lowbit.ddp.DDPConfig.of(config, **options)
    if accelerator.num_processes <= 1:
        lowbit.ddp.warn_uncompressed(
            f"Accelerate runs 1 process ({accelerator.distributed_type}), so the model is not a "
            "DistributedDataParallel and nothing is exchanged. `accelerate launch --cpu --num_processes N` "
            "starts one process; on CPU use `accelerate launch --multi_gpu --num_processes N` with "
            "Accelerator(cpu=True), or torchrun --nproc-per-node N (docs/ddp.md, 'Launching several processes')")
        return None
    if not hasattr(model, "register_comm_hook"):
        raise ValueError("lowbit.integrations.accelerate.register expects the model returned by "
                         f"accelerator.prepare (a DistributedDataParallel), got {type(model).__name__}")
    return lowbit.ddp.register(model, process_group=process_group, config=config)
