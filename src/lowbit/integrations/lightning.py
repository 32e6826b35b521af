"""PyTorch Lightning: low-precision gradients with one callback, on CPU and GPU alike.

    from lowbit.integrations.lightning import LowbitCallback

    trainer = lightning.Trainer(strategy="ddp", devices=2, callbacks=[LowbitCallback(codec="qsgd:bits=4")])

Lightning registers comm hooks itself only on CUDA (``DDPStrategy(ddp_comm_hook=...)``), so passing
lowbit's hook there silently does nothing on CPU. The callback instead registers lowbit on the model
Lightning built (``trainer.strategy.model``) when fitting starts, so it works on every accelerator:
:func:`lowbit.ddp.register` on the DDP model of ``strategy="ddp"``, :func:`lowbit.fsdp.register` on a
model that ``configure_model`` sharded with ``fully_shard`` under ``ModelParallelStrategy`` (FSDP2; it
runs on CPU with gloo too, where ``strategy="fsdp"``, FSDP1, refuses CPU). ``ModelParallelStrategy()``'s
defaults make the data-parallel mesh one rank wide per node (``data_parallel_size`` = the number of
nodes, the devices go to tensor parallelism): FSDP over it exchanges nothing, so the callback installs
nothing and says so; ``ModelParallelStrategy(data_parallel_size=N, tensor_parallel_size=1)`` shards over
N ranks. It also keeps the error-feedback residuals in Lightning's checkpoints: every rank's state (they
differ) is gathered into the checkpoint that rank 0 writes, and each rank takes its own back on load.
"""

from __future__ import annotations

import warnings
from typing import Any, Optional

import torch.distributed as dist

from lowbit.comm.registration import LAUNCH_HINT, warn_uncompressed
from lowbit.extras import require
from lowbit.integrations._register import State, check_options, fsdp_mesh_size, is_ddp, is_fsdp, register_built

pl = require("lightning.pytorch", "lightning", "lowbit.integrations.lightning")

__all__ = ["LowbitCallback", "data_parallel_width"]


def data_parallel_width(strategy: Any, model: Any) -> Optional[int]:
    """The ranks an FSDP2 model's gradients are reduced over: the strategy's ``data_parallel`` mesh
    dimension where it has one (``ModelParallelStrategy``), else the mesh of the model's sharded
    parameters (None: neither is known)."""
    try:
        mesh = strategy.device_mesh
    except (AttributeError, RuntimeError):  # no mesh, or asked before the processes started
        mesh = None
    names = getattr(mesh, "mesh_dim_names", None) or ()
    if "data_parallel" in names:
        return int(mesh["data_parallel"].size())
    return fsdp_mesh_size(model)


class LowbitCallback(pl.Callback):
    """Register lowbit on the model Lightning built, when fitting starts: DDP's comm hook on a
    ``DistributedDataParallel``, FSDP2's exchanges on a ``fully_shard`` model. The options are checked
    here, when the callback is built, so a typo fails before training does. ``state`` holds the
    :class:`lowbit.ddp.LowbitState` (or :class:`lowbit.fsdp.FSDPState`) once fitting has started.

    Args:
        warn_after: steps after which an exchange that was never called is warned about (the strategy
            bypassed it).
        config: a :class:`lowbit.ddp.DDPConfig` or :class:`lowbit.fsdp.FSDPConfig`, instead of ``**options``.
        process_group: goes to :func:`lowbit.ddp.register`.
        **options: the options of :func:`lowbit.ddp.register` or :func:`lowbit.fsdp.register` (``codec``,
            ``policy``, ``error_feedback``, ...), keyword-only.

    Raises:
        ValueError: an option out of range for both registers (naming it), or ``config`` with options.
        TypeError: an option neither register has.
    """

    def __init__(self, *, warn_after: int = 10, config: Any = None, process_group: Any = None,
                 **options: Any) -> None:
        self.options = check_options(config, options, "lowbit.integrations.lightning.LowbitCallback")
        self.process_group = process_group
        self.warn_after = warn_after
        self.state: Optional[State] = None
        self._pending: dict[str, Any] | None = None
        self._warned = False

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        strategy = trainer.strategy
        model = strategy.model
        name = type(strategy).__name__
        if self.state is None:
            if is_fsdp(model) and data_parallel_width(strategy, model) == 1:
                warn_uncompressed(
                    f"the Lightning strategy {name} shards the model over a data-parallel mesh of 1 rank "
                    f"({trainer.world_size} process(es)), so FSDP exchanges no gradient: ModelParallelStrategy's "
                    "defaults give data parallelism one rank per node and the devices to tensor parallelism; use "
                    "ModelParallelStrategy(data_parallel_size=N, tensor_parallel_size=1) and "
                    "fully_shard(..., mesh=self.device_mesh['data_parallel']) in configure_model")
                return
            if not (is_fsdp(model) or is_ddp(model)):
                warn_uncompressed(
                    f"the Lightning strategy {name} ({trainer.world_size} process(es)) neither wrapped the model in "
                    "DistributedDataParallel nor did configure_model shard it with fully_shard: use strategy='ddp' "
                    "with devices=2 or more (Lightning starts the processes), or ModelParallelStrategy with "
                    "fully_shard in configure_model (strategy='fsdp' is FSDP1, which lowbit has no exchange for); "
                    f"or {LAUNCH_HINT}")
                return
            self.state = register_built(model, self.options, process_group=self.process_group)
        if self._pending is not None and self.state is not None:
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
