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
from lowbit.kernels import reference as ref
from lowbit.kernels.dettmers_tables import NORMALISED

TYPES = ("dynamic", "linear", "static", "mantissa", "dynamic_bnb")
#: short labels' names of the types: the first three letters, but for the bitsandbytes map
_SHORT_TYPES = {"dynamic_bnb": "bnb"}

#: Dettmers 2016, Table 2: mean relative error in %, per data type and distribution (of the 2015 kernels,
#: which ``search=paper`` emulates).
PAPER_TABLE2 = {
    "dynamic": {"U(0,1)": 1.39, "N(0,1)": 2.46, "N(0,10^2)": 2.49, "N(0,0.2^2)": 2.45},
    "linear": {"U(0,1)": 2.16, "N(0,1)": 6.47, "N(0,10^2)": 6.44, "N(0,0.2^2)": 6.15},
    "mantissa": {"U(0,1)": 7.22, "N(0,1)": 6.89, "N(0,10^2)": 7.19, "N(0,0.2^2)": 8.26},
    "static": {"U(0,1)": 4.82, "N(0,1)": 6.3, "N(0,10^2)": 6.28, "N(0,0.2^2)": 6.58},
}


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
    def short_label(self) -> str:  # type: ignore[override]
        return f"dettmers-{_SHORT_TYPES.get(self.type, self.type[:3])}"

    @property
    def code_bits(self) -> float:  # type: ignore[override]
        return 8.0  # one byte a value, whatever the type

    @property
    def seeds_feedback(self) -> bool:  # type: ignore[override]
        """Dettmers (2016) trained his 8-bit types without error feedback: the study's "auto" leaves it off
        (its "biased", and lowbit.ddp's "auto", turn it on)."""
        return False

    def published_error(self, distribution: str) -> float | None:
        """Table 2's figure, for the 2015 kernels (``search=paper``) only."""
        return PAPER_TABLE2.get(self.type, {}).get(distribution) if self.search == "paper" else None

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

    def scale_fields(self, numel: int, shape: Sequence[int] | None = None) -> tuple[int, int] | None:
        # normalised types: table value * scale; static / mantissa have no scale (and values of at most
        # their table's largest, which cannot overflow a sum)
        return (0, 4 * self._nscales(numel)) if self.normalised else None

    # ----------------------------------------------------------------------------- encode
    def encode(self, x: torch.Tensor, seed: int = 0) -> torch.Tensor:
        flat = self._flat_input(x)
        n = flat.numel()
        fast = dispatch.compiled_backend(flat, "dettmers_encode") if n else None
        if fast is not None:
            return fast.dettmers_encode(flat, self.type, self.search, self.bucket, self.offset)
        return ref.dettmers_encode(flat, self.type, self.search, self.bucket, self.offset)

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
        return ref.dettmers_decode(payload, numel, self.type, self.bucket, self.offset, y)
