"""lowbit's own communicators: made like the group they come from, and cached with it.

Every process group lowbit creates (lowbit.fsdp's gradient and parameter communicators, the
hierarchical algorithm's node and cross-node groups, the DDP hook thread's group) comes from
:func:`new_subgroup`, which gives it its parent's

* **timeout**: torch's ``new_group`` without ``timeout=`` takes the backend's default (30 minutes on
  gloo, 10 on NCCL), not the ``timeout=`` the job gave ``init_process_group`` or its own group. A
  stalled peer then held lowbit's collectives for up to half an hour where FSDP's and DDP's own raise
  after the job's timeout;
* **backend** (as the parent was made: ``"gloo"``, ``"nccl"``, ``"cpu:gloo,cuda:nccl"``), and on NCCL
  its stream priority.

:class:`PerGroup` holds what lowbit keeps for a process group (the hierarchical topology, the call
checks' buffers), keyed weakly by the group object: it goes when the group goes, and a group made
again after ``destroy_process_group()`` (a new object, ``WORLD`` included) starts with nothing,
instead of reaching groups torch no longer knows ("Group ... is not registered").
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Sequence
from datetime import timedelta
from typing import Generic, TypeVar

import torch
import torch.distributed as dist

__all__ = ["group_timeout", "new_subgroup", "PerGroup"]

V = TypeVar("V")

_WARNED: list[bool] = []


def _resolve(group: dist.ProcessGroup | None) -> dist.ProcessGroup:
    """``group``, or the default group for None."""
    if group is not None:
        return group
    world = dist.group.WORLD
    if world is None:
        raise ValueError("lowbit: torch.distributed is not initialised (no default process group)")
    return world  # type: ignore[return-value]


def _backends(pg: dist.ProcessGroup) -> list[object]:
    """The per-device backends of ``pg`` (gloo's, NCCL's), those this torch shows."""
    devices = getattr(pg, "_device_types", None) or [torch.device("cpu"), torch.device("cuda")]
    out = []
    for dev in devices:
        try:
            out.append(pg._get_backend(dev))
        except (AttributeError, RuntimeError, ValueError):
            continue
    return out


def group_timeout(group: dist.ProcessGroup | None) -> timedelta | None:
    """The timeout of ``group``'s collectives (None: the default group): the longest of its backends'
    (they agree unless one was changed alone). None where this torch does not show it (gloo before
    torch 2.6 keeps it inside C++)."""
    found = []
    for backend in _backends(_resolve(group)):
        t = getattr(getattr(backend, "options", None), "_timeout", None)
        if isinstance(t, timedelta):
            found.append(t)
    return max(found) if found else None


def _nccl_options(pg: dist.ProcessGroup, timeout: timedelta | None) -> object | None:
    """NCCL options for a group made from ``pg``: a fresh set with ``pg``'s stream priority (not a copy:
    a copy would carry ``pg``'s own split parent and rank list). None when ``pg`` has no NCCL backend."""
    nccl = getattr(dist, "ProcessGroupNCCL", None) if dist.is_nccl_available() else None
    if nccl is None:
        return None
    parent = next((b for b in _backends(pg) if isinstance(b, nccl)), None)
    if parent is None:
        return None
    try:
        opts = nccl.Options()
        opts.is_high_priority_stream = parent.options.is_high_priority_stream  # type: ignore[attr-defined]
        if timeout is not None:
            opts._timeout = timeout  # (torch warns when these differ from new_group's timeout=)
    except (AttributeError, RuntimeError, TypeError):
        return None
    return opts


def new_subgroup(parent: dist.ProcessGroup | None, ranks: Sequence[int]) -> dist.ProcessGroup | None:
    """A new process group of ``ranks`` (global ranks, among ``parent``'s; None: the default group)
    with ``parent``'s timeout, backend and NCCL stream priority (the module docstring says why).

    Only the ranks in ``ranks`` call it (``use_local_synchronization``); each such set of ranks must
    make its groups in the same order. Returns the group, or None on a rank outside ``ranks``.
    Where this torch does not show the parent's timeout, the group gets torch's default, with one
    warning."""
    pg = _resolve(parent)
    timeout = group_timeout(pg)
    if timeout is None and not _WARNED:
        _WARNED.append(True)
        warnings.warn("lowbit: this torch does not show a process group's timeout, so lowbit's own process "
                      "groups take torch's default (30 minutes on gloo) instead of the one the job set",
                      RuntimeWarning, stacklevel=2)
    return dist.new_group(list(ranks), timeout=timeout, backend=dist.get_backend(pg),
                          pg_options=_nccl_options(pg, timeout), use_local_synchronization=True)


class PerGroup(Generic[V]):
    """Values kept for process groups, each dropped with its group (the module docstring); None in
    :meth:`get` and :meth:`set` stands for the default group at the time of the call."""

    def __init__(self) -> None:
        self._values: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def get(self, group: dist.ProcessGroup | None) -> V | None:
        """The value kept for ``group``, None if none."""
        if group is None and dist.group.WORLD is None:
            return None
        return self._values.get(_resolve(group))

    def set(self, group: dist.ProcessGroup | None, value: V) -> V:
        """Keep ``value`` for ``group`` (until the group goes); returns it."""
        self._values[_resolve(group)] = value
        return value

    def __len__(self) -> int:
        return len(self._values)
