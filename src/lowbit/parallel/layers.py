"""Model-parallel linear layers whose activations and activation gradients cross in a lowbit codec.

A :class:`ColumnParallelLinear` holds rank ``r``'s slice of the output features (rows of the weight,
:func:`lowbit.comm.gather.part_sizes` of them). Its input is replicated on every rank; its output slice
is gathered along the features on every rank (forward: a compressed all-gather, so every rank holds the
same activations bit for bit), and in the backward every rank's slice of the weight contributes a partial
gradient of the input, which a compressed all-reduce sums ("activation gradients reduced backward"). The
gather's own backward takes this rank's slice of the (replicated) output gradient: no communication.

The codecs: ``codec`` for activations (forward), ``grad_codec`` for activation gradients (backward;
default the same). The default is Dettmers' dynamic tree 8-bit with one scale per tensor
(``dettmers:type=dynamic,bucket=0``), as in the paper. ``fp32`` crosses exactly.

:func:`parallelize` turns a ``Sequential`` of ``Linear`` / ``ReLU`` / ``Dropout`` (a classifier, an MLP)
into its model-parallel twin with the same parameters; its dropout draws the same mask on every rank.

With ``pair=True`` consecutive ``Linear`` layers go in pairs, as in Megatron-LM (Shoeybi et al. 2019):
a column-parallel layer keeps its output slice (no gather), the next, a :class:`RowParallelLinear`,
takes that slice as its input (its weight's matching columns) and sums the ranks' partial outputs with
one compressed all-reduce. Per pair that is one transfer forward and none backward for the pair's
inside (the row layer's input gradient is local), instead of a gather forward and a reduction backward
per layer: half the activation transfers of an MLP's chain.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from lowbit.codecs.base import Codec, get_codec
from lowbit.comm import collectives as C
from lowbit.comm.allreduce import CommStats, all_reduce
from lowbit.comm.gather import all_gather, part_sizes

__all__ = ["DEFAULT_CODEC", "ParallelComm", "ColumnParallelLinear", "RowParallelLinear", "SharedDropout",
           "parallelize", "gather_features", "copy_to_parallel", "reduce_features"]

DEFAULT_CODEC = "dettmers:type=dynamic,bucket=0"


@dataclasses.dataclass
class ParallelComm:
    """What the model-parallel layers of one model share: the group, the codecs, the byte counters and
    a step counter that seeds stochastic rounding (same on every rank)."""

    group: dist.ProcessGroup | None = None
    codec: Codec | str = DEFAULT_CODEC
    grad_codec: Codec | str | None = None
    stats: CommStats = dataclasses.field(default_factory=CommStats)
    step: int = 0

    def __post_init__(self) -> None:
        self.codec = get_codec(self.codec) if isinstance(self.codec, str) else self.codec
        g = self.grad_codec if self.grad_codec is not None else self.codec
        self.grad_codec = get_codec(g) if isinstance(g, str) else g

    @property
    def world(self) -> tuple[int, int]:
        return C.world(self.group)


class _CopyToParallel(torch.autograd.Function):
    """Identity forward; backward: the compressed sum over ranks of the input's gradient."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: ParallelComm, tag: int) -> torch.Tensor:
        ctx.comm, ctx.tag = comm, tag
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        comm = ctx.comm
        g = g.contiguous().clone()
        if comm.world[1] > 1:
            all_reduce(g, comm.grad_codec, comm.group, algorithm="auto", op="sum", key=("lowbit.parallel", ctx.tag),
                       seed=comm.step * 31 + ctx.tag, stats=comm.stats)
        return g, None, None


class _GatherFeatures(torch.autograd.Function):
    """Forward: the compressed all-gather of every rank's slice along the last dimension; backward: this
    rank's slice of the output gradient (the computation after the gather is replicated)."""

    @staticmethod
    def forward(ctx: Any, y: torch.Tensor, comm: ParallelComm, sizes: list[int], tag: int) -> torch.Tensor:
        rank, _ = comm.world
        ctx.lo, ctx.size = sum(sizes[:rank]), sizes[rank]
        return all_gather(y.contiguous(), comm.codec, comm.group, dim=-1, sizes=sizes,  # type: ignore[return-value]
                          seed=comm.step * 31 + tag, stats=comm.stats)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        return g.narrow(-1, ctx.lo, ctx.size).contiguous(), None, None, None


class _ReduceFeatures(torch.autograd.Function):
    """Forward: the compressed sum over ranks of every rank's partial output; backward: identity (the
    output, and so its gradient, is replicated: each partial's gradient is the output's)."""

    @staticmethod
    def forward(ctx: Any, y: torch.Tensor, comm: ParallelComm, tag: int) -> torch.Tensor:
        y = y.contiguous().clone()
        if comm.world[1] > 1:
            all_reduce(y, comm.codec, comm.group, algorithm="auto", op="sum", key=("lowbit.parallel.row", tag),
                       seed=comm.step * 31 + tag, stats=comm.stats)
        return y

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return g, None, None


def reduce_features(y: torch.Tensor, comm: ParallelComm, tag: int = 0) -> torch.Tensor:
    """Every rank's partial output ``y`` summed in ``comm.codec`` (the same result on every rank)."""
    return _ReduceFeatures.apply(y, comm, tag)


def copy_to_parallel(x: torch.Tensor, comm: ParallelComm, tag: int = 0) -> torch.Tensor:
    """``x`` (replicated) entering model-parallel layers: identity, whose backward sums the ranks' partial
    gradients in ``comm.grad_codec``."""
    return _CopyToParallel.apply(x, comm, tag)


def gather_features(y: torch.Tensor, comm: ParallelComm, sizes: list[int], tag: int = 0) -> torch.Tensor:
    """Every rank's slice ``y`` (last dimension ``sizes[rank]``) gathered in ``comm.codec``."""
    return _GatherFeatures.apply(y, comm, sizes, tag)


class _SplitLinear(nn.Module):
    """What the column- and row-parallel layers share: ``weight`` split along ``split_dim`` (0: output
    features, 1: input features) in :func:`lowbit.comm.gather.part_sizes` parts, this rank's from
    ``lo``; the bias split with the output features, else whole."""

    split_dim = 0

    def _split(self, in_features: int, out_features: int, comm: ParallelComm, tag: int) -> int:
        """Set the split's attributes; returns this rank's number of split features."""
        rank, k = comm.world
        n, what = (out_features, "output") if self.split_dim == 0 else (in_features, "input")
        if n < k:
            raise ValueError(f"{type(self).__name__}: {n} {what} features cannot be split over {k} ranks")
        self.in_features, self.out_features = in_features, out_features
        self.comm, self.tag = comm, tag
        self.sizes = part_sizes(n, k)
        self.lo = sum(self.sizes[:rank])
        return self.sizes[rank]

    @classmethod
    def from_linear(cls, linear: nn.Linear, comm: ParallelComm, **kw: Any) -> "_SplitLinear":
        """This rank's slice of ``linear`` (same values: a model split this way computes what it did)."""
        m = cls(linear.in_features, linear.out_features, comm, bias=linear.bias is not None,  # type: ignore[call-arg]
                device=linear.weight.device, **kw)
        n = m.weight.shape[m.split_dim]
        with torch.no_grad():
            m.weight.copy_(linear.weight.narrow(m.split_dim, m.lo, n))
            if m.bias is not None and linear.bias is not None:
                m.bias.copy_(linear.bias.narrow(0, m.lo, n) if m.split_dim == 0 else linear.bias)
        return m


class ColumnParallelLinear(_SplitLinear):
    """``nn.Linear(in_features, out_features)`` with the output features split across the group's ranks.

    ``forward(x)``: ``x`` (..., in_features) replicated on every rank -> (..., out_features) gathered on every
    rank (``gather_output``; else this rank's slice). ``activation``: an elementwise module applied to
    the slice before the gather, so that what crosses is the activation (ReLU's zeros exact) and its
    backward uses the exact pre-activation: a ReLU after a lossy gather would zero the gradient of every
    small value the codec rounded to 0. ``reduce_input_grad=False`` leaves the input's gradient partial (this rank's slice's contribution): for a caller that sums it itself (the hybrid's
    reduce-scatter of the batch).
    """

    def __init__(self, in_features: int, out_features: int, comm: ParallelComm, bias: bool = True,
                 gather_output: bool = True, reduce_input_grad: bool = True, tag: int = 0,
                 activation: nn.Module | None = None, device: torch.device | str | None = None) -> None:
        super().__init__()
        n = self._split(in_features, out_features, comm, tag)
        self.gather_output, self.reduce_input_grad = gather_output, reduce_input_grad
        self.activation = activation
        self.weight = nn.Parameter(torch.empty(n, in_features, device=device))
        self.bias = nn.Parameter(torch.zeros(n, device=device)) if bias else None
        nn.init.kaiming_uniform_(self.weight, a=5**0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.reduce_input_grad and x.requires_grad:
            x = copy_to_parallel(x, self.comm, 2 * self.tag)
        y = F.linear(x, self.weight, self.bias)
        if self.activation is not None:
            y = self.activation(y)  # elementwise, on the slice: what crosses is the activation itself
        if self.gather_output:
            y = gather_features(y, self.comm, self.sizes, 2 * self.tag + 1)
        return y

    def extra_repr(self) -> str:
        rank, k = self.comm.world
        return (f"in_features={self.in_features}, out_features={self.out_features} (rank {rank} of {k}: "
                f"{self.weight.shape[0]}), codec={self.comm.codec.spec}")


class RowParallelLinear(_SplitLinear):
    """``nn.Linear(in_features, out_features)`` with the *input* features split across the group's ranks
    (the weight's columns, :func:`lowbit.comm.gather.part_sizes` of them, as a
    :class:`ColumnParallelLinear` with ``gather_output=False`` leaves its output).

    ``forward(x)``: ``x`` (..., in slice) this rank's slice -> (..., out_features) on every rank: the
    partial products summed with one compressed all-reduce in ``comm.codec``, then the bias (held whole,
    the same on every rank). Backward: the input slice's gradient is local (the output gradient is
    replicated), the weight's from the local slice: no communication."""

    split_dim = 1

    def __init__(self, in_features: int, out_features: int, comm: ParallelComm, bias: bool = True, tag: int = 0,
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        n = self._split(in_features, out_features, comm, tag)
        self.weight = nn.Parameter(torch.empty(out_features, n, device=device))
        self.bias = nn.Parameter(torch.zeros(out_features, device=device)) if bias else None
        nn.init.kaiming_uniform_(self.weight, a=5**0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = reduce_features(F.linear(x, self.weight), self.comm, 2 * self.tag + 1)
        return y + self.bias if self.bias is not None else y

    def extra_repr(self) -> str:
        rank, k = self.comm.world
        return (f"in_features={self.in_features} (rank {rank} of {k}: {self.weight.shape[1]}), "
                f"out_features={self.out_features}, codec={self.comm.codec.spec}")


class SharedDropout(nn.Module):
    """Dropout that draws the same mask on every rank (the activations after a gather are replicated and
    must stay so): the mask comes from a generator seeded by (seed, the comm's step, call index).

    Inside a CUDA graph (:class:`lowbit.parallel.Hybrid` with ``graph=True``) no generator can be
    seeded per step: while a graph is captured, the calls read buffers (``_static``), into which the
    masks are drawn before each replay, the same way and with the same seeds (:meth:`_fill`)."""

    def __init__(self, p: float, comm: ParallelComm, seed: int = 0,
                 features: tuple[int, int, int] | None = None) -> None:
        super().__init__()
        if not 0.0 <= p < 1.0:
            raise ValueError(f"dropout probability must be in [0, 1), got {p}")
        self.p, self.comm, self.seed = p, comm, seed
        self.features = features  # (lo, size, total): x is this slice of the last dimension of the whole
        self._calls = 0
        self._step = -1
        self._record: list[tuple[tuple[int, ...], torch.device]] | None = None  # shapes, while recording
        self._static: list[torch.Tensor] | None = None  # a graph's mask buffers, one per call of a step
        self._gcall = 0

    def _keep(self, shape: tuple[int, ...], device: torch.device, call: int) -> torch.Tensor:
        """The keep mask of this step's ``call``-th call on an input of ``shape``."""
        g = torch.Generator(device=device)
        g.manual_seed((self.seed * 1_000_003 + self.comm.step * 9_973 + call) & 0x7FFFFFFF)
        if self.features is None:
            return torch.rand(shape, generator=g, device=device) >= self.p
        lo, size, total = self.features  # the whole tensor's mask, this slice of it: as the unsplit layer drew
        return (torch.rand((*shape[:-1], total), generator=g, device=device) >= self.p).narrow(-1, lo, size)

    def _fill(self, bufs: list[torch.Tensor]) -> None:
        """Draw this step's masks into a graph's buffers (before its replay), call by call."""
        for call, buf in enumerate(bufs):
            buf.copy_(self._keep(tuple(buf.shape), buf.device, call))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return x
        static = self._static
        if static is not None:  # being captured: this step's masks are drawn before each replay
            if self._gcall >= len(static) or tuple(static[self._gcall].shape) != tuple(x.shape):
                raise RuntimeError("SharedDropout: the captured step calls the dropout differently from its "
                                   "warm-up (data-dependent control flow in the classifier?)")
            keep = static[self._gcall]
            self._gcall += 1
            return x * keep / (1.0 - self.p)
        if self._step != self.comm.step:
            self._step, self._calls = self.comm.step, 0
        if getattr(self, "_record", None) is not None:
            self._record.append((tuple(x.shape), x.device))
        keep = self._keep(tuple(x.shape), x.device, self._calls)
        self._calls += 1
        return x * keep / (1.0 - self.p)


_ELEMENTWISE = (nn.ReLU, nn.GELU, nn.Tanh, nn.Sigmoid, nn.LeakyReLU, nn.SiLU)


def parallelize(seq: nn.Sequential, comm: ParallelComm, first_reduces_input_grad: bool = True,
                seed: int = 0, pair: bool = False) -> nn.Sequential:
    """The model-parallel twin of ``seq`` (``Linear``, ``ReLU``, ``Dropout``, ``Flatten``, ``Identity``
    only): every ``Linear`` becomes this rank's :class:`ColumnParallelLinear` slice with the same values
    and its output gathered (an elementwise activation right after it is applied to the slice before the
    gather), every ``Dropout`` a :class:`SharedDropout`. ``first_reduces_input_grad=False``
    for a caller that sums the first layer's input gradient itself (:class:`lowbit.parallel.Hybrid`).
    ``pair=True``: a ``Linear`` followed (after elementwise layers and dropout) by another goes with it
    as a column-parallel layer without gather and a :class:`RowParallelLinear` (module doc)."""
    out: list[nn.Module] = []
    tag = 0
    mods = list(seq)
    i = 0

    def tail(j: int) -> tuple[list[nn.Module], int]:
        """The elementwise layers and dropouts from index j, and the index after them."""
        got = []
        while j < len(mods) and isinstance(mods[j], (*_ELEMENTWISE, nn.Dropout, nn.Identity)):
            got.append(mods[j])
            j += 1
        return got, j

    while i < len(mods):
        m = mods[i]
        i += 1
        if isinstance(m, nn.Linear):
            act = None
            if i < len(mods) and isinstance(mods[i], _ELEMENTWISE):
                act = mods[i]  # applied to the slice before the gather
                i += 1
            reduce_in = first_reduces_input_grad or tag > 0
            between, j = tail(i)
            if pair and j < len(mods) and isinstance(mods[j], nn.Linear):
                col = ColumnParallelLinear.from_linear(m, comm, tag=tag, activation=act, gather_output=False,
                                                       reduce_input_grad=reduce_in)
                out.append(col)
                rank = comm.world[0]
                for b in between:  # on the slice: elementwise as is, dropout with the whole layer's mask
                    out.append(SharedDropout(b.p, comm, seed=seed * 101 + len(out),
                                             features=(col.lo, col.sizes[rank], col.out_features))
                               if isinstance(b, nn.Dropout) else b)
                out.append(RowParallelLinear.from_linear(mods[j], comm, tag=tag + 1))
                tag += 2
                i = j + 1
                continue
            out.append(ColumnParallelLinear.from_linear(m, comm, tag=tag, activation=act, reduce_input_grad=reduce_in))
            tag += 1
        elif isinstance(m, nn.Dropout):
            out.append(SharedDropout(m.p, comm, seed=seed * 101 + len(out)))
        elif isinstance(m, (*_ELEMENTWISE, nn.Flatten, nn.Identity)):
            out.append(m)
        else:
            raise ValueError(f"lowbit.parallel.parallelize: cannot split {type(m).__name__} (Linear, ReLU, "
                             "Dropout, Flatten, Identity, GELU, Tanh, Sigmoid only)")
    if tag == 0:
        raise ValueError("lowbit.parallel.parallelize: the Sequential has no Linear layer to split")
    return nn.Sequential(*out)
