"""Reference kernels in plain PyTorch: the executable specification of lowbit's wire format.

They run on any device. Faster backends (numba on CPU, Triton on CUDA) must agree with them: bit for
bit in deterministic modes, and for stochastic rounding they use the same counter-based generator, so
they agree bit for bit there too unless documented otherwise.

Bit packing
    ``bits``-bit codes form one LSB-first bit stream: code ``i`` occupies bits ``[i*bits, (i+1)*bits)``
    of the stream and byte ``j`` holds stream bits ``[8j, 8j+8)``. The stream is ``ceil(n*bits/8)``
    bytes long; nothing is padded to a byte per value.

Counter-based uniforms
    ``u(seed, i) = (fmix32(((i * 0x9E3779B1) mod 2^32) XOR key(seed)) >> 8) * 2^-24`` with murmur3's
    finaliser ``fmix32`` and ``key(seed) = fmix32((seed * 0x85EBCA77 + 0x165667B1) mod 2^32)``.
    Reproducible, independent of thread scheduling, and it never touches torch's global RNG.

Sums (the L2 scale of QSGD, the means of 1bitSGD)
    :func:`tree_sum`: pairwise summation in a fixed order, float32 additions only, so the same bits on
    every device and in every backend that replays it (the numba kernels do; Triton's GPU reductions
    keep their own order, within a few ulps).

Dettmers' 8-bit types
    :func:`dettmers_encode` and :func:`dettmers_decode` are the ``dettmers`` codec's wire format (the
    types, the searches and the departures from the 2015 kernels are described in
    :mod:`lowbit.codecs.dettmers`); the numbers come from :mod:`lowbit.kernels.dettmers_tables`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from lowbit.kernels.dettmers_tables import NAN_CODE, NORMALISED, bnb_dynamic_map, decode_table, layout, magnitudes

M32 = 0xFFFFFFFF


def _fmix32_py(h: int) -> int:
    h &= M32
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & M32
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & M32
    h ^= h >> 16
    return h


def seed_key(seed: int) -> int:
    """The 32-bit key that ``seed`` contributes to every element's hash."""
    return _fmix32_py((int(seed) * 0x85EBCA77 + 0x165667B1) & M32)


def _fmix32(h: torch.Tensor) -> torch.Tensor:
    # h: int64 tensor holding values in [0, 2^32). Products wrap mod 2^64; the low 32 bits are exact.
    h = h ^ (h >> 16)
    h = (h * 0x85EBCA6B) & M32
    h = h ^ (h >> 13)
    h = (h * 0xC2B2AE35) & M32
    h = h ^ (h >> 16)
    return h


def uniform(seed: int, start: int, n: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """``n`` float32 uniforms in [0, 1) for element indices ``start .. start+n-1``."""
    idx = torch.arange(start, start + n, dtype=torch.int64, device=device)
    h = ((idx * 0x9E3779B1) & M32) ^ seed_key(seed)
    h = _fmix32(h)
    return (h >> 8).to(torch.float32) * (1.0 / (1 << 24))


def view_as(b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Reinterpret uint8 bytes as ``dtype``; copies first when the slice is not aligned for it
    (payload slices of a received buffer can start at any byte)."""
    size = torch.empty(0, dtype=dtype).element_size()
    if b.storage_offset() % size:
        b = b.clone()
    return b.view(dtype)


# --------------------------------------------------------------------------------- bit packing
def packed_nbytes(n: int, bits: int) -> int:
    return (n * bits + 7) // 8


def pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack integer codes in ``[0, 2^bits)`` densely into an LSB-first byte stream (uint8)."""
    n = codes.numel()
    nbytes = packed_nbytes(n, bits)
    if bits == 8:
        return codes.reshape(-1).to(torch.uint8)
    if bits == 16:
        c = codes.reshape(-1).to(torch.int32)
        return torch.stack([(c & 0xFF), (c >> 8) & 0xFF], dim=1).reshape(-1).to(torch.uint8)
    if not 1 <= bits <= 7:
        raise ValueError(f"pack_bits: bits must be 1..8 or 16, got {bits}")
    groups = (n + 7) // 8
    c = codes.reshape(-1).to(torch.int64)
    if groups * 8 != n:
        c = torch.nn.functional.pad(c, (0, groups * 8 - n))
    c = c.view(groups, 8)
    shifts = torch.arange(8, device=c.device, dtype=torch.int64) * bits
    word = (c << shifts).sum(dim=1)  # (groups,) holds 8*bits <= 56 bits
    byte_shifts = torch.arange(bits, device=c.device, dtype=torch.int64) * 8
    out = ((word[:, None] >> byte_shifts) & 0xFF).to(torch.uint8).reshape(-1)
    return out[:nbytes]


def unpack_bits(stream: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """Inverse of :func:`pack_bits`: ``n`` codes as int64."""
    if bits == 8:
        return stream[:n].to(torch.int64)
    if bits == 16:
        s = stream[: 2 * n].to(torch.int64).view(n, 2)
        return s[:, 0] | (s[:, 1] << 8)
    if not 1 <= bits <= 7:
        raise ValueError(f"unpack_bits: bits must be 1..8 or 16, got {bits}")
    groups = (n + 7) // 8
    s = stream.to(torch.int64)
    if s.numel() != groups * bits:
        s = torch.nn.functional.pad(s, (0, groups * bits - s.numel()))
    s = s.view(groups, bits)
    byte_shifts = torch.arange(bits, device=s.device, dtype=torch.int64) * 8
    word = (s << byte_shifts).sum(dim=1)
    shifts = torch.arange(8, device=s.device, dtype=torch.int64) * bits
    codes = (word[:, None] >> shifts) & ((1 << bits) - 1)
    return codes.reshape(-1)[:n]


# --------------------------------------------------------------------------------- buckets
def to_buckets(x: torch.Tensor, bucket: int) -> torch.Tensor:
    """(n,) -> (ceil(n/bucket), bucket), zero-padded at the end."""
    n = x.numel()
    nb = (n + bucket - 1) // bucket
    if nb * bucket != n:
        x = torch.nn.functional.pad(x, (0, nb * bucket - n))
    return x.view(nb, bucket)


def canonical_nan(t: torch.Tensor) -> torch.Tensor:
    """``t`` with every NaN made the canonical 0x7FC00000 (``full_like(nan)``): which NaN a sum or max of
    NaNs carries depends on the operand order each compiler picks, so scales never pass one on."""
    return torch.where(torch.isnan(t), torch.full_like(t, float("nan")), t)


def bucket_absmax(xb: torch.Tensor) -> torch.Tensor:
    """Per-row max |x|; NaN propagates (a NaN anywhere in a bucket makes its scale NaN)."""
    a = xb.abs()
    m = a.amax(dim=1) if a.numel() else a.new_zeros(a.shape[0])
    has_nan = torch.isnan(a).any(dim=1)
    return torch.where(has_nan, torch.full_like(m, float("nan")), m)


#: float32's largest finite value: where a finite bucket's L2 norm or a decoded value would exceed it,
#: the scale / value is capped here (finite in, finite out; Inf and NaN in still come out non-finite).
F32_MAX = float(torch.finfo(torch.float32).max)


def tree_sum(v: torch.Tensor) -> torch.Tensor:
    """Sum over the last dimension in lowbit's defined order: the row padded with +0 to a power of two
    ``P``, then neighbours added level by level, ``w[i] = v[2i] + v[2i+1]``, until one value is left:
    ``((v0 + v1) + (v2 + v3)) + ...``. The tree over an aligned block of a power-of-two length is that
    block's own tree, so a kernel may sum blocks first and then their sums. An empty row sums to +0."""
    n = v.shape[-1]
    if n == 0:
        return torch.zeros(v.shape[:-1], dtype=v.dtype, device=v.device)
    p = 1 << (n - 1).bit_length()
    if p != n:
        v = torch.nn.functional.pad(v, (0, p - n))
    while v.shape[-1] > 1:
        v = v[..., 0::2] + v[..., 1::2]
    return v[..., 0]


def cap_l2(l2: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """A finite bucket (max |x| = ``m`` finite) whose L2 norm overflows float32 gets float32's max as its
    scale: still >= every |x| of the bucket, so |x| / scale <= 1 and QSGD stays unbiased."""
    return torch.where(torch.isinf(l2) & torch.isfinite(m), torch.full_like(l2, F32_MAX), l2)


def bucket_l2(xb: torch.Tensor) -> torch.Tensor:
    """Per-row L2 norm, computed as max * sqrt(tree_sum((x/max)^2)) (no overflow in the sum of squares),
    capped at float32's max for finite rows (:func:`cap_l2`: up to sqrt(bucket) values near float32's
    max). A row holding NaN or Inf gets the canonical NaN (:func:`canonical_nan`)."""
    m = bucket_absmax(xb)
    safe = torch.where(m > 0, m, torch.ones_like(m))
    y = xb / safe[:, None]
    # IEEE's correctly rounded float32 square root, taken in float64 and rounded (exact for a square root:
    # 53 >= 2 * 24 + 2 bits); torch's float32 sqrt on CPU is not correctly rounded
    r = torch.sqrt(tree_sum(y * y).double()).float()
    return cap_l2(canonical_nan(m * r), m)  # (r is NaN exactly when m * r is: m is NaN or Inf only then)


def cap_to_scale(v: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``v`` with every infinite value set to ``±|scale|`` where the scale is finite: a decoded QSGD value
    is ``(code - s) * (scale / s)``, at most ``scale`` in exact arithmetic, but float32 overflows near
    its max (``scale / s`` at 1 bit, where ``s = 1/2``, above half the max; the top level of 8 and 16
    bits rounds past the max). Finite values are left as they are (the top level may sit an ulp above
    the scale, as it always has), so decoding is unchanged except where it used to overflow; an Inf or
    NaN scale (non-finite input) still decodes to non-finite values."""
    cap = scale.abs()
    return torch.where(torch.isinf(v) & torch.isfinite(cap), torch.copysign(cap, v), v)


# --------------------------------------------------------------------------------- qsgd
def inf_sign(x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """``r = x / scale`` with ±1 where ``x`` is ±Inf: an infinite value gets the top or bottom code, so it
    decodes as an infinity of its own sign (its bucket's max-norm scale is Inf; ``Inf / Inf`` would be
    NaN, which takes code 0, the bottom level, and +Inf came back as -Inf)."""
    return torch.where(torch.isinf(x), torch.sign(x), r)


def qsgd_levels(bits: int, full: bool = False) -> float:
    """Half the number of quantisation steps ``s``: codes 0..2s map to scale*(code-s)/s.

    b >= 2: s = 2^(b-1) - 1, a symmetric grid with an exact zero (2-bit is ternary {-1, 0, 1}).
    b == 1: s = 1/2, the grid {-scale, +scale} (stochastic sign, still unbiased).
    ``full`` (QSGD's second scheme): every code is used, 2^b levels and 2^b - 1 equal intervals,
    s = (2^b - 1) / 2 (no exact zero; at 1 bit the same grid as above).
    """
    if full:
        return ((1 << bits) - 1) / 2
    return 0.5 if bits == 1 else float((1 << (bits - 1)) - 1)


#: Widths above this round the exact level (:func:`qsgd_round_exact`); at 8 bits and below the level is
#: ``q = (x / scale) * s + s`` in float32 and the code ``floor(q + u)``: q < 256 keeps 16 fractional bits,
#: so the sum's rounding moves the probability by at most 2^-17 of a step (the bits stay as they were).
QSGD_EXACT_ABOVE_BITS = 8


def _residual32(a: torch.Tensor, b: torch.Tensor | float, c: torch.Tensor) -> torch.Tensor:
    """float32 ``fma(a, b, c)`` for the two error terms of :func:`qsgd_level_residual`, ``r*s - fl(r*s)``
    and ``x - r*safe``: the float32 product is exact in float64 and the sum then too (Sterbenz: ``-c`` is
    within a factor 2 of ``a*b``), so rounding it to float32 once is the FMA's rounding."""
    return (a.double() * b + c.double()).float()


def qsgd_level_residual(x: torch.Tensor, r: torch.Tensor, q: torch.Tensor, safe: torch.Tensor,
                        s: float) -> torch.Tensor:
    """``c`` with ``q + c`` the exact level ``s + s * x / safe`` to within 2^-32 of a step, where
    ``r = x / safe`` and ``q = r * s + s`` are float32 (``|r| <= 1``, ``safe`` finite, broadcastable):
    ``x / safe = r + rem / safe`` with the division's remainder ``rem = fma(-r, safe, x)`` (exact),
    ``r * s = p + fma(r, s, -p)`` with ``p = r * s`` (exact) and ``p + s = q + (p - (q - s))`` (Fast2Sum,
    exact since ``|p| <= s``). ``rem / safe`` enters times ``k = s / safe`` (float32, correctly rounded;
    0 where it overflows, for scales below 2^-113, whose remainders are no longer exact anyway)."""
    p = r * s
    p_lo = _residual32(r, s, -p)
    q_lo = p - (q - s)
    rem = _residual32(-r, safe, x)
    return (q_lo + p_lo) + rem * qsgd_level_ratio(safe, s)


def qsgd_level_ratio(safe: torch.Tensor, s: float) -> torch.Tensor:
    """``k = s / safe`` in float32, correctly rounded (a float64 division rounded once more: exact for a
    quotient, 53 >= 2 * 24 + 2 bits), 0 where it overflows."""
    k = (torch.full_like(safe, s, dtype=torch.float64) / safe.double()).float()
    return torch.where(k < float("inf"), k, torch.zeros_like(k))


def qsgd_round_exact(x: torch.Tensor, r: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, s: float,
                     add: torch.Tensor | float) -> torch.Tensor:
    """``floor(q* + add)`` of the exact level ``q* = q + c`` (:func:`qsgd_level_residual`) with ``add``
    the uniform ``u`` (stochastic) or 1/2 (nearest), as ``fl + floor((q - fl) + (c + add))`` with
    ``fl = floor(q)``: float32 sums of numbers below 2, so the probability of rounding up is
    ``frac(q*)`` within 2^-22 (a float32 ``q + u`` near 2^16 keeps 8 fractional bits: a bias of 2^-9 of
    a step). ``scale``: the buckets' scales, broadcastable; where one is Inf or NaN (its codes decode to
    non-finite values anyway) the float32 ``floor(q + add)``."""
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    c = qsgd_level_residual(x, r, q, safe, s)
    fl = torch.floor(q)
    code = fl + torch.floor((q - fl) + (c + add))
    return torch.where(torch.isfinite(scale), code, torch.floor(q + add))


def qsgd_encode(
    x: torch.Tensor, bits: int, bucket: int, norm: str, stochastic: bool, seed: int, full: bool = False
) -> torch.Tensor:
    """x: (n,) float32 contiguous -> payload uint8: [scales (nb,) f32][codes packed at ``bits``]
    (``full``: the 2^b-level grid, :func:`qsgd_levels`)."""
    n = x.numel()
    xb = to_buckets(x, bucket)  # (nb, bucket)
    scale = bucket_absmax(xb) if norm == "max" else bucket_l2(xb)  # (nb,)
    s = qsgd_levels(bits, full)
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    r = inf_sign(xb, xb / safe[:, None])
    q = r * s + s  # in [0, 2s]
    add = uniform(seed, 0, xb.numel(), x.device).view_as(q) if stochastic else 0.5
    if bits > QSGD_EXACT_ABOVE_BITS:
        q = qsgd_round_exact(xb, r, q, scale[:, None], s, add)
    else:
        q = torch.floor(q + add)
    codes = torch.nan_to_num(q, nan=0.0).clamp_(0.0, 2 * s).to(torch.int64).reshape(-1)[:n]
    return torch.cat([scale.contiguous().view(torch.uint8), pack_bits(codes, bits)])


def qsgd_decode(payload: torch.Tensor, n: int, bits: int, bucket: int, out: torch.Tensor,
                full: bool = False) -> torch.Tensor:
    nb = (n + bucket - 1) // bucket
    scale = view_as(payload[: 4 * nb], torch.float32)
    codes = unpack_bits(payload[4 * nb :], bits, n)
    s = qsgd_levels(bits, full)
    step = scale / s  # (nb,)
    lv = codes.to(torch.float32) - s
    if nb:
        pad = nb * bucket - n
        lv = cap_to_scale(torch.nn.functional.pad(lv, (0, pad)).view(nb, bucket) * step[:, None], scale[:, None])
        out.copy_(lv.reshape(-1)[:n])
    return out


# --------------------------------------------------------------------------------- onebit
def onebit_stats(xg: torch.Tensor, valid: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """xg: (groups, m) float32. Returns (positive mask, mean of x >= 0, mean of x < 0) per group (sums by
    :func:`tree_sum`).

    NaN counts as non-negative so it lands in a mean and comes out non-finite.
    """
    pos = ~(xg < 0)
    neg = ~pos
    if valid is not None:
        pos_v, neg_v = pos & valid, neg & valid
    else:
        pos_v, neg_v = pos, neg
    zero = torch.zeros((), dtype=xg.dtype, device=xg.device)
    cnt_pos = pos_v.sum(dim=1).clamp_min(1).to(xg.dtype)
    cnt_neg = neg_v.sum(dim=1).clamp_min(1).to(xg.dtype)
    means = []
    for mask, cnt in ((pos_v, cnt_pos), (neg_v, cnt_neg)):
        total = tree_sum(torch.where(mask, xg, zero))
        scaled = tree_sum(torch.where(mask, xg * ONEBIT_SUM_SCALE, zero))
        means.append(onebit_mean(total, scaled, cnt))
    return pos, means[0], means[1]


#: onebit means of finite values never overflow: the sum is also taken of x * 2**-32 (an exact scaling,
#: so the same sum scaled, unless it underflows), which cannot overflow for fewer than 2**32 values.
ONEBIT_SUM_SCALE = 2.0**-32


def onebit_mean(total: torch.Tensor, scaled: torch.Tensor, cnt: torch.Tensor) -> torch.Tensor:
    """``total / cnt``; where the float32 sum overflowed although every value was finite (``scaled``, the
    sum of the values times 2**-32, is finite), ``(scaled / cnt) * 2**32`` instead, capped at float32's
    max (the mean of finite float32 values is at most their largest). An Inf or NaN input still gives a
    non-finite mean; a NaN mean is the canonical one (:func:`canonical_nan`)."""
    alt = (scaled / cnt) * (1.0 / ONEBIT_SUM_SCALE)
    alt = torch.where(torch.isinf(alt), torch.copysign(torch.full_like(alt, F32_MAX), alt), alt)
    mean = torch.where(torch.isinf(total) & torch.isfinite(scaled), alt, total / cnt)
    return canonical_nan(mean)


def onebit_encode_buckets(x: torch.Tensor, bucket: int) -> torch.Tensor:
    """x: (n,) -> [(mean_pos, mean_neg) per bucket: float32 x 2nb][sign bits: 1 = non-negative]."""
    n = x.numel()
    xb = to_buckets(x, bucket)
    nb = xb.shape[0]
    valid = None
    if nb * bucket != n:
        valid = (torch.arange(nb * bucket, device=x.device) < n).view(nb, bucket)
    pos, mp, mn = onebit_stats(xb, valid)
    scales = torch.stack([mp, mn], dim=1).reshape(-1).contiguous()
    return torch.cat([scales.view(torch.uint8), pack_bits(pos.reshape(-1)[:n], 1)])


def onebit_decode_buckets(payload: torch.Tensor, n: int, bucket: int, out: torch.Tensor) -> torch.Tensor:
    nb = (n + bucket - 1) // bucket
    scales = view_as(payload[: 8 * nb], torch.float32).view(nb, 2)
    bits = unpack_bits(payload[8 * nb :], 1, n).to(torch.bool)
    if nb:
        b = torch.nn.functional.pad(bits, (0, nb * bucket - n)).view(nb, bucket)
        vals = torch.where(b, scales[:, :1], scales[:, 1:])
        out.copy_(vals.reshape(-1)[:n])
    return out


def onebit_encode_columns(x: torch.Tensor, rows: int) -> torch.Tensor:
    """Per column of the (rows, n/rows) view: [(mean_pos, mean_neg) per column][sign bits, row-major]."""
    n = x.numel()
    cols = n // rows if rows else 0
    x2 = x.view(rows, cols)
    pos, mp, mn = onebit_stats(x2.t(), None)  # groups = columns
    scales = torch.stack([mp, mn], dim=1).reshape(-1).contiguous()
    return torch.cat([scales.view(torch.uint8), pack_bits(pos.t().reshape(-1), 1)])


def onebit_decode_columns(payload: torch.Tensor, n: int, rows: int, out: torch.Tensor) -> torch.Tensor:
    cols = n // rows if rows else 0
    scales = view_as(payload[: 8 * cols], torch.float32).view(cols, 2)
    bits = unpack_bits(payload[8 * cols :], 1, n).to(torch.bool).view(rows, cols)
    if n:
        out.view(rows, cols).copy_(torch.where(bits, scales[:, 0][None, :], scales[:, 1][None, :]))
    return out


# --------------------------------------------------------------------------------- dettmers
def _dm_table(values: Sequence[float], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32, device=device)


def dettmers_nearest_codes(m: torch.Tensor, values: Sequence[float]) -> torch.Tensor:
    """Code of the nearest entry of ``values`` (codes = positions; duplicates take the first)."""
    dev = m.device
    uniq = sorted(set(values))
    first_code = {v: values.index(v) for v in uniq}
    sv = torch.tensor(uniq, dtype=torch.float64, device=dev)
    mids = ((sv[1:] + sv[:-1]) / 2).to(torch.float32)
    codes = torch.tensor([first_code[v] for v in uniq], dtype=torch.int64, device=dev)
    return codes[torch.bucketize(m, mids)]


def dettmers_paper_search(m: torch.Tensor, tbl: Sequence[float], size: int, pivot0: int) -> torch.Tensor:
    """Emulate the 2015 kernels' binary search over ``tbl[:size]`` (vectorised; see lowbit.codecs.dettmers)."""
    t = _dm_table(list(tbl[:size]) + [1.0] * (130 - size), m.device)  # index `size` = the kernel's overread
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


def dettmers_codes(m: torch.Tensor, type_: str, search: str, offset: int) -> torch.Tensor:
    """Magnitudes (already divided by the scale where normalised) -> codes 0..127."""
    t = type_
    mags = magnitudes(t, offset)
    if search == "nearest":
        return dettmers_nearest_codes(m, mags)
    if t == "dynamic":
        codes = dettmers_paper_search(m, mags, 126, 63)
        codes = torch.where(codes == 126, torch.full_like(codes, 127), codes)
        codes = torch.where(m < 1.5e-6, torch.full_like(codes, 126), codes)
        return torch.where(m > 0.995703, torch.full_like(codes, 127), codes)
    codes = dettmers_paper_search(m, mags, 128, 64)
    scale10 = 10.0**offset
    lo, hi = {"linear": (1.5e-6, 0.990703), "static": (5e-7 * scale10, 93 * scale10),
              "mantissa": (5e-7 * scale10, 150 * scale10)}[t]
    codes = torch.where(m < lo, torch.zeros_like(codes), codes)
    return torch.where(m > hi, torch.full_like(codes, 127), codes)


def dettmers_signed(codes: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    # Code 0 (zero) keeps sign 0, so 0x80 stays free as the NaN marker of the fixed-offset types.
    neg = (x < 0) & (codes != 0)
    return codes | (neg.to(torch.int64) << 7)


def dettmers_encode(x: torch.Tensor, type_: str, search: str, bucket: int, offset: int) -> torch.Tensor:
    """x: (n,) float32 contiguous -> [absmax f32 per bucket (normalised types only)][one code byte per
    value]; ``bucket=0``: one scale for the whole tensor."""
    n = x.numel()
    if n == 0:
        return torch.empty(0, dtype=torch.uint8, device=x.device)
    if type_ in NORMALISED:
        xb = to_buckets(x, bucket) if bucket else x.view(1, n)
        scale = bucket_absmax(xb)  # (nb,)
        safe = torch.where(scale > 0, scale, torch.ones_like(scale))
        r = (xb / safe[:, None]).reshape(-1)[:n]
        r = torch.nan_to_num(r, nan=0.0, posinf=1.0, neginf=-1.0)
        if type_ == "dynamic_bnb":
            codes = dettmers_nearest_codes(r, bnb_dynamic_map())
        else:
            codes = dettmers_signed(dettmers_codes(r.abs(), type_, search, offset), r)
        return torch.cat([scale.contiguous().view(torch.uint8), codes.to(torch.uint8)])
    finite = torch.isfinite(x)
    m = torch.where(finite, x.abs(), torch.zeros_like(x))
    codes = dettmers_signed(dettmers_codes(m, type_, search, offset), x)
    codes = torch.where(finite, codes, torch.full_like(codes, NAN_CODE))
    return codes.to(torch.uint8)


def dettmers_decode(payload: torch.Tensor, n: int, type_: str, bucket: int, offset: int,
                    out: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`dettmers_encode` into ``out`` (n,): table lookup times the bucket's scale."""
    if n == 0:
        return out
    ns = layout(n, type_, bucket)[2]
    lut = _dm_table(decode_table(type_, offset), payload.device)
    vals = lut[payload[4 * ns :].to(torch.int64)]
    if ns:
        scale = view_as(payload[: 4 * ns], torch.float32)
        if bucket:
            vals = (to_buckets(vals, bucket) * scale[:, None]).reshape(-1)[:n]
        else:
            vals = vals * scale
    out.copy_(vals)
    return out
