"""Session-wide test setup.

Without CUDA, Triton kernels run in Triton's interpreter, which must be chosen before anything imports
triton; some test dependencies do (Lightning imports torchmetrics, which imports triton), so it is set
here, before any test module is collected, rather than in the Triton test module alone.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
