"""Error feedback inside a collective: what a rank did not send joins its next call (the residual).

Error feedback's one home is :mod:`lowbit.feedback` (the update, the rule for non-finite values, the
residual memory and its checkpoints); these are the steps the algorithms take with it, in the form
a collective needs: encode ``x + residual`` and keep what the payload lost, and guard a step's residual
with the non-finite rule once the reduced result is there (:func:`_guard_residual` where every rank
holds the whole result; :func:`restore_unless_finite_anywhere` where each holds a shard of it).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from lowbit.comm import collectives as C
from lowbit.comm.framing import _keep
from lowbit.feedback import encode_with_feedback as _encode_with_feedback
from lowbit.feedback import restore_unless_finite

__all__ = ["_encode_with_feedback", "_guard_residual", "restore_unless_finite_anywhere"]


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


def restore_unless_finite_anywhere(residual: torch.Tensor, before: torch.Tensor, shard: torch.Tensor,
                                   groups: Sequence[dist.ProcessGroup]) -> None:
    """The non-finite rule (:func:`lowbit.feedback.restore_unless_finite`) for a reduce-scatter, where each
    rank holds only its ``shard`` of the reduced result: one rank's Inf lands in the shard of the rank
    that owns that chunk, and the others' shards stay finite. So each rank's verdict (1: its shard holds
    an Inf or NaN) is summed over ``groups`` (together: every rank of the reduce-scatter), and every rank
    puts ``residual`` back to ``before`` when any shard is non-finite. On the device: a one-value
    all-reduce per group, no host synchronisation."""
    bad = torch.isfinite(shard).all().logical_not().to(torch.float32).reshape(1)  # (1,) float32
    for g in groups:
        C.all_reduce(bad, g)
    torch.where(bad == 0, residual, before, out=residual)
