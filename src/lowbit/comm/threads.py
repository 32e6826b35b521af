"""lowbit's background threads: one FIFO worker each, stopped before the process group goes.

Three parts of lowbit run work on a thread of their own: the DDP hook thread (lowbit.ddp), the
emulated link (:func:`lowbit.comm.collectives.emulate_link`) and the completion thread, which runs the
callbacks of the backend's collectives on CPU (gloo) instead of gloo's own threads, which the
interpreter cannot join (``lowbit.comm.collectives.on_lowbit_thread``). Each is a :class:`Worker`, a
daemon thread that runs the jobs put to it in order, started on first use. Their lifecycle:

1. A worker keeps no reference to a job once it has run. The DDP hook thread's frame held the last
   bucket's job (the state, its buffers, its process group) until the next one: the state outlived
   ``gc.collect()`` before ``destroy_process_group()`` and lived on, with its group, into interpreter
   shutdown, which is what ``lowbit.launch.shutdown`` exists to prevent.
2. :func:`stop_all` lets every worker finish what it was given, then ends and joins its thread.
   ``lowbit.launch.shutdown`` calls it before it destroys the process group; it also runs at
   interpreter exit (``atexit``, while threads can still be joined), so no lowbit thread is left
   inside torch when the interpreter and the C++ runtime tear down their objects. A worker stopped
   starts again on the next job.
3. After a fork the child has no thread: the worker starts anew there on first use.
"""

from __future__ import annotations

import atexit
import os
import queue
import threading
import weakref
from collections.abc import Callable
from typing import Any

from lowbit.launch import before_shutdown

__all__ = ["Worker", "stop_all", "STOP_TIMEOUT_S"]

#: how long :func:`stop_all` waits for each worker to finish its jobs (a collective whose peer is gone
#: can hold one for the group's timeout; the exit is not held longer than this)
STOP_TIMEOUT_S = 10.0

_STOP = object()
_WORKERS: "weakref.WeakSet[Worker]" = weakref.WeakSet()


class Worker:
    """A daemon thread named ``name`` that runs ``run(job)`` for each :meth:`put` job, in order, then
    ``done()`` (if given) once nothing of the job is referenced any more: a caller that waits for
    ``done`` finds the job's objects free. ``run`` should not raise: an exception ends the thread
    (printed by Python's thread hook; ``done`` still runs), and the next :meth:`put` starts a new one."""

    def __init__(self, name: str, run: Callable[[Any], None], done: Callable[[], None] | None = None) -> None:
        self.name = name
        self._run = run
        self._done = done
        self._reset()
        _WORKERS.add(self)

    def _reset(self) -> None:
        self._lock = threading.Lock()
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._stopping: threading.Thread | None = None  # a stopped thread that may still finish its jobs

    def put(self, job: Any) -> None:
        """Queue ``job``; starts the thread if none runs."""
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._queue = queue.SimpleQueue()  # (a dead thread's queue holds nothing that will run)
                self._thread = threading.Thread(target=self._loop, args=(self._queue, self._stopping),
                                                name=self.name, daemon=True)
                self._stopping = None
                self._thread.start()
            self._queue.put(job)

    def _loop(self, q: queue.SimpleQueue, before: threading.Thread | None) -> None:
        if before is not None:
            before.join()  # the jobs given before a stop run first: one order, as on one thread
        while True:
            job = q.get()
            if job is _STOP:
                return
            try:
                self._run(job)
            finally:
                job = None  # nothing of a finished job stays referenced while the thread waits (point 1)
                if self._done is not None:
                    self._done()

    def alive(self) -> bool:
        """Whether the thread runs."""
        t = self._thread
        return t is not None and t.is_alive()

    def stop(self, timeout: float | None = STOP_TIMEOUT_S) -> bool:
        """Finish the jobs queued so far, then end the thread and join it (at most ``timeout`` seconds).
        True when no thread of this worker is left running."""
        with self._lock:
            t, self._thread = self._thread, None
            if t is None:
                return True
            self._stopping = t
            self._queue.put(_STOP)
        if t is not threading.current_thread():
            t.join(timeout)
        return not t.is_alive()


def stop_all(timeout: float | None = STOP_TIMEOUT_S) -> bool:
    """Stop every worker (:meth:`Worker.stop`), again while one that was stopped got work from another's
    last jobs (the DDP hook thread queues its collectives' completions on lowbit's completion thread);
    True when none is left running."""
    stuck: list[Worker] = []  # (still running after ``timeout``: not waited for again)
    for _ in range(len(_WORKERS) + 1):
        todo = [w for w in list(_WORKERS) if w.alive() and w not in stuck]
        if not todo:
            break
        stuck += [w for w in todo if not w.stop(timeout)]
    return not stuck


def _after_fork() -> None:
    for w in list(_WORKERS):
        w._reset()


atexit.register(stop_all)
before_shutdown(stop_all)
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork)
