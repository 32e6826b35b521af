"""Dettmers' 8-bit data types (ICLR 2016) and the bitsandbytes dynamic map.

Every type spends 1 sign bit (bit 7) plus 7 bits of magnitude code, one byte per value:

=================  =====================================================  ==============================
``type``           magnitudes (code 0..127)                               normalisation
=================  =====================================================  ==============================
``dynamic``        the 2015 dynamic tree (126 values), 126 -> 0, 127 -> 1  absmax (per tensor or bucket)
``linear``         k/127                                                  absmax
``static``         static tree per decade, times 10^offset                none (fixed exponent offset)
``mantissa``       m * 10^(e-6+offset), m = 0..15                          none (fixed exponent offset)
``dynamic_bnb``    bitsandbytes' ``create_dynamic_map`` (256 signed)       absmax
=================  =====================================================  ==============================

``search=nearest`` (default) rounds to the nearest representable value. ``search=paper`` emulates the
2015 CUDA kernels' binary search, which is biased (it can stop one entry short of the nearest); only
with it do the relative errors of the paper's Table 2 reproduce (see shared/reference/algorithms.md).
Two deliberate departures from the 2015 kernels, in both modes: the dynamic kernel's read past the
table for |x|/absmax in (0.99140614, 0.995703] returns absmax (code 127) here, and the linear kernel's
mapping of tiny values to code 126 (= 126/127) returns 0 here.

Non-finite input stays non-finite: for the absmax types the scale carries it; the fixed-offset types
(``static``, ``mantissa``) have no scale, so they send code 0x80 ("negative zero"), which decodes to NaN.

Wire format: ``[absmax float32 per bucket (normalised types only)] [one code byte per value]``;
``bucket=0`` means one scale for the whole tensor, as in the paper.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import ClassVar

import torch

from lowbit.codecs.base import Codec, ceil_div, check_choice, check_int, register_codec
from lowbit.kernels import dispatch
from lowbit.kernels.dettmers_tables import NAN_CODE, NORMALISED, bnb_dynamic_map, decode_table, magnitudes
from lowbit.kernels.reference import bucket_absmax, to_buckets, view_as

TYPES = ("dynamic", "linear", "static", "mantissa", "dynamic_bnb")


def _table(values: Sequence[float], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32, device=device)


def _nearest_codes(m: torch.Tensor, values: Sequence[float]) -> torch.Tensor:
    """Code of the nearest entry of ``values`` (codes = positions; duplicates take the first)."""
    dev = m.device
    uniq = sorted(set(values))
    first_code = {v: values.index(v) for v in uniq}
    sv = torch.tensor(uniq, dtype=torch.float64, device=dev)
    mids = ((sv[1:] + sv[:-1]) / 2).to(torch.float32)
    codes = torch.tensor([first_code[v] for v in uniq], dtype=torch.int64, device=dev)
    return codes[torch.bucketize(m, mids)]


def _paper_search(m: torch.Tensor, tbl: Sequence[float], size: int, pivot0: int) -> torch.Tensor:
    """Emulate the 2015 kernels' binary search over ``tbl[:size]`` (vectorised; see module doc)."""
    t = _table(list(tbl[:size]) + [1.0] * (130 - size), m.device)  # index `size` = the kernel's overread
    pivot = torch.full_like(m, pivot0, dtype=torch.int64)
    lower = torch.zeros_like(pivot)
    j = 32
    while j > 0:
        gt = m > t[pivot]
        lower = torch.where(gt, pivot, lower)
        pivot = torch.where(gt, pivot + j, pivot - j)
        j >>= 1
    # lower == pivot can never hold after the loop, so the kernel always takes this branch:
    take_pivot = (t[pivot] - m) < (t[lower] - m).abs()
    return torch.where(take_pivot, pivot, lower)


@register_codec
@dataclasses.dataclass(frozen=True)
class Dettmers(Codec):
    name: ClassVar[str] = "dettmers"
    biased: ClassVar[bool] = True

    type: str = "dynamic"
    search: str = "nearest"
    bucket: int = 0
    offset: int = 0

    @property
    def per_tensor(self) -> bool:  # type: ignore[override]
        """``bucket=0``: one scale per tensor, as in the paper (so one message per parameter tensor)."""
        return self.bucket == 0

    def __post_init__(self) -> None:
        check_choice("dettmers", "type", self.type, TYPES)
        check_choice("dettmers", "search", self.search, ("nearest", "paper"))
        check_int("dettmers", "bucket", self.bucket, 0, 1 << 30)
        check_int("dettmers", "offset", self.offset, -30, 30)
        if self.search == "paper" and self.type == "dynamic_bnb":
            raise ValueError("dettmers: search='paper' emulates the 2015 kernels; type=dynamic_bnb has none")
        if self.type in NORMALISED and self.offset != 0:
            raise ValueError(f"dettmers: offset applies to the fixed-offset types (static, mantissa), not {self.type}")
        if self.type not in NORMALISED and self.bucket != 0:
            raise ValueError(f"dettmers: type={self.type} has no scale, so bucket must be 0")

    @property
    def label(self) -> str:  # type: ignore[override]
        return f"8bit {self.type} (Dettmers)"

    @property
    def normalised(self) -> bool:
        return self.type in NORMALISED

    def _nscales(self, numel: int) -> int:
        if not self.normalised or numel == 0:
            return 0
        return ceil_div(numel, self.bucket) if self.bucket else 1

    def head_bytes(self, numel: int, shape: Sequence[int] | None = None) -> int:
        return 4 * self._nscales(numel)

    def nbytes(self, numel: int, shape: Sequence[int] | None = None) -> int:
        return 4 * self._nscales(numel) + numel

    # ----------------------------------------------------------------------------- encode
    def _codes(self, m: torch.Tensor) -> torch.Tensor:
        """Magnitudes (already divided by the scale where normalised) -> codes 0..127."""
        t = self.type
        mags = magnitudes(t, self.offset)
        if self.search == "nearest":
            return _nearest_codes(m, mags)
        if t == "dynamic":
            codes = _paper_search(m, mags, 126, 63)
            codes = torch.where(codes == 126, torch.full_like(codes, 127), codes)
            codes = torch.where(m < 1.5e-6, torch.full_like(codes, 126), codes)
            return torch.where(m > 0.995703, torch.full_like(codes, 127), codes)
        codes = _paper_search(m, mags, 128, 64)
        scale10 = 10.0**self.offset
        lo, hi = {"linear": (1.5e-6, 0.990703), "static": (5e-7 * scale10, 93 * scale10),
                  "mantissa": (5e-7 * scale10, 150 * scale10)}[t]
        codes = torch.where(m < lo, torch.zeros_like(codes), codes)
        return torch.where(m > hi, torch.full_like(codes, 127), codes)

    @staticmethod
    def _signed(codes: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        # Code 0 (zero) keeps sign 0, so 0x80 stays free as the NaN marker of the fixed-offset types.
        neg = (x < 0) & (codes != 0)
        return codes | (neg.to(torch.int64) << 7)

    def encode(self, x: torch.Tensor, seed: int = 0) -> torch.Tensor:
        flat = self._flat_input(x)
        n = flat.numel()
        fast = dispatch.compiled_backend(flat, "dettmers_encode") if n else None
        if fast is not None:
            return fast.dettmers_encode(flat, self.type, self.search, self.bucket, self.offset)
        if n == 0:
            return torch.empty(0, dtype=torch.uint8, device=flat.device)
        if self.normalised:
            xb = to_buckets(flat, self.bucket) if self.bucket else flat.view(1, n)
            scale = bucket_absmax(xb)  # (nb,)
            safe = torch.where(scale > 0, scale, torch.ones_like(scale))
            r = (xb / safe[:, None]).reshape(-1)[:n]
            r = torch.nan_to_num(r, nan=0.0, posinf=1.0, neginf=-1.0)
            if self.type == "dynamic_bnb":
                codes = _nearest_codes(r, bnb_dynamic_map())
            else:
                codes = self._signed(self._codes(r.abs()), r)
            return torch.cat([scale.contiguous().view(torch.uint8), codes.to(torch.uint8)])
        finite = torch.isfinite(flat)
        m = torch.where(finite, flat.abs(), torch.zeros_like(flat))
        codes = self._signed(self._codes(m), flat)
        codes = torch.where(finite, codes, torch.full_like(codes, NAN_CODE))
        return codes.to(torch.uint8)

    # ----------------------------------------------------------------------------- decode
    def decode_sum(self, payloads, numel, out=None, shape=None, divide_by=1):  # type: ignore[override]
        y = self._sum_output(payloads, numel, out, shape, divide_by)
        fast = dispatch.compiled_backend(y, "dettmers_decode_sum") if numel else None
        if fast is not None:  # one pass: lookups, sum and mean together
            return fast.dettmers_decode_sum(list(payloads), numel, self.type, self.bucket, self.offset, y,
                                            divide_by)
        return super().decode_sum(payloads, numel, out=y, shape=shape, divide_by=divide_by)

    def decode(self, payload, numel, out=None, shape=None):  # type: ignore[override]
        self._check_payload(payload, numel, shape)
        y = self._output(out, numel, payload.device)
        if numel == 0:
            return y
        fast = dispatch.compiled_backend(y, "dettmers_decode")
        if fast is not None:
            return fast.dettmers_decode(payload, numel, self.type, self.bucket, self.offset, y)
        ns = self._nscales(numel)
        lut = _table(decode_table(self.type, self.offset), payload.device)
        vals = lut[payload[4 * ns :].to(torch.int64)]
        if ns:
            scale = view_as(payload[: 4 * ns], torch.float32)
            if self.bucket:
                vals = (to_buckets(vals, self.bucket) * scale[:, None]).reshape(-1)[:numel]
            else:
                vals = vals * scale
        y.copy_(vals)
        return y
