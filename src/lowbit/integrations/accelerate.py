"""Hugging Face Accelerate: register lowbit on the prepared model.

    from accelerate import Accelerator
    from lowbit.integrations.accelerate import register

    accelerator = Accelerator()
    model, opt, loader = accelerator.prepare(model, opt, loader)
    state = register(accelerator, model, codec="qsgd:bits=4")

Accelerate's ``DistributedDataParallelKwargs(comm_hook=...)`` takes only its own enum of hooks and ignores
a callable, so lowbit registers on the prepared model directly: :func:`lowbit.ddp.register` on the
``DistributedDataParallel`` it builds whenever several processes run, :func:`lowbit.fsdp.register` on the
model its FSDP2 plugin (``FullyShardedDataParallelPlugin(fsdp_version=2)``, GPU) sharded. On CPU
Accelerate ignores the FSDP plugin and builds a DDP model: DDP's hook is registered then. With one
process there is nothing to compress: ``None`` is returned, with a warning (rank 0, once) that says so.
Note that ``accelerate launch --cpu --num_processes N`` starts *one* process (without
``--mpirun_hostfile``); ``accelerate launch --multi_gpu --num_processes N`` starts N, on CPU too when the
script builds ``Accelerator(cpu=True)`` (docs/ddp.md, "Launching several processes"). The Hugging Face
Trainer prepares its model itself: :mod:`lowbit.integrations.transformers`.
"""

from __future__ import annotations

from typing import Any, Optional

import lowbit.ddp
from lowbit.extras import require
from lowbit.integrations._register import WRAPPERS, State, check_options, register_built

require("accelerate", "accelerate", "lowbit.integrations.accelerate")

__all__ = ["register"]


def register(accelerator: Any, model: Any, *, config: Any = None, process_group: Any = None,
             **options: Any) -> Optional[State]:
    """Register lowbit on ``model`` as returned by ``accelerator.prepare``: DDP's comm hook on a
    ``DistributedDataParallel``, FSDP2's exchanges on a ``fully_shard`` model. The options are validated on
    every run, one process included, so a typo fails on a laptop too.

    Args:
        accelerator: the ``accelerate.Accelerator``.
        model: the model ``accelerator.prepare`` returned (a ``DistributedDataParallel``, or an FSDP2 model
            with the FSDP2 plugin, when several processes run).
        config: a :class:`lowbit.ddp.DDPConfig` or :class:`lowbit.fsdp.FSDPConfig`, instead of ``**options``.
        process_group: goes to :func:`lowbit.ddp.register`.
        **options: the options of :func:`lowbit.ddp.register` or :func:`lowbit.fsdp.register`, keyword-only.

    Returns:
        The :class:`lowbit.ddp.LowbitState` or :class:`lowbit.fsdp.FSDPState`, or ``None`` (with a
        warning) when one process runs.

    Raises:
        ValueError: an option out of range for the register that serves (naming it), ``config`` together
            with options, or, with several processes, a model that is neither a DDP nor an FSDP2 model;
            :class:`lowbit.ddp.ConfigMismatchError` as the registers.
        TypeError: an option neither register has.
    """
    opts = check_options(config, options, "lowbit.integrations.accelerate.register")
    if accelerator.num_processes <= 1:
        lowbit.ddp.warn_uncompressed(
            f"Accelerate runs 1 process ({accelerator.distributed_type}), so the model is not a "
            "DistributedDataParallel and nothing is exchanged. `accelerate launch --cpu --num_processes N` "
            "starts one process; on CPU use `accelerate launch --multi_gpu --num_processes N` with "
            "Accelerator(cpu=True), or torchrun --nproc-per-node N (docs/ddp.md, 'Launching several processes')")
        return None
    state = register_built(model, opts, process_group=process_group)
    if state is None:
        raise ValueError("lowbit.integrations.accelerate.register expects the model returned by accelerator.prepare; "
                         f"got a {type(model).__name__}, {WRAPPERS}")
    return state
