"""What the integrations' ``register`` (DDP's and FSDP's) share with their users: warnings given once
per process on rank 0 (a setting that does not do what the user may think, a job that compresses
nothing), and the rule that a model is registered once (a second register is refused, naming the first
state). Below both integrations, so that neither imports the other."""

from __future__ import annotations

import os
import warnings
import weakref
from typing import Any, Optional

import torch.distributed as dist
from torch import nn

__all__ = ["LAUNCH_HINT", "warn_once", "warn_uncompressed", "refuse_second_register", "remember_register"]

LAUNCH_HINT = ("start several processes: torchrun --nproc-per-node 2 script.py, or accelerate launch --multi_gpu "
               "--num_processes 2 script.py (docs/ddp.md, 'Launching several processes')")
_SAID: set = set()  # the no-op warnings this process has given (each once)


def warn_once(message: str, group: Optional[dist.ProcessGroup] = None, stacklevel: int = 3) -> None:
    """Warn (``RuntimeWarning``) ``message``, once per process and on rank 0 of ``group`` only: what
    ``register`` (DDP's and FSDP's) and the integrations tell a user about a setting that does not do
    what they may think."""
    if message in _SAID:
        return
    _SAID.add(message)
    initialised = dist.is_available() and dist.is_initialized()
    rank = dist.get_rank(group) if initialised else int(os.environ.get("RANK", "0"))
    if rank == 0:
        warnings.warn(message, RuntimeWarning, stacklevel=stacklevel)


def warn_uncompressed(reason: str, group: Optional[dist.ProcessGroup] = None) -> None:
    """Warn (:func:`warn_once`) that gradients are not compressed and why. ``register`` and the
    integrations call it where they install nothing: training then runs uncompressed, and the user who
    asked for compression must hear it."""
    warn_once(f"lowbit: gradients are not compressed: {reason}", group, stacklevel=4)


#: model -> what :func:`register` (DDP's or FSDP's) registered on it, in words (weakly keyed: a model
#: that goes away takes its entry along), so that a second register on the same model is refused
_REGISTERED: "weakref.WeakKeyDictionary[nn.Module, str]" = weakref.WeakKeyDictionary()


def refuse_second_register(model: nn.Module, what: str) -> None:
    """Raise a ``ValueError`` if ``model`` already has a lowbit state from ``register`` (DDP's or FSDP's),
    naming that state: a second one would install a second hook or set of exchanges over the first (or
    be refused by DDP only after every rank has agreed and made its thread's group)."""
    first = _REGISTERED.get(model)
    if first is not None:
        raise ValueError(f"{what}: this model is already registered ({first}); keep that state (register "
                         "once per model), or wrap a new model to start over")


def remember_register(model: nn.Module, state: Any, settings: str) -> None:
    """Note that ``model`` has ``state`` (described by ``settings``), for :func:`refuse_second_register`."""
    _REGISTERED[model] = f"{type(state).__name__} at 0x{id(state):x}: {settings}"
