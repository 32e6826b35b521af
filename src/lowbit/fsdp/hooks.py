"""lowbit.fsdp's two custom collectives for FSDP2: :class:`LowbitReduceScatter` (gradients) and
:class:`LowbitAllGather` (parameters), both on the exchange core (:mod:`lowbit.comm.exchange`), and the
communicators they run on."""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Sequence

import torch
import torch.distributed as dist

from lowbit.auto.estimates import spread_sample
from lowbit.auto.fsdp_tuner import NATIVE
from lowbit.codecs.base import Codec, get_codec
from lowbit.comm import collectives as C
from lowbit.comm import graphs
from lowbit.comm import exchange as X
from lowbit.comm.groups import new_subgroup
from lowbit.comm.residual import restore_unless_finite_anywhere
from lowbit.fsdp.state import FSDPState

log = logging.getLogger("lowbit.fsdp")


# ------------------------------------------------------------------------------------------ layout
# A row's layout, the exact-values patch, the cast path and the seed rule are the exchange core's
# (lowbit.comm.exchange): FSDP lays out each call's K equal rows with them.
_exact_codec = X.exact_codec
_row_layout = X.row_layout
_seed = X.rounding_seed


def _op_scale(op: object, k: int) -> float:
    """The factor FSDP's reduce op applies to the sum: SUM 1, AVG 1/K, PREMUL_SUM its factor."""
    if op is None:
        return 1.0
    factor = getattr(op, "factor", None)
    if factor is not None:  # ReduceOp.PREMUL_SUM(f) (set_gradient_divide_factor)
        return float(factor)
    if op == dist.ReduceOp.SUM:
        return 1.0
    if op == dist.ReduceOp.AVG:
        return 1.0 / k
    raise ValueError(f"lowbit.fsdp: unsupported reduce op {op!r} (SUM, AVG and PREMUL_SUM are)")


# ------------------------------------------------------------------------------------------ the two comms
class _Comm:
    """What both custom collectives share: FSDP's allocate(), the group's layout and its topology."""

    def __init__(self, state: FSDPState, name: str, index: int, sizes: list[int], exact: list[bool],
                 codec: Codec, groups: _Groups | None) -> None:
        self.state, self.name, self.index = state, name, index
        self.sizes, self.exact, self.codec = sizes, exact, codec
        self.groups = groups
        self._layouts: dict[tuple[int, torch.dtype], X.Layout] = {}
        self._plans: dict[tuple[int, torch.dtype, int], X.Plan] = {}
        self._warned = False
        self._graph_ok: dict[dist.ProcessGroup, bool] = {}

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def _graphed(self, x: torch.Tensor, group: dist.ProcessGroup) -> bool:
        """Whether this call replays a CUDA graph (:mod:`lowbit.comm.graphs`): the group's backend is
        checked once; an emulated link, which may be turned on later, at every call (its thread must carry
        the collective)."""
        if not x.is_cuda or C.link_emulated():
            return False
        ok = self._graph_ok.get(group)
        if ok is None:
            ok = self._graph_ok[group] = graphs.capturable(x.device, [group])
        return ok

    def plan(self, numel: int, dtype: torch.dtype, n: int) -> X.Plan:
        """The exchange core's plan of a call over ``n`` ranks: ``n`` rows of :meth:`layout`, my own slot
        sent as zeros (equal splits: the plain all-to-all)."""
        p = self._plans.get((numel, dtype, n))
        if p is None:
            lay = self.layout(numel, dtype)
            p = self._plans[(numel, dtype, n)] = X.Plan((lay,) * n, pad_own=True)
        return p

    def layout(self, numel: int, dtype: torch.dtype) -> X.Layout:
        """The row's layout for a call of ``numel`` values a rank in ``dtype`` (exact parameters ride in
        ``dtype``'s own bytes)."""
        lay = self._layouts.get((numel, dtype))
        if lay is None:
            lay, exact = _row_layout(self.sizes, self.exact, numel, self.codec, _exact_codec(dtype))
            if not exact and not self._warned:
                self._warned = True
                log.info("lowbit.fsdp: %s: this call carries %d values a rank, not the %d of its parameters "
                         "(frozen or unused ones left out); the whole row takes %s", self.name, numel,
                         sum(self.sizes), self.codec.spec)
            self._layouts[(numel, dtype)] = lay
        return lay

    def split(self, group: dist.ProcessGroup) -> tuple[dist.ProcessGroup | None, dist.ProcessGroup, int, int]:
        """(intra-node group or None, the compressed exchange's group, nodes N, ranks per node L): this
        direction's own communicators (:func:`_make_groups`), or FSDP's group when it has none."""
        if self.groups is None:
            return None, group, group.size(), 1
        g = self.groups
        return g.intra, g.cross, g.nodes, g.local


@dataclasses.dataclass(frozen=True)
class _Groups:
    """The communicators of one direction (gradients or parameters): ``cross`` carries the compressed
    exchange (among the ranks of one local index, one a node; all ranks with one node), ``intra`` the
    native one inside a node (None with one node)."""

    intra: dist.ProcessGroup | None
    cross: dist.ProcessGroup
    nodes: int
    local: int


def _make_groups(group: dist.ProcessGroup, node_size: int | None) -> _Groups:
    """New communicators over ``group``'s ranks. The gradients get their own, apart from FSDP's: one NCCL
    communicator runs one collective at a time, and the backward's parameter all-gathers would queue
    behind the gradients' exchange (and the other way round) instead of sharing the link, as FSDP's own
    reduce-scatter and all-gather do on their two streams. Every rank calls this in the same order."""
    ranks = dist.get_process_group_ranks(group)
    k, rank = len(ranks), group.rank()
    if node_size is None or node_size >= k:
        return _Groups(None, new_subgroup(group, ranks), k, 1)  # (group's timeout and backend)
    nodes = k // node_size
    node, local = divmod(rank, node_size)
    intra = new_subgroup(group, ranks[node * node_size : (node + 1) * node_size])
    cross = new_subgroup(group, [ranks[j * node_size + local] for j in range(nodes)])
    return _Groups(intra, cross, nodes, node_size)


class LowbitReduceScatter(_Comm):
    """FSDP2's ``ReduceScatter`` for one FSDP module: gradients cross the wire in the state's codec, or, as
    ``codec="auto"`` chooses (:meth:`set_choice`), in another codec or FSDP's own reduce-scatter."""

    def __init__(self, state: FSDPState, name: str, index: int, sizes: list[int], exact: list[bool],
                 codec: Codec | None, groups: _Groups | None) -> None:
        super().__init__(state, name, index, sizes, exact, codec, groups)  # type: ignore[arg-type]
        self.native = codec is None  # FSDP's own reduce-scatter (codec="auto" starts there)
        self.choice = NATIVE if codec is None else codec.spec
        self.ef = state.feedback is not None and codec is not None and not codec.sums_on_wire

    def set_choice(self, key: str) -> None:
        """codec="auto": from the next call, ``key``: a codec spec, or ``NATIVE`` (FSDP's own reduce-scatter
        in its reduce dtype). Error feedback for the biased codecs; a module whose choice changes starts
        with an empty residual."""
        fb = self.state.feedback
        if fb is not None:
            for k in [k for k in fb.residuals if k[0] == self.name]:
                del fb.residuals[k]
        self.choice, self.native = key, key == NATIVE
        self.codec = None if self.native else get_codec(key)  # type: ignore[assignment]
        self._layouts, self._plans = {}, {}
        self.ef = fb is not None and not self.native and self.codec.biased

    def sample(self, rows: torch.Tensor) -> tuple[torch.Tensor, int]:
        """codec="auto": a sample of this rank's gradient rows ((K, S); :func:`lowbit.auto.estimates.spread_sample`)
        with the values the policy keeps exact read as zeros (they cross exactly), and how many values it
        stands for."""
        k, s = rows.shape
        if any(self.exact) and sum(self.sizes) == s:
            exact = torch.repeat_interleave(torch.tensor(self.exact), torch.tensor(self.sizes)).to(rows.device)
            rows = rows.masked_fill(exact, 0)  # (K, S), a copy
        return spread_sample(rows.reshape(-1)), k * s

    def residual(self, s: int, n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor | None:
        """This module's error-feedback residual for a call of ``s`` values a rank over ``n`` ranks ((n * s,)
        float32, zeros the first time), None where the call keeps none: no error feedback, one rank, a
        float codec (cast path), or a row that the exact codec carries whole."""
        if not self.ef or n == 1:
            return None
        lay = self.layout(s, dtype)
        if lay.cast is not None or lay.codec.sums_on_wire:
            return None
        return self.state.feedback.residual((self.name, s), n * s, device)

    def residual_sq(self) -> torch.Tensor | None:
        """The squared norm of this module's error-feedback residual (a device scalar), None without one."""
        fb = self.state.feedback
        res = [e for key, e in fb.residuals.items() if key[0] == self.name] if fb is not None and self.ef else []
        return sum((e.double() ** 2).sum() for e in res) if res else None  # type: ignore[return-value]

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 op: object = None, async_op: bool = False) -> None:
        st = self.state
        k = group.size()
        s = output_tensor.numel()
        if input_tensor.numel() != k * s:
            raise ValueError(f"lowbit.fsdp: reduce-scatter input has {input_tensor.numel()} values, expected {k} x {s}")
        if st.auto is not None:
            st.auto.observe(self, input_tensor.view(k, s))
        if self.native:  # FSDP's own reduce-scatter, in its reduce dtype and op
            st.iter += 1
            st.grad_stats.calls += 1
            C.reduce_scatter(output_tensor, input_tensor, group, op)
            st.grad_stats.bytes_sent += (k - 1) * s * input_tensor.element_size()
            if self.groups is not None and self.groups.intra is not None:  # the chunks for other nodes' ranks
                st.grad_stats.bytes_inter += (k - self.groups.local) * s * input_tensor.element_size()
            return
        scale = _op_scale(op, k)
        intra, cross, nodes, local = self.split(group)
        x = input_tensor.view(k, s)
        if intra is None:
            st.iter += 1
            self._count(s, x.dtype, cross)
            fn = functools.partial(self._reduce, group=cross, scale=scale)
            seeds = self._seeds(cross)
            if self._graphed(x, cross):
                key = (k, s, x.dtype, output_tensor.dtype, cross, scale, self.choice, self._residual_ptr(s, x.dtype, cross))
                st.grad_graphs.run(key, fn, [x], [output_tensor], seeds, keyed=self.codec.device_seed)
            else:
                fn([x], [output_tensor], seeds)
            return
        # Sum each node's rows natively (in the reduce dtype); row n of the result is node n's sum
        # of the chunk that my local index owns on node n.
        blocks = x.view(nodes, local, s).transpose(0, 1).contiguous()  # (L, N, S): block l -> local rank l
        x = torch.empty(nodes, s, dtype=input_tensor.dtype, device=input_tensor.device)
        C.reduce_scatter(x.view(-1), blocks.view(-1), intra)
        st.grad_stats.bytes_sent += (local - 1) * nodes * s * input_tensor.element_size()
        del blocks
        st.iter += 1
        self._count(s, x.dtype, cross)
        self._reduce([x], [output_tensor], self._seeds(cross), group=cross, scale=scale, intra=intra)

    def _count(self, s: int, dtype: torch.dtype, group: dist.ProcessGroup) -> None:
        """One exchange of rows of ``s`` values over ``group``: the call and the bytes it sends."""
        st = self.state
        st.grad_stats.calls += 1
        n = group.size()
        if n == 1:
            return
        sent = (n - 1) * self.layout(s, dtype).message
        st.grad_stats.bytes_sent += sent
        if self.groups is not None and self.groups.intra is not None:
            st.grad_stats.bytes_inter += sent

    def _seeds(self, group: dist.ProcessGroup) -> list[int]:
        """This call's rounding seed for the row to each rank of ``group`` (none for a deterministic codec)."""
        if not self.codec.stochastic:
            return []
        st = self.state
        return [_seed(st.iter, self.index, st.rank, i) for i in range(group.size())]

    def _residual_ptr(self, s: int, dtype: torch.dtype, group: dist.ProcessGroup) -> int:
        """Where this module's error-feedback residual lives (a graph reads it there), 0 without one."""
        res = self.residual(s, group.size(), dtype, self.state.device)
        return 0 if res is None else res.data_ptr()

    def _reduce(self, ins: Sequence[torch.Tensor], outs: Sequence[torch.Tensor], seeds: Sequence[int | torch.Tensor],
                *, group: dist.ProcessGroup, scale: float, intra: dist.ProcessGroup | None = None) -> None:
        """The tensor work of one reduce-scatter (what a CUDA graph captures): ``ins[0]`` (N, S) my row for
        each rank -> ``outs[0]`` (S,) the reduced shard in FSDP's dtype, times ``scale``. With error
        feedback, lowbit.feedback's rule for a non-finite step, decided alike on every rank of FSDP's
        group (``intra``: the node's group when the rows were summed inside nodes first)."""
        x, output = ins[0], outs[0]
        s = output.numel()
        direct = output.dtype == torch.float32 and output.is_contiguous()
        res = self.residual(s, group.size(), x.dtype, x.device)  # (the one _exchange updates), None without
        before = res.clone() if res is not None else None
        reduced = self._exchange(x, group, s, output.view(-1) if direct else None, seeds)
        if res is not None:
            restore_unless_finite_anywhere(res, before, reduced, [group] if intra is None else [group, intra])
        if scale != 1.0:
            reduced.mul_(scale)
        if not direct:
            output.copy_(reduced)

    def _exchange(self, x: torch.Tensor, group: dist.ProcessGroup, s: int,
                  out: torch.Tensor | None = None, seeds: Sequence[int | torch.Tensor] = ()) -> torch.Tensor:
        """Phases 1-2 over ``group`` (the exchange core's reduce-scatter, :mod:`lowbit.comm.exchange`):
        ``x`` (N, S) holds my row for each of its N ranks; returns the sum of everybody's row for me, (S,)
        float32 (in ``out`` when given). ``seeds``: the row to rank i's rounding seed (:meth:`_seeds`).
        Tensor work only (the statistics are :meth:`_count`'s)."""
        rank, n = group.rank(), group.size()
        dev = x.device
        if out is None:
            out = torch.empty(s, dtype=torch.float32, device=dev)
        if n == 1:
            out.copy_(x[0])
            return out
        p = self.plan(s, x.dtype, n)
        res = self.residual(s, n, x.dtype, dev)  # (a non-finite step puts it back: _reduce)
        send = X.scatter_encode(p, x, rank, seeds, None if res is None else list(res.view(n, s)))
        recv = torch.empty(n * p.layouts[0].message, dtype=torch.uint8, device=dev)
        C.all_to_all(recv, send, group)
        del send
        return X.scatter_sum(p, recv, rank, x[rank], out)


class LowbitAllGather(_Comm):
    """FSDP2's ``AllGather`` for one FSDP module: parameter shards cross the wire in ``param_codec``."""

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 async_op: bool = False) -> None:
        st = self.state
        k = group.size()
        s = input_tensor.numel()
        dev = input_tensor.device
        if not input_tensor.is_floating_point():
            # mixed parameter dtypes: FSDP gathers raw bytes, which no codec can read; send them as they are
            if not self._warned:
                self._warned = True
                log.warning("lowbit.fsdp: %s gathers parameters of mixed dtypes as bytes; sent uncompressed", self.name)
            C.all_gather(output_tensor, input_tensor, group, link=False)
            st.param_stats.bytes_sent += (k - 1) * s * input_tensor.element_size()
            return
        intra, cross, nodes, local = self.split(group)
        st.param_stats.calls += 1
        self._count(s, input_tensor.dtype, cross)
        if intra is None:
            fn = functools.partial(self._gather_rows, group=cross)
            if self._graphed(input_tensor, cross):
                key = (k, s, input_tensor.dtype, output_tensor.dtype, cross, self.codec.spec)
                st.param_graphs.run(key, fn, [input_tensor], [output_tensor.view(k, s)])
            else:
                fn([input_tensor], [output_tensor.view(k, s)], ())
            return
        # Compressed among the ranks of my local index (one a node), then natively inside the node.
        rows = torch.empty(nodes, s, dtype=input_tensor.dtype, device=dev)
        self._gather(input_tensor, rows, cross)
        gathered = torch.empty(local * nodes * s, dtype=input_tensor.dtype, device=dev)
        C.all_gather(gathered, rows.view(-1), intra, link=False)
        st.param_stats.bytes_sent += (local - 1) * nodes * s * input_tensor.element_size()
        # (L, N, S) -> (N, L, S): global rank n * L + l
        output_tensor.view(nodes, local, s).copy_(gathered.view(local, nodes, s).transpose(0, 1))

    def _count(self, s: int, dtype: torch.dtype, group: dist.ProcessGroup) -> None:
        """One compressed all-gather of ``s`` values a rank over ``group``: the bytes it sends."""
        n = group.size()
        sent = (n - 1) * self.layout(s, dtype).message
        self.state.param_stats.bytes_sent += sent
        if self.groups is not None and self.groups.intra is not None:
            self.state.param_stats.bytes_inter += sent

    def _gather_rows(self, ins: Sequence[torch.Tensor], outs: Sequence[torch.Tensor], seeds: Sequence[object],
                     *, group: dist.ProcessGroup) -> None:
        """:meth:`_gather` as a :class:`lowbit.comm.graphs.Graphs` function (what a CUDA graph captures)."""
        self._gather(ins[0], outs[0], group)

    def _gather(self, shard: torch.Tensor, rows: torch.Tensor, group: dist.ProcessGroup) -> None:
        """Encode ``shard`` ((S,)), all-gather over ``group`` and decode every rank's into ``rows`` (N, S):
        the exchange core's all-gather (:mod:`lowbit.comm.exchange`). Tensor work only (the statistics
        are :meth:`_count`'s)."""
        rank, n = group.rank(), group.size()
        p = self.plan(shard.numel(), shard.dtype, n)
        # a fixed seed per module and rank: the backward's re-gather decodes the same weights
        send = X.gather_encode(p, shard, rank, seed=_seed(self.index, self.state.rank))
        recv = torch.empty(n * p.width, dtype=torch.uint8, device=shard.device)
        C.all_gather(recv, send, group)
        del send
        X.gather_decode(p, recv, rows)
