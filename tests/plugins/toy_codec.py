"""A codec written outside lowbit, in one file: 8-bit absmax per tensor, nearest rounding (``toy8``).

What the extensibility test registers through ``LOWBIT_PLUGINS=tests.plugins.toy_codec``: the codec's
class, its wire size and its two transforms are all lowbit needs from it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import ClassVar

import torch

from lowbit.codecs.base import Codec, register_codec


@register_codec
@dataclasses.dataclass(frozen=True)
class Toy8(Codec):
    name: ClassVar[str] = "toy8"
    biased: ClassVar[bool] = True  # nearest rounding: error feedback helps ("auto" turns it on)

    def head_bytes(self, numel: int, shape: Sequence[int] | None = None) -> int:
        return 4  # one float32 scale

    def nbytes(self, numel: int, shape: Sequence[int] | None = None) -> int:
        return 4 + numel

    def encode(self, x: torch.Tensor, seed: int = 0) -> torch.Tensor:
        flat = self._flat_input(x)
        scale = flat.abs().amax() if flat.numel() else torch.zeros((), device=flat.device)
        q = torch.round(flat / torch.where(scale > 0, scale, torch.ones_like(scale)) * 127).clamp_(-127, 127)
        return torch.cat([scale.reshape(1).view(torch.uint8), q.to(torch.int8).view(torch.uint8)])

    def decode(self, payload, numel, out=None, shape=None):  # type: ignore[override]
        self._check_payload(payload, numel, shape)
        y = self._output(out, numel, payload.device)
        scale = payload[:4].clone().view(torch.float32)  # (a copy: any alignment)
        torch.mul(payload[4:].view(torch.int8).to(torch.float32), scale / 127, out=y)
        return y
