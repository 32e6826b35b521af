"""Top-k sparsification (beyond the seeds): the ``k = ceil(ratio * n)`` largest-magnitude values.

Biased; use it with error feedback. The payload has a fixed size for a given ``n``:
``[indices: int32 x k][values: float32 x k]`` (8 bytes per kept value). NaN and inf rank as the
largest magnitudes, so non-finite input is always sent and comes out non-finite.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import ClassVar

import torch

from lowbit.codecs.base import Codec, register_codec
from lowbit.kernels.reference import view_as


@register_codec
@dataclasses.dataclass(frozen=True)
class TopK(Codec):
    name: ClassVar[str] = "topk"
    biased: ClassVar[bool] = True

    ratio: float = 0.01

    def __post_init__(self) -> None:
        r = self.ratio
        if isinstance(r, bool) or not isinstance(r, (int, float)) or not (0.0 < r <= 1.0):
            raise ValueError(f"topk: ratio={r!r} is out of range; it must be a number in (0, 1]")

    @property
    def label(self) -> str:  # type: ignore[override]
        return f"top-k {self.ratio}"

    @property
    def short_label(self) -> str:  # type: ignore[override]
        return f"topk{self.ratio}"

    def k(self, numel: int) -> int:
        return 0 if numel == 0 else min(numel, max(1, math.ceil(self.ratio * numel)))

    def head_bytes(self, numel: int, shape: Sequence[int] | None = None) -> int:
        return 4 * self.k(numel)  # the int32 indices, then the float32 values

    def nbytes(self, numel: int, shape: Sequence[int] | None = None) -> int:
        return 8 * self.k(numel)

    def scale_fields(self, numel: int, shape: Sequence[int] | None = None) -> tuple[int, int]:
        return 4 * self.k(numel), 8 * self.k(numel)  # the values themselves

    def encode(self, x: torch.Tensor, seed: int = 0) -> torch.Tensor:
        flat = self._flat_input(x)
        k = self.k(flat.numel())
        mag = flat.abs()
        mag = torch.where(torch.isnan(mag), torch.full_like(mag, float("inf")), mag)
        idx = torch.topk(mag, k, sorted=False).indices if k else flat.new_zeros(0, dtype=torch.int64)
        vals = flat[idx]
        return torch.cat([idx.to(torch.int32).view(torch.uint8), vals.contiguous().view(torch.uint8)])

    def decode(self, payload, numel, out=None, shape=None):  # type: ignore[override]
        self._check_payload(payload, numel, shape)
        y = self._output(out, numel, payload.device)
        k = self.k(numel)
        y.zero_()
        if k:
            idx = view_as(payload[: 4 * k], torch.int32).to(torch.int64)
            vals = view_as(payload[4 * k :], torch.float32)
            if int(idx.min()) < 0 or int(idx.max()) >= numel:
                raise ValueError(f"topk: payload holds an index outside [0, {numel})")
            y.index_copy_(0, idx, vals)
        return y
