"""The one thin wrapper over torch.distributed: every backend difference lives here.

* gloo wants flat outputs for ``all_gather_into_tensor`` (``(world*n,)``, not ``(world, n)``).
* gloo and NCCL both move ``uint8``; MPI builds of torch may not, so payloads are viewed as they are.
* Results are always read from buffers we allocated, never from a Work's/future's value (whose layout
  differs between gloo and NCCL — the weak spot of PyTorch's built-in quantization hook).
* A failed or timed-out collective surfaces as :class:`CollectiveError` naming the operation, the rank
  and the cause, instead of a bare backend message or a hang.
* :func:`emulate_link` (CPU / gloo): a slow network (a bandwidth and a per-message latency) for this
  process's lowbit collectives, to study compression where the real link is a fast loopback.
"""

from __future__ import annotations

import atexit
import collections
import ctypes
import functools
import hashlib
import os
import threading
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from lowbit.comm.groups import PerGroup
from lowbit.comm.threads import Worker

__all__ = ["CollectiveError", "Deferred", "capturing", "world", "all_to_all_async", "all_gather_async",
           "all_reduce_async", "reduce_scatter_async", "all_to_all", "all_gather", "all_reduce", "reduce_scatter",
           "then", "join",
           "wait", "done", "all_gather_object",
           "emulate_link", "link_emulated", "through_link", "check_call", "CHECK_CALLS", "issued"]


class CollectiveError(RuntimeError):
    """A collective failed: a peer died, the network broke, or the group's timeout expired."""


def world(group: dist.ProcessGroup | None) -> tuple[int, int]:
    """(rank, world size) within ``group``; (0, 1) when torch.distributed is not initialised."""
    if not dist.is_available() or not dist.is_initialized():
        if group is not None:
            raise ValueError("a process group was given but torch.distributed is not initialised")
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def _fail(op: str, group: dist.ProcessGroup | None | tuple[int, int], exc: BaseException) -> CollectiveError:
    """The error of a failed ``op`` on ``group`` (or on the (rank, size) read from it before)."""
    rank, size = group if isinstance(group, tuple) else world(group)
    return CollectiveError(
        f"lowbit: {op} failed on rank {rank} of {size} ({type(exc).__name__}: {exc}). A peer process may "
        "have died or the group's timeout expired; check the other ranks' logs."
    )


# ------------------------------------------------------------------------------ asynchronous ops
# Every op below is *issued* on the calling thread before it returns (so collectives keep the caller's
# program order, like torch's own) and returns a torch future. ``then`` runs a callback once the op has
# completed: on CUDA right away, on a pool stream that waits for the op (NCCL completes futures at
# enqueue time), on CPU on lowbit's completion thread when the data has arrived (never on the backend's
# own thread: :func:`on_lowbit_thread` says why). Callbacks never issue collectives (that would break
# the order) and never wait for another op's callback.


def done(value: object, device: torch.device) -> torch.futures.Future:
    """A future that is already complete with ``value`` (world size 1, nothing to send)."""
    fut: torch.futures.Future = torch.futures.Future(devices=[device] if device.type == "cuda" else None)
    fut.set_result(value)
    return fut


def capturing() -> bool:
    """Whether the calling thread's current CUDA stream is being captured into a CUDA graph."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


class Deferred:
    """What :func:`then` returns while a CUDA graph is being captured: ``fn()`` runs when the result is
    waited for, on the waiting stream, after a stream wait on ``work``. (A future's callback would run
    on a pool stream outside the capture, and its events cannot be waited on inside it.) ``wait()`` and
    ``value()`` return ``fn()``'s value, computed once."""

    __slots__ = ("work", "fn", "op", "group", "_done", "_value")

    def __init__(self, work: object, fn: Callable[[], object], op: str, group: dist.ProcessGroup | None) -> None:
        self.work, self.fn, self.op, self.group = work, fn, op, group
        self._done, self._value = False, None

    def wait(self) -> object:
        if not self._done:
            if isinstance(self.work, Deferred):  # a chained callback: its own errors are its own
                self.work.wait()
            else:
                try:
                    self.work.wait()  # type: ignore[attr-defined]  # a stream wait on NCCL: captured
                except CollectiveError:
                    raise
                except Exception as exc:  # noqa: BLE001 — re-raised with context
                    raise _fail(self.op, self.group, exc) from exc
            self._value, self._done = self.fn(), True
        return self._value

    value = wait

    def done(self) -> bool:
        return self._done

    def then(self, cb: Callable[["Deferred"], object]) -> "Deferred":
        """As torch's ``Future.then``: ``cb(self)``, run when the result is waited for."""
        return Deferred(self, lambda: cb(self), self.op, self.group)


def then(work: object, fn: Callable[[], object], op: str,
         group: dist.ProcessGroup | None) -> torch.futures.Future | Deferred:
    """Future of ``fn()`` run after ``work`` (a torch Work, or a future of lowbit's: already complete, or
    the emulated link's) completed: on CPU on lowbit's completion thread (:func:`on_lowbit_thread`).
    A failed op surfaces as :class:`CollectiveError` naming it. During CUDA graph capture: a
    :class:`Deferred` (``fn()`` runs when waited for)."""
    if capturing():
        return Deferred(work, fn, op, group)
    mine = isinstance(work, torch.futures.Future)  # lowbit's own (done, or the emulated link's)
    fut = work if mine else work.get_future()  # type: ignore[attr-defined]
    # The callback must not hold the group (it may be freed after the job destroyed the group, and a
    # group freed on its own backend thread cannot join that thread): only its rank and size.
    where = world(group)

    after = fut if mine else on_lowbit_thread(fut)
    read = fut.value if after is fut else fut.wait  # (complete by now; wait(): this stream waits for its events)

    def cb(_: torch.futures.Future) -> object:
        try:
            read()
        except Exception as exc:  # noqa: BLE001 — re-raised with context
            raise _fail(op, where, exc) from exc
        return fn()

    return after.then(cb)


def _complete_job(job: tuple) -> None:
    fut, trigger = job
    try:
        fut.wait()  # (the host waits, the GIL released; an error is read again by the callback)
    except Exception:  # noqa: BLE001 — handed on: the callback raises it with context
        pass
    trigger.set_result(None)  # the callbacks chained on it run here, on this thread


#: lowbit's completion thread (lowbit.comm.threads: joined at interpreter exit and before the group goes)
_COMPLETION_WORKER = Worker("lowbit-completion", _complete_job)


def on_lowbit_thread(fut: torch.futures.Future) -> torch.futures.Future:
    """``fut`` (a backend's future), or where it is not complete yet, a future that lowbit's completion
    thread completes once ``fut`` has: whatever is chained on it runs on that thread, in issue order.

    Why not on the backend's thread, where ``fut.then`` would run it: a Python callback there runs on a
    C++ thread (gloo's worker) that the interpreter cannot join. When the callback completes the future
    the caller waits for (DDP's reducer, the last bucket of the step), the caller may go on to exit while
    that thread still has to take the GIL back (returning from ``set_result``, freeing the callback). At
    interpreter exit CPython ends such a thread with ``pthread_exit``, whose unwinding through a C++
    ``noexcept`` frame (pybind11's ``gil_scoped_release``) is ``std::terminate``: "terminate called without
    an active exception", SIGABRT after the work was done (issue 44: 4 of 12 resumed 2-rank onebit runs).
    lowbit's own thread is joined at exit (:func:`lowbit.comm.threads.stop_all`, an ``atexit`` handler)
    before the interpreter finalises, so the chain always runs to its end. NCCL completes its futures at
    enqueue time, so on CUDA the callbacks still run at once on the issuing thread, as before."""
    if fut.done():
        return fut
    # (CUDA tensors on gloo: the callbacks run on streams of these devices and their future records events)
    cuda = torch.cuda.is_initialized()
    trigger: torch.futures.Future = torch.futures.Future(
        devices=[torch.device("cuda", i) for i in range(torch.cuda.device_count())] if cuda else None)
    _COMPLETION_WORKER.put((fut, trigger))
    return trigger


def join(futs: list[torch.futures.Future], value: Callable[[], object], device: torch.device) -> torch.futures.Future:
    """Future of ``value()``, completed once every future in ``futs`` has, and ordered after all of their
    device work: whoever waits on it (DDP's reducer) waits for every one of them.

    ``torch.futures.collect_all`` cannot do this on CUDA: its future holds no tensors, so it records no
    CUDA events, and a stream that waits on it (or on a ``.then`` of it) does not wait for the work of
    the futures it collected (on 2 GPUs the DDP hook read half-decoded buckets: replicas drifted apart).
    Here each input's callback runs on a stream that waited for that input (``then``'s contract), records
    an event there, and the last one makes its stream wait for all the events before completing the
    result with ``value()`` (a tensor's events are then recorded after them). A failed input fails it."""
    if any(isinstance(f, Deferred) for f in futs):
        raise RuntimeError("lowbit: collectives issued inside a CUDA graph capture cannot be joined into one "
                           "future (DDP's hook cannot be captured); wait for each instead")
    cuda = device.type == "cuda"
    res: torch.futures.Future = torch.futures.Future(devices=[device] if cuda else None)
    lock = threading.Lock()
    left = [len(futs)]
    events: list[torch.cuda.Event] = []
    errors: list[BaseException] = []

    def cb(f: torch.futures.Future) -> None:
        try:
            f.value()
        except Exception as exc:  # noqa: BLE001 — passed on to the result
            with lock:
                errors.append(exc)
        ev = None
        if cuda:
            ev = torch.cuda.Event()
            ev.record(torch.cuda.current_stream(device))
        with lock:
            if ev is not None:
                events.append(ev)
            left[0] -= 1
            last = left[0] == 0
        if not last:
            return
        if errors:
            res.set_exception(errors[0])
            return
        try:
            if cuda:
                stream = torch.cuda.current_stream(device)
                for e in events:
                    stream.wait_event(e)
            res.set_result(value())
        except Exception as exc:  # noqa: BLE001
            res.set_exception(exc)

    if not futs:
        res.set_result(value())
    for f in futs:
        f.then(cb)
    return res


#: collectives this process issued through this module (payloads, per-call checks, PyTorch's hooks sent
#: across the emulated link): :func:`issued`
_ISSUED = [0]


def issued() -> int:
    """How many collectives this process has issued through lowbit's wrapper so far: every payload
    exchange, every per-call check of :func:`check_call` (one on CPU per call), and PyTorch's own hooks'
    collectives sent across the emulated link (:func:`through_link`). A slow link pays its latency once
    per collective: the study records it per step (``collectives_per_step``) for the speed model."""
    return _ISSUED[0]


def _issue(op: str, group: dist.ProcessGroup | None, call: Callable[[], object], nbytes: int = 0,
           tensors: tuple[torch.Tensor, ...] = ()) -> object:
    _ISSUED[0] += 1
    if _LINK["bytes_per_s"] is not None:
        return _via_link(op, group, call, nbytes, tensors)
    try:
        work = call()
    except Exception as exc:  # noqa: BLE001 — re-raised with context
        raise _fail(op, group, exc) from exc
    _HELD.add(work, tensors)
    return work


# ------------------------------------------------------------------------------ tensors a backend holds
class _Held:
    """The tensors handed to a CPU backend's collectives, referenced from Python until the backend's
    thread has let go of them, and never freed once the interpreter exits.

    Why (issue 44, the second cause of the abort at exit): gloo's worker thread completes a Work's future
    and only then destroys the Work, which holds the op's tensors. A tensor whose Python object died in
    between (lowbit's callback ran and dropped its buffers) is kept alive by the Work with its Python
    object handed to C++, and the Work's destructor must take the GIL to free that object. When the
    interpreter is finalising by then, CPython ends gloo's thread with ``pthread_exit`` inside that
    destructor: "terminate called without an active exception" (a core: ``~AsyncAllgatherWork`` ->
    ``decref_pyobject`` -> ``take_gil`` -> ``pthread_exit``). Nothing in Python can tell when gloo's
    thread has let go, so an op's tensors stay referenced here until the op and the ``keep`` ops issued
    after it have completed (gloo lets go microseconds after completing: a thread held up longer only
    takes the GIL, harmless while the interpreter runs), and at exit (:meth:`keep_forever`, an ``atexit`` handler) whatever is
    still here is never freed: the process ends with it. CUDA tensors are not held (NCCL runs no
    Python-owned tensor's destructor on its threads in the ops lowbit issues; holding them would delay
    the caching allocator)."""

    def __init__(self, keep: int = 2) -> None:
        self.keep = keep
        self._lock = threading.Lock()
        self._ops: collections.deque = collections.deque()
        self.exiting = False

    def add(self, work: object, tensors: tuple[torch.Tensor, ...]) -> None:
        """Hold ``tensors`` of the op ``work`` (None: complete already) if any is on the CPU."""
        if not any(t.device.type == "cpu" for t in tensors):
            return
        with self._lock:
            ops = self._ops
            ops.append((work, tensors))
            if self.exiting:
                return
            while len(ops) > self.keep and all(_completed(ops[i][0]) for i in range(self.keep + 1)):
                ops.popleft()
            while len(ops) > _HELD_MOST:  # (an op that never completes must not keep every later one)
                ops.popleft()

    def keep_forever(self) -> None:
        """From now on nothing held is freed, not even by the interpreter's finalisation."""
        with self._lock:
            self.exiting = True
            ctypes.pythonapi.Py_IncRef(ctypes.py_object(self._ops))


def _completed(work: object) -> bool:
    if work is None:
        return True
    done_ = getattr(work, "is_completed", None) or getattr(work, "done", None)
    return bool(done_()) if done_ is not None else True


#: the most ops :class:`_Held` holds, complete or not
_HELD_MOST = 64
_HELD = _Held()
atexit.register(_HELD.keep_forever)


# ------------------------------------------------------------------------------------------ emulated link
_LINK: dict = {"bytes_per_s": None, "latency_s": 0.0}


def emulate_link(bytes_per_s: float | None, latency_s: float = 0.0) -> None:
    """Make this process's lowbit collectives cross an emulated link of ``bytes_per_s`` and a one-way
    ``latency_s`` per message (None: the real link again). Each collective is issued, in program order, by
    one link thread that runs it, waits for it and then holds the link for ``latency_s + bytes sent /
    bytes_per_s`` (what this rank puts on the wire: the tensor it contributes; one latency per collective,
    what a direct exchange between two sites pays, where a ring of K ranks would pay K-1 or 2(K-1)); the
    caller is not blocked, as beside a real network. For CPU tensors on gloo (a study of slow links on one
    machine); every rank of a group should emulate the same link. DDP's own C++ allreduce does not pass
    here: register lowbit's hook to send fp32 across the emulated link too."""
    if bytes_per_s is not None and not (isinstance(bytes_per_s, (int, float)) and bytes_per_s > 0):
        raise ValueError(f"emulated link speed must be a number of bytes/s > 0 or None, got {bytes_per_s!r}")
    if isinstance(latency_s, bool) or not isinstance(latency_s, (int, float)) or not 0 <= latency_s < float("inf"):
        raise ValueError(f"emulated link latency must be a finite number of seconds >= 0, got {latency_s!r}")
    _LINK["bytes_per_s"] = None if bytes_per_s is None else float(bytes_per_s)
    _LINK["latency_s"] = 0.0 if bytes_per_s is None else float(latency_s)


def _link_job(job: tuple) -> None:
    call, nbytes, fut, op, group, tensors = job
    try:
        work = call()
        _HELD.add(work, tensors)
        work.wait()  # a Work or a Future: both wait
        bps = _LINK["bytes_per_s"]
        if bps:
            time.sleep(_LINK["latency_s"] + nbytes / bps)
        fut.set_result(None)
    except Exception as exc:  # noqa: BLE001 — handed to whoever waits, with context
        fut.set_exception(_fail(op, group, exc))


#: the link thread (lowbit.comm.threads: started on the first collective, stopped before the group goes)
_LINK_WORKER = Worker("lowbit-emulated-link", _link_job)


def _via_link(op: str, group: dist.ProcessGroup | None, call: Callable[[], object], nbytes: int,
              tensors: tuple[torch.Tensor, ...] = ()) -> object:
    fut: torch.futures.Future = torch.futures.Future()
    _LINK_WORKER.put((call, nbytes, fut, op, group, tensors))
    return fut


def link_emulated() -> bool:
    """Whether this process's collectives cross an emulated link (:func:`emulate_link`)."""
    return _LINK["bytes_per_s"] is not None


def through_link(fut: torch.futures.Future, nbytes: int, op: str = "all_reduce",
                 group: dist.ProcessGroup | None = None) -> torch.futures.Future:
    """A collective issued elsewhere (PyTorch's own DDP hooks) across the emulated link: the link thread
    waits for ``fut``, then holds the link for ``nbytes`` (what this rank sent), in FIFO order with
    lowbit's collectives; the returned future carries ``fut``'s value. ``fut`` itself when no link is
    emulated."""
    if _LINK["bytes_per_s"] is None:
        return fut
    _ISSUED[0] += 1
    held = _via_link(op, group, lambda: fut, nbytes)
    return held.then(lambda _: fut.value())


def all_to_all_async(recv: torch.Tensor, send: torch.Tensor, send_splits: list[int], recv_splits: list[int],
                     group: dist.ProcessGroup | None) -> object:
    """Issue the byte exchange (rank r's chunk i goes to rank i) into ``recv``; returns the Work."""
    if len(send_splits) == 1:  # world size 1
        recv.copy_(send[: recv.numel()])
        return done(None, recv.device)
    return _issue("all_to_all_single", group, lambda: dist.all_to_all_single(
        recv, send, recv_splits, send_splits, group=group, async_op=True), send.numel() * send.element_size(),
        (recv, send))


def all_gather_async(recv: torch.Tensor, send: torch.Tensor, group: dist.ProcessGroup | None) -> object:
    """Issue the all-gather of equally sized 1-D ``send`` into flat ``recv`` (rank order); the Work."""
    _, size = world(group)
    if size == 1:
        recv.copy_(send)
        return done(None, recv.device)
    return _issue("all_gather_into_tensor", group, lambda: _gather_fn(recv, send, group=group, async_op=True),
                  send.numel() * send.element_size(), (recv, send))


def all_reduce_async(t: torch.Tensor, group: dist.ProcessGroup | None) -> object:
    """Issue the in-place native sum allreduce (fp32/fp16/bf16 only: never quantised bytes)."""
    _, size = world(group)
    if size == 1:
        return done(None, t.device)
    return _issue("all_reduce", group, lambda: dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group, async_op=True),
                  t.numel() * t.element_size(), (t,))


def reduce_scatter_async(out: torch.Tensor, inp: torch.Tensor, group: dist.ProcessGroup | None,
                         op: object = None) -> object:
    """Issue the native reduce-scatter of flat ``inp`` (``world * out.numel()`` values) into ``out`` (this
    rank's chunk), a sum unless ``op`` says otherwise (torch's ReduceOp: FSDP passes AVG or PREMUL_SUM);
    returns the Work (gloo's has no future: :func:`wait` on it)."""
    _, size = world(group)
    if size == 1:
        out.copy_(inp[: out.numel()])
        return done(None, out.device)
    op = dist.ReduceOp.SUM if op is None else op
    return _issue("reduce_scatter_tensor", group, lambda: _scatter_fn(out, inp, group=group, op=op, async_op=True),
                  inp.numel() * inp.element_size(), (out, inp))


def _complete(op: str, group: dist.ProcessGroup | None, fn: Callable[[bool], object], nbytes: int,
              link: bool = True, tensors: tuple[torch.Tensor, ...] = ()) -> None:
    """Run a collective as torch's ``async_op=False`` does (``fn(async_op)`` issues it): on gloo it has
    finished when this returns; on NCCL (torch >= 2.8) it is queued on the caller's current stream, ordered
    before whatever that stream runs next, with no hop to the process group's internal stream and back
    (issued async, a collective goes there, and FSDP's reduce-scatter and all-gather on one group would
    both queue on that one stream). A timeout then surfaces as NCCL's watchdog reports it, as for FSDP's
    own collectives. Across an emulated link it is issued async to the link thread and waited for (unless
    ``link`` is False: a collective that the emulation leaves out)."""
    _ISSUED[0] += 1
    if link and _LINK["bytes_per_s"] is not None:
        wait(_via_link(op, group, lambda: fn(True), nbytes, tensors), op, group)
    else:
        try:
            fn(False)
        except Exception as exc:  # noqa: BLE001 — re-raised with context
            raise _fail(op, group, exc) from exc
        _HELD.add(None, tensors)  # (gloo's thread may still hold the finished Work: see _Held)


def all_to_all(recv: torch.Tensor, send: torch.Tensor, group: dist.ProcessGroup | None) -> None:
    """The equal-split byte exchange of :func:`all_to_all_async`, run synchronously (:func:`_complete`)."""
    if world(group)[1] == 1:
        recv.copy_(send[: recv.numel()])
        return
    _complete("all_to_all_single", group, lambda a: dist.all_to_all_single(recv, send, group=group, async_op=a),
              send.numel() * send.element_size(), tensors=(recv, send))


def all_to_all_v(recv: torch.Tensor, send: torch.Tensor, send_splits: list[int], recv_splits: list[int],
                 group: dist.ProcessGroup | None) -> None:
    """The byte exchange of :func:`all_to_all_async` with its split lists, run synchronously
    (:func:`_complete`)."""
    if len(send_splits) == 1:
        recv.copy_(send[: recv.numel()])
        return
    _complete("all_to_all_single", group, lambda a: dist.all_to_all_single(
        recv, send, recv_splits, send_splits, group=group, async_op=a), send.numel() * send.element_size(),
        tensors=(recv, send))


def all_gather(recv: torch.Tensor, send: torch.Tensor, group: dist.ProcessGroup | None,
               link: bool = True) -> None:
    """:func:`all_gather_async`, run synchronously (:func:`_complete`; ``link``: as there)."""
    if world(group)[1] == 1:
        recv.copy_(send)
        return
    _complete("all_gather_into_tensor", group, lambda a: _gather_fn(recv, send, group=group, async_op=a),
              send.numel() * send.element_size(), link, (recv, send))


def all_reduce(t: torch.Tensor, group: dist.ProcessGroup | None) -> None:
    """:func:`all_reduce_async` (an in-place native sum), run synchronously (:func:`_complete`)."""
    if world(group)[1] == 1:
        return
    _complete("all_reduce", group, lambda a: dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group, async_op=a),
              t.numel() * t.element_size(), tensors=(t,))


def reduce_scatter(out: torch.Tensor, inp: torch.Tensor, group: dist.ProcessGroup | None,
                   op: object = None) -> None:
    """:func:`reduce_scatter_async`, run synchronously (:func:`_complete`)."""
    if world(group)[1] == 1:
        out.copy_(inp[: out.numel()])
        return
    rop = dist.ReduceOp.SUM if op is None else op
    _complete("reduce_scatter_tensor", group, lambda a: _scatter_fn(out, inp, group=group, op=rop, async_op=a),
              inp.numel() * inp.element_size(), tensors=(out, inp))


def wait(fut: object, op: str, group: dist.ProcessGroup | None) -> object:
    """``fut.wait()`` on a torch Future or Work, with any failure as :class:`CollectiveError` (the callback
    chain loses the type). On CUDA a Work's wait makes the current stream wait, not the host."""
    try:
        return fut.wait()
    except CollectiveError:
        raise
    except Exception as exc:  # noqa: BLE001
        msg = str(exc)
        if "lowbit:" in msg:
            raise CollectiveError(msg[msg.index("lowbit:"):].strip()) from exc
        raise _fail(op, group, exc) from exc


# torch >= 2.12 renames all_gather_into_tensor / reduce_scatter_tensor to all_gather_single /
# reduce_scatter_single (the old names warn).
_gather_fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_scatter_fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def all_gather_object(obj: object, group: dist.ProcessGroup | None) -> list[object]:
    _, size = world(group)
    if size == 1:
        return [obj]
    out: list[object] = [None] * size
    try:
        dist.all_gather_object(out, obj, group=group)
    except Exception as exc:  # noqa: BLE001
        raise _fail("all_gather_object", group, exc) from exc
    return out


# ------------------------------------------------------------------------------------ per-call check
#: Whether every call's fingerprint is checked (:func:`check_call`). ``LOWBIT_CHECK_CALLS=0`` turns the
#: check off, for measuring what it costs only (benchmarks/bench_agreement.py): ranks that then call
#: differently may hang, abort or get silently different results.
CHECK_CALLS = os.environ.get("LOWBIT_CHECK_CALLS", "1").strip() != "0"

#: CUDA: the ranks compare a rolling fingerprint of every call once per this many calls of a group
#: (one small all-gather each time, its cost shared by the calls), and read each comparison on the host
#: :data:`CHECK_LAG` comparisons later, by then long done (:func:`check_call`).
CHECK_EVERY = 8
CHECK_LAG = 2
_MASK = (1 << 63) - 1


class _Pending:
    """A group's CUDA check state: the calls of the window being filled (their fingerprints folded into
    ``rolling``), and a ring of ``CHECK_LAG`` comparisons in flight (pinned rows of the k gathered
    fingerprints, the event recorded after the copy, the window's fingerprint and calls). Buffers are
    allocated once per group."""

    def __init__(self, k: int, device: torch.device) -> None:
        n = max(1, CHECK_LAG)
        self.mine = torch.empty(1, dtype=torch.int64, device=device)
        self.theirs = torch.empty(k, dtype=torch.int64, device=device)
        self.host = torch.empty((n, k), dtype=torch.int64, pin_memory=True)
        self.events = [torch.cuda.Event() for _ in range(n)]
        self.checks: list[tuple[int, list[tuple]] | None] = [None] * n
        self.count = 0  # comparisons issued
        self.rolling = 0
        self.window: list[tuple] = []

    def add(self, fp: int, fields: tuple) -> None:
        self.rolling = (self.rolling * 1000003 + fp) & _MASK  # order matters: a swap of two calls differs
        self.window.append(fields)


#: the CUDA call checks' state per process group (dropped with it: lowbit.comm.groups)
_PENDING: PerGroup[_Pending] = PerGroup()


@functools.lru_cache(maxsize=4096)
def _fingerprint(fields: tuple) -> int:
    """A signed 64-bit hash of ``fields`` (their repr: strings and numbers), the same in every process;
    cached, since a training loop repeats the same few calls."""
    return int.from_bytes(hashlib.blake2b(repr(fields).encode(), digest_size=8).digest(), "little", signed=True)


def _mismatch(group: dist.ProcessGroup | None, what: str, fields: tuple,
              describe: Callable[[tuple], str]) -> CollectiveError:
    """Every rank has seen the same fingerprints differ: they all gather each other's call and raise the
    same error, one line per rank."""
    theirs = all_gather_object(fields, group)
    lines = "\n".join(f"  rank {r}: {describe(t)}" for r, t in enumerate(theirs))  # type: ignore[arg-type]
    return CollectiveError(f"lowbit: the ranks called {what} differently:\n{lines}")


def _first_difference(theirs: list[list[tuple]]) -> tuple[int, list[tuple | None]]:
    """The first call of a window at which the ranks' calls differ, and each rank's call there."""
    longest = max(len(w) for w in theirs)
    for i in range(longest):
        calls = [w[i] if i < len(w) else None for w in theirs]
        if any(c != calls[0] for c in calls):
            return i, calls
    return longest, [None] * len(theirs)  # the same calls with different fingerprints: cannot happen


def _read(group: dist.ProcessGroup | None, what: str, describe: Callable[[tuple], str], p: _Pending,
          slot: int) -> None:
    """Read comparison ``slot``; on a mismatch every rank (all read the same comparison at the same
    call) gathers the window's calls and raises the same error naming the first call that differs."""
    check = p.checks[slot]
    if check is None:
        return
    p.checks[slot] = None
    p.events[slot].synchronize()
    if bool((p.host[slot] != check[0]).any()):
        theirs = all_gather_object(check[1], group)
        i, calls = _first_difference(theirs)  # type: ignore[arg-type]
        lines = "\n".join(f"  rank {r}: {describe(c) if c is not None else '(no such call)'}"
                          for r, c in enumerate(calls))
        raise CollectiveError(f"lowbit: the ranks called {what} differently (call {i + 1} of the "
                              f"{max(len(w) for w in theirs)} checked together; the error comes up to "
                              f"{CHECK_EVERY * (CHECK_LAG + 1)} calls late on CUDA):\n{lines}")


def _compare(group: dist.ProcessGroup | None, what: str, describe: Callable[[tuple], str], p: _Pending) -> None:
    """Start the comparison of the window filled so far: all-gather its rolling fingerprint into the
    pinned ring (no host wait), reading first the comparison whose slot it takes."""
    slot = p.count % len(p.checks)
    _read(group, what, describe, p, slot)
    p.mine.fill_(p.rolling)
    work = all_gather_async(p.theirs, p.mine, group)
    work.wait()  # type: ignore[union-attr]  # NCCL: the current stream waits, not the host
    p.host[slot].copy_(p.theirs, non_blocking=True)
    p.events[slot].record()
    p.checks[slot] = (p.rolling, p.window)
    p.count += 1
    p.rolling, p.window = 0, []


def flush_checks(group: dist.ProcessGroup | None = None, what: str = "all_reduce",
                 describe: Callable[[tuple], str] = repr) -> None:
    """Compare the calls of ``group`` not yet compared and read every comparison in flight (waits for
    them), raising the :class:`CollectiveError` of the first mismatch. Every rank must call it at the
    same point (e.g. at the end of a run)."""
    p = _PENDING.get(group)
    if p is None:
        return
    if p.window:
        _compare(group, what, describe, p)
    n = len(p.checks)
    for i in range(n):
        _read(group, what, describe, p, (p.count + i) % n)


def check_call(group: dist.ProcessGroup | None, what: str, fields: tuple, describe: Callable[[tuple], str],
               device: torch.device) -> None:
    """Ranks must make every call of ``what`` alike (``fields``: codec, algorithm, op, numel, ...); the
    ranks compare 64-bit fingerprints of their ``fields``.

    CPU: the host compares them now; on a mismatch every rank raises the same :class:`CollectiveError`
    listing each rank's call (``describe``), before the payloads, whose sizes may differ, are sent.
    CUDA: each call's fingerprint is folded into a rolling one, which the ranks all-gather once every
    :data:`CHECK_EVERY` calls into pinned memory (no host wait; ~0.1 ms a time on 2x H200, shared by the
    calls); the host reads each comparison :data:`CHECK_LAG` comparisons later, when it is long done.
    Every rank reads the same comparison at the same call, so on a mismatch all gather their calls and
    raise the same error naming the first call that differed; it comes up to ``CHECK_EVERY *
    (CHECK_LAG + 1)`` calls late (and a payload size that differs may make NCCL fail or hang first).
    :func:`flush_checks` compares and reads everything still open (a host synchronisation)."""
    _, k = world(group)
    if k == 1 or not CHECK_CALLS:
        return
    fp = _fingerprint(fields)
    if device.type == "cuda":
        if torch.cuda.is_current_stream_capturing():
            # a CUDA graph records the collectives once (the eager step before it made them, checked) and
            # replays them as recorded: nothing to compare, and no host read may happen inside a capture
            return
        p = _PENDING.get(group)
        if p is None or p.theirs.numel() != k or p.theirs.device != device:
            p = _PENDING.set(group, _Pending(k, device))
        p.add(fp, fields)
        if len(p.window) >= CHECK_EVERY:
            _compare(group, what, describe, p)
        return
    mine = torch.full((1,), fp, dtype=torch.int64)
    theirs = torch.empty(k, dtype=torch.int64)
    wait(all_gather_async(theirs, mine, group), "all_gather_into_tensor", group)
    if bool((theirs != fp).any()):
        raise _mismatch(group, what, fields, describe)
