"""1bitSGD (Seide et al. 2014): one sign bit per value and two reconstruction values per group.

The two values are the means of the group's non-negative and negative entries (the MSE-optimal
reconstruction for a zero threshold). Groups are

* ``bucket=0``: per column, as CNTK does (Seide et al.; the seed's 1bitSGD). CNTK makes the first
  tensor dimension the "row" and flattens the others onto columns, and lists dimensions
  fastest-varying first, so its first dimension is PyTorch's *last*: a column is a contiguous run of
  ``shape[-1]`` values (the kW values of a convolution kernel row, the input features of a Linear
  weight; a 1-D tensor is one column). So per column is the bucketed layout with a bucket of
  ``shape[-1]``, and uses its kernels. The layout depends on the shape: ``encode(x)`` takes it from
  ``x.shape``; ``nbytes``, ``head_bytes`` and ``decode`` need ``shape=`` and refuse without it.
* ``bucket=N``: consecutive runs of N values of the flattened tensor (the seed's reshaped 1bitSGD*,
  N=64 there).

Meant to be used with error feedback (:class:`lowbit.ErrorFeedback`); without it training diverges.

Wire format: ``[(mean_pos, mean_neg) float32 per group] [sign bits, 1 = non-negative, LSB-first]``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import ClassVar

import torch

from lowbit.codecs.base import Codec, ceil_div, check_int, register_codec
from lowbit.kernels import dispatch


@register_codec
@dataclasses.dataclass(frozen=True)
class OneBit(Codec):
    name: ClassVar[str] = "onebit"
    biased: ClassVar[bool] = True

    bucket: int = 64

    def __post_init__(self) -> None:
        check_int("onebit", "bucket", self.bucket, 0, 1 << 30)

    @property
    def label(self) -> str:  # type: ignore[override]
        return "1bitSGD" if self.bucket == 0 else f"1bitSGD*/{self.bucket}"

    @property
    def short_label(self) -> str:  # type: ignore[override]
        return f"onebit/{self.bucket}"

    @property
    def code_bits(self) -> float:  # type: ignore[override]
        return 1.0  # (a group's two means add 64/bucket bits a value: 1bitSGD*/64 sends 2)

    @property
    def needs_shape(self) -> bool:  # type: ignore[override]
        return self.bucket == 0

    def _column(self, numel: int, shape: Sequence[int] | None) -> int:
        """Values per column (column mode): ``shape[-1]``, the tensor's contiguous last dimension."""
        if shape is None:
            raise ValueError("onebit:bucket=0 (one pair of means per column) lays its payload out by the tensor's "
                             "shape: pass shape= to nbytes / head_bytes / decode (shape=(n,) for a 1-D tensor)")
        prod = math.prod(int(s) for s in shape)
        if prod != numel:
            raise ValueError(f"onebit: shape {tuple(shape)} has {prod} elements, numel is {numel}")
        return int(shape[-1]) if len(shape) else 1

    def _groups(self, numel: int, shape: Sequence[int] | None) -> int:
        if self.bucket:
            return ceil_div(numel, self.bucket)
        col = self._column(numel, shape)
        return numel // col if col else 0

    def _width(self, numel: int, shape: Sequence[int] | None) -> int:
        """The bucket the kernels use: ``bucket``, or the column length."""
        return self.bucket if self.bucket else max(1, self._column(numel, shape))

    def head_bytes(self, numel: int, shape: Sequence[int] | None = None) -> int:
        return 8 * self._groups(numel, shape)

    def nbytes(self, numel: int, shape: Sequence[int] | None = None) -> int:
        return 8 * self._groups(numel, shape) + (numel + 7) // 8

    def scale_fields(self, numel: int, shape: Sequence[int] | None = None) -> tuple[int, int]:
        return 0, 8 * self._groups(numel, shape)  # a decoded value is one of its group's two means

    def encode(self, x: torch.Tensor, seed: int = 0) -> torch.Tensor:
        flat = self._flat_input(x)
        return dispatch.onebit_encode_buckets(flat, self._width(flat.numel(), tuple(x.shape)))

    def decode_sum(self, payloads, numel, out=None, shape=None, divide_by=1):  # type: ignore[override]
        y = self._sum_output(payloads, numel, out, shape, divide_by)
        fast = dispatch.compiled_backend(y, "onebit_decode_sum_buckets") if numel else None
        if fast is not None:  # one pass: sign lookups, sum and mean together
            return fast.onebit_decode_sum_buckets(list(payloads), numel, self._width(numel, shape), y, divide_by)
        return super().decode_sum(payloads, numel, out=y, shape=shape, divide_by=divide_by)

    def decode(self, payload, numel, out=None, shape=None):  # type: ignore[override]
        self._check_payload(payload, numel, shape)
        y = self._output(out, numel, payload.device)
        if not numel:
            return y
        return dispatch.onebit_decode_buckets(payload, numel, self._width(numel, shape), y)
