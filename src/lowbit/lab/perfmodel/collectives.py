"""Alpha-beta cost of the collectives lowbit uses, on a cluster of nodes (docs/perfmodel.md, section 2).

``M`` bytes per rank (the payload: the encoded size for compressed algorithms), ``K`` ranks, ``G`` GPUs per
node, ``N = ceil(K / G)`` nodes; a link costs ``alpha + n * beta`` per message (``beta`` = 1 / bandwidth).
A step's time is set by its slowest link: on one node the intra-node link; on several, a ring ordered node
by node crosses each node boundary once per direction (one inter-node link carrying one block per step),
and an all-to-all pushes ``G (K - G) / K * M`` bytes out of every node over the node's ``nics`` links.
Bytes are those each rank *sends* (it receives as many).

The algorithms are those of lowbit's registry (:func:`lowbit.comm.allreduce.register_algorithm`) that have a
cost: a plugin's entry brings its own ``cost`` and ``work`` (values encoded and decoded); lowbit's own are
here, in :data:`BUILTIN_COSTS` (importing the speed model changes nothing in comm).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

from lowbit.comm.allreduce import AlgorithmPlugin, algorithms, get_algorithm
from lowbit.lab.perfmodel.links import Link

__all__ = ["CommCost", "Topology", "ring_allreduce", "ring_allgather", "all_to_all", "scatter_gather",
           "allgather", "hierarchical", "collective", "modeled_algorithms"]


def positive_int(value: object, what: str) -> None:
    """ValueError ``"{what} must be a positive integer"`` unless ``value`` is an int >= 1 (not a bool)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{what} must be a positive integer, got {value!r}")


@dataclasses.dataclass(frozen=True)
class Topology:
    """Ranks, how they sit on nodes, and the links between them."""

    world: int
    gpus_per_node: int
    intra: Link
    inter: Link | None = None
    nics_per_node: int = 1

    def __post_init__(self) -> None:
        positive_int(self.world, "number of GPUs")
        positive_int(self.gpus_per_node, "gpus per node")
        positive_int(self.nics_per_node, "nics per node")
        if self.nodes > 1 and self.inter is None:
            raise ValueError(f"{self.world} GPUs at {self.gpus_per_node} per node span {self.nodes} nodes: "
                             "an inter-node link is needed")

    @property
    def nodes(self) -> int:
        return math.ceil(self.world / self.gpus_per_node)

    @property
    def local(self) -> int:
        """GPUs per node actually used (the world may fit in less than one node)."""
        return min(self.world, self.gpus_per_node)

    @property
    def ring_link(self) -> Link:
        """The bottleneck link of a flat ring over all ranks."""
        return self.intra if self.nodes == 1 else self._inter

    @property
    def _inter(self) -> Link:
        assert self.inter is not None
        return self.inter


@dataclasses.dataclass(frozen=True)
class CommCost:
    """Time of one collective and the bytes each rank sends."""

    time_s: float
    bytes_per_rank: float
    steps: int = 0

    def __add__(self, other: CommCost) -> CommCost:
        return CommCost(self.time_s + other.time_s, self.bytes_per_rank + other.bytes_per_rank,
                        self.steps + other.steps)


_ZERO = CommCost(0.0, 0.0, 0)


def _check_bytes(nbytes: float) -> None:
    if not (nbytes >= 0 and math.isfinite(nbytes)):
        raise ValueError(f"message size must be a finite number of bytes >= 0, got {nbytes!r}")


def ring_allreduce(nbytes: float, topo: Topology) -> CommCost:
    """Ring allreduce: reduce-scatter then allgather, ``2(K-1)`` steps of ``M/K`` bytes each."""
    _check_bytes(nbytes)
    k = topo.world
    if k == 1:
        return _ZERO
    link = topo.ring_link
    steps = 2 * (k - 1)
    return CommCost(steps * link.time(nbytes / k), steps * nbytes / k, steps)


def ring_allgather(block_bytes: float, topo: Topology) -> CommCost:
    """Ring allgather of one ``block_bytes`` block per rank: ``K-1`` steps forwarding one block."""
    _check_bytes(block_bytes)
    k = topo.world
    if k == 1:
        return _ZERO
    link = topo.ring_link
    return CommCost((k - 1) * link.time(block_bytes), (k - 1) * block_bytes, k - 1)


def all_to_all(nbytes: float, topo: Topology) -> CommCost:
    """Pairwise all_to_all of ``M`` bytes per rank cut in K chunks (each rank sends ``(K-1)/K M``)."""
    _check_bytes(nbytes)
    k, g = topo.world, topo.local
    if k == 1:
        return _ZERO
    chunk = nbytes / k
    intra_time = (g - 1) * chunk / topo.intra.bandwidth_Bps
    if topo.nodes == 1:
        latency = (k - 1) * topo.intra.latency_s
        inter_time = 0.0
    else:
        inter = topo._inter
        latency = (k - 1) * max(inter.latency_s, topo.intra.latency_s)
        node_out = g * (k - g) * chunk  # bytes leaving one node
        inter_time = node_out / (inter.bandwidth_Bps * min(topo.nics_per_node, g))
    return CommCost(latency + max(intra_time, inter_time), (k - 1) * chunk, k - 1)


def scatter_gather(nbytes: float, topo: Topology) -> CommCost:
    """all_to_all of encoded chunks, then ring allgather of the re-encoded own chunk: ``2(K-1)/K M``."""
    return all_to_all(nbytes, topo) + ring_allgather(nbytes / topo.world, topo)


def allgather(nbytes: float, topo: Topology) -> CommCost:
    """The seed's Algorithm 1: every rank's whole payload to every rank; each receives ``K-1`` payloads."""
    return ring_allgather(nbytes, topo)


def hierarchical(nbytes: float, topo: Topology, fp32_bytes: float | None = None) -> CommCost:
    """Intra-node reduce-scatter, an exchange of each ``1/G`` shard between nodes, intra-node allgather.

    Without ``fp32_bytes``: a native hierarchical allreduce (the shards cross nodes in a ring allreduce).
    With it, lowbit's ``algorithm="hierarchical"``: fp32 inside a node, and between nodes the compressed
    shard (``nbytes / G``) by the flat algorithm lowbit picks for ``N`` ranks (allgather for 2 nodes,
    scatter_gather above); on one node a ring allreduce of ``fp32_bytes``. The ``G`` concurrent exchanges
    share the node's ``nics_per_node`` links: each sees ``bandwidth * min(nics, G) / G``.
    """
    _check_bytes(nbytes)
    g, n = topo.local, topo.nodes
    if topo.world == 1:
        return _ZERO
    full = nbytes if fp32_bytes is None else fp32_bytes
    _check_bytes(full)
    if n == 1:
        return ring_allreduce(full, topo)
    half_intra = ring_allgather(full / g, Topology(g, g, topo.intra))  # the reduce-scatter or the allgather
    inter = topo._inter
    ring_link = Link(inter.latency_s, inter.bandwidth_Bps * min(topo.nics_per_node, g) / g, inter.name)
    shard = nbytes / g
    cross = Topology(n, 1, ring_link, ring_link)  # one rank of each node: every hop crosses nodes
    if fp32_bytes is None:
        across = ring_allreduce(shard, cross)
    else:
        across = allgather(shard, cross) if n == 2 else scatter_gather(shard, cross)
    return half_intra + across + half_intra


# ------------------------------------------------------------------- lowbit's own algorithms' costs
# cost(nbytes, topo, fp32_bytes) -> CommCost and work(numel, world, gpus_per_node) -> (encoded, decoded) values
# per rank (as lowbit.comm.registry.AlgorithmPlugin names them); world > 1 and a compressed payload for work.
def _work_hierarchical(n: float, k: int, g: int) -> tuple[float, float]:
    # lowbit's: only the 1/G shard between nodes is coded
    nodes = math.ceil(k / g)
    if nodes == 1:
        return 0.0, 0.0
    shard = n / g
    return (shard, nodes * shard) if nodes == 2 else (shard * (1 + 1 / nodes), 2 * shard)


Cost = Callable[..., CommCost]
Work = Callable[[float, int, int], tuple[float, float]]

#: The speed model of lowbit's own algorithms, by registry name: ``(cost, work)``. A registry entry with a
#: ``cost`` of its own (a plugin's; one that replaces a built-in) is priced by that instead.
BUILTIN_COSTS: dict[str, tuple[Cost, Work]] = {
    "allreduce": (lambda nbytes, topo, fp32_bytes=None: ring_allreduce(nbytes, topo), lambda n, k, g: (n, n)),
    "scatter_gather": (lambda nbytes, topo, fp32_bytes=None: scatter_gather(nbytes, topo),
                       lambda n, k, g: (n * (1 + 1 / k), 2 * n)),
    "allgather": (lambda nbytes, topo, fp32_bytes=None: allgather(nbytes, topo), lambda n, k, g: (n, k * n)),
    "hierarchical": (hierarchical, _work_hierarchical),
}


def _priced(name: str) -> AlgorithmPlugin | None:
    """The registry's entry of ``name`` with its cost and work (its own, else :data:`BUILTIN_COSTS`'s);
    None when it has no cost or there is no such algorithm."""
    try:
        plugin = get_algorithm(name)
    except ValueError:
        return None
    if plugin.cost is None and name in BUILTIN_COSTS:
        cost, work = BUILTIN_COSTS[name]
        plugin = dataclasses.replace(plugin, cost=cost, work=work)
    return plugin if plugin.cost is not None else None


def modeled_algorithms(quantised: bool | None = None, multi_node: bool | None = None) -> tuple[str, ...]:
    """The registered algorithms that have a cost (what the speed model knows), in registration order;
    ``quantised`` / ``multi_node`` (when not None) keep those whose registry flag is that."""
    return tuple(name for name in algorithms() if (p := _priced(name)) is not None
                 and quantised in (None, p.quantised) and multi_node in (None, p.multi_node))


def model_of(algorithm: str) -> AlgorithmPlugin:
    """The registry's entry of ``algorithm`` with its ``cost`` and ``work`` (the entry's own, else lowbit's
    :data:`BUILTIN_COSTS`); a ValueError naming the modelled algorithms when it has none."""
    plugin = _priced(algorithm) if isinstance(algorithm, str) else None
    if plugin is None:
        raise ValueError(f"unknown algorithm {algorithm!r}; choose one of {', '.join(modeled_algorithms())}")
    return plugin


def collective(algorithm: str, nbytes: float, topo: Topology, fp32_bytes: float | None = None) -> CommCost:
    """Cost of ``algorithm`` (one of :func:`modeled_algorithms`) on ``nbytes`` of payload per rank
    (``fp32_bytes``: the uncompressed size when the payload is compressed, which ``hierarchical`` moves
    inside the node): the registry's ``cost``."""
    return model_of(algorithm).cost(nbytes, topo, fp32_bytes)
