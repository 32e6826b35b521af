"""lowbit.comm.threads.Worker: jobs in order, nothing kept of a finished job, stopped and joined at exit."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import threading
import weakref
from pathlib import Path

from lowbit.comm.threads import Worker

SRC = Path(__file__).resolve().parents[2] / "src"


class _Job:
    def __init__(self, i: int) -> None:
        self.i = i


def test_jobs_run_in_order_across_a_stop_and_none_is_kept_once_done() -> None:
    seen: list[int] = []
    finished = threading.Semaphore(0)
    w = Worker("lowbit-test-order", lambda job: seen.append(job.i), finished.release)
    first = _Job(0)
    ref = weakref.ref(first)
    w.put(first)
    del first
    assert finished.acquire(timeout=5)
    gc.collect()
    assert ref() is None  # done() came after the thread let go of the job
    for i in range(1, 50):
        w.put(_Job(i))
        if i == 25:
            assert w.stop(timeout=None) is True  # the jobs given so far ran; the thread is gone
            assert not w.alive() and seen == list(range(26))
    assert w.alive()  # the next job started it again
    assert w.stop(timeout=None)
    assert seen == list(range(50))


def test_a_worker_finishes_its_jobs_and_is_joined_at_interpreter_exit(tmp_path: Path) -> None:
    """The process exits right after queuing a job: the atexit stop runs it to the end and joins the
    thread (a daemon thread would be abandoned mid-job, as lowbit's were at interpreter shutdown)."""
    out = tmp_path / "out"
    code = ("import time\n"
            "from lowbit.comm.threads import Worker\n"
            "def job(path):\n"
            "    time.sleep(0.5)\n"
            "    open(path, 'w').write('done')\n"
            f"Worker('lowbit-test-exit', job).put({str(out)!r})\n")
    env = dict(os.environ, PYTHONPATH=str(SRC))
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert p.returncode == 0, p.stderr
    assert out.read_text() == "done"


def test_stop_all_also_stops_a_worker_that_another_s_last_job_gave_work() -> None:
    """The DDP hook thread's last job queues its collectives' completions on lowbit's completion thread:
    whichever of the two ``stop_all`` stops first, neither is left running (one was, in either order)."""
    from lowbit.comm.threads import stop_all

    seen: list[str] = []
    a: Worker
    b: Worker

    def run_a(job: str) -> None:
        seen.append(job)
        if job == "a1":
            b.put("b1")

    def run_b(job: str) -> None:
        seen.append(job)
        a.put("a2")

    a = Worker("lowbit-test-a", run_a)
    b = Worker("lowbit-test-b", run_b)
    a.put("a1")
    assert stop_all(timeout=5)
    assert not a.alive() and not b.alive()
    assert seen == ["a1", "b1", "a2"]
