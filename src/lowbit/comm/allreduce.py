"""Compressed allreduce over any torch.distributed process group: the public API.

:func:`all_reduce` checks its arguments and that the ranks call alike, then :func:`start` runs the call
through the registry entry of the algorithm it resolves to (:mod:`lowbit.comm.registry`). The modules
of this package, by job:

* :mod:`lowbit.comm.registry` — the algorithm registry, ``auto``'s rule (:func:`resolve_algorithm`);
* :mod:`lowbit.comm.flat` — lowbit's flat algorithms (``scatter_gather``, ``allgather``, ``allreduce``,
  ``simulated``), registered as any plugin registers; :mod:`lowbit.comm.hierarchical` — ``hierarchical``;
* :mod:`lowbit.comm.framing` — message slots and receive buffers; :mod:`lowbit.comm.stats` —
  :class:`CommStats`; :mod:`lowbit.comm.residual` — error feedback's steps inside a collective;
* :mod:`lowbit.comm.collectives` — the one wrapper over torch.distributed.

The names users and other modules import from here (``register_algorithm``, ``CommStats``,
``resolve_algorithm``, ``bytes_sent_per_rank``, ...) stay importable from here.

Issue order and asynchrony: every collective of a call is issued on the caller's thread before the call
returns, so lowbit's collectives keep the caller's program order and mix freely with torch's own and
with DDP's. Nothing blocks the host on CUDA: encoding runs on the caller's current stream, NCCL orders
the collective after it, and decoding runs in the collective's future callback, on a pool stream that
waits for it (scatter_gather's middle phase runs on a side stream that waits for the all-to-all). On
CPU (gloo) decoding runs on lowbit's completion thread when the data has arrived (not on gloo's own,
which the interpreter cannot join at exit); scatter_gather waits for its
all-to-all on the caller's thread before it can issue the all-gather. ``async_op=True`` returns a
handle whose ``wait()`` gives the result, as torch's Work does.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any

import torch
import torch.distributed as dist

from lowbit.codecs.base import Codec, get_codec
from lowbit.comm import collectives as C
from lowbit.comm.flat import _native, simulated_numel  # (importing it registers the flat algorithms)
from lowbit.comm.framing import ALIGN, _POOL, _framed, _keep, _slot, _up, _zeros, chunk_sizes  # noqa: F401
from lowbit.comm.registry import (AUTO, AUTO_TWO_RANKS_SCATTER_FROM, SIMULATED, _PLUGINS,  # noqa: F401
                                  AlgorithmPlugin, Call, algorithm_choices, algorithms, auto_algorithm, get_algorithm,
                                  register_algorithm, resolve_algorithm, resolve_entry)
from lowbit.comm.residual import _encode_with_feedback, _guard_residual  # noqa: F401
from lowbit.comm.stats import CommStats
from lowbit.feedback import ErrorFeedback

__all__ = ["AUTO", "SIMULATED", "AlgorithmPlugin", "register_algorithm", "algorithms", "algorithm_choices",
           "get_algorithm", "Call", "CommStats", "Handle", "all_reduce", "run", "chunk_sizes", "bytes_sent_per_rank",
           "auto_algorithm", "resolve_algorithm", "simulated_numel", "start"]


def normalize_op(op: object) -> str:
    """``"sum"`` or ``"mean"`` from torch's ``ReduceOp.SUM`` / ``ReduceOp.AVG`` or the strings "sum",
    "mean", "avg" (any case). Other reductions (max, product, ...) are not sums: a ValueError."""
    if isinstance(op, str):
        name = op.strip().lower()
    else:
        name = str(getattr(op, "name", op)).rsplit(".", 1)[-1].lower()
        if dist.is_available():
            if op == dist.ReduceOp.SUM:
                name = "sum"
            elif op == dist.ReduceOp.AVG:
                name = "avg"
    if name == "sum":
        return "sum"
    if name in ("mean", "avg"):
        return "mean"
    raise ValueError(f"op must be torch.distributed.ReduceOp.SUM or .AVG (or 'sum' / 'mean'), got {op!r}")


def _overlaps(t: torch.Tensor) -> bool:
    """Whether two elements of ``t`` may share memory (an expanded view: a stride 0; ``as_strided``):
    its dimensions, by stride, must each step past everything the smaller ones span."""
    span = 0
    for stride, size in sorted((st, sz) for sz, st in zip(t.shape, t.stride()) if sz > 1):
        if stride <= span:
            return True
        span += (size - 1) * stride
    return False


def _check_args(tensor: torch.Tensor, codec: Codec, algorithm: str) -> None:
    if not isinstance(tensor, torch.Tensor) or not tensor.is_floating_point():
        raise ValueError(f"all_reduce expects a floating-point tensor, got {getattr(tensor, 'dtype', type(tensor))}")
    if _overlaps(tensor):
        raise ValueError(f"all_reduce: the tensor (shape {tuple(tensor.shape)}, strides {tensor.stride()}) has elements "
                         "that overlap in memory (an expanded or as_strided view), so it cannot hold one result per "
                         "element; reduce tensor.clone() (or the tensor it was expanded from) instead")
    plugin = None if algorithm == AUTO else get_algorithm(algorithm)
    if plugin is not None and not plugin.quantised and not codec.sums_on_wire:
        raise ValueError(
            f"algorithm {algorithm!r} sums on the wire, so it only takes fp32/fp16/bf16, not {codec.spec}; "
            "use 'scatter_gather' or 'allgather' for quantised codecs"
        )


def start(
    x: torch.Tensor,
    codec: Codec,
    group: dist.ProcessGroup | None,
    algorithm: str,
    op: str,
    residual: torch.Tensor | None = None,
    seed: int = 0,
    stats: CommStats | None = None,
    out: torch.Tensor | None = None,
    exact: int = 0,
    post: Callable[[], torch.Tensor] | None = None,
    world: tuple[int, int] | None = None,
    node_size: int | None = None,
    shape: tuple[int, ...] | None = None,
) -> torch.futures.Future:
    """Issue one reduction now, on this thread; returns a future of ``out`` holding the result.

    x: (n + exact,) float32 contiguous (a natively summed codec also takes x already in its wire dtype,
    and reduces it in place). The first n values cross in ``codec``'s precision; the last
    ``exact`` (allgather only: a DDP bucket's small tensors) ride raw in fp32 in the same message and are
    summed exactly. ``residual`` ((n,) float32, updated in place) enables error feedback: x + residual is
    what gets sent. ``out`` (default ``x``) may alias ``x``; ``x`` is not read after the call's own
    stream work. ``algorithm`` is resolved to a registry entry
    (:func:`lowbit.comm.registry.resolve_entry`), whose ``start`` runs the call. ``post`` runs after the
    result is in ``out``, in the completion callback, and its return value becomes the future's (the
    DDP hook copies the result into its bucket and returns the bucket). ``world``: (rank, size) in
    ``group`` when the caller already knows them. ``node_size``: ranks per node for ``hierarchical``
    (see :mod:`lowbit.comm.hierarchical`). ``shape``: the shape of the first n values, for per-tensor
    codecs (per column, one scale per tensor); default flat.
    """
    call = Call(x, codec, group, op, x if out is None else out, C.world(group) if world is None else world,
                residual, seed, stats, post, node_size, shape, exact)
    if stats is not None:
        stats.calls += 1  # (once: an algorithm that runs another goes through run(), which does not count)
    return run(call, algorithm)


def run(call: Call, algorithm: str) -> torch.futures.Future:
    """Run ``call`` through the entry ``algorithm`` resolves to, without counting it (:func:`start` has):
    what an algorithm that hands its call, or a part of it, to another uses."""
    # (fp32 riders go with allgather only: with them auto does not look at the size)
    _, entry = resolve_entry(algorithm, call.codec, call.world[1], None if call.exact else call.x.numel(),
                             call.x.device)
    if call.exact and not entry.exact:
        raise ValueError("exact values ride only with the allgather algorithm")
    return entry.start(call)


def bytes_sent_per_rank(codec: Codec, n: int, k: int, algorithm: str, rank: int = 0, exact: int = 0,
                        node_size: int | None = None, shape: tuple[int, ...] | None = None,
                        device: torch.device | str | None = None) -> int:
    """What rank ``rank`` puts on the wire for one call of ``n`` values (plus ``exact`` raw fp32 riders),
    predicted from the codec's sizes by the entry the call runs (its ``bytes_per_rank``): ring all-gather
    / allreduce accounting, 16-byte message slots included (``hierarchical``: with ``node_size`` ranks per
    node; ``auto``: as it resolves for a tensor on ``device``). The collectives count the buffers they
    really send; this is the model's side."""
    if k == 1 or (n == 0 and not exact):
        return 0
    _, entry = resolve_entry(algorithm, codec, k, None if exact else n, device)
    return entry.bytes_per_rank(codec, n, k, rank, exact, node_size, shape)


def _agree(group: dist.ProcessGroup | None, key: Hashable, fingerprint: tuple, device: torch.device) -> None:
    """Ranks must call all_reduce alike: (key, codec, algorithm, op, numel, feedback), checked on every
    call by a 64-bit fingerprint exchanged before the data (:func:`lowbit.comm.collectives.check_call`)."""
    C.check_call(group, "all_reduce", (repr(key), *fingerprint),
                 lambda t: f"key {t[0]}, codec {t[1]}, algorithm {t[2]}, op {t[3]}, numel {t[4]}, feedback {t[5]}",
                 device)


class Handle:
    """What ``all_reduce(..., async_op=True)`` returns: ``wait()``, ``is_completed()`` and
    ``get_future()`` like torch's Work. On CUDA ``wait()`` makes the current stream wait (no host wait)."""

    def __init__(self, fut: torch.futures.Future, group: dist.ProcessGroup | None) -> None:
        self._fut = fut
        self._group = group

    def wait(self, timeout: float | None = None) -> bool:
        C.wait(self._fut, "all_reduce", self._group)
        return True

    def is_completed(self) -> bool:
        return self._fut.done()

    def get_future(self) -> torch.futures.Future:
        return self._fut


def all_reduce(
    tensor: torch.Tensor,
    codec: Codec | str = "qsgd:bits=8",
    group: dist.ProcessGroup | None = None,
    algorithm: str = "scatter_gather",
    op: object = "sum",
    feedback: ErrorFeedback | None = None,
    async_op: bool = False,
    *,
    key: Hashable = "tensor",
    seed: int = 0,
    stats: CommStats | None = None,
    node_size: int | None = None,
) -> Handle | None:
    """Reduce ``tensor`` in place across ``group`` with its values sent in ``codec``'s precision.

    Like ``torch.distributed.all_reduce``: every rank passes a tensor of the same shape and ends with the
    same (bit-identical) result, and the collectives are issued now, in the caller's program order.
    A float32 contiguous ``tensor`` is reduced in place; any other dtype or layout (a strided view) is
    copied into a contiguous float32 buffer and the result copied back into its elements, never
    touching memory outside them.

    Args:
        tensor: the values to reduce, the same shape on every rank.
        codec: a codec spec (``"qsgd:bits=4,bucket=512"``) or a :class:`~lowbit.Codec`.
        group: the process group (default: the world).
        algorithm: ``scatter_gather`` (default), ``allgather``, ``allreduce`` (fp32/fp16/bf16 only),
            ``auto`` (:func:`auto_algorithm`: scatter_gather above 2 ranks; for 2, allgather, or
            scatter_gather for large CPU tensors) or ``hierarchical`` (native inside each node, compressed
            between nodes: :mod:`lowbit.comm.hierarchical`). ``simulated`` is Grubic et al.'s simulation of
            low-precision NCCL for benchmarks: a native fp32 allreduce of a buffer of the codec's wire
            size, **leaving the tensor unreduced** (speed only).
        op: ``torch.distributed.ReduceOp.SUM`` (the default, as torch's) or ``ReduceOp.AVG``, or the
            strings ``"sum"`` / ``"mean"``.
        feedback: an :class:`~lowbit.ErrorFeedback` of the same codec: error feedback, under ``key``.
        async_op: return a handle instead of waiting.
        key: the residual's key in ``feedback`` (one per tensor).
        seed: keys the stochastic rounding (pass the step number).
        stats: a :class:`CommStats` that accumulates calls and bytes sent (and phase times when its
            ``timing`` is on).
        node_size: ranks per node for ``hierarchical`` (default ``$LOWBIT_NODE_SIZE`` or torchrun's
            ``LOCAL_WORLD_SIZE``).

    Returns:
        None, or with ``async_op=True`` a handle whose ``wait()`` makes ``tensor`` hold the result.

    Raises:
        ValueError: an unknown codec or algorithm, a codec the algorithm cannot carry, ``feedback`` of
            another codec or with a codec summed natively, a tensor whose elements overlap in memory (an
            expanded view), all before anything is sent.
        lowbit.comm.CollectiveError: a collective failed (with the rank, the group and the call).
    """
    if not isinstance(codec, (str, Codec)):
        raise ValueError(f"codec must be a codec spec such as 'qsgd:bits=8' or a Codec, got {codec!r} (lowbit.all_reduce "
                         "takes the codec second; pass the reduction as op=torch.distributed.ReduceOp.SUM)")
    codec = get_codec(codec) if isinstance(codec, str) else codec
    op = normalize_op(op)
    _check_args(tensor, codec, algorithm)
    if feedback is not None and feedback.codec != codec:
        raise ValueError(f"feedback was built for {feedback.codec.spec}, but the collective uses {codec.spec}")
    if feedback is not None and (algorithm == "allreduce" or codec.sums_on_wire):
        raise ValueError(f"{codec.spec} is summed natively and is lossless up to the cast; it takes no error feedback")

    plugin = _PLUGINS.get(algorithm)
    if plugin is not None and plugin.prepare is not None and not codec.sums_on_wire:
        node_size = plugin.prepare(group, node_size)
    _agree(group, key, (codec.spec, algorithm if plugin is None or plugin.flat else f"{algorithm}/{node_size}", op,
                        tensor.numel(), feedback is not None), tensor.device)

    src = tensor.detach()
    direct = src.dtype == torch.float32 and src.is_contiguous()
    if direct:
        x = src.view(-1)  # (n,) float32: reduced in place
    else:  # another dtype or a strided view: copied in here, the result copied back (``back``)
        x = torch.empty(src.shape, dtype=torch.float32, device=src.device).copy_(src).view(-1)
    residual = feedback.residual(key, x.numel(), x.device) if feedback is not None else None
    fut = start(x, codec, group, algorithm, op, residual, seed, stats, node_size=node_size,
                shape=tuple(tensor.shape) if codec.per_tensor else None)
    if not direct:
        def back(f: torch.futures.Future) -> torch.Tensor:
            res = f.value()
            _keep(res)
            with torch.no_grad():
                tensor.copy_(res.view(tensor.shape))
            return tensor

        fut = fut.then(back)
    handle = Handle(fut, group)
    if async_op:
        return handle
    handle.wait()
    return None
