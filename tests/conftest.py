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
# what every test module a child unpickles its function from imports (the server imports it once)
os.environ.setdefault("LOWBIT_FORKSERVER_PRELOAD", "pytest")

