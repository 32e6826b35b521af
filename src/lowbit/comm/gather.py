"""Compressed all-gather and reduce-scatter of tensors along one dimension (model parallelism).

Model-parallel layers (:mod:`lowbit.parallel`) move activations and activation gradients, not gradients
of parameters: every rank's slice of a batch or of a layer's output features is gathered on every rank
(forward), and the partial gradients every rank holds for a slice are summed on the rank that owns it
(backward). Both cross in any codec:

* :func:`all_gather` — rank ``r`` encodes its part (``sizes[r]`` entries along ``dim``) once; one
  all-gather of equal message slots; every rank decodes every part, its own included, so the result is
  bit-identical on every rank. Bytes a rank sends: ``(K-1) * slot``, ``slot`` the 16-byte-aligned size
  of the largest part's payload (:func:`bytes_all_gather`).
* :func:`reduce_scatter` — rank ``r`` encodes its copy of each other rank's part, one all-to-all, and
  sums (in rank order, float32) the ``K-1`` decoded copies of its own part plus its own exact copy.
  Bytes a rank sends: the payload slots of the other ranks' parts (:func:`bytes_reduce_scatter`).

Per-tensor codecs (Dettmers' types with one scale per tensor, ``bucket=0``, the default of model
parallelism in the paper) encode each part as a tensor of its own shape. Both calls are issued now, in
program order, and return a future when ``async_op=True``: :mod:`lowbit.parallel` issues the transfer
of sub-batch ``i+1`` before it computes on sub-batch ``i``.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Sequence

import torch
import torch.distributed as dist

from lowbit.codecs.base import Codec, get_codec
from lowbit.comm import collectives as C
from lowbit.comm import exchange as X
from lowbit.comm.framing import _keep, _slot
from lowbit.comm.stats import CommStats

__all__ = ["all_gather", "reduce_scatter", "part_sizes", "bytes_all_gather", "bytes_reduce_scatter"]


def part_sizes(total: int, k: int) -> list[int]:
    """``total`` entries split over ``k`` ranks, the first ``total % k`` one larger (as torch.chunk would
    not: it can leave ranks empty)."""
    return [total // k + (1 if i < total % k else 0) for i in range(k)]


def _shape(shape: Sequence[int], dim: int, size: int) -> tuple[int, ...]:
    s = list(shape)
    s[dim] = size
    return tuple(s)


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def _codec_shape(codec: Codec, shape: tuple[int, ...]) -> tuple[int, ...] | None:
    return shape if codec.per_tensor else None


def _check(x: torch.Tensor, codec: Codec | str, group: dist.ProcessGroup | None, dim: int,
           sizes: Sequence[int] | None, what: str) -> tuple[Codec, int, int, int, list[int]]:
    codec = get_codec(codec) if isinstance(codec, str) else codec
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise ValueError(f"lowbit.comm.gather.{what}: expected a floating-point tensor, got "
                         f"{getattr(x, 'dtype', type(x).__name__)}")
    if x.dim() == 0:
        raise ValueError(f"lowbit.comm.gather.{what}: a 0-d tensor has no dimension to split")
    d = dim % x.dim()
    rank, k = C.world(group)
    if sizes is None:
        sizes = [x.shape[d]] * k if what == "all_gather" else part_sizes(x.shape[d], k)
    sizes = [int(s) for s in sizes]
    if len(sizes) != k or any(s < 0 for s in sizes):
        raise ValueError(f"lowbit.comm.gather.{what}: sizes must give one non-negative size per rank "
                         f"({k}), got {sizes}")
    if what == "all_gather" and x.shape[d] != sizes[rank]:
        raise ValueError(f"lowbit.comm.gather.all_gather: rank {rank}'s part has {x.shape[d]} entries along "
                         f"dim {d}, but sizes says {sizes[rank]}")
    if what == "reduce_scatter" and x.shape[d] != sum(sizes):
        raise ValueError(f"lowbit.comm.gather.reduce_scatter: the tensor has {x.shape[d]} entries along dim "
                         f"{d}, sizes add up to {sum(sizes)}")
    return codec, d, rank, k, sizes


@dataclasses.dataclass(frozen=True)
class _Plan:
    """One call shape of :func:`all_gather` / :func:`reduce_scatter`, checked, agreed between the ranks
    and laid out once: the parts' sizes, starts and shapes along ``d``, their message slots and payload
    bytes, and the widest slot."""

    codec: Codec
    #: A weak reference to the group: a plan neither keeps a destroyed group alive nor serves a new
    #: group that reuses its id.
    group: object
    d: int
    rank: int
    k: int
    sizes: tuple[int, ...]
    starts: tuple[int, ...]
    shapes: tuple[tuple[int, ...], ...]
    slots: tuple[tuple[int, int], ...]
    nbytes: tuple[int, ...]
    width: int
    #: The exchange core's plan of the parts (:mod:`lowbit.comm.exchange`): what encodes and decodes them.
    x: X.Plan | None = None
    #: What the ranks must agree on (codec, dimension, parts, the other dimensions, dtype): checked on
    #: every call, cached plan or not (:func:`_check_call`).
    fields: tuple = ()


_PLANS: dict[tuple, _Plan] = {}


def _plan(x: torch.Tensor, codec: Codec | str, group: dist.ProcessGroup | None, dim: int,
          sizes: Sequence[int] | None, what: str) -> _Plan:
    """The plan of this call (built on its first call only: model parallelism repeats a few shapes every
    step, and the checks cost more host time than the kernels); the ranks' agreement is checked on every
    call, cached plan or not."""
    live = dist.is_available() and dist.is_initialized()
    g = group if group is not None else (dist.group.WORLD if live else None)
    if sizes is not None and not isinstance(sizes, (list, tuple)):
        sizes = list(sizes)  # an iterator is read once
    key = None
    if live and g is not None and isinstance(x, torch.Tensor) and isinstance(codec, (Codec, str)) \
            and isinstance(dim, int):
        key = (what, codec, id(g), dim, None if sizes is None else tuple(sizes), tuple(x.shape), x.dtype)
        plan = _PLANS.get(key)
        if plan is not None and plan.group() is g:
            _check_call(group, what, plan.fields, x.device)
            return plan
    codec, d, rank, k, sizes = _check(x, codec, group, dim, sizes, what)
    shape = _shape(x.shape, d, -1) if what == "all_gather" else tuple(x.shape)
    fields = (codec.spec, d, tuple(sizes), shape, str(x.dtype))
    _check_call(group, what, fields, x.device)
    shapes = tuple(_shape(x.shape, d, s) for s in sizes)
    xp = X.plan(codec, [_numel(s) for s in shapes], [_codec_shape(codec, s) for s in shapes])
    plan = _Plan(codec=codec, group=weakref.ref(g) if g is not None else (lambda: None), d=d, rank=rank, k=k,
                 sizes=tuple(sizes), starts=tuple(sum(sizes[:r]) for r in range(k)), shapes=shapes,
                 slots=tuple(lay.slot for lay in xp.layouts), nbytes=tuple(lay.nbytes for lay in xp.layouts),
                 width=xp.width, fields=fields, x=xp)
    if key is not None:
        if len(_PLANS) >= 4096:  # shapes that keep changing: start over rather than grow without bound
            _PLANS.clear()
        _PLANS[key] = plan
    return plan


def _check_call(group: dist.ProcessGroup | None, what: str, fields: tuple, device: torch.device) -> None:
    """The ranks must call a gather alike (codec, dimension, parts, the other dimensions, dtype): checked on
    every call (:func:`lowbit.comm.collectives.check_call`; a plan cached on one rank does not skip it)."""
    C.check_call(group, what, fields,
                 lambda t: f"codec {t[0]}, dim {t[1]}, sizes {list(t[2])}, shape {list(t[3])}, {t[4]}", device)


def bytes_all_gather(codec: Codec | str, shape: Sequence[int], dim: int, sizes: Sequence[int]) -> int:
    """Bytes each rank sends in :func:`all_gather` of parts of ``shape`` with ``sizes[r]`` entries along
    ``dim``: ``(K-1)`` equal slots of the largest part's payload."""
    codec = get_codec(codec) if isinstance(codec, str) else codec
    k = len(sizes)
    if k <= 1:
        return 0
    d = dim % len(shape)
    slot = max(_slot(codec, _numel(_shape(shape, d, s)), _codec_shape(codec, _shape(shape, d, s)))[1]
               for s in sizes)
    return (k - 1) * slot


def bytes_reduce_scatter(codec: Codec | str, shape: Sequence[int], dim: int, sizes: Sequence[int],
                         rank: int) -> int:
    """Bytes rank ``rank`` sends in :func:`reduce_scatter` of a tensor of ``shape`` whose parts along
    ``dim`` have ``sizes``: one payload slot for every other rank's part."""
    codec = get_codec(codec) if isinstance(codec, str) else codec
    d = dim % len(shape)
    return sum(_slot(codec, _numel(_shape(shape, d, s)), _codec_shape(codec, _shape(shape, d, s)))[1]
               for r, s in enumerate(sizes) if r != rank)


def _xplan(p: _Plan, codec: Codec) -> X.Plan:
    """The core's plan with the caller's codec object (equal ones may differ: a test may count its calls)."""
    if p.x.layouts[0].codec is codec:  # type: ignore[union-attr]
        return p.x  # type: ignore[return-value]
    return X.Plan(tuple(dataclasses.replace(lay, codec=codec) for lay in p.x.layouts))  # type: ignore[union-attr]


def all_gather(
    x: torch.Tensor,
    codec: Codec | str = "dettmers:type=dynamic,bucket=0",
    group: dist.ProcessGroup | None = None,
    dim: int = 0,
    sizes: Sequence[int] | None = None,
    *,
    seed: int = 0,
    stats: CommStats | None = None,
    async_op: bool = False,
) -> torch.Tensor | torch.futures.Future:
    """Concatenate every rank's ``x`` along ``dim``, each part crossing in ``codec``'s precision.

    ``sizes[r]``: rank ``r``'s entries along ``dim`` (default: all equal to this rank's); the other
    dimensions must agree. Every rank decodes every part (its own too): the result is bit-identical on
    every rank, in ``x``'s dtype. ``async_op=True`` returns a future of the result.
    """
    p = _plan(x, codec, group, dim, sizes, "all_gather")
    codec = codec if isinstance(codec, Codec) else p.codec  # the caller's object (equal ones may differ)
    xp = _xplan(p, codec)
    d, rank, k, width = p.d, p.rank, p.k, p.width
    send = X.gather_encode(xp, x, rank, seed=X.rounding_seed(seed, rank))  # equal slots: all-gather needs equal sizes
    out = torch.empty(_shape(x.shape, d, p.starts[-1] + p.sizes[-1]), dtype=x.dtype, device=x.device)
    if k == 1:
        X.gather_decode(xp, send, [out])
        return C.done(out, x.device) if async_op else out
    recv = torch.empty(k * width, dtype=torch.uint8, device=x.device)
    work = C.all_gather_async(recv, send, group)
    if stats is not None:
        stats.calls += 1
        stats.bytes_sent += (k - 1) * width

    def finish() -> torch.Tensor:
        _keep(recv)
        _keep(out)
        X.gather_decode(xp, recv, [out.narrow(d, at, s) for s, at in zip(p.sizes, p.starts)])
        return out

    fut = C.then(work, finish, "all_gather_into_tensor", group)
    if async_op:
        return fut
    return C.wait(fut, "all_gather_into_tensor", group)  # type: ignore[return-value]


def reduce_scatter(
    x: torch.Tensor,
    codec: Codec | str = "dettmers:type=dynamic,bucket=0",
    group: dist.ProcessGroup | None = None,
    dim: int = 0,
    sizes: Sequence[int] | None = None,
    *,
    seed: int = 0,
    stats: CommStats | None = None,
    async_op: bool = False,
) -> torch.Tensor | torch.futures.Future:
    """This rank's part (along ``dim``) of the sum over ranks of ``x``, the other ranks' copies crossing
    in ``codec``'s precision (this rank's own copy is added exactly).

    ``sizes[r]``: the entries along ``dim`` rank ``r`` owns (default :func:`part_sizes`); they must add
    up to ``x.shape[dim]``. The sum runs in rank order in float32; the result has ``x``'s dtype.
    """
    p = _plan(x, codec, group, dim, sizes, "reduce_scatter")
    codec = codec if isinstance(codec, Codec) else p.codec  # the caller's object (equal ones may differ)
    xp = _xplan(p, codec)
    d, rank, k, sizes, starts = p.d, p.rank, p.k, p.sizes, p.starts
    own = x.narrow(d, starts[rank], sizes[rank]).to(torch.float32)
    if k == 1:
        res = own.contiguous().to(x.dtype)
        return C.done(res, x.device) if async_op else res
    parts = [x.narrow(d, starts[r], sizes[r]) for r in range(k)]
    send = X.scatter_encode(xp, parts, rank, [X.rounding_seed(seed, rank, r) for r in range(k)])
    send_splits, recv_splits = xp.send_splits(rank), xp.recv_splits(rank)
    recv = torch.empty(sum(recv_splits), dtype=torch.uint8, device=x.device)
    work = C.all_to_all_async(recv, send, send_splits, recv_splits, group)
    if stats is not None:
        stats.calls += 1
        stats.bytes_sent += sum(send_splits)
    own = own.contiguous()

    def finish() -> torch.Tensor:
        _keep(recv)
        _keep(send)
        _keep(own)
        total = torch.empty(own.numel(), dtype=torch.float32, device=x.device)
        X.scatter_sum(xp, recv, rank, own, total)
        return total.view(p.shapes[rank]).to(x.dtype)

    fut = C.then(work, finish, "all_to_all_single", group)
    if async_op:
        return fut
    return C.wait(fut, "all_to_all_single", group)  # type: ignore[return-value]
