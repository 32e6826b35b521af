"""Error feedback (residual memory) for any codec: the sigma-delta trick of 1bitSGD.

For each key (a tensor name, a DDP bucket index, a chunk of a collective)::

    p = x + e          # compensate: add what previous steps failed to send
    payload = encode(p)
    e = p - decode(payload)   # remember what this step failed to send

so the sum of everything delivered tracks the sum of everything produced, within one step's error.
Residuals are float32 tensors on the input's device; ``state_dict()`` / ``load_state_dict()`` carry
them through checkpoints so a resumed run continues bit-identically.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

import torch

from lowbit.codecs.base import Codec, get_codec


class ErrorFeedback:
    def __init__(self, codec: Codec | str) -> None:
        self.codec = get_codec(codec) if isinstance(codec, str) else codec
        self.residuals: dict[Hashable, torch.Tensor] = {}

    def residual(self, key: Hashable, numel: int, device: torch.device | str) -> torch.Tensor:
        """The residual buffer of ``key`` ((numel,) float32, zeros the first time); collectives update
        it in place."""
        e = self.residuals.get(key)
        if e is None:
            e = self.residuals[key] = torch.zeros(numel, dtype=torch.float32, device=device)
        elif e.numel() != numel:
            raise ValueError(
                f"error feedback for key {key!r}: residual has {e.numel()} elements but the tensor has "
                f"{numel} (did the model or bucket layout change?)"
            )
        return e

    def compensate(self, key: Hashable, x: torch.Tensor) -> torch.Tensor:
        """x + e (float32, flat). Does not modify ``x``."""
        flat = x.reshape(-1).to(torch.float32)
        e = self.residuals.get(key)
        if e is None:
            return flat.clone() if flat.data_ptr() == x.data_ptr() else flat
        if e.numel() != flat.numel():
            raise ValueError(
                f"error feedback for key {key!r}: residual has {e.numel()} elements but the tensor has "
                f"{flat.numel()} (did the model or bucket layout change?)"
            )
        return flat + e

    def update(self, key: Hashable, compensated: torch.Tensor, delivered: torch.Tensor) -> None:
        """e = compensated - delivered (both flat float32). A step whose input was not finite leaves the
        residual as it was (its Inf/NaN still reaches the output, so AMP's GradScaler skips the step)."""
        new = compensated - delivered
        old = self.residuals.get(key)
        if old is not None:
            new = torch.where(torch.isfinite(compensated).all(), new, old)
        else:
            new = torch.where(torch.isfinite(compensated).all(), new, torch.zeros_like(new))
        self.residuals[key] = new

    def encode(
        self, key: Hashable, x: torch.Tensor, seed: int = 0, shape: Sequence[int] | None = None
    ) -> torch.Tensor:
        """Compensate, encode, and remember the new residual; returns the payload."""
        p = self.compensate(key, x)
        src = p.view(tuple(shape)) if shape is not None else p.view(x.shape) if x.dim() else p
        payload = self.codec.encode(src, seed=seed)
        delivered = self.codec.decode(payload, p.numel(), shape=shape if shape is not None else tuple(x.shape))
        self.update(key, p, delivered)
        return payload

    def reset(self) -> None:
        self.residuals.clear()

    def residual_norm(self) -> float:
        return float(sum(float(e.double().pow(2).sum()) for e in self.residuals.values()) ** 0.5)

    def state_dict(self) -> dict[str, Any]:
        return {
            "codec": self.codec.spec,
            "residuals": {k: v.detach().cpu().clone() for k, v in self.residuals.items()},
        }

    def load_state_dict(self, state: dict[str, Any], device: torch.device | str | None = None) -> None:
        if not isinstance(state, dict):
            raise ValueError(f"error-feedback checkpoint must be a dict (from state_dict()), got {type(state).__name__}")
        if state.get("codec") != self.codec.spec:
            raise ValueError(
                f"error-feedback checkpoint was saved for codec {state.get('codec')!r}, "
                f"but this state uses {self.codec.spec!r}"
            )
        if "residuals" not in state:
            raise ValueError("error-feedback checkpoint has no 'residuals' (save ErrorFeedback.state_dict() as it is)")
        residuals = state.get("residuals")
        if not isinstance(residuals, dict):
            raise ValueError(f"error-feedback checkpoint: 'residuals' must be a dict, got {type(residuals).__name__}")
        for k, v in residuals.items():
            if not isinstance(v, torch.Tensor) or not v.is_floating_point():
                raise ValueError(f"error-feedback checkpoint: residual {k!r} must be a float tensor, got "
                                 f"{getattr(v, 'dtype', type(v).__name__)}")
            if not bool(torch.isfinite(v).all()):
                raise ValueError(f"error-feedback checkpoint: residual {k!r} holds Inf or NaN")
        self.residuals = {
            k: (v.to(device) if device is not None else v).to(torch.float32).reshape(-1).clone()
            for k, v in residuals.items()
        }
