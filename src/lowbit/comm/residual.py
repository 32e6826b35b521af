"""Error feedback inside a collective: what a rank did not send joins its next call (the residual).

Error feedback's one home is :mod:`lowbit.feedback` (the update, the rule for non-finite values, the
residual memory and its checkpoints); these are the two steps the algorithms take with it, in the form
a collective needs: encode ``x + residual`` and keep what the payload lost, and guard a step's residual
with the non-finite rule once the reduced result is there.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from lowbit.comm.framing import _keep
from lowbit.feedback import encode_with_feedback as _encode_with_feedback
from lowbit.feedback import restore_unless_finite

__all__ = ["_encode_with_feedback", "_guard_residual"]


def _guard_residual(residual: torch.Tensor, out: torch.Tensor, n: int,
                    post: Callable[[], torch.Tensor] | None) -> Callable[[], torch.Tensor]:
    """A non-finite step must not poison error feedback (:func:`lowbit.feedback.restore_unless_finite`):
    when the reduced result ``out[:n]`` holds an Inf or NaN (some rank sent one, so every rank sees it, and
    AMP's GradScaler skips the step everywhere), every rank puts its residual back to its value before the
    step. The residual is saved now (before the step) and selected on the device when the result is in."""
    prev = residual.clone()

    def guarded() -> torch.Tensor:
        _keep(prev)
        restore_unless_finite(residual, prev, out[:n])
        return out if post is None else post()

    return guarded
