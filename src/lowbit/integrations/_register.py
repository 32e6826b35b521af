"""What the framework adapters share: the user's options, checked when the adapter is built, and the one
choice of which lowbit ``register`` serves the model the framework built.

A framework decides late what it wraps the model in (Lightning's strategy, Accelerate's plugin, the
Hugging Face Trainer's arguments), and an adapter is built before that. So the options are checked at
construction against both configurations, :class:`lowbit.ddp.DDPConfig` and
:class:`lowbit.fsdp.FSDPConfig` (a typo fails before training does), and when the model exists:

1. a model with a ``fully_shard`` module (FSDP2) goes to :func:`lowbit.fsdp.register`;
2. a ``DistributedDataParallel`` model goes to :func:`lowbit.ddp.register`;
3. anything else (one process, a strategy that wrapped nothing) installs nothing: the adapter says why.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional, Union

from torch import nn
from torch.distributed.fsdp import FullyShardedDataParallel
from torch.nn.parallel import DistributedDataParallel

import lowbit.ddp
import lowbit.fsdp

__all__ = ["Options", "check_options", "is_ddp", "is_fsdp", "is_fsdp1", "WRAPPERS", "fsdp_mesh_size", "register_built"]

State = Union[lowbit.ddp.LowbitState, lowbit.fsdp.FSDPState]


@dataclasses.dataclass(frozen=True)
class Options:
    """The options, as each register takes them: a config, or the error that register raises for them."""

    ddp: Optional[lowbit.ddp.DDPConfig]
    fsdp: Optional[lowbit.fsdp.FSDPConfig]
    ddp_error: Optional[Exception] = None
    fsdp_error: Optional[Exception] = None
    who: str = "lowbit.integrations"


def _build(cls: Any, config: Any, options: dict[str, Any]) -> tuple[Any, Optional[Exception]]:
    try:
        return cls.of(config, **options), None
    except (TypeError, ValueError) as exc:
        return None, exc


def check_options(config: Any, options: dict[str, Any], who: str) -> Options:
    """Check ``config`` or ``options`` against both registers' configurations, now. A ``DDPConfig`` serves
    DDP models only and an ``FSDPConfig`` FSDP2 models only; plain options serve whichever the framework
    builds, and are refused here only when neither configuration takes them (the error names both)."""
    if isinstance(config, lowbit.ddp.DDPConfig):
        return Options(lowbit.ddp.DDPConfig.of(config, **options), None,
                       fsdp_error=ValueError("it was given a lowbit.ddp.DDPConfig: give a lowbit.fsdp.FSDPConfig"),
                       who=who)
    if isinstance(config, lowbit.fsdp.FSDPConfig):
        return Options(None, lowbit.fsdp.FSDPConfig.of(config, **options),
                       ddp_error=ValueError("it was given a lowbit.fsdp.FSDPConfig: give a lowbit.ddp.DDPConfig"),
                       who=who)
    if config is not None:
        raise ValueError(f"{who}: config must be a lowbit.ddp.DDPConfig or a lowbit.fsdp.FSDPConfig, "
                         f"got {type(config).__name__}")
    ddp, ddp_error = _build(lowbit.ddp.DDPConfig, None, options)
    fsdp, fsdp_error = _build(lowbit.fsdp.FSDPConfig, None, options)
    if ddp is None and fsdp is None:
        assert ddp_error is not None and fsdp_error is not None
        kind = TypeError if isinstance(ddp_error, TypeError) and isinstance(fsdp_error, TypeError) else ValueError
        if str(ddp_error) == str(fsdp_error):
            raise kind(f"{who}: {ddp_error}") from ddp_error
        raise kind(f"{who}: these options fit neither lowbit.ddp.register ({ddp_error}) nor "
                   f"lowbit.fsdp.register ({fsdp_error})") from ddp_error
    return Options(ddp, fsdp, ddp_error, fsdp_error, who)


def is_fsdp(model: Any) -> bool:
    """Whether ``model`` or one of its modules was sharded with ``fully_shard`` (FSDP2)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # a torch without FSDP2
        return False
    return isinstance(model, nn.Module) and any(isinstance(m, FSDPModule) for m in model.modules())


def is_ddp(model: Any) -> bool:
    """Whether ``model`` is a ``DistributedDataParallel`` (FSDP1's ``FullyShardedDataParallel`` has a
    ``register_comm_hook`` too, whose hooks take no DDP bucket: it is not one)."""
    return isinstance(model, DistributedDataParallel)


def is_fsdp1(model: Any) -> bool:
    """Whether ``model`` holds FSDP1 (``FullyShardedDataParallel``), which lowbit has no exchange for."""
    return isinstance(model, nn.Module) and any(isinstance(m, FullyShardedDataParallel) for m in model.modules())


def fsdp_mesh_size(model: nn.Module) -> Optional[int]:
    """The number of ranks of the mesh ``model``'s sharded parameters live on (None: no DTensor)."""
    for p in model.parameters():
        mesh = getattr(p, "device_mesh", None)
        if mesh is not None:
            return int(mesh.size())
    return None


#: what the adapters say when the model is neither (after "the model is a ..."): what lowbit can serve
WRAPPERS = ("neither a DistributedDataParallel nor an FSDP2 (fully_shard) model; lowbit has no exchange for "
            "FSDP1 (FullyShardedDataParallel: use FSDP2, fsdp_version=2) or DeepSpeed")


def register_built(model: Any, options: Options, *, process_group: Any = None,
                   replicate_group: Any = None) -> Optional[State]:
    """Register lowbit on the model a framework built: :func:`lowbit.fsdp.register` on an FSDP2 model,
    :func:`lowbit.ddp.register` on a DDP model, None (nothing installed; the caller says why) otherwise.
    Options one register refused at construction raise that error here, if that register serves."""
    if is_fsdp(model):
        if options.fsdp is None:
            raise _refused(options, options.fsdp_error, "is sharded with fully_shard (FSDP2)", "lowbit.fsdp.register")
        return lowbit.fsdp.register(model, replicate_group=replicate_group, config=options.fsdp)
    if is_ddp(model):
        if options.ddp is None:
            raise _refused(options, options.ddp_error, "is a DistributedDataParallel", "lowbit.ddp.register")
        return lowbit.ddp.register(model, process_group=process_group, config=options.ddp)
    return None


def _refused(options: Options, error: Optional[Exception], what: str, register: str) -> Exception:
    """The error, kept from construction, of the one register that serves this model."""
    kind = TypeError if isinstance(error, TypeError) else ValueError
    return kind(f"{options.who}: the model {what}, and {register} refuses these options: {error}")
