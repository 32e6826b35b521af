"""Hugging Face Accelerate (and so the Hugging Face Trainer): register lowbit on the prepared model.

    from accelerate import Accelerator
    from lowbit.integrations.accelerate import register

    accelerator = Accelerator()
    model, opt, loader = accelerator.prepare(model, opt, loader)
    state = register(accelerator, model, codec="qsgd:bits=4")

Accelerate's ``DistributedDataParallelKwargs(comm_hook=...)`` takes only its own enum of hooks and ignores
a callable; the prepared model is a plain ``DistributedDataParallel`` whenever several processes run, so
lowbit registers on it directly. With one process there is nothing to compress: ``None`` is returned.
"""

from __future__ import annotations

from typing import Any

import lowbit.ddp
from lowbit.extras import require

require("accelerate", "accelerate", "lowbit.integrations.accelerate")

__all__ = ["register"]


def register(accelerator: Any, model: Any, **kwargs: Any) -> lowbit.ddp.LowbitState | None:
    """Install lowbit's comm hook on ``model`` as returned by ``accelerator.prepare``; returns the state
    (``None`` when the run is not distributed). Keyword arguments go to :func:`lowbit.ddp.register`."""
    if accelerator.num_processes <= 1:
        return None
    if not hasattr(model, "register_comm_hook"):
        raise ValueError("lowbit.integrations.accelerate.register expects the model returned by "
                         f"accelerator.prepare (a DistributedDataParallel), got {type(model).__name__}")
    return lowbit.ddp.register(model, **kwargs)
