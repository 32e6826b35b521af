"""Per-step compression or local steps: the time per step of each, and the bandwidth below which local
SGD reaches a target sooner (docs/perfmodel.md, section 11; docs/localsgd.md).

Two ways to train data-parallel over a slow link:

* **DDP with a per-step codec**: every step the gradient crosses the link in the codec; the step is
  :func:`lowbit.lab.perfmodel.model.predict`'s (the overlap timeline of section 3);
* **local SGD** (:mod:`lowbit.localsgd`) with ``H`` local steps: every step is compute alone, and every
  ``H`` steps the weight change (``n`` values) is all-reduced in the outer codec, synchronously (this
  version does not overlap it), so one step costs ``compute + (exchange + encode + decode) / H``. On one
  node the exchange runs among all ``K`` ranks over the cluster's link; on several nodes each node runs
  fp32 DDP inside every step (intra link) and local rank ``l`` sends chunk ``l`` (``n / G`` values) among
  the ``N`` ranks of its local index over the inter-node link (shared by the node's ``G`` concurrent
  exchanges), then an fp32 all-gather inside the node puts the chunks together, as
  ``LocalSGD(node_size=G)`` does. Streaming (``fragments=F``): ``F`` exchanges of ``n / F`` values each
  per period, the same bytes, ``F`` times the per-message latency.

Local SGD changes the optimisation: it needs ``steps_ratio`` (``rho``) times as many steps as the
per-step scheme to reach the same loss. The model does not predict ``rho``; it is an input (measured:
the study's steps to target, :func:`lowbit.lab.study.crossover.check`). Time to target is steps x
step time, so local SGD pays where ``rho * step_local(B) < step_ddp(B)``. :func:`crossover_bandwidth`
finds the bandwidth ``B*`` of the slow link below which it does (bisection on ``log B``). With zero
latency, free codecs and no overlap (one message after the backward) it is, in closed form,

    B* = (W_ddp - rho * W_local / H) / ((rho - 1) * compute)

``W`` the bytes a rank's exchange holds the link for: it moves in proportion to the codecs' bytes,
and grows with ``H``; ``rho = 1`` pays on every link, ``W_ddp <= rho W_local / H`` on none.

``link_rule="emulated"`` prices the study's emulated link (:func:`lowbit.comm.collectives.emulate_link`)
instead of a real ring: each collective holds the link for the bytes this rank contributes (allreduce
and allgather: the payload ``M``; scatter_gather: ``M (1 + 1/K)``), and the per-step exchange is one
message after the backward (the study's models fit in one DDP bucket).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence

from lowbit.lab.perfmodel.collectives import CommCost, Topology, collective, positive_int, ring_allgather
from lowbit.lab.perfmodel.links import Link
from lowbit.lab.perfmodel.model import (FP32_BITS, Cluster, Layer, bits_per_value, codec_work, predict,
                                    resolve_algorithm, short_codec)

__all__ = ["SchemeStep", "Crossover", "LINK_RULES", "model_layers", "with_bandwidth", "slow_link", "ddp_step",
           "localsgd_step", "crossover_bandwidth", "crossover", "emulated_cost"]

#: How a collective is priced: ``ring`` (section 2's alpha-beta collectives) or ``emulated`` (module doc).
LINK_RULES = ("ring", "emulated")

#: Bandwidths searched by :func:`crossover_bandwidth`, bytes/s: 1 kB/s to 10 TB/s.
SEARCH_BPS = (1e3, 1e13)
#: The collectives of one exchange by algorithm on the emulated link (scatter_gather: its all-to-all and
#: its all-gather).
_EMULATED_COLLECTIVES = {"allreduce": 1, "allgather": 1, "scatter_gather": 2}
#: Points of the log grid :func:`crossover_bandwidth` scans for sign changes (12 a decade).
_GRID = 121


@dataclasses.dataclass(frozen=True)
class SchemeStep:
    """One training step of a scheme, amortised over its period (``local_steps`` = 1 for DDP).

    ``step_s = compute_s + comm_s + codec_s``; ``bytes_per_step`` is what one rank puts on the slow link per
    step (``bytes_per_exchange / local_steps``)."""

    scheme: str                # "ddp" or "localsgd"
    codec: str
    local_steps: int
    fragments: int
    algorithm: str
    bits_per_value: float
    compute_s: float           # the step's compute (with DDP inside the node for grouped local SGD)
    comm_s: float              # exposed communication per step
    codec_s: float             # encode + decode per step
    step_s: float
    bytes_per_exchange: float  # per rank, on the slow link, per synchronisation (a period of H steps)
    bytes_per_step: float

    @property
    def label(self) -> str:
        if self.scheme == "ddp":
            return f"DDP {short_codec(self.codec)}"
        return f"local SGD {short_codec(self.codec)} H={self.local_steps}" + (
            f" F={self.fragments}" if self.fragments > 1 else "")


@dataclasses.dataclass(frozen=True)
class Crossover:
    """Local SGD against a per-step scheme: ``bandwidth_Bps`` (``inf``: it pays on every link searched; 0: on
    none) and both steps at that bandwidth (at the search's end when there is no crossing)."""

    ddp: SchemeStep
    local: SchemeStep
    steps_ratio: float
    bandwidth_Bps: float


def model_layers(params: int, compute_s: float) -> list[Layer]:
    """A model given only by its size and its compute per step: one layer (its gradient is ready at the end
    of the backward, so DDP's exchange does not overlap it)."""
    positive_int(params, "number of parameters")
    if not (compute_s > 0 and math.isfinite(compute_s)):
        raise ValueError(f"compute per step must be a finite number of seconds > 0, got {compute_s!r}")
    return [Layer("model", int(params), float(compute_s))]


def slow_link(cluster: Cluster) -> Link:
    """The link the exchanges cross: the inter-node link on several nodes, else the intra-node one."""
    topo = cluster.topology()
    return topo.ring_link


def with_bandwidth(cluster: Cluster, bandwidth_Bps: float) -> Cluster:
    """``cluster`` with its slow link (:func:`slow_link`) at ``bandwidth_Bps``, the latency kept."""
    link = slow_link(cluster)
    new = Link(link.latency_s, float(bandwidth_Bps), f"{bandwidth_Bps * 8 / 1e6:.4g} Mbit/s")
    if cluster.topology().nodes > 1:
        return dataclasses.replace(cluster, inter=new)
    return dataclasses.replace(cluster, intra=new)


def _check_rule(link_rule: str) -> None:
    if link_rule not in LINK_RULES:
        raise ValueError(f"unknown link rule {link_rule!r}; choose one of {', '.join(LINK_RULES)}")


def emulated_cost(algorithm: str, nbytes: float, ranks: int, link: Link,
                  collectives: float | None = None) -> CommCost:
    """One exchange on the study's emulated link: the link held for the bytes this rank contributes
    (allreduce, allgather: ``nbytes``; scatter_gather: ``nbytes (1 + 1/K)``, its all-to-all and its
    all-gather), plus the link's latency per collective issued: the algorithm's own (1, or 2 for
    scatter_gather), or ``collectives`` where it is given (measured: ``collectives_per_step`` of a study
    record, which counts the messages a model's buckets make and lowbit's per-call checks, one collective
    each on CPU)."""
    if ranks == 1:
        return CommCost(0.0, 0.0, 0)
    if collectives is not None and not (collectives >= 0 and math.isfinite(collectives)):
        raise ValueError(f"collectives per exchange must be a finite number >= 0, got {collectives!r}")
    own = _EMULATED_COLLECTIVES.get(algorithm)
    if own is None:
        raise ValueError(f"the emulated link rule prices allreduce, allgather and scatter_gather, not {algorithm!r}")
    n = own if collectives is None else collectives
    held = nbytes * (1 + 1 / ranks) if algorithm == "scatter_gather" else nbytes
    return CommCost(n * link.latency_s + held / link.bandwidth_Bps, held, int(round(n)))


def _codec_seconds(algorithm: str, numel: float, ranks: int, bits: float, encode_Bps: float | None,
                   decode_Bps: float | None) -> float:
    enc, dec = codec_work(algorithm, int(round(numel)), ranks, 1, bits)
    return (4 * enc / encode_Bps if encode_Bps and enc else 0.0) + (4 * dec / decode_Bps if decode_Bps and dec else 0.0)


def ddp_step(layers: Sequence[Layer], cluster: Cluster, codec: str | float = FP32_BITS, *, algorithm: str = "auto",
             encode_Bps: float | None = None, decode_Bps: float | None = None, overlap: bool = True,
             link_rule: str = "ring", collectives: float | None = None) -> SchemeStep:
    """One DDP step with ``codec`` every step.

    Args:
        layers: the model's layers (:func:`model_layers` for a size and a compute time).
        cluster: the GPUs and links.
        codec: a codec spec (``"fp32"`` for plain DDP) or bits per value.
        algorithm: ``auto`` or a modelled algorithm (as :func:`lowbit.lab.perfmodel.predict`).
        encode_Bps, decode_Bps: the codec's throughput, bytes of float32 per second (None: free).
        overlap: communication overlaps the backward (ring rule only).
        link_rule: ``ring`` or ``emulated`` (module doc).
        collectives: (emulated rule) collectives a step, each paying the link's latency (None: one
            exchange of the algorithm's own; :func:`emulated_cost`).

    Returns:
        The step, as a :class:`SchemeStep`.

    Raises:
        ValueError: an unknown codec, algorithm or link rule, or bad layers.
    """
    _check_rule(link_rule)
    layers = list(layers)
    if link_rule == "ring":
        p = predict(layers, cluster, batch_per_gpu=1, codec=codec, algorithm=algorithm, encode_Bps=encode_Bps,
                    decode_Bps=decode_Bps, overlap=overlap)
        b = p.breakdown
        return SchemeStep("ddp", str(codec), 1, 1, p.algorithm, p.bits_per_value, b.compute_s, b.exposed_comm_s,
                          b.encode_s + b.decode_s, p.step_s, p.bytes_per_rank, p.bytes_per_rank)
    n = sum(layer.params for layer in layers)
    compute = sum(layer.compute_s for layer in layers)
    k = cluster.gpus
    bits = bits_per_value(codec, max(n, 1))
    algo = resolve_algorithm(algorithm, codec, k)
    cost = emulated_cost(algo, n * bits / 8, k, slow_link(cluster), collectives)
    codec_s = _codec_seconds(algo, n, k, bits, encode_Bps, decode_Bps) if k > 1 else 0.0
    return SchemeStep("ddp", str(codec), 1, 1, algo, bits, compute, cost.time_s, codec_s,
                      compute + cost.time_s + codec_s, cost.bytes_per_rank, cost.bytes_per_rank)


def localsgd_step(layers: Sequence[Layer], cluster: Cluster, codec: str | float = FP32_BITS, local_steps: int = 1,
                  *, fragments: int = 1, algorithm: str = "auto", encode_Bps: float | None = None,
                  decode_Bps: float | None = None, link_rule: str = "ring",
                  collectives: float | None = None) -> SchemeStep:
    """One step of local SGD with ``local_steps`` (H) inner steps and ``codec`` for the weight change,
    amortised over the period (module doc).

    Args:
        layers: the model's layers (:func:`model_layers` for a size and a compute time).
        cluster: the GPUs and links; on several nodes, fp32 DDP inside each node every step.
        codec: the outer exchange's codec spec (``"fp32"``: native allreduce) or bits per value.
        local_steps: H, inner steps per outer synchronisation.
        fragments: F, streaming fragments (the same bytes in F exchanges).
        algorithm: ``auto`` or a modelled algorithm for the outer exchange.
        encode_Bps, decode_Bps: the codec's throughput, bytes of float32 per second (None: free).
        link_rule: ``ring`` or ``emulated`` (module doc).
        collectives: (emulated rule) collectives each fragment's exchange issues, each paying the link's
            latency (None: the algorithm's own; :func:`emulated_cost`).

    Returns:
        The amortised step, as a :class:`SchemeStep`.

    Raises:
        ValueError: H or F not a positive integer, more fragments than parameters, an unknown codec,
            algorithm or link rule.
    """
    _check_rule(link_rule)
    positive_int(local_steps, "local steps (H)")
    positive_int(fragments, "fragments (F)")
    layers = list(layers)
    n = sum(layer.params for layer in layers)
    if fragments > max(n, 1):
        raise ValueError(f"{fragments} fragments for {n} parameters")
    topo = cluster.topology()
    g, nodes = topo.local, topo.nodes
    if nodes > 1 and g > 1:  # fp32 DDP inside the node every step
        inside = ddp_step(layers, Cluster(g, g, topo.intra), "fp32")
        compute = inside.step_s
    else:
        compute = sum(layer.compute_s for layer in layers)
    ranks = nodes if nodes > 1 else topo.world
    values = n / fragments / (g if nodes > 1 else 1)          # this rank's share of one fragment
    bits = bits_per_value(codec, max(int(values), 1))
    algo = resolve_algorithm(algorithm, codec, ranks)
    link = slow_link(cluster)
    if nodes > 1 and g > 1:  # the node's G exchanges share its NICs
        link = Link(link.latency_s, link.bandwidth_Bps * min(topo.nics_per_node, g) / g, link.name)
    payload = values * bits / 8
    if ranks == 1:
        one = CommCost(0.0, 0.0, 0)
    elif link_rule == "ring":
        one = collective(algo, payload, Topology(ranks, 1, link, link),
                         fp32_bytes=4 * values if bits < FP32_BITS else None)
    else:
        one = emulated_cost(algo, payload, ranks, link, collectives)
    codec_s = _codec_seconds(algo, values, ranks, bits, encode_Bps, decode_Bps) if ranks > 1 else 0.0
    gather_s = ring_allgather(4 * values, Topology(g, g, topo.intra)).time_s if nodes > 1 and g > 1 else 0.0
    h = local_steps
    comm = fragments * (one.time_s + gather_s) / h
    codec_per_step = fragments * codec_s / h
    per_exchange = fragments * one.bytes_per_rank
    return SchemeStep("localsgd", str(codec), h, fragments, algo, bits, compute, comm, codec_per_step,
                      compute + comm + codec_per_step, per_exchange, per_exchange / h)


def crossover_bandwidth(ddp_at: Callable[[float], float], local_at: Callable[[float], float],
                        steps_ratio: float = 1.0, search: tuple[float, float] = SEARCH_BPS) -> float:
    """The bandwidth (bytes/s) below which local SGD reaches the target sooner: where
    ``steps_ratio * local_at(B) < ddp_at(B)`` (the step times as functions of the slow link's bandwidth).

    Returns:
        The crossing, by bisection on ``log B`` to 0.1 %; ``inf`` when local SGD pays on every point of
        a log grid over ``search``, 0 when on none. Where it pays in a window only (a latency per
        collective can make the per-step codec sooner on the slowest links too), the window's top.

    Raises:
        ValueError: ``steps_ratio`` not a finite number > 0, or a bad search range.
    """
    if not (steps_ratio > 0 and math.isfinite(steps_ratio)):
        raise ValueError(f"steps ratio must be a finite number > 0, got {steps_ratio!r}")
    lo, hi = search
    if not 0 < lo < hi:
        raise ValueError(f"search range must be 0 < low < high bytes/s, got {search!r}")

    def gain(b: float) -> float:  # > 0: local SGD sooner
        return ddp_at(b) - steps_ratio * local_at(b)

    # The gain need not change sign once: with a latency per collective, local SGD may pay only in a
    # window (below it the per-step codec's fewer bytes win, above it its compute does). Scan a log grid
    # for sign changes and refine the highest at which local SGD stops paying (the top of its window).
    grid = [math.exp(math.log(lo) + (math.log(hi) - math.log(lo)) * i / (_GRID - 1)) for i in range(_GRID)]
    pays = [gain(b) > 0 for b in grid]
    if all(pays):
        return math.inf
    if not any(pays):
        return 0.0
    changes = [i for i in range(_GRID - 1) if pays[i] != pays[i + 1]]
    downs = [i for i in changes if pays[i]]
    i = (downs or changes)[-1]
    a, z = math.log(grid[i]), math.log(grid[i + 1])
    sign_lo = pays[i]
    while z - a > 1e-3:
        m = (a + z) / 2
        if (gain(math.exp(m)) > 0) == sign_lo:
            a = m
        else:
            z = m
    return math.exp((a + z) / 2)


def crossover(layers: Sequence[Layer], cluster: Cluster, *, ddp_codec: str | float = FP32_BITS,
              local_codec: str | float = FP32_BITS, local_steps: int = 16, fragments: int = 1,
              steps_ratio: float = 1.0, algorithm: str = "auto", encode_Bps: float | None = None,
              decode_Bps: float | None = None, overlap: bool = True, link_rule: str = "ring") -> Crossover:
    """DDP with ``ddp_codec`` against local SGD (``local_steps``, ``fragments``, ``local_codec``) on
    ``cluster``, whose slow link (:func:`slow_link`) is varied: :func:`crossover_bandwidth` with
    ``steps_ratio`` (local SGD's steps to the target over DDP's), both steps at the cluster's own link.

    Returns:
        A :class:`Crossover`.

    Raises:
        ValueError: as :func:`ddp_step`, :func:`localsgd_step` and :func:`crossover_bandwidth`.
    """
    layers = list(layers)
    common = dict(algorithm=algorithm, encode_Bps=encode_Bps, decode_Bps=decode_Bps, link_rule=link_rule)

    def d(c: Cluster) -> SchemeStep:
        return ddp_step(layers, c, ddp_codec, overlap=overlap, **common)  # type: ignore[arg-type]

    def loc(c: Cluster) -> SchemeStep:
        return localsgd_step(layers, c, local_codec, local_steps, fragments=fragments, **common)  # type: ignore[arg-type]

    b = crossover_bandwidth(lambda bw: d(with_bandwidth(cluster, bw)).step_s,
                            lambda bw: loc(with_bandwidth(cluster, bw)).step_s, steps_ratio)
    return Crossover(d(cluster), loc(cluster), float(steps_ratio), b)
