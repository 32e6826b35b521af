"""The one compressed-exchange core: an encoded reduce-scatter and an encoded all-gather.

Every compressed exchange of lowbit is made of these two steps, whoever calls them: DDP's algorithms
(:mod:`lowbit.comm.flat`: ``scatter_gather`` is an encoded reduce-scatter of the tensor's chunks, then an
encoded all-gather of the re-encoded sums), FSDP2's custom collectives (:mod:`lowbit.fsdp`: gradients
reduce-scattered, parameters all-gathered) and the model-parallel gathers (:mod:`lowbit.comm.gather`).
A speed-up made here reaches all of them.

A call is laid out by a :class:`Plan`: one :class:`Layout` per rank's part (its codec, its values, its
shape for per-tensor codecs, and the values it also carries exactly), each part's message slot on the
16-byte grid of :mod:`lowbit.comm.framing`. The steps are tensor work only, so the caller chooses how
the collective between them runs (synchronously, as an async Work with a callback, or inside a CUDA
graph: :mod:`lowbit.comm.graphs`):

* reduce-scatter: :func:`scatter_encode` (rank ``r`` encodes its copy of every other rank's part, with
  error feedback when given residuals; its own part never crosses the wire) -> an all-to-all ->
  :func:`scatter_sum` (the ``K-1`` received copies of my part decoded and summed in rank order in
  float32, then my own exact copy added; a mean scales first, so nothing finite overflows).
* all-gather: :func:`gather_encode` (my part once, in a slot as wide as the widest part's: an
  all-gather needs equal sizes) -> an all-gather -> :func:`gather_decode` (every rank's part decoded,
  mine too, so every rank holds the same values).

Also here, once: the rounding-seed rule (:func:`rounding_seed`), the exact-values patch (a part's
values the policy keeps in full precision ride a second time in their own dtype and overwrite their lossy
copies: :class:`Layout`), and the float cast path (a float codec's payload is the values in its wire
dtype: cast straight into the message and summed straight out of it, ``FAST_FLOATS``).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import torch

from lowbit.codecs.base import Codec, get_codec
from lowbit.comm.framing import _framed, _slot, _zeros
from lowbit.feedback import encode_with_feedback

__all__ = ["FAST_FLOATS", "Layout", "Plan", "exact_codec", "gather_decode", "gather_encode", "mean_scaling",
           "plan", "pow2_inverse", "rounding_seed", "row_layout", "scatter_encode", "scatter_sum"]

#: Whether float codecs (bf16, fp16, fp32: a payload that is the values in ``wire_dtype``) take the cast
#: path: cast straight into the message and out of it, a few kernels a call instead of the codec's
#: encode / frame / decode (same bytes on the wire, same sums; tests turn it off to compare).
FAST_FLOATS = True


def rounding_seed(*parts: int) -> int:
    """The rounding seed of one payload, from the integers that name it (the call's seed or step, the
    stream, the sending rank, the destination part, the phase): distinct, reproducible streams, 31 bits.
    Ranks must not share rounding noise, or the errors of the K payloads would be correlated instead of
    averaging out."""
    h = 0
    for p in parts:
        h = (h * 1_000_003 + p * 7_919 + 104_729) & 0x7FFFFFFF
    return h


# ------------------------------------------------------------------------------------------ layouts
_EXACT = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def exact_codec(dtype: torch.dtype) -> Codec:
    """The codec that carries values of ``dtype`` exactly (its own bytes)."""
    return get_codec(_EXACT.get(dtype, "fp32"))


@dataclasses.dataclass(frozen=True)
class Layout:
    """One part of ``numel`` values in a message: the whole part in ``codec`` (one contiguous encode, one
    decode straight into place; viewed as ``shape`` by per-tensor codecs), then the values at ``exact``
    (column ranges: the parameters the policy keeps in full precision, norms and biases, a few thousand
    of millions) once more in ``exact_codec``, which overwrite their lossy copies after decoding. Costs E
    extra values on the wire and saves a gather and scatter of the whole part per call."""

    codec: Codec
    numel: int
    exact: tuple[tuple[int, int], ...] = ()  # (start, length) column ranges
    exact_codec: Codec | None = None
    shape: tuple[int, ...] | None = None  # per-tensor codecs: the part's own shape

    @functools.cached_property
    def code_shape(self) -> tuple[int, ...] | None:
        """The shape the codec sees: the part's own (per-tensor codecs), else its flat layout."""
        return self.shape if self.shape is not None else self.codec.flat_shape(self.numel)

    @functools.cached_property
    def exact_numel(self) -> int:
        return sum(n for _, n in self.exact)

    @functools.cached_property
    def slot(self) -> tuple[int, int]:
        """(lead, size) of the part's payload in a message (computed once: a layout serves every call)."""
        return _slot(self.codec, self.numel, self.code_shape)

    @functools.cached_property
    def nbytes(self) -> int:
        """The payload's own bytes (the slot less its lead and padding)."""
        return self.codec.nbytes(self.numel, self.code_shape)

    @functools.cached_property
    def exact_slot(self) -> tuple[int, int]:
        """(lead, size) of the exact values' payload, after the part's; (0, 0) when there are none."""
        return _slot(self.exact_codec, self.exact_numel) if self.exact else (0, 0)  # type: ignore[arg-type]

    @functools.cached_property
    def cast(self) -> torch.dtype | None:
        """The wire dtype when the codecs are plain casts (payload = the values in that dtype, no header,
        flat), decided once; else None."""
        codec, ecodec, numel = self.codec, self.exact_codec, self.numel
        wd = codec.wire_dtype
        if not FAST_FLOATS or wd is None or codec.flat_shape(numel) is not None or self.shape is not None:
            return None
        if codec.nbytes(numel) != numel * wd.itemsize or self.slot[0] or self.exact_slot[0]:
            return None
        e = self.exact_numel
        if e and (ecodec.wire_dtype is None or ecodec.nbytes(e) != e * ecodec.wire_dtype.itemsize):  # type: ignore[union-attr]
            return None
        return wd

    @property
    def message(self) -> int:
        return self.slot[1] + self.exact_slot[1]

    def index(self, device: torch.device) -> torch.Tensor | None:
        """The exact columns as one index ((E,) int64 on ``device``; E is small), None without any."""
        return _index(self.exact, device) if self.exact else None


@functools.lru_cache(maxsize=256)
def _index(ranges: tuple[tuple[int, int], ...], device: torch.device) -> torch.Tensor:
    return torch.cat([torch.arange(a, a + n) for a, n in ranges]).to(device)


def row_layout(sizes: Sequence[int], exact: Sequence[bool], numel: int, codec: Codec,
               ecodec: Codec) -> tuple[Layout, bool]:
    """The layout of a part made of tensors of ``sizes`` values, those flagged ``exact`` patched exactly
    in ``ecodec``; when the sizes do not add up to ``numel`` (FSDP left some parameters out of this call:
    frozen or unused), the whole part in ``codec`` and nothing exact (second value False)."""
    if sum(sizes) != numel or not sizes:
        return Layout(codec, numel, (), ecodec), numel == 0
    if codec.spec in ("fp32", ecodec.spec):  # the codec itself is exact for this dtype
        return Layout(codec, numel, (), ecodec), True
    ranges: list[tuple[int, int]] = []
    at = 0
    for n, ex in zip(sizes, exact):
        if ex and n:
            if ranges and ranges[-1][0] + ranges[-1][1] == at:
                ranges[-1] = (ranges[-1][0], ranges[-1][1] + n)  # neighbours merge into one range
            else:
                ranges.append((at, n))
        at += n
    if ranges == [(0, numel)]:  # everything exact: the exact codec carries the part itself
        return Layout(ecodec, numel, (), ecodec), True
    return Layout(codec, numel, tuple(ranges), ecodec), True


@dataclasses.dataclass(frozen=True)
class Plan:
    """The layout of one call: part ``r`` (the values rank ``r`` owns in a reduce-scatter, or sends in an
    all-gather) laid out by ``layouts[r]``. ``pad_own``: in a reduce-scatter my own slot travels as zeros
    (every split equal: the plain all-to-all, whose host cost on NCCL is a third of the one with split
    lists); else it has no bytes."""

    layouts: tuple[Layout, ...]
    pad_own: bool = False

    @functools.cached_property
    def width(self) -> int:
        """The all-gather's slot: the widest part's message."""
        return max(lay.message for lay in self.layouts)

    def send_splits(self, rank: int) -> list[int]:
        return [0 if i == rank and not self.pad_own else lay.message for i, lay in enumerate(self.layouts)]

    def recv_splits(self, rank: int) -> list[int]:
        m = self.layouts[rank].message
        return [0 if i == rank and not self.pad_own else m for i in range(len(self.layouts))]

    def equal_splits(self) -> bool:
        """Whether the all-to-all's splits are all equal (the plain all-to-all serves)."""
        return self.pad_own and len({lay.message for lay in self.layouts}) == 1

    def scatter_bytes(self, rank: int) -> int:
        """Bytes rank ``rank`` sends in the reduce-scatter (its own slot stays home)."""
        return sum(lay.message for i, lay in enumerate(self.layouts) if i != rank)

    def gather_bytes(self) -> int:
        """Bytes a rank sends in the all-gather: ``K-1`` slots of :attr:`width`."""
        return (len(self.layouts) - 1) * self.width


def plan(codec: Codec, sizes: Sequence[int], shapes: Sequence[tuple[int, ...] | None] | None = None,
         pad_own: bool = False) -> Plan:
    """A plan of flat parts of ``sizes`` values (``shapes``: their own shapes, for per-tensor codecs)."""
    shapes = shapes if shapes is not None else [None] * len(sizes)
    return Plan(tuple(Layout(codec, int(n), shape=s) for n, s in zip(sizes, shapes)), pad_own)


# ------------------------------------------------------------------------------------------ the mean
def pow2_inverse(k: int) -> float:
    """2^-ceil(log2 k): K values of at most float32's max, each times this, sum to at most its max."""
    return 2.0 ** -(k - 1).bit_length()


def mean_scaling(codec: Codec, payloads: list[torch.Tensor], n: int, shape: tuple[int, ...] | None,
                 divide_by: int) -> tuple[float, float]:
    """Finite in, finite out for a mean of K values: summing first, as a fused decode-and-sum does, turns
    values above float32's max / K into ±Inf. So the received payloads' scales are multiplied by
    ``pre = 2^-ceil(log2 K)`` (in place: they then decode to ``pre`` times their values, exactly), the sum
    is taken, then divided by ``K * pre`` (<= 1; none for K a power of two). Scaling by a power of two
    commutes with float32 rounding, so the result has the same bits as ``sum / K`` wherever that did not
    overflow (outside the subnormal range). Returns ``(pre, divisor)``: ``(1, divide_by)`` when there is
    nothing to divide or the codec has no scales (:meth:`Codec.scale_fields`); then the caller divides
    as before."""
    if divide_by == 1 or n == 0:
        return 1.0, divide_by
    pre = pow2_inverse(divide_by)
    if codec.scale_fields(n, shape) is None:
        return 1.0, divide_by
    for p in payloads:
        codec.scale_payload_(p, n, pre, shape)
    return pre, divide_by * pre


def _sum_into(out: torch.Tensor, others: list[torch.Tensor], own: torch.Tensor) -> torch.Tensor:
    """``out`` (float32) = others[0] + others[1] + ... + own, added in that order in float32 (the order
    and precision of the codec path: decode_sum of the others, then the own part)."""
    if len(others) == 1 and torch.result_type(others[0], own) == torch.float32:
        return torch.add(others[0], own, out=out)  # one kernel; a + b == b + a exactly
    out.copy_(others[0])
    for o in others[1:]:
        out.add_(o)
    return out.add_(own)


# ------------------------------------------------------------------------------------------ reduce-scatter
def scatter_encode(p: Plan, parts: Sequence[torch.Tensor] | torch.Tensor, rank: int,
                   seeds: Sequence[int | torch.Tensor] = (),
                   residuals: Sequence[torch.Tensor | None] | None = None,
                   compensated: bool = False) -> torch.Tensor:
    """The reduce-scatter's message from ``rank``: part ``i`` of ``parts`` (my copy of the values rank
    ``i`` owns; a ``(K, S)`` tensor of equal rows also serves) encoded for rank ``i`` with rounding seed
    ``seeds[i]`` (none: 0). ``residuals[i]``: error feedback for that part (float32, the part's size): the
    part sent is ``part + residual`` and the residual becomes what its payload lost (zero at the exact
    columns, which arrive whole); ``compensated``: the parts already hold ``x + residual`` (float32). My own
    part is not encoded (its residual, if any, is zeroed). Returns the message, the parts in rank order in
    their slots (:meth:`Plan.send_splits`)."""
    k = len(p.layouts)
    dev = parts.device if isinstance(parts, torch.Tensor) else next(t for t in parts).device
    cast = p.layouts[0].cast if isinstance(parts, torch.Tensor) and p.equal_splits() and residuals is None else None
    if cast is not None:
        return _scatter_cast(p, parts, cast)  # type: ignore[arg-type]
    pieces: list[tuple[int, torch.Tensor, int]] = []
    for i in range(k):
        lay = p.layouts[i]
        if i == rank:
            if residuals is not None and residuals[i] is not None:
                residuals[i].zero_()  # type: ignore[union-attr]  # it never crosses the wire: nothing lost
            if p.pad_own:
                pieces.append((0, _zeros(lay.message, dev), lay.message))
            continue
        x = parts[i]
        seed = seeds[i] if seeds else 0
        res = residuals[i] if residuals is not None else None
        if lay.numel == 0:  # nothing to send: an empty slot
            pieces.append((0, _zeros(0, dev), lay.message))
            continue
        if res is not None:
            comp = x if compensated else x.float() + res
            payload = encode_with_feedback(lay.codec, comp, res, seed, lay.shape)  # type: ignore[arg-type]
            if lay.exact:
                res.index_fill_(0, lay.index(dev), 0.0)  # the exact copy delivers these values whole
        else:  # (a codec reads any float dtype and layout; a per-tensor one, its part's own shape)
            payload = lay.codec.encode(x if lay.shape is None else x.to(torch.float32).contiguous().view(lay.shape),
                                       seed=seed)
        lead, size = lay.slot
        pieces.append((lead, payload, size))
        if lay.exact:
            elead, esize = lay.exact_slot
            pieces.append((elead, lay.exact_codec.encode(torch.index_select(x, 0, lay.index(dev))), esize))  # type: ignore[union-attr]
    return _framed(pieces, dev)


def _scatter_cast(p: Plan, x: torch.Tensor, wd: torch.dtype) -> torch.Tensor:
    """:func:`scatter_encode` for a float codec: every row cast into its slot of the message at once (my
    own too: it stays at home), exact values copied behind."""
    lay = p.layouts[0]
    n, s = x.shape
    msg, size, nb, e = lay.message, lay.slot[1], s * wd.itemsize, lay.exact_numel
    if not e and msg == nb and x.dtype == wd and x.is_contiguous():
        return x.view(-1).view(torch.uint8)  # the rows are already the message (reduce dtype = wire's): no copy
    send = torch.empty(n, msg, dtype=torch.uint8, device=x.device)
    send[:, :nb].view(wd).copy_(x)
    if e:
        ed = lay.exact_codec.wire_dtype  # type: ignore[union-attr]
        send[:, size : size + e * ed.itemsize].view(ed).copy_(torch.index_select(x, 1, lay.index(x.device)))
    return send.view(-1)


def scatter_sum(p: Plan, recv: torch.Tensor, rank: int, own: torch.Tensor, out: torch.Tensor,
                divide_by: int = 1) -> torch.Tensor:
    """My part of the sum, from the reduce-scatter's receive buffer (:meth:`Plan.recv_splits`): the other
    ranks' copies decoded and summed in rank order (float32), then ``own`` (my exact copy, any float
    dtype) added; exact columns patched with their exact sum. ``divide_by``: a mean (scaled first where
    the codec has scales: :func:`mean_scaling`). Into ``out`` ((n,) float32); returns it."""
    k = len(p.layouts)
    lay = p.layouts[rank]
    n, m = lay.numel, lay.message
    if k == 1 or n == 0:
        out.copy_(own.reshape(-1))
        return out.div_(divide_by) if divide_by != 1 else out
    others = [j for j in range(k) if j != rank]
    at = [(j if p.pad_own else i) * m for i, j in enumerate(others)]
    own = own.reshape(-1)
    e = lay.exact_numel
    wd = lay.cast
    if wd is not None and p.pad_own and divide_by == 1:
        rows = recv.view(k, m)
        nb = n * wd.itemsize
        _sum_into(out, [rows[j, :nb].view(wd) for j in others], own)
        if e:
            ed = lay.exact_codec.wire_dtype  # type: ignore[union-attr]
            size = lay.slot[1]
            idx = lay.index(out.device)
            acc = torch.empty(e, dtype=torch.float32, device=out.device)
            _sum_into(acc, [rows[j, size : size + e * ed.itemsize].view(ed) for j in others], own[idx])
            out.index_copy_(0, idx, acc)
        return out
    lead, nb = lay.slot[0], lay.nbytes
    payloads = [recv[a + lead : a + lead + nb] for a in at]
    pre, div = mean_scaling(lay.codec, payloads, n, lay.code_shape, divide_by)
    lay.codec.decode_sum(payloads, n, out=out, shape=lay.code_shape)
    if pre != 1.0:
        out.add_(own, alpha=pre)  # (pre * own is exact: a power of two)
    else:
        out.add_(own)  # my own part joins after the others' sum (it never crossed the wire)
    if div != 1:
        out.div_(div)
    if e:
        ecodec, (elead, _) = lay.exact_codec, lay.exact_slot
        size, enb, idx = lay.slot[1], ecodec.nbytes(e), lay.index(out.device)  # type: ignore[union-attr]
        acc = ecodec.decode_sum([recv[a + size + elead : a + size + elead + enb] for a in at], e)  # type: ignore[union-attr]
        acc.add_(own[idx])
        if divide_by != 1:
            acc.div_(divide_by)
        out.index_copy_(0, idx, acc)
    return out


# ------------------------------------------------------------------------------------------ all-gather
def gather_encode(p: Plan, part: torch.Tensor, rank: int, seed: int | torch.Tensor = 0) -> torch.Tensor:
    """The all-gather's message from ``rank``: its ``part`` encoded once (rounding seed ``seed``), the
    exact values behind it, framed in a slot of :attr:`Plan.width` bytes."""
    lay = p.layouts[rank]
    dev = part.device
    wd = lay.cast
    if wd is not None and lay.message == p.width:  # a float codec: cast into the message
        size, nb, e = lay.slot[1], lay.numel * wd.itemsize, lay.exact_numel
        send = torch.empty(p.width, dtype=torch.uint8, device=dev)
        send[:nb].view(wd).copy_(part.reshape(-1))
        if e:
            ed = lay.exact_codec.wire_dtype  # type: ignore[union-attr]
            torch.index_select(part.reshape(-1), 0, lay.index(dev), out=send[size : size + e * ed.itemsize].view(ed))
        return send
    if lay.numel:
        payload = lay.codec.encode(part if lay.shape is None else part.to(torch.float32).contiguous().view(lay.shape),
                                   seed=seed)
    else:
        payload = torch.empty(0, dtype=torch.uint8, device=dev)
    lead, size = lay.slot
    pieces = [(lead, payload, size)]
    if lay.exact:
        elead, esize = lay.exact_slot
        pieces.append((elead, lay.exact_codec.encode(part.reshape(-1)[lay.index(dev)]), esize))  # type: ignore[union-attr]
    if p.width > lay.message:  # padded to the widest part's slot (the pad counts as sent)
        lead, last, size = pieces[-1]
        pieces[-1] = (lead, last, size + p.width - lay.message)
    return _framed(pieces, dev)


def gather_decode(p: Plan, recv: torch.Tensor, outs: Sequence[torch.Tensor] | torch.Tensor) -> None:
    """Every rank's part, from the all-gather's receive buffer (``K`` slots of :attr:`Plan.width`), decoded
    into ``outs[r]`` (a view of any layout and float dtype; a ``(K, S)`` tensor of equal rows also
    serves), in rank order, mine too: every rank decodes the same codes."""
    w = p.width
    k = len(p.layouts)
    lay = p.layouts[0]
    if isinstance(outs, torch.Tensor) and lay.cast is not None and lay.message == w \
            and all(q is lay for q in p.layouts):  # a float codec, equal parts: out of the message for all at once
        wd, n, e = lay.cast, lay.numel, lay.exact_numel
        rows = recv.view(k, w)
        outs.copy_(rows[:, : n * wd.itemsize].view(wd))
        if e:
            ed, size = lay.exact_codec.wire_dtype, lay.slot[1]  # type: ignore[union-attr]
            outs.index_copy_(1, lay.index(outs.device), rows[:, size : size + e * ed.itemsize].view(ed).to(outs.dtype))
        return
    tmp: torch.Tensor | None = None
    for r, (lay, dst) in enumerate(zip(p.layouts, outs)):
        n = lay.numel
        if not n:
            continue
        at = r * w
        wd = lay.cast
        if wd is not None and lay.message == w:
            dst.copy_(recv[at : at + n * wd.itemsize].view(wd).view(dst.shape))
        else:
            lead, nb = lay.slot[0], lay.nbytes
            payload = recv[at + lead : at + lead + nb]
            if dst.is_contiguous() and dst.dtype == torch.float32:
                lay.codec.decode(payload, n, out=dst.view(-1), shape=lay.code_shape)
            elif dst.is_contiguous():  # one float32 buffer serves every rank's part of this size
                if tmp is None or tmp.numel() != n:
                    tmp = torch.empty(n, dtype=torch.float32, device=dst.device)
                lay.codec.decode(payload, n, out=tmp, shape=lay.code_shape)
                dst.copy_(tmp.view(dst.shape))
            else:
                dst.copy_(lay.codec.decode(payload, n, shape=lay.code_shape).view(dst.shape))
        if lay.exact:
            e, ecodec = lay.exact_numel, lay.exact_codec
            elead = lay.exact_slot[0]
            start = at + lay.slot[1] + elead
            vals = recv[start : start + ecodec.nbytes(e)]  # type: ignore[union-attr]
            ed = ecodec.wire_dtype  # type: ignore[union-attr]
            vals = vals.view(ed) if ed is not None and ecodec.head_bytes(e, None) == 0 else ecodec.decode(vals, e)  # type: ignore[union-attr]
            dst.view(-1).index_copy_(0, lay.index(dst.device), vals.to(dst.dtype))
