"""QSGD (Alistarh et al. 2017) with buckets, as used by the seed study (Grubic et al. 2018).

The flattened tensor is cut into buckets of ``bucket`` consecutive values; each bucket is scaled by its
max |x| (``norm=max``, the seed's better choice) or its L2 norm (``norm=l2``, the paper's Q_s), and each
value is rounded to a grid of ``2s+1`` levels ``scale * l / s`` with ``l in [-s, s]``:

* ``bits >= 2``: ``s = 2^(bits-1) - 1`` (2-bit is ternary, 4-bit has 15 levels, 8-bit 255);
* ``bits == 1``: the grid is ``{-scale, +scale}`` (stochastic sign).

``levels=full`` is QSGD's second scheme: every one of the ``2^bits`` codes is a level, ``2^bits - 1``
equal intervals over ``[-scale, scale]`` (``s = (2^bits - 1) / 2``; no exact zero; at 1 bit the same grid).
The default ``levels=zero`` keeps a level at zero (the seed's choice).

``rounding=stochastic`` picks the upper neighbour with probability equal to the distance from the lower
one, so ``E[decode(encode(x))] = x`` and Lemma 3.1's variance bound holds with ``n = bucket``;
``rounding=nearest`` is deterministic with error at most half a level. At 16 bits both round the exact
level ``s + s * x / scale`` (to within 2^-22 of a step; a float32 ``q + u`` near 2^16 keeps only 8
fractional bits); at 8 bits and below the float32 ``floor(q + u)`` / ``floor(q + 1/2)`` of
``q = (x / scale) * s + s``, within 2^-17 of a step (``kernels.reference.qsgd_encode``).

Wire format: ``[scale per bucket: float32 x ceil(n/bucket)] [codes: bits each, LSB-first bit stream]``,
so 4-bit with bucket 512 costs ``4 + 32/512`` bits per value.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import ClassVar

import torch

from lowbit.codecs.base import Codec, ceil_div, check_choice, check_int, register_codec
from lowbit.kernels import dispatch

QSGD_BITS = (1, 2, 3, 4, 5, 6, 7, 8, 16)


@register_codec
@dataclasses.dataclass(frozen=True)
class QSGD(Codec):
    name: ClassVar[str] = "qsgd"

    bits: int = 8
    bucket: int = 512
    norm: str = "max"
    rounding: str = "stochastic"
    levels: str = dataclasses.field(default="zero", metadata={"omit_default": True})

    def __post_init__(self) -> None:
        check_choice("qsgd", "bits", self.bits, QSGD_BITS)
        check_int("qsgd", "bucket", self.bucket, 1, 1 << 30)
        check_choice("qsgd", "norm", self.norm, ("max", "l2"))
        check_choice("qsgd", "rounding", self.rounding, ("stochastic", "nearest"))
        check_choice("qsgd", "levels", self.levels, ("zero", "full"))

    device_seed: ClassVar[bool] = True

    @property
    def stochastic(self) -> bool:  # type: ignore[override]
        return self.rounding == "stochastic"

    @property
    def label(self) -> str:  # type: ignore[override]
        extra = [f"{k}={v}" for k, v, d in (("norm", self.norm, "max"), ("rounding", self.rounding, "stochastic"),
                                            ("levels", self.levels, "zero")) if v != d]
        return f"QSGD {self.bits}bit/{self.bucket}" + (" " + ",".join(extra) if extra else "")

    @property
    def short_label(self) -> str:  # type: ignore[override]
        return f"qsgd{self.bits}/{self.bucket}"

    @property
    def code_bits(self) -> float:  # type: ignore[override]
        return float(self.bits)  # (the bucket's scale adds 32/bucket bits a value)

    def head_bytes(self, numel: int, shape: Sequence[int] | None = None) -> int:
        return 4 * ceil_div(numel, self.bucket)

    def nbytes(self, numel: int, shape: Sequence[int] | None = None) -> int:
        return 4 * ceil_div(numel, self.bucket) + (numel * self.bits + 7) // 8

    def scale_fields(self, numel: int, shape: Sequence[int] | None = None) -> tuple[int, int]:
        return 0, 4 * ceil_div(numel, self.bucket)  # a decoded value is (code - s) * scale / s

    def encode(self, x: torch.Tensor, seed: int | torch.Tensor = 0) -> torch.Tensor:
        """``seed``: an int, or (CUDA, Triton kernels) a one-element int32 device tensor holding the
        seed's key (:func:`lowbit.kernels.dispatch.write_keys`), read by the kernel when it runs."""
        flat = self._flat_input(x)
        return dispatch.qsgd_encode(flat, self.bits, self.bucket, self.norm, self.stochastic,
                                    seed if isinstance(seed, torch.Tensor) else int(seed), self.levels == "full")

    def decode(self, payload, numel, out=None, shape=None):  # type: ignore[override]
        self._check_payload(payload, numel, shape)
        y = self._output(out, numel, payload.device)
        return dispatch.qsgd_decode(payload, numel, self.bits, self.bucket, y, self.levels == "full")

    def decode_sum(self, payloads, numel, out=None, shape=None, divide_by=1):  # type: ignore[override]
        y = self._sum_output(payloads, numel, out, shape, divide_by)
        fused = dispatch.qsgd_decode_sum(list(payloads), numel, self.bits, self.bucket, y, divide_by,
                                         self.levels == "full")
        if fused is not None:
            return fused
        return super().decode_sum(payloads, numel, out=y, shape=shape, divide_by=divide_by)
