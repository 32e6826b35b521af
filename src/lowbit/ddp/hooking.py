"""lowbit.ddp's comm hook: :func:`hook`, the bucket's work (:func:`_issue`) and the hook thread.

No ``from __future__ import annotations`` here: DDP inspects the hook's annotations at registration."""

import logging
import os
import threading
from typing import Dict, Optional

import torch
import torch.distributed as dist

from lowbit.comm import collectives as C
from lowbit.comm.allreduce import start
from lowbit.comm.threads import Worker
from lowbit.ddp.config import _FP32
from lowbit.ddp.messages import _ON_SIDE_STREAM, _Layout, _copy_all, _plan_groups, _remember
from lowbit.ddp.state import LowbitState

log = logging.getLogger("lowbit.ddp")


def _bucket_capturing(bucket: dist.GradBucket) -> bool:
    """Whether the bucket's CUDA stream is being captured into a graph (never on CPU)."""
    return bucket.buffer().is_cuda and C.capturing()


def hook(state: LowbitState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook: low-precision mean of the bucket's gradients across the group."""
    error = getattr(state, "error", None)
    if error is not None:  # an earlier collective failed: raised with its own type (DDP disguised it)
        raise error
    if _bucket_capturing(bucket):
        raise RuntimeError("lowbit's DDP hook cannot run inside a CUDA graph capture (it returns futures "
                           "that DDP chains; capture the model without lowbit.ddp, or run DDP eagerly)")
    group = state.process_group
    if state._world is None:
        state._world = C.world(group)
        state._refresh_native()
    world = state._world[1]
    buf = bucket.buffer()
    if state.iter < state.start_iter or state._native:
        # Before DDP's bucket rebuild (or hierarchical inside one node, or codec="auto" measuring or with
        # fp32 everywhere): the plain fp32 allreduce, as torch's own hook does it.
        warm, st = state.iter < state.start_iter, state.stats
        calls, sent = st.calls, st.bytes_sent
        state._advance(bucket)
        fut = start(buf, _FP32, group, "allreduce", "mean", stats=st, world=state._world)
        if warm:  # counted apart too: stats.warmup_calls / warmup_bytes (CommStats)
            st.warmup_calls, st.warmup_bytes = st.warmup_calls + st.calls - calls, st.warmup_bytes + st.bytes_sent - sent
        return fut
    flat = buf.reshape(-1)
    if state._group_of is None:
        state._group_of = _plan_groups(state, world, flat.device)
    lay = state._layout(bucket, flat)
    step_seed = state.seed * 1_000_003 + state.iter * 1_009
    last = bucket.is_last()
    state._advance(bucket)
    mode = state.hook_thread
    if mode is True or (mode == "auto" and flat.is_cuda and not _inline_pays(state)):
        own = getattr(state, "_thread_group", None)
        return _HOOK_THREAD.submit(state, lay, buf, own if own is not None else group, step_seed, last)
    if flat.is_cuda:
        return _issue_on_side_stream(state, lay, buf, group, step_seed, last)
    return _issue(state, lay, buf, group, step_seed, last)


def _inline_pays(state: LowbitState) -> bool:
    """``hook_thread="auto"`` on CUDA: whether the bucket work runs inline on lowbit's side stream rather
    than on the hook thread. Inline when every message replays a CUDA graph (then a bucket's work is a
    few launches, and the hand-off to a thread and the last bucket's wait for it cost the autograd
    thread more than they save: on one H200, GPT-2 small's 8-bit step with the wire free ran at 0.88x /
    0.87x / 0.84x of plain DDP inline against 0.79x / 0.83x / 0.85x on the thread, three runs of 3-5
    rounds, benchmarks/results/overhead_1xh200_1202b/: not slower, within the noise); on the thread while any message runs its exchange eagerly (about a
    millisecond of host time a call, which the thread keeps off the backward's critical path). Decided
    once per message plan; ``stats.timing`` (its syncs) keeps the thread."""
    groups = state._group_of or {}
    seen = state._inline_for  # (the plan itself, not its id: a new plan may reuse a freed one's address)
    if seen is None or seen[0] is not groups or seen[1] != state.stats.timing:
        state._inline_for = (groups, state.stats.timing)
        state._inline = bool(groups) and all(g.graphable(state) for g in {id(g): g for g in groups.values()}.values())
    return state._inline


_SIDE_STREAMS: Dict[torch.device, "torch.cuda.Stream"] = {}


def _side_stream(device: torch.device) -> "torch.cuda.Stream":
    """lowbit's side stream of ``device`` for the bucket work issued in the hook (not the hook thread's)."""
    s = _SIDE_STREAMS.get(device)
    if s is None:
        s = _SIDE_STREAMS[device] = torch.cuda.Stream(device)
    return s


def _issue_on_side_stream(state: LowbitState, lay: _Layout, buf: torch.Tensor, group: Optional[dist.ProcessGroup],
                          step_seed: int, last: bool) -> torch.futures.Future:
    """:func:`_issue` inline, on lowbit's side stream of the bucket's device after the backward's work so
    far (the gradients are in the bucket): the backward's stream goes on with its kernels while the
    exchange runs, and its messages may replay their CUDA graphs, as on the hook thread, without a
    thread's hand-off. The future records its events on the side stream, so DDP's wait on it orders the
    gradients' use after the exchange."""
    stream = _side_stream(buf.device)
    stream.wait_stream(torch.cuda.current_stream(buf.device))
    with torch.cuda.stream(stream):
        _ON_SIDE_STREAM.on = True
        try:
            return _issue(state, lay, buf, group, step_seed, last)
        finally:
            _ON_SIDE_STREAM.on = False


def _issue(state: LowbitState, lay: _Layout, buf: torch.Tensor, group: Optional[dist.ProcessGroup], step_seed: int,
           last: bool) -> torch.futures.Future:
    """The bucket's work: copy its gradients into their messages, send the complete messages and the
    natively summed units; a future of the bucket holding the mean."""
    if torch.autograd.profiler._is_profiler_enabled:  # a range for torch.profiler, free otherwise
        with torch.autograd.profiler.record_function("lowbit.ddp.hook"):
            return _issue_bucket(state, lay, buf, group, step_seed, last)
    return _issue_bucket(state, lay, buf, group, step_seed, last)


def _issue_bucket(state: LowbitState, lay: _Layout, buf: torch.Tensor, group: Optional[dist.ProcessGroup],
                  step_seed: int, last: bool) -> torch.futures.Future:
    futs = []
    if lay.grouped:
        dst, src = [], []
        for g, name, view in lay.grouped:
            g.arrive(name, view)
            dst.append(g.slot[name])
            src.append(view)
        _copy_all(dst, src)  # this bucket's gradients into their messages' staging buffers: one fused copy
        for g in lay.groups:
            futs.append(g.fut)
            if g.arrived == g.size:
                g.send(state, group, step_seed)
    for u in lay.units:
        u.gather()
        futs.append(start(u.stage, u.codec, group, "allreduce", "mean", stats=state.stats, post=u.finisher(buf),
                          world=state._world))
    if last and state._group_of and any(g.arrived for g in state._group_of.values()):
        missing = sorted({g.index for g in state._group_of.values() if g.arrived})
        raise RuntimeError(f"lowbit: the step ended with message groups {missing} incomplete: a parameter the "
                           "state expects never reached a DDP bucket (was it frozen after register?)")
    if len(futs) == 1 and not lay.grouped:
        return futs[0]  # its value is the whole bucket, reduced in place
    return C.join(futs, lambda: buf, buf.device)  # (not collect_all: it loses the CUDA stream order)


class _HookThread:
    """One thread per process that does the compressed hook's work (:func:`_issue`) for every lowbit
    state, in the order DDP called the hook (one FIFO queue: collectives keep the same order on every
    rank, as on the calling thread). The hook returns a future at once; the job completes it with the
    bucket once the bucket's own future has (or with its error). On CUDA a job runs on a side stream of
    the bucket's device that first waits for an event recorded on the caller's stream when the hook
    was called (the gradients are in the bucket by then), and the future it completes records its
    events after that stream's work, so DDP's stream waits for everything the job did.

    The step's last bucket waits until every queued job has issued its collectives: right after it
    DDP issues a collective of its own from the autograd thread (``find_unused_parameters``: the
    used-parameter map), which must come after lowbit's on every rank. The backward pass has been
    launched by then, so the wait costs it nothing."""

    def __init__(self) -> None:
        # (lowbit.comm.threads: holds no job once done, stopped before the process group goes)
        self._worker = Worker("lowbit-ddp-hook", lambda job: self._job(*job), self._finished)
        self._idle = threading.Condition()
        self._pending = 0
        self._streams: Dict[torch.device, torch.cuda.Stream] = {}

    def _reset(self) -> None:  # in a forked child: the parent's thread does not exist there
        self.__init__()  # type: ignore[misc]

    def submit(self, state: LowbitState, lay: _Layout, buf: torch.Tensor, group: Optional[dist.ProcessGroup],
               step_seed: int, last: bool) -> torch.futures.Future:
        cuda = buf.is_cuda
        out: torch.futures.Future = torch.futures.Future(devices=[buf.device] if cuda else None)
        ready = None
        if cuda:
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(buf.device))
        with self._idle:
            self._pending += 1
        self._worker.put((state, lay, buf, group, step_seed, last, ready, out))
        if last:
            with self._idle:
                self._idle.wait_for(lambda: self._pending == 0)
        return out

    def _stream(self, device: torch.device) -> "torch.cuda.Stream":
        s = self._streams.get(device)
        if s is None:
            s = self._streams[device] = torch.cuda.Stream(device)
        return s

    def _finished(self) -> None:  # a job has run, and its objects are free
        with self._idle:
            self._pending -= 1
            if self._pending == 0:
                self._idle.notify_all()

    def _job(self, state: LowbitState, lay: _Layout, buf: torch.Tensor, group: Optional[dist.ProcessGroup],
             step_seed: int, last: bool, ready: Optional[torch.cuda.Event], out: torch.futures.Future) -> None:
        try:
            if ready is not None:
                stream = self._stream(buf.device)
                with torch.cuda.device(buf.device), torch.cuda.stream(stream):
                    stream.wait_event(ready)
                    _ON_SIDE_STREAM.on = True
                    try:
                        inner = _issue(state, lay, buf, group, step_seed, last)
                    finally:
                        _ON_SIDE_STREAM.on = False
            else:
                inner = _issue(state, lay, buf, group, step_seed, last)
        except BaseException as exc:  # noqa: BLE001 — DDP's wait on the bucket raises it
            _remember(state, exc)
            out.set_exception(exc)
            # and so does its wait on any bucket with gradients in a message this failure left unsent
            for g in (state._group_of or {}).values():
                if g.fut is not None and not g.fut.done():
                    g.fut.set_exception(exc)
            return
        inner.then(_forward_to(out, buf))


def _forward_to(out: torch.futures.Future, buf: torch.Tensor):
    def done(f: torch.futures.Future) -> None:
        # A ``then`` callback runs on a stream that waited for ``f``'s work (the futures' contract on
        # CUDA): completing ``out`` there records its events after it.
        try:
            f.wait()
        except BaseException as exc:  # noqa: BLE001
            out.set_exception(exc)
            return
        out.set_result(buf)

    return done


_HOOK_THREAD = _HookThread()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_HOOK_THREAD._reset)
