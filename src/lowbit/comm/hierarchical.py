"""``algorithm="hierarchical"``: compress only what crosses between nodes.

Compression pays on the slow link between machines, not on NVLink inside one. With ``G`` ranks per
node and ``N`` nodes (``K = G * N`` ranks, node ``j`` holding group ranks ``j*G ... j*G + G - 1``, as
torchrun places them), one reduction of ``n`` values runs in three phases:

1. **inside each node**, a native fp32 reduce-scatter: local rank ``l`` ends with its node's sum of
   chunk ``l`` (``ceil(n / G)`` values; the last chunk may be short or empty);
2. **between nodes**, among the ranks of the same local index (one per node, each carrying ``1/G`` of
   the tensor), the compressed sum of that chunk, with the flat algorithm that suits ``N`` ranks
   (allgather for 2 nodes, scatter_gather above) and error feedback on the node sums;
3. **inside each node**, a native all-gather of the chunks; the mean divides by ``K`` at the end.

Every rank ends with the same bits: phase 2 gives the ranks of one local index the same chunk, phase
3 hands every chunk to every rank. Bytes per rank: ``2 (G-1)/G`` fp32 copies of the tensor inside the
node, and the compressed exchange of ``n / G`` values between nodes (:func:`bytes_between_nodes`).

Per-tensor codecs (per-column 1bitSGD, Dettmers with one scale per tensor) cannot send a shard of a
tensor: with them the call runs the flat allgather.

The sub-groups (one per node, one per local index) are created once per (group, node size) on first
use, by the ranks that belong to them, with the group's timeout and backend, and cached with the group
(lowbit.comm.groups: a group made again after ``destroy_process_group()`` gets new ones). The node size
comes from ``node_size=``, else ``LOWBIT_NODE_SIZE``, else torchrun's ``LOCAL_WORLD_SIZE``.
``LOWBIT_NODE_SIZE`` is how a single host emulates several nodes (docs/multinode.md).
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable

import torch
import torch.distributed as dist

from lowbit.codecs.base import Codec
from lowbit.codecs.floats import FP32
from lowbit.comm import collectives as C
from lowbit.comm.allreduce import bytes_sent_per_rank, run
from lowbit.comm.flat import _native
from lowbit.comm.framing import _keep
from lowbit.comm.groups import PerGroup, new_subgroup
from lowbit.comm.registry import AlgorithmPlugin, Call, register_algorithm, resolve_algorithm

__all__ = ["NODE_SIZE_ENV", "node_size_for", "Topology", "topology", "start_hierarchical", "bytes_between_nodes",
           "bytes_hierarchical"]

NODE_SIZE_ENV = "LOWBIT_NODE_SIZE"


def node_size_for(group: dist.ProcessGroup | None, node_size: int | None = None) -> int:
    """Ranks per node for ``group``: ``node_size``, else ``$LOWBIT_NODE_SIZE``, else ``$LOCAL_WORLD_SIZE``
    (torchrun), at most the group's size. ValueError when none is known or the group's ranks do not
    split into whole nodes."""
    _, k = C.world(group)
    source = "node_size"
    if node_size is None:
        for var in (NODE_SIZE_ENV, "LOCAL_WORLD_SIZE"):
            if os.environ.get(var, "").strip():
                source, raw = var, os.environ[var].strip()
                try:
                    node_size = int(raw)
                except ValueError:
                    raise ValueError(f"${var}={raw!r} is not a number of ranks per node") from None
                break
        else:
            raise ValueError("algorithm='hierarchical' needs the number of ranks per node: pass node_size=, "
                             f"set ${NODE_SIZE_ENV}, or launch with torchrun (which sets LOCAL_WORLD_SIZE)")
    if isinstance(node_size, bool) or not isinstance(node_size, int) or node_size < 1:
        raise ValueError(f"{source} must be a positive int (ranks per node), got {node_size!r}")
    node_size = min(node_size, k)  # a group smaller than a node (e.g. one process) lies in one node
    if k % node_size:
        raise ValueError(f"{source}={node_size}: the group's {k} ranks do not split into nodes of {node_size}")
    return node_size


@dataclasses.dataclass(frozen=True)
class Topology:
    """This rank's place: its node's group (``intra``, None when one rank a node) and its local index's
    group across nodes (``cross``, None when one node)."""

    node_size: int
    nodes: int
    node: int
    local: int
    intra: dist.ProcessGroup | None
    cross: dist.ProcessGroup | None


#: per process group: node size -> this rank's Topology (dropped with the group: lowbit.comm.groups)
_TOPOLOGIES: PerGroup[dict[int, Topology]] = PerGroup()


def topology(group: dist.ProcessGroup | None, node_size: int) -> Topology:
    """The cached :class:`Topology` of this rank in ``group`` split into nodes of ``node_size``."""
    rank, k = C.world(group)
    topos = _TOPOLOGIES.get(group)
    if topos is None:
        topos = _TOPOLOGIES.set(group, {})
    topo = topos.get(node_size)
    if topo is None:
        ranks = dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)
        nodes = k // node_size
        node, local = divmod(rank, node_size)
        intra = cross = None
        if node_size > 1:
            intra = new_subgroup(group, ranks[node * node_size : (node + 1) * node_size])
        if nodes > 1:
            cross = new_subgroup(group, [ranks[j * node_size + local] for j in range(nodes)])
        topo = topos[node_size] = Topology(node_size, nodes, node, local, intra, cross)
    return topo


def _chunk(n: int, g: int) -> int:
    return -(-n // g) if g else 0


def bytes_between_nodes(codec: Codec, n: int, k: int, node_size: int, rank: int = 0) -> int:
    """Bytes rank ``rank`` sends to other nodes for one hierarchical call of ``n`` values (phase 2)."""
    nodes = k // node_size
    if nodes == 1 or codec.per_tensor:  # per-tensor codecs run the flat allgather, not this algorithm
        return 0
    m = _chunk(n, node_size)
    node, local = divmod(rank, node_size)
    mine = max(0, min(n, (local + 1) * m) - local * m)
    return bytes_sent_per_rank(codec, mine, nodes, resolve_algorithm("auto", codec, nodes), node)


def bytes_hierarchical(codec: Codec, n: int, k: int, node_size: int, rank: int = 0) -> int:
    """Every byte rank ``rank`` sends for one hierarchical call: fp32 reduce-scatter and all-gather inside
    the node (``(G-1) * ceil(n/G)`` values each) plus :func:`bytes_between_nodes`."""
    if k == 1 or n == 0:
        return 0
    intra = 2 * (node_size - 1) * _chunk(n, node_size) * 4
    return intra + bytes_between_nodes(codec, n, k, node_size, rank)


def start_hierarchical(
    x: torch.Tensor,
    codec: Codec,
    group: dist.ProcessGroup | None,
    op: str,
    residual: torch.Tensor | None,
    seed: int,
    stats: object | None,
    out: torch.Tensor,
    post: Callable[[], torch.Tensor] | None,
    node_size: int | None,
) -> torch.futures.Future:
    """Issue one hierarchical reduction of ``x`` into ``out`` (see the module docstring); the future of
    ``out`` (or of ``post()``). ``residual`` ((n,) float32): error feedback of the node sums; this rank
    uses the part of it that covers its chunk."""
    g = node_size_for(group, node_size)
    topo = topology(group, g)
    k = g * topo.nodes
    n = x.numel()
    m = _chunk(n, g)
    dev = x.device
    lo = topo.local * m
    mine = max(0, min(n, lo + m) - lo)
    # A mean is summed at 2^-ceil(log2 K) of the values (exact: a power of two) and divided by K 2^-c at
    # the end, so K finite values near float32's max do not overflow in the node's or the nodes' sums
    # (finite in, finite out, as the fp32 allreduce divides first). For K a power of two the result has
    # the same bits as summing first and dividing by K; QSGD's codes do not change under the scaling.
    divide = 1.0
    if op == "mean" and k > 1:
        pre = 2.0 ** -math.ceil(math.log2(k))
        x = x * pre
        divide = k * pre
    # Phase 1: the node's sum of my chunk.
    if g > 1:
        src = x
        if n != g * m:
            src = torch.zeros(g * m, dtype=torch.float32, device=dev)
            src[:n].copy_(x)
        chunk = torch.empty(m, dtype=torch.float32, device=dev)
        work = C.reduce_scatter_async(chunk, src, topo.intra)
        if stats is not None:
            stats.bytes_sent += (g - 1) * m * 4  # type: ignore[attr-defined]
        C.wait(work, "reduce_scatter_tensor", topo.intra)  # CUDA: a stream wait; CPU: the host waits
    else:
        chunk = x  # one rank a node: my chunk is the whole tensor
    # Phase 2: the compressed sum of my chunk across nodes, among the ranks of my local index.
    if topo.nodes > 1 and mine:
        before = stats.bytes_sent if stats is not None else 0  # type: ignore[attr-defined]
        res = residual[lo : lo + mine] if residual is not None else None
        part = chunk[:mine]
        fut = run(Call(part, codec, topo.cross, "sum", part, (topo.node, topo.nodes), res, seed, stats),
                  resolve_algorithm("auto", codec, topo.nodes))  # (run: still one call of the caller's)
        if stats is not None:
            stats.bytes_inter += stats.bytes_sent - before  # type: ignore[attr-defined]
        C.wait(fut, "all_reduce", topo.cross)
    # Phase 3: every chunk to every rank of the node.
    if g > 1:
        gathered = torch.empty(g * m, dtype=torch.float32, device=dev)
        work3 = C.all_gather_async(gathered, chunk, topo.intra)
        if stats is not None:
            stats.bytes_sent += (g - 1) * m * 4  # type: ignore[attr-defined]

        def finish() -> torch.Tensor:
            _keep(gathered)
            _keep(out)
            if divide != 1.0:
                torch.div(gathered[:n], divide, out=out)
            else:
                out.copy_(gathered[:n])
            return out if post is None else post()

        return C.then(work3, finish, "all_gather_into_tensor", topo.intra)
    if divide != 1.0:
        torch.div(chunk[:n], divide, out=out)
    elif out.data_ptr() != chunk.data_ptr():
        out.copy_(chunk[:n])
    return C.done(out if post is None else post(), dev)


# ---------------------------------------------------------------------------------- the algorithm
_FP32 = FP32()  # (not get_codec: a lookup would import $LOWBIT_PLUGINS while lowbit.comm is half imported)


def _start(c: Call) -> torch.futures.Future:
    """``algorithm="hierarchical"`` as lowbit.comm.allreduce.start dispatches it (the call is counted)."""
    k = c.world[1]
    if node_size_for(c.group, c.node_size) == k:
        # One node: nothing crosses a slow link, so nothing is compressed (per-tensor codecs included):
        # one native fp32 allreduce, which NCCL runs best inside a node.
        return _native(c.x, _FP32, c.group, c.op, k, c.stats, c.out, c.post)
    if c.codec.sums_on_wire:  # fp16 / bf16: summed by the native allreduce, as every algorithm does
        return _native(c.x, c.codec, c.group, c.op, k, c.stats, c.out, c.post)
    if c.codec.per_tensor:  # a tensor's own groups cannot be cut into shards: the flat allgather
        return run(c, "allgather")
    return start_hierarchical(c.x, c.codec, c.group, c.op, c.residual, c.seed, c.stats, c.out, c.post, c.node_size)


def _bytes(codec: Codec, n: int, k: int, rank: int, exact: int, node_size: int | None,
           shape: tuple[int, ...] | None) -> int:
    if node_size is None:
        raise ValueError("bytes_sent_per_rank: the hierarchical algorithm needs node_size")
    if node_size >= k:
        return int(2 * (k - 1) * (n + exact) * 4 // k)  # one node: the native fp32 allreduce (see _start)
    if codec.sums_on_wire or codec.per_tensor:
        return bytes_sent_per_rank(codec, n, k, resolve_algorithm("hierarchical", codec, k), rank, exact,
                                   shape=shape)
    return bytes_hierarchical(codec, n, k, node_size, rank)


register_algorithm("hierarchical", AlgorithmPlugin(
    start=_start, bytes_per_rank=_bytes, prepare=node_size_for, multi_node=True,
    doc="native fp32 inside each node, compressed only between nodes (node_size ranks per node)"))
