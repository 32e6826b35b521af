"""lowbit's flat algorithms: one reduction over the whole group, each an entry of the registry.

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

``simulated`` — Grubic et al.'s simulated low-precision NCCL: a native fp32 allreduce of the codec's wire
    size, cut from the tensor; speed only, the tensor is not reduced.

Each registers as :func:`lowbit.comm.registry.register_algorithm` registers any plugin's, with its
``start`` and ``bytes_per_rank``; they are ``flat`` entries (``auto`` and the codec rules of
:func:`lowbit.comm.registry.resolve_algorithm` pick among them). Error feedback: the server's
quantisation error on the chunk that rank r owns is folded into rank r's residual (times K for a mean),
so it re-enters the next step's sum; the residual therefore does not depend on how the tensor is
chunked, which keeps checkpoints valid across DDP's bucket rebuilds.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from lowbit.codecs.base import Codec
from lowbit.comm import collectives as C
from lowbit.comm import exchange as X
from lowbit.comm.framing import _POOL, _framed, _keep, _slot, _up, chunk_sizes
from lowbit.comm.registry import SIMULATED, AlgorithmPlugin, Call, register_algorithm
from lowbit.comm.residual import _encode_with_feedback, _guard_residual
from lowbit.comm.stats import _comm_clock, _Timer
from lowbit.feedback import restore_unless_finite

__all__ = ["simulated_numel"]


def _seed(seed: int, rank: int, chunk: int, phase: int) -> int:
    """A payload's rounding seed (the exchange core's rule, :func:`lowbit.comm.exchange.rounding_seed`):
    per step, rank, chunk and phase."""
    return X.rounding_seed(seed, rank, chunk, phase)


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


_pow2_inverse = X.pow2_inverse
_mean_scaling = X.mean_scaling


def call_seeds(algorithm: str, seed: int, rank: int, k: int) -> list[int]:
    """The rounding seeds of one call of ``algorithm`` (its payloads' streams, :func:`_seed`): allgather's
    one payload; scatter_gather's chunk for each rank, then the server's re-encode of my chunk."""
    if algorithm == "allgather":
        return [_seed(seed, rank, 0, 0)]
    return [_seed(seed, rank, i, 0) for i in range(k)] + [_seed(seed, rank, rank, 1)]


def _allgather_encode(x: torch.Tensor, comp: torch.Tensor, n: int, exact: int, codec: Codec,
                      residual: torch.Tensor | None, seed: int | torch.Tensor,
                      shape: tuple[int, ...] | None) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """allgather's message: ``comp`` encoded once (error feedback: the residual keeps what it lost), the
    ``exact`` fp32 riders (``x[n:]``) raw behind it. Returns it and (lead, payload bytes, slot size)."""
    payload = _encode_with_feedback(codec, comp, residual, seed, shape)
    lead, psize = _slot(codec, n, shape)
    parts = [(lead, payload, psize)]
    if exact:
        parts.append((0, x[n:].view(torch.uint8), _up(4 * exact)))
    return _framed(parts, x.device), (lead, payload.numel(), psize)


def _allgather_sum(recv: torch.Tensor, at: tuple[int, int, int], s: int, n: int, exact: int, codec: Codec,
                   k: int, op: str, shape: tuple[int, ...] | None, out: torch.Tensor) -> None:
    """allgather's result: every rank's payload (``K`` slots of ``s`` bytes) decoded and summed in rank
    order, the riders summed exactly, the mean scaled first (:func:`lowbit.comm.exchange.mean_scaling`)."""
    lead, p, psize = at
    divide_by = k if op == "mean" else 1
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


def _allgather(x, comp, n, exact, codec, group, op, rank, k, residual, seed, stats, out, post,
               shape=None) -> torch.futures.Future:
    dev = x.device
    with _Timer(stats, "t_encode", dev):
        send, at = _allgather_encode(x, comp, n, exact, codec, residual, call_seeds("allgather", seed, rank, k)[0],
                                     shape)
        s = send.numel()
        recv = _POOL.take(k * s, torch.uint8, dev)
    work = C.all_gather_async(recv, send, group)
    if stats is not None:
        stats.bytes_sent += (k - 1) * s
    stamp = _comm_clock(stats, work, dev)

    def finish() -> torch.Tensor:
        stamp()
        with _Timer(stats, "t_decode", dev):
            _keep(recv)
            _keep(out)
            _allgather_sum(recv, at, s, n, exact, codec, k, op, shape, out)
            _POOL.give(recv)
        return out if post is None else post()

    return C.then(work, finish, "all_gather_into_tensor", group)


_SIDE: dict[torch.device, torch.cuda.Stream] = {}


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    s = _SIDE.get(device)
    if s is None:
        s = _SIDE[device] = torch.cuda.Stream(device)
    return s


_PLANS: dict[tuple, X.Plan] = {}


def _chunk_plan(codec: Codec, n: int, k: int) -> X.Plan:
    """The exchange core's plan of ``n`` values in ``k`` chunks (:func:`chunk_sizes`), kept per call
    shape: DDP sends the same messages every step."""
    key = (codec.spec, id(codec), n, k)
    p = _PLANS.get(key)
    if p is None or p.layouts[0].codec is not codec:  # (the caller's codec object: an id may be reused)
        if len(_PLANS) >= 1024:
            _PLANS.clear()
        p = _PLANS[key] = X.plan(codec, chunk_sizes(n, k))
    return p


def _sg_encode(p: X.Plan, comp: torch.Tensor, rank: int, residual: torch.Tensor | None,
               seeds: list) -> torch.Tensor:
    """scatter_gather's phase 1 (the exchange core's reduce-scatter): my copy of every other rank's chunk
    encoded for it (worker quantisation, error feedback). My own chunk stays in fp32 on this rank: it
    never crosses the wire, so quantising it would only add error and work (its residual is 0)."""
    k = len(p.layouts)
    cuts = _cuts(p)
    return X.scatter_encode(p, [comp[a:b] for a, b in cuts], rank, seeds[:k],
                            None if residual is None else [residual[a:b] for a, b in cuts], compensated=True)


def _cuts(p: X.Plan) -> list[tuple[int, int]]:
    out, at = [], 0
    for lay in p.layouts:
        out.append((at, at + lay.numel))
        at += lay.numel
    return out


def _sg_middle(p: X.Plan, codec: Codec, comp: torch.Tensor, recv: torch.Tensor, rank: int, op: str,
               residual: torch.Tensor | None, seed: int | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """scatter_gather's phase 2: the other ranks' copies of my chunk decoded and summed (rank order, fp32),
    my own fp32 copy added, the mean taken, then re-encoded (server quantisation) for the all-gather;
    the server's error joins my residual (x K for a mean: it re-enters next step's sum). Returns the
    all-gather's message and its receive buffer."""
    k = len(p.layouts)
    a, b = _cuts(p)[rank]
    mine = b - a
    dev = comp.device
    reduced = _POOL.take(mine, torch.float32, dev)
    X.scatter_sum(p, recv, rank, comp[a:b], reduced, divide_by=k if op == "mean" else 1)
    own = X.gather_encode(p, reduced, rank, seed=seed)
    if residual is not None and mine:
        lay = p.layouts[rank]
        sent = own[lay.slot[0] : lay.slot[0] + lay.nbytes]
        server_err = reduced - codec.decode(sent, mine, shape=lay.code_shape)
        if op == "mean":
            server_err.mul_(k)
        residual[a:b].add_(server_err)
    _POOL.give(reduced)
    return own, _POOL.take(k * p.width, torch.uint8, dev)  # all_gather needs equal sizes; pads count as sent


def _sg_finish(p: X.Plan, gathered: torch.Tensor, out: torch.Tensor) -> None:
    """scatter_gather's phase 3: every rank decodes every re-encoded chunk (bit-identical everywhere)."""
    X.gather_decode(p, gathered, [out[a:b] for a, b in _cuts(p)])


def _scatter_gather(comp, codec, group, op, rank, k, residual, seed, stats, out, post) -> torch.futures.Future:
    dev = comp.device
    p = _chunk_plan(codec, comp.numel(), k)
    seeds = call_seeds("scatter_gather", seed, rank, k)
    with _Timer(stats, "t_encode", dev):
        send = _sg_encode(p, comp, rank, residual, seeds)
        send_splits, recv_splits = p.send_splits(rank), p.recv_splits(rank)
        recv = _POOL.take(sum(recv_splits), torch.uint8, dev)
    work1 = C.all_to_all_async(recv, send, send_splits, recv_splits, group)
    if stats is not None:
        stats.bytes_sent += sum(send_splits)
    stamp1 = _comm_clock(stats, work1, dev)

    def phase2() -> tuple[object, torch.Tensor]:
        with _Timer(stats, "t_decode", dev):
            own, gathered = _sg_middle(p, codec, comp, recv, rank, op, residual, seeds[k])
            _POOL.give(recv)
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
        stamp2()
        with _Timer(stats, "t_decode", dev):
            _keep(gathered)
            _keep(out)
            _sg_finish(p, gathered, out)
            _POOL.give(gathered)
        return out if post is None else post()

    return C.then(work2, finish, "all_gather_into_tensor", group)


def exchange_now(x: torch.Tensor, codec: Codec, group: dist.ProcessGroup | None, algorithm: str, op: str,
                 residual: torch.Tensor | None, seeds: Sequence[int | torch.Tensor], world: tuple[int, int],
                 exact: int = 0, shape: tuple[int, ...] | None = None) -> None:
    """One call of ``scatter_gather`` or ``allgather`` on ``x`` in place, synchronously: its collectives
    are waited for on the current stream (no host wait on NCCL), so the whole call is tensor work that a
    CUDA graph can capture (:mod:`lowbit.comm.graphs`; the DDP hook replays it per message). The same
    phases, the same bits as :func:`lowbit.comm.allreduce.start` with those arguments, ``seeds`` those of
    :func:`call_seeds` (ints, or one-element int32 device tensors of their keys). With error feedback
    ``x + residual`` is sent, and a non-finite result puts the residual back (lowbit.feedback's rule).
    The statistics are the caller's (:func:`bytes_now`)."""
    rank, k = world
    n = x.numel() - exact
    prev = residual.clone() if residual is not None and n else None
    comp = x[:n] if residual is None else x[:n].add_(residual)  # in place: x is only written after it is read
    if algorithm == "allgather":
        shape = shape if shape is not None else codec.flat_shape(n)  # (as the async path)
        send, at = _allgather_encode(x, comp, n, exact, codec, residual, seeds[0] if seeds else 0, shape)
        s = send.numel()
        recv = torch.empty(k * s, dtype=torch.uint8, device=x.device)
        C.all_gather(recv, send, group)
        _allgather_sum(recv, at, s, n, exact, codec, k, op, shape, x)
    elif algorithm == "scatter_gather" and not exact and shape is None:
        p = _chunk_plan(codec, n, k)
        seeds = list(seeds) if seeds else [0] * (k + 1)
        send = _sg_encode(p, comp, rank, residual, seeds)
        recv = torch.empty(sum(p.recv_splits(rank)), dtype=torch.uint8, device=x.device)
        C.all_to_all_v(recv, send, p.send_splits(rank), p.recv_splits(rank), group)
        own, gathered = _sg_middle(p, codec, comp, recv, rank, op, residual, seeds[k])
        C.all_gather(gathered, own, group)
        _sg_finish(p, gathered, x)
    else:
        raise ValueError(f"lowbit: exchange_now runs scatter_gather and allgather, not {algorithm!r}"
                         f"{' with riders or a shape' if algorithm == 'scatter_gather' else ''}")
    if prev is not None:
        restore_unless_finite(residual, prev, x[:n])  # type: ignore[arg-type]


def bytes_now(codec: Codec, algorithm: str, n: int, k: int, rank: int, exact: int = 0,
              shape: tuple[int, ...] | None = None) -> int:
    """Bytes one :func:`exchange_now` call sends from ``rank`` (what the async path counts)."""
    if algorithm == "allgather":
        return (k - 1) * (_slot(codec, n, shape)[1] + (_up(4 * exact) if exact else 0))
    p = _chunk_plan(codec, n, k)
    return sum(p.send_splits(rank)) + (k - 1) * p.width


# ------------------------------------------------------------------------------ the registry's entries
# start(call) and bytes_per_rank(codec, n, k, rank, exact, node_size, shape), as every AlgorithmPlugin
# has them.
def _coded(x: torch.Tensor, exact: int, residual: torch.Tensor | None, out: torch.Tensor,
           post: Callable[[], torch.Tensor] | None
           ) -> tuple[int, torch.Tensor, Callable[[], torch.Tensor] | None, torch.futures.Future | None]:
    """What the coded algorithms share before they send: ``(n, comp, post, done)``, n the values to code,
    ``comp`` what is encoded (with the residual added), ``post`` guarding the residual against a
    non-finite result, and ``done`` the finished future when there is nothing to send (else None)."""
    n = x.numel() - exact
    comp = x[:n] if residual is None else x[:n] + residual
    if residual is not None and n:
        post = _guard_residual(residual, out, n, post)
    if n == 0 and not exact:
        if out.data_ptr() != x.data_ptr():
            out.copy_(x)
        return n, comp, post, C.done(out if post is None else post(), x.device)
    return n, comp, post, None


def _start_allgather(c: Call) -> torch.futures.Future:
    n, comp, post, done = _coded(c.x, c.exact, c.residual, c.out, c.post)
    if done is not None:
        return done
    rank, k = c.world
    return _allgather(c.x, comp, n, c.exact, c.codec, c.group, c.op, rank, k, c.residual, c.seed, c.stats, c.out,
                      post, c.shape if c.shape is not None else c.codec.flat_shape(n))


def _start_scatter_gather(c: Call) -> torch.futures.Future:
    n, comp, post, done = _coded(c.x, 0, c.residual, c.out, c.post)
    if done is not None:
        return done
    rank, k = c.world
    return _scatter_gather(comp, c.codec, c.group, c.op, rank, k, c.residual, c.seed, c.stats, c.out, post)


def _start_native(c: Call) -> torch.futures.Future:
    return _native(c.x, c.codec, c.group, c.op, c.world[1], c.stats, c.out, c.post)


def _start_simulated(c: Call) -> torch.futures.Future:
    # (riders: part of x, simulated too)
    return _simulated(c.x, c.codec, c.group, c.world[1], c.stats, c.out, c.post, c.shape)


def _bytes_allgather(codec: Codec, n: int, k: int, rank: int, exact: int, node_size: int | None,
                     shape: tuple[int, ...] | None) -> int:
    return (k - 1) * (_slot(codec, n, shape)[1] + _up(4 * exact))


def _bytes_scatter_gather(codec: Codec, n: int, k: int, rank: int, exact: int, node_size: int | None,
                          shape: tuple[int, ...] | None) -> int:
    slots = [_slot(codec, c)[1] for c in chunk_sizes(n, k)]
    return sum(s for i, s in enumerate(slots) if i != rank) + (k - 1) * max(slots)


def _bytes_native(codec: Codec, n: int, k: int, rank: int, exact: int, node_size: int | None,
                  shape: tuple[int, ...] | None) -> int:
    return int(2 * (k - 1) * codec.nbytes(n, codec.flat_shape(n)) // k)


def _bytes_simulated(codec: Codec, n: int, k: int, rank: int, exact: int, node_size: int | None,
                     shape: tuple[int, ...] | None) -> int:
    return int(2 * (k - 1) * simulated_numel(codec, n + exact, shape) * 4 // k)


register_algorithm("scatter_gather", AlgorithmPlugin(
    start=_start_scatter_gather, bytes_per_rank=_bytes_scatter_gather, flat=True,
    doc="all-to-all of encoded chunks, sum per chunk, all-gather of the re-encoded sums: ~2 payloads per rank"))
register_algorithm("allgather", AlgorithmPlugin(
    start=_start_allgather, bytes_per_rank=_bytes_allgather, flat=True, exact=True,
    doc="every rank's whole payload to every rank, each decodes and sums all K: (K-1) payloads per rank"))
register_algorithm("allreduce", AlgorithmPlugin(
    start=_start_native, bytes_per_rank=_bytes_native, flat=True, quantised=False,
    doc="the native allreduce in fp32, fp16 or bf16 (codecs that sum on the wire only)"))
register_algorithm(SIMULATED, AlgorithmPlugin(
    start=_start_simulated, bytes_per_rank=_bytes_simulated, flat=True, exact=True,
    doc="Grubic et al.'s simulated low-precision NCCL: an fp32 allreduce of the codec's wire size; speed only, "
        "the tensor is not reduced"))
