"""Compressed allreduce over any torch.distributed process group.

Quantised bytes never pass through a reducing collective: payloads are moved with all-to-all and
all-gather, and every sum happens in float32 after decoding, in rank order, so every rank ends with a
bit-identical result.

Algorithms (K ranks, tensor of n values, payload size P(m) for m values):

``scatter_gather`` — the seed's MPI reduce-and-broadcast (also CGX's and DeepSpeed's scheme)
    Phase 1: cut the tensor into K chunks; encode chunk i (worker error feedback) and send it to rank i
             (``all_to_all_single``).
    Phase 2: rank r decodes the K payloads of its chunk and sums them in rank order (fp32), divides by K
             for a mean, and re-encodes the result (server quantisation).
    Phase 3: ``all_gather`` the re-encoded chunks; every rank decodes all K of them.
    Bytes sent per rank: about 2 (K-1)/K P(n).

``allgather`` — the seed's Algorithm 1
    Encode the whole tensor once, all-gather the payloads, every rank decodes all K and sums them in rank
    order. Bytes sent per rank: (K-1) P(n) — cheap for small K, it scales badly.

``allreduce`` — the native allreduce in fp32, fp16 or bf16 (the seed's "NCCL 32-bit" baseline).

These, ``simulated``, ``hierarchical`` (:mod:`lowbit.comm.hierarchical`) and any plugin's are entries of
one registry (:func:`register_algorithm`, :class:`AlgorithmPlugin`) that every layer reads: the DDP hook,
the study, the CLI and the speed model (docs/codecs.md, "Your own algorithm").

Error feedback keeps one residual per key (per tensor), updated in place. The server's quantisation
error on the chunk that rank r owns is folded into rank r's residual (times K for a mean), so it
re-enters the next step's sum; the residual therefore does not depend on how the tensor is chunked,
which keeps checkpoints valid across DDP's bucket rebuilds.

Issue order and asynchrony: every collective of a call is issued on the caller's thread before the call
returns, so lowbit's collectives keep the caller's program order and mix freely with torch's own and
with DDP's. Nothing blocks the host on CUDA: encoding runs on the caller's current stream, NCCL orders
the collective after it, and decoding runs in the collective's future callback, on a pool stream that
waits for it (scatter_gather's middle phase runs on a side stream that waits for the all-to-all). On
CPU (gloo) decoding runs on gloo's thread when the data has arrived; scatter_gather waits for its
all-to-all on the caller's thread before it can issue the all-gather. ``async_op=True`` returns a
handle whose ``wait()`` gives the result, as torch's Work does.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Hashable
from typing import Any

import torch
import torch.distributed as dist

from lowbit.codecs.base import Codec, get_codec, load_plugins
from lowbit.comm import collectives as C
from lowbit.feedback import ErrorFeedback

#: Grubic et al.'s simulation of low-precision NCCL (Figs 7, 9, 11): a native fp32 allreduce of a buffer cut
#: to bits/32 of the tensor. Speed only: the tensor is NOT reduced (each rank keeps its own values).
SIMULATED = "simulated"

__all__ = ["AUTO", "SIMULATED", "AlgorithmPlugin", "register_algorithm", "algorithms",
           "algorithm_choices", "get_algorithm", "set_cost", "CommStats", "Handle", "all_reduce",
           "chunk_sizes", "bytes_sent_per_rank", "auto_algorithm", "resolve_algorithm", "simulated_numel", "start"]

#: The name that is not an algorithm but picks one per call (:func:`resolve_algorithm`).
AUTO = "auto"


@dataclasses.dataclass(frozen=True)
class AlgorithmPlugin:
    """One collective algorithm: an entry of the registry that every layer reads (:func:`register_algorithm`,
    :func:`algorithms`); the built-ins are entries too, and a new algorithm is one more, in a module of its
    own (``lowbit.comm.hierarchical``; ``tests/plugins/toy_algorithm.py``; docs/codecs.md, "Your own
    algorithm").

    ``start(x, codec, group, op, residual, seed, stats, out, post, node_size, shape, world)`` issues one
    reduction of ``x`` ((n,) float32) into ``out`` and returns the future of ``out`` (of ``post()`` when
    given), as :func:`start` does, the call already counted in ``stats``; ``None`` for lowbit's flat
    algorithms, which :func:`start` runs itself. ``bytes_per_rank(codec, n, k, rank, exact, node_size,
    shape)`` is what rank ``rank`` sends for one call of ``n`` values (``None``: the flat formulas of
    :func:`bytes_sent_per_rank`). ``prepare(group, node_size)`` resolves, once per call before the ranks
    agree, what they must agree on (hierarchical: the node size); ``None``: nothing.

    For the speed model (lowbit.perfmodel, which reads them; ``None``: the algorithm is not modelled):
    ``cost(nbytes, topo, fp32_bytes)`` is a :class:`lowbit.perfmodel.collectives.CommCost` (seconds,
    bytes sent per rank, steps) for a payload of ``nbytes`` per rank in the codec's precision on a
    :class:`lowbit.perfmodel.collectives.Topology` (world size, ranks per node, links), ``fp32_bytes``
    being the uncompressed size when the payload is compressed (None when it is fp32);
    ``work(numel, world, gpus_per_node)`` gives the values ``(encoded, decoded)`` per rank for one call of
    ``numel`` values (default ``(numel, numel)``). The built-ins' costs are attached by
    :mod:`lowbit.perfmodel.collectives` (:func:`set_cost`).

    ``quantised``: takes quantised codecs (False: only codecs that sum on the wire, as ``allreduce``).
    ``multi_node``: meant for clusters of several nodes (``lowbit advise --algorithm auto`` tries it only
    there). ``doc``: one line for listings.
    """

    start: Callable[..., torch.futures.Future] | None = None
    bytes_per_rank: Callable[..., int] | None = None
    prepare: Callable[[dist.ProcessGroup | None, int | None], int | None] | None = None
    cost: Callable[..., Any] | None = None
    work: Callable[[float, int, int], tuple[float, float]] | None = None
    quantised: bool = True
    multi_node: bool = False
    doc: str = ""


_PLUGINS: dict[str, AlgorithmPlugin] = {}
_FLAT = frozenset(("scatter_gather", "allgather", "allreduce", SIMULATED))  # run by start() itself
_COSTS: dict[str, tuple[Callable[..., Any], Callable[[float, int, int], tuple[float, float]] | None]] = {}


def register_algorithm(name: str, plugin: AlgorithmPlugin) -> None:
    """Make ``name`` an algorithm of :func:`all_reduce`, :func:`start`, the DDP hook, the study, the CLI
    and (with a ``cost``) the speed model: every layer validates and lists algorithms from this registry.
    Registering a name again replaces its entry. Name a module that calls this in ``$LOWBIT_PLUGINS`` so
    that every process, spawned workers included, registers it."""
    if not isinstance(name, str) or not name.isidentifier() or name == AUTO:
        raise ValueError(f"register_algorithm: the name must be an identifier other than {AUTO!r}, got {name!r}")
    if not isinstance(plugin, AlgorithmPlugin):
        raise ValueError(f"register_algorithm: {name!r} needs an AlgorithmPlugin, got {type(plugin).__name__}")
    if name not in _FLAT and (plugin.start is None or plugin.bytes_per_rank is None):
        raise ValueError(f"register_algorithm: {name!r} needs its start and bytes_per_rank (only lowbit's flat "
                         f"algorithms {', '.join(sorted(_FLAT))} are run by start() itself)")
    cost = _COSTS.get(name)
    if cost is not None and plugin.cost is None:
        plugin = dataclasses.replace(plugin, cost=cost[0], work=cost[1])
    _PLUGINS[name] = plugin


def algorithms() -> tuple[str, ...]:
    """Every registered algorithm (the built-ins, then those of ``$LOWBIT_PLUGINS``), in registration order;
    ``auto`` is not one of them (:func:`algorithm_choices`)."""
    load_plugins()
    return tuple(_PLUGINS)


def algorithm_choices() -> tuple[str, ...]:
    """What ``algorithm=`` accepts: ``auto`` and every registered algorithm."""
    return (AUTO,) + algorithms()


def get_algorithm(name: str) -> AlgorithmPlugin:
    """The registry's entry of ``name``; a ValueError naming the known algorithms when there is none."""
    plugin = _PLUGINS.get(name) if isinstance(name, str) else None
    if plugin is None:
        names = algorithms()  # (loads $LOWBIT_PLUGINS: the name may be one of theirs)
        plugin = _PLUGINS.get(name) if isinstance(name, str) else None
        if plugin is None:
            raise ValueError(f"unknown algorithm {name!r}; choose one of {list((AUTO,) + names)}")
    return plugin


def set_cost(name: str, cost: Callable[..., Any], work: Callable[[float, int, int], tuple[float, float]] | None = None
             ) -> None:
    """Attach the speed model's ``cost`` (and ``work``) to the algorithm ``name``, now or when it registers
    (how :mod:`lowbit.perfmodel.collectives` gives the built-ins theirs, without loading any plugin; a
    plugin passes them to its :class:`AlgorithmPlugin` directly)."""
    _COSTS[name] = (cost, work)
    if name in _PLUGINS:
        _PLUGINS[name] = dataclasses.replace(_PLUGINS[name], cost=cost, work=work)


# lowbit's flat algorithms (start() and bytes_sent_per_rank() run them); hierarchical registers itself
# (lowbit.comm.hierarchical); the speed model attaches the built-ins' costs (lowbit.perfmodel.collectives).
register_algorithm("scatter_gather", AlgorithmPlugin(
    doc="all-to-all of encoded chunks, sum per chunk, all-gather of the re-encoded sums: ~2 payloads per rank"))
register_algorithm("allgather", AlgorithmPlugin(
    doc="every rank's whole payload to every rank, each decodes and sums all K: (K-1) payloads per rank"))
register_algorithm("allreduce", AlgorithmPlugin(
    quantised=False, doc="the native allreduce in fp32, fp16 or bf16 (codecs that sum on the wire only)"))
register_algorithm(SIMULATED, AlgorithmPlugin(
    doc="Grubic et al.'s simulated low-precision NCCL: an fp32 allreduce of the codec's wire size; speed only, "
        "the tensor is not reduced"))


def __getattr__(name: str) -> Any:
    # ALGORITHMS, as it was a tuple: now read from the registry when asked for.
    if name == "ALGORITHMS":
        return algorithm_choices()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@dataclasses.dataclass
class CommStats:
    """Accumulated cost of compressed collectives: calls, bytes this rank put on the wire, and (only when
    ``timing`` is on) seconds in encode / communicate / decode.

    Bytes are counted from the payload buffers actually handed to torch.distributed (not the 8-byte
    fingerprint of :func:`all_reduce`'s per-call check); ``bytes_inter`` is the part
    the hierarchical algorithm sent between nodes. Timing is opt-in: on CUDA
    it synchronises the device around each phase (a profiling mode that serialises the pipeline); on
    CPU it reads the clock only (``t_comm`` is then the time from issuing a collective to its data
    being there, queueing behind earlier collectives included).
    """

    calls: int = 0
    bytes_sent: int = 0
    bytes_inter: int = 0  # of bytes_sent, what went to other nodes (algorithm="hierarchical" only)
    t_encode: float = 0.0
    t_comm: float = 0.0
    t_decode: float = 0.0
    timing: bool = False

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class _Timer:
    """Adds wall time to a CommStats field when its ``timing`` is on (after a device sync on CUDA)."""

    __slots__ = ("stats", "field", "cuda", "t0")

    def __init__(self, stats: CommStats | None, field: str, device: torch.device) -> None:
        self.stats = stats if stats is not None and stats.timing else None
        self.field, self.cuda = field, device.type == "cuda"

    def __enter__(self) -> None:
        if self.stats is not None:
            if self.cuda:
                torch.cuda.synchronize()
            self.t0 = time.perf_counter()

    def __exit__(self, *exc: object) -> None:
        if self.stats is not None:
            if self.cuda:
                torch.cuda.synchronize()
            setattr(self.stats, self.field, getattr(self.stats, self.field) + time.perf_counter() - self.t0)


def _comm_clock(stats: CommStats | None, work: object, device: torch.device) -> Callable[[], None]:
    """Timing of a collective: on CUDA wait for it now (timing mode only); on CPU return a stamp that the
    completion callback calls, so t_comm spans issue to arrival without blocking anyone."""
    if stats is None or not stats.timing:
        return lambda: None
    t0 = time.perf_counter()
    if device.type == "cuda":
        if hasattr(work, "wait"):
            work.wait()  # type: ignore[attr-defined]
        torch.cuda.synchronize()
        stats.t_comm += time.perf_counter() - t0
        return lambda: None

    def stamp() -> None:
        stats.t_comm += time.perf_counter() - t0

    return stamp


def chunk_sizes(n: int, k: int) -> list[int]:
    """Split n values into k nearly equal chunks (the first n % k get one more)."""
    return [n // k + (1 if i < n % k else 0) for i in range(k)]


#: ``auto`` for two ranks: from how many values scatter_gather beats allgather, per device type of the tensor
#: (None: at no size). With two ranks both send the same bytes; scatter_gather makes two exchanges instead of
#: one and decodes 1.5 n values instead of 2 n (it keeps its own half in fp32). On a CPU (gloo, numba kernels,
#: one thread a rank) the half a tensor of decoding it saves outweighs the extra exchange from about 2M values
#: on; on CUDA (NCCL) allgather was the faster at every size measured, 1M to 256M values over NVLink and over
#: sockets (benchmarks/results/allreduce_gloo_cpu2_auto_*.json, allreduce_nccl_*_2xh200.json; docs/bench.md,
#: "Which algorithm auto runs").
AUTO_TWO_RANKS_SCATTER_FROM: dict[str, int | None] = {"cpu": 1 << 21, "cuda": None}


def auto_algorithm(k: int, numel: int | None = None, device: torch.device | str | None = None) -> str:
    """The flat algorithm ``auto`` runs for a quantised codec on ``k`` ranks: ``scatter_gather`` above two
    ranks (its bytes per rank stay ~2 payloads as K grows, allgather's grow as K-1); for two ranks
    ``allgather`` (one exchange), unless the tensor's device type has a size from which scatter_gather was
    measured faster (:data:`AUTO_TWO_RANKS_SCATTER_FROM`) and ``numel`` reaches it. Without ``numel`` or
    ``device`` (a caller that does not know them) two ranks take allgather. The one rule of ``auto``: the
    collectives, the DDP hook and the speed model (:func:`lowbit.perfmodel.model.resolve_algorithm`) all
    resolve it here."""
    if k > 2:
        return "scatter_gather"
    if k < 2 or numel is None or device is None:
        return "allgather"
    start_at = AUTO_TWO_RANKS_SCATTER_FROM.get(torch.device(device).type)
    return "scatter_gather" if start_at is not None and numel >= start_at else "allgather"


def resolve_algorithm(algorithm: str, codec: Codec, k: int, numel: int | None = None,
                      device: torch.device | str | None = None) -> str:
    """The algorithm a call really runs: native allreduce for codecs that sum on the wire; ``auto`` is
    :func:`auto_algorithm` for ``k`` ranks and a tensor of ``numel`` values on ``device`` (allgather for
    two ranks unless measured otherwise for that device and size, scatter_gather above); ``hierarchical``
    stays itself (it picks its between-node algorithm the same way). Per-tensor codecs
    (``codec.per_tensor``: per-column 1bitSGD, Dettmers with one scale) always take ``allgather``."""
    if algorithm == SIMULATED:
        return SIMULATED  # any codec: only its bits per value matter
    if codec.sums_on_wire:
        return "allreduce"
    if codec.per_tensor:
        return "allgather"  # a tensor's own groups cannot be cut into chunks
    if algorithm == "auto":
        return auto_algorithm(k, numel, device)
    return algorithm


def _seed(seed: int, rank: int, chunk: int, phase: int) -> int:
    # Distinct, reproducible random streams per step, rank, chunk and phase: ranks must not share
    # rounding noise, or the errors of the K payloads would be correlated instead of averaging out.
    return (seed * 1_000_003 + rank * 7_919 + chunk * 104_729 + phase * 15_485_863) & 0x7FFFFFFF


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


def _keep(t: torch.Tensor) -> None:
    """Tell the caching allocator that ``t`` (allocated on another stream) is used on the current one.
    (Not while a CUDA graph is captured: the callbacks then run on the capturing stream itself.)"""
    if t.is_cuda and not C.capturing():
        t.record_stream(torch.cuda.current_stream(t.device))


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
    stream work. ``algorithm`` is resolved (see :func:`resolve_algorithm`). ``post`` runs after the
    result is in ``out``, in the completion callback, and its return value becomes the future's (the
    DDP hook copies the result into its bucket and returns the bucket). ``world``: (rank, size) in
    ``group`` when the caller already knows them. ``node_size``: ranks per node for ``hierarchical``
    (see :mod:`lowbit.comm.hierarchical`). ``shape``: the shape of the first n values, for per-tensor
    codecs (per column, one scale per tensor); default flat.
    """
    rank, k = C.world(group) if world is None else world
    out = x if out is None else out
    plugin = _PLUGINS.get(algorithm)
    if plugin is not None and plugin.start is not None and k > 1:
        if exact:
            raise ValueError("exact values ride only with the allgather algorithm")
        if stats is not None:
            stats.calls += 1
        return plugin.start(x, codec, group, op, residual, seed, stats, out, post, node_size, shape, (rank, k))
    # (fp32 riders go with allgather only: with them auto does not look at the size)
    algorithm = resolve_algorithm(algorithm, codec, k, None if exact else x.numel(), x.device)
    if stats is not None:
        stats.calls += 1
    if algorithm == SIMULATED:
        return _simulated(x, codec, group, k, stats, out, post, shape)
    if exact and algorithm != "allgather":
        raise ValueError("exact values ride only with the allgather algorithm")
    if k == 1 and algorithm in _PLUGINS and _PLUGINS[algorithm].start is not None:
        algorithm = "allgather"  # one rank: nothing to send, the flat path copies
    if algorithm == "allreduce":
        return _native(x, codec, group, op, k, stats, out, post)
    n = x.numel() - exact
    comp = x[:n] if residual is None else x[:n] + residual
    if residual is not None and n:
        post = _guard_residual(residual, out, n, post)
    if n == 0 and not exact:
        if out.data_ptr() != x.data_ptr():
            out.copy_(x)
        return C.done(out if post is None else post(), x.device)
    if algorithm == "allgather":
        return _allgather(x, comp, n, exact, codec, group, op, rank, k, residual, seed, stats, out, post,
                          shape if shape is not None else codec.flat_shape(n))
    return _scatter_gather(comp, codec, group, op, rank, k, residual, seed, stats, out, post)


def _guard_residual(residual: torch.Tensor, out: torch.Tensor, n: int,
                    post: Callable[[], torch.Tensor] | None) -> Callable[[], torch.Tensor]:
    """A non-finite step must not poison error feedback: when the reduced result holds an Inf or NaN
    (some rank sent one, so every rank sees it, and AMP's GradScaler skips the step everywhere), every
    rank puts its residual back to its value before the step, as if the step had not happened. Decided
    on the device (no host synchronisation): the residual is saved before the step and selected after."""
    prev = residual.clone()

    def guarded() -> torch.Tensor:
        _keep(prev)
        ok = torch.isfinite(out[:n]).all()
        torch.where(ok, residual, prev, out=residual)
        return out if post is None else post()

    return guarded


def simulated_numel(codec: Codec, n: int, shape: tuple[int, ...] | None = None) -> int:
    """fp32 values of the simulated buffer for ``n`` values in ``codec``: ``ceil(n * bits / 32)``, bits as
    the codec's wire size gives them (scales included)."""
    if n <= 0:
        return 0
    return -(-codec.nbytes(n, shape if shape is not None else codec.flat_shape(n)) // 4)


def _simulated(x, codec, group, k, stats, out, post, shape) -> torch.futures.Future:
    """Grubic et al.'s simulation: time a native allreduce of the bytes the codec would send, cut from
    the tensor; the tensor itself is left as it is (this rank's values, not the mean)."""
    m = min(simulated_numel(codec, x.numel(), shape), x.numel())
    buf = x[:m].clone()
    if out.data_ptr() != x.data_ptr():
        out.copy_(x)
    if k == 1 or m == 0:
        return C.done(out if post is None else post(), x.device)
    work = C.all_reduce_async(buf, group)
    if stats is not None:
        stats.bytes_sent += 2 * (k - 1) * m * 4 // k
    stamp = _comm_clock(stats, work, x.device)

    def finish() -> torch.Tensor:
        stamp()
        _keep(buf)
        return out if post is None else post()

    return C.then(work, finish, "all_reduce", group)


def _native(x, codec, group, op, k, stats, out, post) -> torch.futures.Future:
    dt = codec.wire_dtype
    with _Timer(stats, "t_encode", x.device):
        buf = x.to(dt) if dt != torch.float32 else out if out.data_ptr() == x.data_ptr() else out.copy_(x)
        if op == "mean" and k > 1:
            buf.div_(k)  # before the sum, as torch's DDP does (no overflow of the 16-bit types)
    work = C.all_reduce_async(buf, group)
    if stats is not None:
        stats.bytes_sent += 2 * (k - 1) * buf.numel() * buf.element_size() // k if k > 1 else 0
    stamp = _comm_clock(stats, work, x.device)

    def finish() -> torch.Tensor:
        stamp()
        if buf.data_ptr() != out.data_ptr():
            _keep(buf)
            out.copy_(buf)
        return out if post is None else post()

    return C.then(work, finish, "all_reduce", group)


def _pow2_inverse(k: int) -> float:
    """2^-ceil(log2 k): K values of at most float32's max, each times this, sum to at most its max."""
    return 2.0 ** -(k - 1).bit_length()


def _mean_scaling(codec: Codec, payloads: list[torch.Tensor], n: int, shape: tuple[int, ...] | None,
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
    pre = _pow2_inverse(divide_by)
    if codec.scale_fields(n, shape) is None:
        return 1.0, divide_by
    for p in payloads:
        codec.scale_payload_(p, n, pre, shape)
    return pre, divide_by * pre


def _encode_with_feedback(codec: Codec, comp: torch.Tensor, residual: torch.Tensor | None, seed: int,
                          shape: tuple[int, ...] | None = None) -> torch.Tensor:
    """Encode ``comp`` (flat; viewed as ``shape`` for per-tensor codecs); with error feedback leave
    ``residual = comp - decode(payload)`` (in place)."""
    payload = codec.encode(comp.view(shape) if shape is not None else comp, seed=seed)
    if residual is not None and comp.numel():
        codec.decode(payload, comp.numel(), out=residual,
                     shape=shape if shape is not None else codec.flat_shape(comp.numel()))
        torch.sub(comp, residual, out=residual)
    return payload


#: Message slots start, and payload code streams sit, on 16-byte boundaries: the kernels then read and
#: write the codes in 16-byte vectors on every rank's slice of a receive buffer (a misaligned slice
#: makes Triton fall back to narrow loads).
ALIGN = 16


def _slot(codec: Codec, m: int, shape: tuple[int, ...] | None = None) -> tuple[int, int]:
    """(lead, size) of the message slot of an m-value payload (of ``shape``, default flat): ``lead`` zero
    bytes put its code stream on a 16-byte boundary, and ``size`` (a multiple of 16) holds lead +
    payload + tail padding."""
    shape = shape if shape is not None else codec.flat_shape(m)
    lead = -codec.head_bytes(m, shape) % ALIGN
    return lead, _up(lead + codec.nbytes(m, shape))


def _up(b: int) -> int:
    return -(-b // ALIGN) * ALIGN


class _Pool:
    """Receive buffers for CPU collectives, reused across calls: a large fresh CPU allocation comes back
    from the OS as untouched pages, and faulting them in costs more than decoding into them (22 ms vs
    5 ms for 16M values on a 2-core VM). A buffer is taken when a collective is issued and given back
    once its data has been decoded; several calls in flight each hold their own. (CUDA tensors use torch's
    caching allocator, which already reuses memory per stream.)"""

    def __init__(self) -> None:
        self.free: dict[tuple[int, torch.dtype], list[torch.Tensor]] = {}
        self.lock = threading.Lock()

    def take(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        if device.type != "cpu":
            return torch.empty(numel, dtype=dtype, device=device)
        with self.lock:
            stack = self.free.get((numel, dtype))
            if stack:
                return stack.pop()
        return torch.empty(numel, dtype=dtype, device=device)

    def give(self, t: torch.Tensor) -> None:
        if t.device.type != "cpu":
            return
        with self.lock:
            stack = self.free.setdefault((t.numel(), t.dtype), [])
            if len(stack) < 4:  # a few per size: calls in flight at once
                stack.append(t)


_POOL = _Pool()

_ZEROS: dict[torch.device, torch.Tensor] = {}


def _zeros(nbytes: int, device: torch.device) -> torch.Tensor:
    """``nbytes`` zero bytes (a view of one read-only buffer per device, grown when a pad is longer)."""
    z = _ZEROS.get(device)
    if z is None or z.numel() < nbytes:
        z = _ZEROS[device] = torch.zeros(max(2 * ALIGN, nbytes), dtype=torch.uint8, device=device)
    return z[:nbytes]


def _framed(parts: list[tuple[int, torch.Tensor, int]], device: torch.device) -> torch.Tensor:
    """One contiguous message from (lead, bytes, slot size) parts, zero-padded: a single copy kernel."""
    pieces = []
    for lead, payload, size in parts:
        if lead:
            pieces.append(_zeros(lead, device))
        pieces.append(payload)
        tail = size - lead - payload.numel()
        if tail:
            pieces.append(_zeros(tail, device))
    if len(pieces) == 1:
        return pieces[0]
    return torch.cat(pieces) if pieces else torch.empty(0, dtype=torch.uint8, device=device)


def bytes_sent_per_rank(codec: Codec, n: int, k: int, algorithm: str, rank: int = 0, exact: int = 0,
                        node_size: int | None = None, shape: tuple[int, ...] | None = None,
                        device: torch.device | str | None = None) -> int:
    """What rank ``rank`` puts on the wire for one call of ``n`` values (plus ``exact`` raw fp32 riders),
    predicted from the codec's sizes: ring all-gather / allreduce accounting, 16-byte message slots
    included (``hierarchical``: with ``node_size`` ranks per node; ``auto``: as it resolves for a tensor on
    ``device``). The collectives count the buffers they really send; this is the model's side."""
    if k == 1 or (n == 0 and not exact):
        return 0
    plugin = _PLUGINS.get(algorithm)
    if plugin is not None and plugin.bytes_per_rank is not None:
        return plugin.bytes_per_rank(codec, n, k, rank, exact, node_size, shape)
    if algorithm == SIMULATED:
        return int(2 * (k - 1) * simulated_numel(codec, n + exact, shape) * 4 // k)
    algorithm = resolve_algorithm(algorithm, codec, k, None if exact else n, device)
    if algorithm == "allreduce":
        return int(2 * (k - 1) * codec.nbytes(n, codec.flat_shape(n)) // k)
    if algorithm == "allgather":
        return (k - 1) * (_slot(codec, n, shape)[1] + _up(4 * exact))
    slots = [_slot(codec, c)[1] for c in chunk_sizes(n, k)]
    return sum(s for i, s in enumerate(slots) if i != rank) + (k - 1) * max(slots)


def _allgather(x, comp, n, exact, codec, group, op, rank, k, residual, seed, stats, out, post,
               shape=None) -> torch.futures.Future:
    dev = x.device
    with _Timer(stats, "t_encode", dev):
        payload = _encode_with_feedback(codec, comp, residual, _seed(seed, rank, 0, 0), shape)
        p = payload.numel()
        lead, psize = _slot(codec, n, shape)
        parts = [(lead, payload, psize)]
        if exact:
            parts.append((0, x[n:].view(torch.uint8), _up(4 * exact)))
        send = _framed(parts, dev)
        s = send.numel()
        recv = _POOL.take(k * s, torch.uint8, dev)
    work = C.all_gather_async(recv, send, group)
    if stats is not None:
        stats.bytes_sent += (k - 1) * s
    stamp = _comm_clock(stats, work, dev)
    divide_by = k if op == "mean" else 1

    def finish() -> torch.Tensor:
        stamp()
        with _Timer(stats, "t_decode", dev):
            _keep(recv)
            _keep(out)
            payloads = [recv[i * s + lead : i * s + lead + p] for i in range(k)]
            pre, div = _mean_scaling(codec, payloads, n, shape, divide_by)
            if n:
                codec.decode_sum(payloads, n, out=out[:n], shape=shape, divide_by=divide_by if pre == 1 else 1)
                if pre != 1 and div != 1:
                    out[:n].div_(div)
            if exact:
                vals = recv.view(k, s)[:, psize : psize + 4 * exact].view(torch.float32)  # (k, exact), rank order
                tail = out[n:]
                torch.sum(vals if divide_by == 1 else vals.mul_(_pow2_inverse(k)), dim=0, out=tail)
                if divide_by != 1 and divide_by * _pow2_inverse(k) != 1:
                    tail.div_(divide_by * _pow2_inverse(k))
            _POOL.give(recv)
        return out if post is None else post()

    return C.then(work, finish, "all_gather_into_tensor", group)


_SIDE: dict[torch.device, torch.cuda.Stream] = {}


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    s = _SIDE.get(device)
    if s is None:
        s = _SIDE[device] = torch.cuda.Stream(device)
    return s


def _scatter_gather(comp, codec, group, op, rank, k, residual, seed, stats, out, post) -> torch.futures.Future:
    dev = comp.device
    n = comp.numel()
    sizes = chunk_sizes(n, k)
    starts = [sum(sizes[:i]) for i in range(k)]
    slots = [_slot(codec, m) for m in sizes]
    nbytes = [codec.nbytes(m, codec.flat_shape(m)) for m in sizes]
    smax = max(sz for _, sz in slots)
    # Phase 1: encode my copy of every other rank's chunk (worker quantisation); chunk i goes to rank i.
    # My own chunk stays in fp32 on this rank: it never crosses the wire, so quantising it would only
    # add error and work (its residual is 0).
    with _Timer(stats, "t_encode", dev):
        parts = []
        for i in range(k):
            if i == rank:
                continue
            lo, hi = starts[i], starts[i] + sizes[i]
            payload = _encode_with_feedback(codec, comp[lo:hi], None if residual is None else residual[lo:hi],
                                            _seed(seed, rank, i, 0))
            parts.append((slots[i][0], payload, slots[i][1]))
        if residual is not None:
            residual[starts[rank] : starts[rank] + sizes[rank]].zero_()
        send = _framed(parts, dev)
        send_splits = [0 if i == rank else slots[i][1] for i in range(k)]
        my_lead, my_slot = slots[rank]
        recv_splits = [0 if i == rank else my_slot for i in range(k)]
        recv = _POOL.take(sum(recv_splits), torch.uint8, dev)
    work1 = C.all_to_all_async(recv, send, send_splits, recv_splits, group)
    if stats is not None:
        stats.bytes_sent += sum(send_splits)
    stamp1 = _comm_clock(stats, work1, dev)

    def phase2() -> tuple[object, torch.Tensor]:
        # Decode the other ranks' copies of my chunk and sum them (rank order, fp32), add my own fp32
        # copy, take the mean, then re-encode (server quantisation) and all-gather.
        mine, nb = sizes[rank], nbytes[rank]
        with _Timer(stats, "t_decode", dev):
            own_chunk = comp[starts[rank] : starts[rank] + mine]
            reduced = _POOL.take(mine, torch.float32, dev)
            if k > 1 and mine:
                payloads = [recv[j * my_slot + my_lead : j * my_slot + my_lead + nb] for j in range(k - 1)]
                pre, div = _mean_scaling(codec, payloads, mine, codec.flat_shape(mine), k if op == "mean" else 1)
                codec.decode_sum(payloads, mine, out=reduced, shape=codec.flat_shape(mine))
                reduced.add_(own_chunk, alpha=pre)  # (pre * own is exact: a power of two)
            else:
                reduced.copy_(own_chunk)
                div = 1
            if div != 1:
                reduced.div_(div)
        with _Timer(stats, "t_encode", dev):
            own = codec.encode(reduced, seed=_seed(seed, rank, rank, 1))
            if residual is not None and mine:
                # Fold the server's error into my residual; it re-enters next step's sum (x K for a mean).
                server_err = reduced - codec.decode(own, mine, shape=codec.flat_shape(mine))
                if op == "mean":
                    server_err.mul_(k)
                residual[starts[rank] : starts[rank] + mine].add_(server_err)
            own = _framed([(my_lead, own, smax)], dev)  # all_gather needs equal sizes; pads count as sent
            gathered = _POOL.take(k * smax, torch.uint8, dev)
            _POOL.give(recv)
            _POOL.give(reduced)
        work2 = C.all_gather_async(gathered, own, group)
        if stats is not None:
            stats.bytes_sent += (k - 1) * own.numel()
        return work2, gathered

    if dev.type == "cuda":
        # The middle phase waits for the all-to-all on a side stream: the caller's stream (the backward
        # pass) never waits for the network, and the host never waits at all.
        side = _side_stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):
            work1.wait()  # type: ignore[union-attr]  # a stream wait on NCCL, not a host wait
            stamp1()
            # send too: wait() lets NCCL drop its hold on the buffers as if this (side) stream were
            # theirs; send was made on the caller's stream, which would reuse its memory while the
            # all-to-all may still read it (NaN losses on 4 GPUs before this line).
            for t in (comp, recv, send):
                _keep(t)
            if residual is not None:
                _keep(residual)
            work2, gathered = phase2()
    else:
        C.wait(work1 if isinstance(work1, torch.futures.Future) else work1.get_future(), "all_to_all_single", group)
        stamp1()
        work2, gathered = phase2()
    stamp2 = _comm_clock(stats, work2, dev)

    def finish() -> torch.Tensor:
        # Phase 3: every rank decodes every re-encoded chunk (bit-identical everywhere).
        stamp2()
        with _Timer(stats, "t_decode", dev):
            _keep(gathered)
            _keep(out)
            for i in range(k):
                if sizes[i]:
                    lo, at = starts[i], i * smax + slots[i][0]
                    codec.decode(gathered[at : at + nbytes[i]], sizes[i], out=out[lo : lo + sizes[i]],
                                 shape=codec.flat_shape(sizes[i]))
            _POOL.give(gathered)
        return out if post is None else post()

    return C.then(work2, finish, "all_gather_into_tensor", group)


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
    ``op``: ``torch.distributed.ReduceOp.SUM`` (the default, as torch's) or ``ReduceOp.AVG``, or the
    strings ``"sum"`` / ``"mean"``. ``algorithm``: ``scatter_gather`` (default), ``allgather``,
    ``allreduce`` (fp32/fp16/bf16 only), ``auto`` (:func:`auto_algorithm`: scatter_gather above 2 ranks;
    for 2, allgather, or scatter_gather for large CPU tensors) or
    ``hierarchical`` (native inside each node, compressed between nodes; ``node_size`` ranks per node,
    default ``$LOWBIT_NODE_SIZE`` or torchrun's ``LOCAL_WORLD_SIZE``: :mod:`lowbit.comm.hierarchical`).
    ``simulated`` is Grubic et al.'s simulation of low-precision NCCL for benchmarks: a native fp32
    allreduce of a buffer of the codec's wire size, **leaving the tensor unreduced** (speed only).
    ``feedback`` (an :class:`~lowbit.ErrorFeedback` of the same codec) adds error feedback under ``key``.
    A float32 contiguous ``tensor`` is reduced in place; any other dtype or layout (a strided view) is
    copied into a contiguous float32 buffer and the result copied back into its elements, never
    touching memory outside them. A tensor whose elements overlap in memory (an expanded view) is
    refused with a ValueError before anything is sent.
    ``seed`` keys the stochastic rounding (pass the step number). ``stats`` accumulates calls and bytes
    sent (and phase times when its ``timing`` is on). With ``async_op=True`` returns a handle whose
    ``wait()`` makes ``tensor`` hold the result.
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
    _agree(group, key, (codec.spec, algorithm if plugin is None or plugin.start is None else f"{algorithm}/{node_size}", op,
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
