"""Session-wide test setup.

Without CUDA, Triton kernels run in Triton's interpreter, which must be chosen before anything imports
triton; some test dependencies do (Lightning imports torchmetrics, which imports triton), so it is set
here, before any test module is collected, rather than in the Triton test module alone.

Multi-process tests start their ranks with lowbit.launch.spawn. Here its processes fork from a server that
imported torch and lowbit once (``$LOWBIT_START_METHOD=forkserver``; each child gets the caller's
environment back): ~0.2 s a 2-rank start on the 2-core machine instead of ~4 s (issue 31 item 7). Set
``LOWBIT_START_METHOD=spawn`` to run the suite with fresh interpreters.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("LOWBIT_START_METHOD", "forkserver")


# ------------------------------------------------------------------------------ exclusive modules
# `make test` runs the suite on two pytest-xdist workers, one test file per worker at a time
# (`-n 2 --dist loadfile`: a file's shared spawn runs once). A few files judge speed: what codec="auto"
# decides on a fast link, budgets of wall-clock seconds. Marked `pytestmark = pytest.mark.exclusive`, such a
# file runs while the other worker waits: every other file holds a shared lock while it runs, an exclusive
# one the lock alone. A turnstile taken before every shared lock lets a waiting exclusive file in next
# (without it, the other worker's files could keep taking the shared lock until the end). Without xdist
# nothing is locked.
import fcntl  # noqa: E402
import tempfile  # noqa: E402

import pytest  # noqa: E402


def _lock(path: str, mode: int):
    f = open(path, "a+")  # noqa: SIM115 — held for the module, closed by the fixture
    fcntl.flock(f, mode)
    return f


@pytest.fixture(scope="module", autouse=True)
def _exclusive_files(request: pytest.FixtureRequest):
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    if not run:
        yield
        return
    base = os.path.join(tempfile.gettempdir(), f"lowbit-pytest-{run}")
    exclusive = request.node.get_closest_marker("exclusive") is not None
    turnstile = _lock(base + ".turnstile", fcntl.LOCK_EX)
    if exclusive:
        held = _lock(base + ".lock", fcntl.LOCK_EX)  # (keeps the turnstile: the other worker waits at it)
    else:
        turnstile.close()
        held = _lock(base + ".lock", fcntl.LOCK_SH)
    try:
        yield
    finally:
        held.close()
        if exclusive:
            turnstile.close()
