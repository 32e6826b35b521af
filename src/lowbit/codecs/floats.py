"""Floating-point passthrough codecs: fp32 (exact), fp16 and bf16 (torch's round-to-nearest-even casts)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import ClassVar

import torch

from lowbit.codecs.base import Codec, register_codec
from lowbit.kernels.reference import view_as


@dataclasses.dataclass(frozen=True)
class _FloatCodec(Codec):
    dtype: ClassVar[torch.dtype] = torch.float32
    itemsize: ClassVar[int] = 4

    @property
    def wire_dtype(self) -> torch.dtype:  # type: ignore[override]
        return self.dtype

    @property
    def label(self) -> str:
        return "32bit" if self.itemsize == 4 else f"16bit ({self.name})"

    @property
    def short_label(self) -> str:
        return self.name

    @property
    def code_bits(self) -> float:
        return 8.0 * self.itemsize

    def nbytes(self, numel: int, shape: Sequence[int] | None = None) -> int:
        return self.itemsize * numel

    def encode(self, x: torch.Tensor, seed: int = 0) -> torch.Tensor:
        if not isinstance(x, torch.Tensor) or not x.is_floating_point():
            raise ValueError(f"encode expects a floating-point tensor, got {getattr(x, 'dtype', type(x))}")
        flat = x.reshape(-1).to(self.dtype).contiguous()
        if flat.data_ptr() == x.data_ptr():
            flat = flat.clone()  # the payload never aliases the caller's tensor
        return flat.view(torch.uint8)

    def decode(self, payload, numel, out=None, shape=None):  # type: ignore[override]
        self._check_payload(payload, numel, shape)
        y = self._output(out, numel, payload.device)
        if numel:
            y.copy_(view_as(payload, self.dtype))
        return y


@register_codec
@dataclasses.dataclass(frozen=True)
class FP32(_FloatCodec):
    """32-bit passthrough: the uncompressed baseline."""

    name: ClassVar[str] = "fp32"
    dtype: ClassVar[torch.dtype] = torch.float32
    itemsize: ClassVar[int] = 4


@register_codec
@dataclasses.dataclass(frozen=True)
class FP16(_FloatCodec):
    """IEEE half precision (values above 65504 overflow to inf, as torch's cast does)."""

    name: ClassVar[str] = "fp16"
    dtype: ClassVar[torch.dtype] = torch.float16
    itemsize: ClassVar[int] = 2


@register_codec
@dataclasses.dataclass(frozen=True)
class BF16(_FloatCodec):
    """bfloat16: fp32's exponent range with an 8-bit mantissa."""

    name: ClassVar[str] = "bf16"
    dtype: ClassVar[torch.dtype] = torch.bfloat16
    itemsize: ClassVar[int] = 2
