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

Error feedback keeps one residual per key (per tensor). The server's quantisation error on the chunk
that rank r owns is folded into rank r's residual (times K for a mean), so it re-enters the next step's
sum; the residual therefore does not depend on how the tensor is chunked, which keeps checkpoints valid
across DDP's bucket rebuilds.

Asynchrony: ``async_op=True`` hands the communication to one worker thread per process group, which
runs jobs in submission order (so every rank issues its collectives in the same order) while the caller
goes on — the seed's double buffering: encoding the next tensor overlaps communicating this one.
"""

from __future__ import annotations

import dataclasses
import queue
import threading
import time
from collections.abc import Callable, Hashable
from typing import Any

import torch
import torch.distributed as dist

from lowbit.codecs.base import Codec, get_codec
from lowbit.comm import collectives as C
from lowbit.feedback import ErrorFeedback

ALGORITHMS = ("scatter_gather", "allgather", "allreduce")
NATIVE = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}

__all__ = ["ALGORITHMS", "CommStats", "all_reduce", "chunk_sizes", "bytes_sent_per_rank"]


@dataclasses.dataclass
class CommStats:
    """Accumulated cost of compressed collectives (seconds; bytes this rank sent)."""

    calls: int = 0
    bytes_sent: int = 0
    t_encode: float = 0.0
    t_comm: float = 0.0
    t_decode: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class _Timer:
    """Adds wall time (after device synchronisation on CUDA) to a CommStats field."""

    def __init__(self, stats: CommStats | None, field: str, ref: torch.Tensor) -> None:
        self.stats, self.field, self.ref = stats, field, ref

    def __enter__(self) -> None:
        if self.stats is not None:
            C.barrier_device(self.ref)
            self.t0 = time.perf_counter()

    def __exit__(self, *exc: object) -> None:
        if self.stats is not None:
            C.barrier_device(self.ref)
            setattr(self.stats, self.field, getattr(self.stats, self.field) + time.perf_counter() - self.t0)


def chunk_sizes(n: int, k: int) -> list[int]:
    """Split n values into k nearly equal chunks (the first n % k get one more)."""
    return [n // k + (1 if i < n % k else 0) for i in range(k)]


def bytes_sent_per_rank(codec: Codec, n: int, k: int, algorithm: str, rank: int = 0) -> int:
    """Bytes rank ``rank`` puts on the wire for one call (ring all-gather / allreduce accounting)."""
    if k == 1 or n == 0:
        return 0
    if algorithm == "allreduce":
        return int(2 * (k - 1) * codec.nbytes(n) // k)
    if algorithm == "allgather":
        return (k - 1) * codec.nbytes(n)
    sizes = [codec.nbytes(c) for c in chunk_sizes(n, k)]
    return sum(s for i, s in enumerate(sizes) if i != rank) + (k - 1) * max(sizes)


def _seed(seed: int, rank: int, chunk: int, phase: int) -> int:
    # Distinct, reproducible random streams per step, rank, chunk and phase: ranks must not share
    # rounding noise, or the errors of the K payloads would be correlated instead of averaging out.
    return (seed * 1_000_003 + rank * 7_919 + chunk * 104_729 + phase * 15_485_863) & 0x7FFFFFFF


def _check_args(tensor: torch.Tensor, codec: Codec, algorithm: str, op: str) -> None:
    if not isinstance(tensor, torch.Tensor) or not tensor.is_floating_point():
        raise ValueError(f"all_reduce expects a floating-point tensor, got {getattr(tensor, 'dtype', type(tensor))}")
    if algorithm not in ALGORITHMS:
        raise ValueError(f"unknown algorithm {algorithm!r}; choose one of {list(ALGORITHMS)}")
    if op not in ("mean", "sum"):
        raise ValueError(f"op must be 'mean' or 'sum', got {op!r}")
    if algorithm == "allreduce" and codec.name not in NATIVE:
        raise ValueError(
            f"algorithm 'allreduce' sums on the wire, so it only takes fp32/fp16/bf16, not {codec.spec}; "
            "use 'scatter_gather' or 'allgather' for quantised codecs"
        )


Finish = Callable[[], "tuple[torch.Tensor, torch.Tensor | None]"]


def prepare_flat(
    x: torch.Tensor,
    codec: Codec,
    group: dist.ProcessGroup | None,
    algorithm: str,
    op: str,
    residual: torch.Tensor | None,
    seed: int,
    stats: CommStats | None = None,
) -> Finish:
    """Stage 1 (runs on the caller's thread): compensate and encode. Returns stage 2, which communicates
    and decodes and returns (reduced (n,) float32, new residual or None). Splitting the two lets the
    encode of the next tensor overlap the communication of this one (the seed's double buffering).

    x: (n,) float32. ``residual`` (same shape) enables error feedback: x + residual is what gets sent.
    """
    rank, k = C.world(group)
    n = x.numel()
    if stats is not None:
        stats.calls += 1
    if algorithm == "allreduce":
        return _native(x, codec, group, op, k, stats)
    comp = x if residual is None else x + residual
    if n == 0:
        return lambda: (comp.clone(), (comp.clone() if residual is not None else None))
    if algorithm == "allgather":
        return _allgather(comp, codec, group, op, rank, k, residual is not None, seed, stats)
    return _scatter_gather(comp, codec, group, op, rank, k, residual is not None, seed, stats)


def _native(x: torch.Tensor, codec: Codec, group, op: str, k: int, stats: CommStats | None) -> Finish:
    dt = NATIVE[codec.name]
    with _Timer(stats, "t_encode", x):
        # fp32 reduces in place: x is either the caller's tensor (all_reduce is in place by contract)
        # or a fresh concatenation (the DDP hook), so no copy is needed.
        buf = x.to(dt) if dt != torch.float32 else x

    def finish() -> tuple[torch.Tensor, None]:
        with _Timer(stats, "t_comm", x):
            C.all_reduce_sum(buf, group)
        if stats is not None:
            stats.bytes_sent += bytes_sent_per_rank(codec, x.numel(), k, "allreduce")
        with _Timer(stats, "t_decode", x):
            out = buf.to(torch.float32)
            if op == "mean" and k > 1:
                out.div_(k)
        return out, None

    return finish


def _allgather(comp, codec, group, op, rank, k, feedback, seed, stats) -> Finish:
    n = comp.numel()
    with _Timer(stats, "t_encode", comp):
        payload = codec.encode(comp, seed=_seed(seed, rank, 0, 0))
        residual = comp - codec.decode(payload, n) if feedback else None

    def finish():
        with _Timer(stats, "t_comm", comp):
            gathered = C.all_gather(payload, group)
        if stats is not None:
            stats.bytes_sent += (k - 1) * payload.numel()
        with _Timer(stats, "t_decode", comp):
            p = payload.numel()
            # comp is not needed any more (the residual was taken above): sum into it, and take the
            # mean in the same pass where the backend can (else decode_sum divides after summing)
            out = codec.decode_sum([gathered[i * p : (i + 1) * p] for i in range(k)], n, out=comp,
                                   divide_by=k if op == "mean" and k > 1 else 1)
        return out, residual

    return finish


def _scatter_gather(comp, codec, group, op, rank, k, feedback, seed, stats) -> Finish:
    n = comp.numel()
    sizes = chunk_sizes(n, k)
    starts = [sum(sizes[:i]) for i in range(k)]
    nbytes = [codec.nbytes(s) for s in sizes]
    # Phase 1: encode my copy of every other rank's chunk (worker quantisation); chunk i goes to rank i.
    # My own chunk stays in fp32 on this rank: it never crosses the wire, so quantising it would only
    # add error and work (its residual is 0).
    empty = torch.empty(0, dtype=torch.uint8, device=comp.device)
    with _Timer(stats, "t_encode", comp):
        payloads = [empty if i == rank else codec.encode(comp[starts[i] : starts[i] + sizes[i]], seed=_seed(seed, rank, i, 0))
                    for i in range(k)]
        residual = None
        if feedback:
            residual = torch.zeros_like(comp)
            for i in range(k):
                if i != rank:
                    chunk = comp[starts[i] : starts[i] + sizes[i]]
                    torch.sub(chunk, codec.decode(payloads[i], sizes[i]), out=residual[starts[i] : starts[i] + sizes[i]])
        send = torch.cat(payloads)
    send_splits = [0 if i == rank else nbytes[i] for i in range(k)]
    recv_splits = [0 if i == rank else nbytes[rank] for i in range(k)]

    def finish():
        with _Timer(stats, "t_comm", comp):
            recv = C.all_to_all(send, send_splits, recv_splits, group)
        # Phase 2: decode the other ranks' copies of my chunk and sum them (rank order, fp32), add my own
        # fp32 copy, then re-encode the result (server quantisation).
        mine, nb = sizes[rank], nbytes[rank]
        with _Timer(stats, "t_decode", comp):
            reduced = C.workspace("reduced", mine, torch.float32, comp.device)
            own_chunk = comp[starts[rank] : starts[rank] + mine]
            if k > 1:
                codec.decode_sum([recv[j * nb : (j + 1) * nb] for j in range(k - 1)], mine, out=reduced)
                reduced.add_(own_chunk)
            else:
                reduced.copy_(own_chunk)
            if op == "mean" and k > 1:
                reduced.div_(k)
        with _Timer(stats, "t_encode", comp):
            own = codec.encode(reduced, seed=_seed(seed, rank, rank, 1))
            if feedback and mine:
                # Fold the server's error into my residual; it re-enters next step's sum (x K for a mean).
                server_err = reduced - codec.decode(own, mine)
                if op == "mean":
                    server_err.mul_(k)
                residual[starts[rank] : starts[rank] + mine].add_(server_err)
            pmax = max(nbytes)
            if own.numel() < pmax:  # all_gather needs equal sizes; the pad bytes are counted as sent
                own = torch.cat([own, own.new_zeros(pmax - own.numel())])
        # Phase 3: every rank gets every re-encoded chunk and decodes it.
        with _Timer(stats, "t_comm", comp):
            gathered = C.all_gather(own, group)
        if stats is not None:
            stats.bytes_sent += bytes_sent_per_rank(codec, n, k, "scatter_gather", rank)
        with _Timer(stats, "t_decode", comp):
            # comp is not needed any more (the residual was taken in phase 1): decode into it. When
            # comp is the caller's own fp32 tensor this also saves the final copy.
            out = comp
            for i in range(k):
                if sizes[i]:
                    codec.decode(gathered[i * pmax : i * pmax + nbytes[i]], sizes[i], out=out[starts[i] : starts[i] + sizes[i]])
        return out, residual

    return finish


# ------------------------------------------------------------------------------------- async engine
class _Engine:
    """One worker thread per process group; runs communication jobs strictly in submission order.

    On CUDA the thread issues its work on its own stream, so collectives and decoding overlap the
    backward kernels instead of queueing behind them (and, worse, making them queue behind the
    network). A job first waits for an event recorded on the submitter's stream, so it sees the
    tensors the submitter produced; its result is synchronised before the future completes.
    """

    def __init__(self, device: torch.device) -> None:
        self.jobs: queue.Queue[tuple[Callable[[], Any], torch.futures.Future, Any] | None] = queue.Queue()
        self.device = device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.thread = threading.Thread(target=self._loop, name="lowbit-comm", daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        if self.stream is not None:
            torch.cuda.set_device(self.device)
            torch.cuda.set_stream(self.stream)
        while True:
            item = self.jobs.get()
            if item is None:
                return
            fn, fut, ready = item
            try:
                if ready is not None:
                    self.stream.wait_event(ready)  # type: ignore[union-attr]
                result = fn()
                if self.stream is not None:
                    self.stream.synchronize()
                fut.set_result(result)
            except BaseException as exc:  # noqa: BLE001 — delivered to whoever waits
                fut.set_exception(exc)

    def submit(self, fn: Callable[[], Any]) -> torch.futures.Future:
        fut: torch.futures.Future = torch.futures.Future()
        ready = None
        if self.stream is not None:
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(self.device))
        self.jobs.put((fn, fut, ready))
        return fut


_ENGINES: dict[tuple[int, str], _Engine] = {}
_ENGINES_LOCK = threading.Lock()


def engine_for(group: dist.ProcessGroup | None, device: torch.device) -> _Engine:
    key = (id(group) if group is not None else 0, str(device))
    with _ENGINES_LOCK:
        eng = _ENGINES.get(key)
        if eng is None or not eng.thread.is_alive():
            eng = _ENGINES[key] = _Engine(device)
        return eng


class Handle:
    """What ``all_reduce(..., async_op=True)`` returns: ``wait()`` and ``get_future()`` like a Work."""

    def __init__(self, fut: torch.futures.Future) -> None:
        self._fut = fut

    def wait(self, timeout: float | None = None) -> bool:
        self._fut.wait()
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
    op: str = "mean",
    feedback: ErrorFeedback | None = None,
    async_op: bool = False,
    *,
    key: Hashable = "tensor",
    seed: int = 0,
    stats: CommStats | None = None,
) -> Handle | None:
    """Reduce ``tensor`` in place across ``group`` with its values sent in ``codec``'s precision.

    Like ``torch.distributed.all_reduce``: every rank passes a tensor of the same shape and ends with the
    same (bit-identical) result. ``op="mean"`` (default) or ``"sum"``. ``feedback`` (an
    :class:`~lowbit.ErrorFeedback` of the same codec) adds error feedback under ``key``. ``seed`` keys the
    stochastic rounding (pass the step number). ``stats`` accumulates bytes sent and the time in
    encode / communicate / decode. With ``async_op=True`` returns a handle whose ``wait()`` blocks until
    ``tensor`` holds the result.
    """
    codec = get_codec(codec) if isinstance(codec, str) else codec
    _check_args(tensor, codec, algorithm, op)
    if feedback is not None and feedback.codec != codec:
        raise ValueError(f"feedback was built for {feedback.codec.spec}, but the collective uses {codec.spec}")
    if algorithm == "allreduce" and feedback is not None:
        raise ValueError("algorithm 'allreduce' is lossless up to the cast; it takes no error feedback")

    x = tensor.detach().reshape(-1).to(torch.float32)
    residual = None
    if feedback is not None:
        residual = feedback.residuals.get(key)
        if residual is None:
            residual = torch.zeros_like(x)
        elif residual.numel() != x.numel():
            raise ValueError(f"error feedback for key {key!r} holds {residual.numel()} values, tensor has {x.numel()}")
    finish = prepare_flat(x, codec, group, algorithm, op, residual, seed, stats)

    def job() -> torch.Tensor:
        out, new_res = finish()
        if feedback is not None and new_res is not None:
            feedback.residuals[key] = new_res
        if out.data_ptr() != tensor.data_ptr():
            with torch.no_grad():
                tensor.copy_(out.view(tensor.shape))
        return tensor

    if not async_op:
        job()
        return None
    return Handle(engine_for(group, tensor.device).submit(job))
