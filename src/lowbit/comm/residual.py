"""Error feedback inside a collective: what a rank did not send joins its next call (the residual).

The residual memory itself (one tensor per key, checkpoints) is :class:`lowbit.feedback.ErrorFeedback`;
these are the two steps the algorithms take with it: encode ``x + residual`` and keep what the payload
lost, and put the residual back when a step's result is not finite.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from lowbit.codecs.base import Codec
from lowbit.comm.framing import _keep


def _encode_with_feedback(codec: Codec, comp: torch.Tensor, residual: torch.Tensor | None, seed: int,
                          shape: tuple[int, ...] | None = None) -> torch.Tensor:
    """Encode ``comp`` (flat; viewed as ``shape`` for per-tensor codecs); with error feedback leave
    ``residual = comp - decode(payload)`` (in place)."""
    payload = codec.encode(comp.view(shape) if shape is not None else comp, seed=seed)
    if residual is not None and comp.numel():
        codec.decode(payload, comp.numel(), out=residual,
                     shape=shape if shape is not None else codec.flat_shape(comp.numel()))
        torch.sub(comp, residual, out=residual)
    return payload


def _guard_residual(residual: torch.Tensor, out: torch.Tensor, n: int,
                    post: Callable[[], torch.Tensor] | None) -> Callable[[], torch.Tensor]:
    """A non-finite step must not poison error feedback: when the reduced result holds an Inf or NaN
    (some rank sent one, so every rank sees it, and AMP's GradScaler skips the step everywhere), every
    rank puts its residual back to its value before the step, as if the step had not happened. Decided
    on the device (no host synchronisation): the residual is saved before the step and selected after."""
    prev = residual.clone()

    def guarded() -> torch.Tensor:
        _keep(prev)
        ok = torch.isfinite(out[:n]).all()
        torch.where(ok, residual, prev, out=residual)
        return out if post is None else post()

    return guarded
