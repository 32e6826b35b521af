"""Fused Triton kernels for the codecs: one pass over the input, near memory bandwidth.

Every function has the name, signature and return convention of its counterpart in
:mod:`lowbit.kernels.reference` (the executable specification of the wire format) and produces the same
bytes: bit for bit in every mode, with two documented exceptions where the reference itself depends on
torch's summation order (``norm="l2"`` scales and the onebit means; see below).

Plan of the encoders (qsgd, onebit, dettmers)
    When the bucket is a power of two between 8 and 8192 ("fused path"), one program owns ``ROWS``
    whole buckets: it loads them once, reduces each bucket to its scale, quantises, packs the codes and
    writes scales and codes. Input is read exactly once. The qsgd and dettmers tiles are 1D (per-bucket
    values reach the elements through a reshape): a ``(ROWS, BUCKET)`` tile made the Dettmers gather
    1.8x slower on an H200 (benchmarks/experiments/tune_encode_gpu.py).
    Other buckets (odd sizes, larger than 8192, dettmers' ``bucket=0`` = one scale for the tensor) take
    the "general path", reading the input twice: first the scales (an atomic integer max per block of
    ``absmax_elems`` when every block lies in one bucket, else chunk partials and a small ``amax`` in
    torch), then a linear kernel over blocks that gathers each element's scale, walking the blocks
    backwards so that it starts on the part of the input the first pass left in L2. Dettmers with one
    scale has its own second pass (_dm_one_scale_kernel): several tiles per program, the next tile's
    load issued before the current tile's arithmetic.
    Every kernel compiles a full-tile variant without masks (16-byte loads and stores whatever ``n``
    is) and a masked one for the last tile.

Division by the scale
    Where every scale of a tile is 0 or within [2**-60, 2**126) (_fast_ok) -- always, unless a bucket
    holds inf or NaN or is extreme -- x / scale is computed as Markstein's correction of x * (1/scale):
    three instructions instead of a full ``div.rn`` each, and the same correctly rounded quotient
    (tested against numpy's division and, on a GPU, against ``div.rn`` for every float x <= scale at
    dozens of scales). Such quotients are finite with |r| <= 1, so the code after them skips the NaN
    tests and clamps; other tiles take ``div_rn`` and the checks (_div_tile).

Bit-exactness
    * Arithmetic mirrors the reference op by op in float32: true divisions use ``div_rn`` (Triton's
      ``/`` is approximate), and kernels are compiled with ``enable_fp_fusion=False`` so ``a*b+c`` is
      not contracted into an FMA (torch runs those as separate elementwise kernels). torch divides a
      tensor by a Python scalar as a true division on CPU but as a multiplication by the float32
      reciprocal on CUDA; qsgd decode probes which (once per device) and does the same.
    * Stochastic rounding draws ``u(seed, i)`` from the same murmur3-fmix32 counter hash, in uint32.
    * Max-norm scales are exact (max does not depend on order; NaN comes out as the reference's NaN).
      ``norm="l2"`` scales are a float32 sum of squares in Triton's reduction order, torch's order
      differs (and differs between torch's own CPU and CUDA kernels), so they agree to a few ulps, and a
      code can differ by one level where that moves a value across a rounding boundary. Onebit means
      likewise (sums of same-signed values, a relative difference below 1e-6); sign bits are exact.

Packing
    Codes form the LSB-first bit stream of :func:`lowbit.kernels.reference.pack_bits`. 8- and 16-bit
    codes are stored as uint8/uint16 elements; 1/2/4-bit codes are reshaped to ``(BLOCK/cpb, cpb)``
    (``cpb`` codes per byte) and summed after shifting, one byte per row. 3/5/6/7-bit codes are not
    handled here: those calls run the reference. Encoders return a payload whose code stream starts
    16-byte aligned (a view at offset 0/4/8/12 of a buffer 16 bytes longer); a payload to decode is
    fastest when ``(data_ptr + scale bytes) % 16 == 0`` too, and must be 4-byte aligned or it is copied.

Dettmers' nearest search
    Instead of a binary search (8 dependent gathers), a cell table indexed by the top bits of the value's
    order-preserving integer key gives, per cell, the codes below and above the one midpoint inside it
    (cells are fine enough that none holds two): one gather and one compare per value, bit-identical
    to ``torch.bucketize`` over the codec's float32 midpoints. ``search="paper"`` emulates the 2015
    binary search with table gathers, as the codec does.

Measured (H200, Triton 3.6, GPU time per call, benchmarks/results/kernels_gpu_h200.json): see
docs/kernels.md for the table against a device-to-device copy of the same bytes.

Importing this module raises ImportError when Triton is missing (the dispatcher then falls back).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch

try:
    import triton
    import triton.language as tl
except Exception as exc:  # pragma: no cover - exercised only where Triton is absent
    raise ImportError(f"lowbit.kernels.triton_kernels needs Triton: {exc}") from exc

from lowbit.kernels import reference as ref
from lowbit.kernels.dettmers_tables import host_tables as _dm_host_tables
from lowbit.kernels.dettmers_tables import layout as _dm_layout

__all__ = [
    "qsgd_encode",
    "qsgd_decode",
    "qsgd_decode_sum",
    "onebit_encode_buckets",
    "onebit_decode_buckets",
    "onebit_decode_sum_buckets",
    "dettmers_encode",
    "dettmers_decode",
    "dettmers_decode_sum",
    "CONFIG",
]

#: Tuning knobs: elements per program and warps per program (the benchmark sweeps them).
#: absmax_elems: block of the atomic max |x| pass of the general path (a read-only pass: larger blocks
#: mean fewer atomics on one address and more bytes in flight).
#: qsgd_enc_warps: warps of the qsgd encoder (2 beat 4 on an H200: more programs in flight per SM).
#: one_scale_*: the Dettmers quantiser with one scale per tensor (_dm_one_scale_kernel): tiles of
#: one_scale_elems values, one_scale_tiles of them per program with the next tile's load in flight.
CONFIG: dict[str, int] = {"elems": 2048, "warps": 4, "qsgd_enc_warps": 2, "max_fused_bucket": 8192,
                          "absmax_elems": 16384, "one_scale_elems": 1024, "one_scale_tiles": 4,
                          "one_scale_warps": 4}

#: Bit widths with a packed Triton path; others run the reference.
PACKED_BITS = (1, 2, 4, 8, 16)
#: Payloads at most this many are decoded and summed in one launch (more: chained launches).
MAX_SUM = 8
#: reference's overflow guards, as Triton constants
F32_MAX = tl.constexpr(ref.F32_MAX)
#: below this |scale| no decoded qsgd value can overflow (|code - s| <= s, step <= 2 |scale|)
F32_HALF_MAX = tl.constexpr(ref.F32_MAX / 2)
ONEBIT_SUM_SCALE = tl.constexpr(ref.ONEBIT_SUM_SCALE)
ONEBIT_SUM_UNSCALE = tl.constexpr(1.0 / ref.ONEBIT_SUM_SCALE)

_LAUNCH = {"enable_fp_fusion": False}


# ===================================================================================== jit helpers
# Each kernel runs its body in one of two compiled variants: MASKED=False for tiles wholly inside the
# tensor (no masks, so loads and stores stay 16 bytes wide whatever n is) and MASKED=True for the last.
@triton.jit
def _ld(ptr, mask, other, MASKED: tl.constexpr):
    if MASKED:
        v = tl.load(ptr, mask=mask, other=other)
    else:
        v = tl.load(ptr)
    return v


@triton.jit
def _st(ptr, val, mask, MASKED: tl.constexpr):
    if MASKED:
        tl.store(ptr, val, mask=mask)
    else:
        tl.store(ptr, val)


@triton.jit
def _uniform(idx, key):
    """u(seed, i) of the reference: idx any integer tensor (global element index), key uint32."""
    h = idx.to(tl.uint32) * 0x9E3779B1 ^ key
    h ^= h >> 16
    h *= 0x85EBCA6B
    h ^= h >> 13
    h *= 0xC2B2AE35
    h ^= h >> 16
    return (h >> 8).to(tl.float32) * (1.0 / 16777216.0)


@triton.jit
def _absmax_bits(x, axis: tl.constexpr):
    """Max |x| along axis as int32 bits, NaN-propagating: |x| has its sign bit clear, so its bits
    order like the floats, with every NaN above +inf; NaNs come out as the canonical 0x7FC00000 (the
    reference's NaN). One integer max per element instead of a float max plus a NaN test."""
    m = tl.max(tl.abs(x).to(tl.int32, bitcast=True), axis=axis)
    return tl.where(m > 0x7F800000, 0x7FC00000, m)


@triton.jit
def _row_absmax(x):
    """x: (R, C) float32 -> (R,) max |x|, NaN if the row holds a NaN (reference.bucket_absmax)."""
    return _absmax_bits(x, 1).to(tl.float32, bitcast=True)


@triton.jit
def _markstein(x, s, inv):
    """x / s correctly rounded, from inv = 1/s correctly rounded: q = x*inv is within an ulp, the
    remainder x - q*s is exact in an FMA, and q + remainder*inv rounds to the true quotient
    (Markstein's theorem) -- three instructions instead of a full ``div.rn`` per element. Exact while
    s, 1/s and the remainder stay normal; _fast_ok says where the callers may use it."""
    q = x * inv
    return tl.fma(tl.fma(-q, s, x), inv, q)


@triton.jit
def _fast_ok(scale):
    """Scales (max |x| of their bucket, or an L2 norm) whose buckets _markstein divides exactly:
    0 (an all-zero bucket, divided by 1), or within [2**-60, 2**126). Then 1/s is normal, every x is
    finite (an inf or NaN makes the scale inf or NaN), and for |x| <= s the remainder is exact whenever
    |x| >= 2**-102; a smaller |x| gives a quotient below 2**-42, which every codec maps to the same
    code whichever neighbouring float (or signed zero) it is."""
    return (scale == 0) | ((scale >= 8.673617379884035e-19) & (scale < 8.507059173023462e37))


@triton.jit
def _safe(scale):
    return tl.where(scale > 0, scale, 1.0)


@triton.jit
def _all_fast(scale):
    """Scalar: whether every scale of this (ROWS,) vector passes _fast_ok."""
    return tl.min(_fast_ok(scale).to(tl.int32), axis=0) == 1


@triton.jit
def _tile_scales(x, ROWS: tl.constexpr, BUCKET: tl.constexpr):
    """x: (ROWS * BUCKET,) a 1D tile of whole buckets -> max |x| of each bucket: a scalar when
    ROWS == 1, else (ROWS,). Tiles stay 1D: a (ROWS, BUCKET) tile made the Dettmers gather ~1.8x slower
    on an H200 (benchmarks/experiments/tune_encode_gpu.py), whatever the bucket."""
    if ROWS == 1:
        scale = _absmax_bits(x, 0).to(tl.float32, bitcast=True)
    else:
        scale = _row_absmax(tl.reshape(x, (ROWS, BUCKET)))
    return scale


@triton.jit
def _per_elem(v, ROWS: tl.constexpr, BUCKET: tl.constexpr):
    """A per-bucket value (scalar or (ROWS,)) for each element of the 1D tile (scalar stays scalar)."""
    if ROWS == 1:
        out = v
    else:
        out = tl.reshape(tl.broadcast_to(v[:, None], (ROWS, BUCKET)), (ROWS * BUCKET,))
    return out


@triton.jit
def _tile_fast(scale, ROWS: tl.constexpr):
    """Scalar: every scale of the tile passes _fast_ok."""
    if ROWS == 1:
        fast = _fast_ok(scale)
    else:
        fast = _all_fast(scale)
    return fast


@triton.jit
def _div_tile(x, scale, ROWS: tl.constexpr, BUCKET: tl.constexpr, SANITIZE: tl.constexpr, NAN_TO: tl.constexpr):
    """r = x / safe scale of its bucket, rounded as tl.div_rn, for a 1D tile of whole buckets (or any x
    with ROWS == 1 and a scalar scale). Where every scale passes _fast_ok, _markstein divides and r is
    finite with |r| <= 1 already; otherwise div_rn, and with SANITIZE NaN -> NAN_TO and a clamp to
    [-1, 1] make r bounded too (the codecs' own handling of those values, see _quantize, _dm_codes), so
    that the code after this needs no checks either way."""
    safe = _safe(scale)
    s = _per_elem(safe, ROWS, BUCKET)
    if _tile_fast(scale, ROWS):
        r = _markstein(x, s, _per_elem(tl.div_rn(1.0, safe), ROWS, BUCKET))
    else:
        r = tl.div_rn(x, s)
        if SANITIZE:
            r = tl.where(r != r, NAN_TO, r)
            r = tl.minimum(tl.maximum(r, -1.0), 1.0)
    return r


@triton.jit
def _tile_sums(v, ROWS: tl.constexpr, BUCKET: tl.constexpr):
    """Sum of v over each bucket of a 1D tile (scalar when ROWS == 1)."""
    if ROWS == 1:
        out = tl.sum(v, axis=0)
    else:
        out = tl.sum(tl.reshape(v, (ROWS, BUCKET)), axis=1)
    return out


@triton.jit
def _store_scales(scale_ptr, scale, pid, nb, ROWS: tl.constexpr, MASKED: tl.constexpr):
    if ROWS == 1:
        _st(scale_ptr + pid, scale, pid < nb, MASKED)
    else:
        rows = pid * ROWS + tl.arange(0, ROWS)
        _st(scale_ptr + rows, scale, rows < nb, MASKED)


@triton.jit
def _quantize(r, idx, key, S: tl.constexpr, STOCH: tl.constexpr, BOUNDED: tl.constexpr):
    """QSGD code of each r = x / (its bucket's safe scale): uint32 in [0, 2S].

    The reference floors q + u, maps NaN to 0 and clamps to [0, 2S]. Clamping first gives the same
    codes (the bounds are integers), and then truncation is the floor. BOUNDED: r is finite with
    |r| <= 1 (_div_tile with NAN_TO=-1, whose r = -1 gives q = 0, the code of a NaN), so q + u >= 0
    and only the upper clamp is left."""
    q = r * S + S
    if STOCH:
        q = q + _uniform(idx, key)
    else:
        q = q + 0.5
    if not BOUNDED:
        q = tl.where(q == q, q, 0.0)
        q = tl.maximum(q, 0.0)
    return tl.minimum(q, 2 * S).to(tl.uint32)  # (2S + u may round up to 2S + 1)


@triton.jit
def _pack_store(codes, code_ptr, elem0, nbytes, n,
                BLOCK: tl.constexpr, BITS: tl.constexpr, MASKED: tl.constexpr, HINT: tl.constexpr = False):
    """Store BLOCK codes (any shape, row-major = element order; codes of elements >= n already zero)
    of elements elem0 .. elem0+BLOCK-1 (elem0 a multiple of 8) into the LSB-first stream."""
    if BITS == 8:
        offs = elem0 + tl.arange(0, BLOCK)
        _st(code_ptr + offs, tl.reshape(codes, (BLOCK,)).to(tl.uint8), offs < n, MASKED)
    elif BITS == 16:
        offs = elem0 + tl.arange(0, BLOCK)
        code16_ptr = code_ptr.to(tl.pointer_type(tl.uint16))
        _st(code16_ptr + offs, tl.reshape(codes, (BLOCK,)).to(tl.uint16), offs < n, MASKED)
    else:
        if HINT and not MASKED:
            # A layout hint: a uint8 store of the tile's shape whose mask is never true (a full tile
            # has every offset < n), so Triton lays the tile out 16 values per thread, as it does for
            # 8-bit codes: per-bucket reductions then cover 16 values per lane and bytes pack within a
            # thread. Measured on an H200: 2-bit encode +3-5 points of copy bandwidth, 1-bit +0-3;
            # 4-bit mixed and onebit worse, so only qsgd at 1-2 bits asks for it.
            offs8 = elem0 + tl.arange(0, BLOCK)
            tl.store(code_ptr + offs8, tl.reshape(codes, (BLOCK,)).to(tl.uint8), mask=offs8 >= n)
        CPB: tl.constexpr = 8 // BITS
        c = tl.reshape(codes, (BLOCK // CPB, CPB))
        shifts = (tl.arange(0, CPB) * BITS).to(tl.uint32)
        byte = tl.sum(c << shifts[None, :], axis=1)
        boffs = elem0 // CPB + tl.arange(0, BLOCK // CPB)
        _st(code_ptr + boffs, byte.to(tl.uint8), boffs < nbytes, MASKED)


@triton.jit
def _load_codes(code_ptr, elem0, nbytes, n,
                BLOCK: tl.constexpr, BITS: tl.constexpr, MASKED: tl.constexpr):
    """Inverse of _pack_store: (BLOCK,) uint32 codes of elements elem0 .. elem0+BLOCK-1."""
    if BITS == 8:
        offs = elem0 + tl.arange(0, BLOCK)
        c = _ld(code_ptr + offs, offs < n, 0, MASKED).to(tl.uint32)
    elif BITS == 16:
        offs = elem0 + tl.arange(0, BLOCK)
        code16_ptr = code_ptr.to(tl.pointer_type(tl.uint16))
        c = _ld(code16_ptr + offs, offs < n, 0, MASKED).to(tl.uint32)
    else:
        CPB: tl.constexpr = 8 // BITS
        boffs = elem0 // CPB + tl.arange(0, BLOCK // CPB)
        byte = _ld(code_ptr + boffs, boffs < nbytes, 0, MASKED).to(tl.uint32)
        shifts = (tl.arange(0, CPB) * BITS).to(tl.uint32)
        c = tl.reshape((byte[:, None] >> shifts[None, :]) & ((1 << BITS) - 1), (BLOCK,))
    return c


@triton.jit
def _pid(I64: tl.constexpr, REVERSE: tl.constexpr = False):
    """This program's tile index. REVERSE (for a second pass over x) walks the tiles backwards, so it
    starts on the end of x that the first pass left in L2."""
    pid = tl.program_id(0)
    if REVERSE:
        pid = tl.num_programs(0) - 1 - pid
    if I64:
        pid = pid.to(tl.int64)
    return pid


# ===================================================================================== qsgd kernels
@triton.jit
def _qsgd_encode_body(x_ptr, pay_ptr, code_ptr, n, nb, bucket, nbytes, key, pid,
                      BUCKET: tl.constexpr, ROWS: tl.constexpr, FUSED: tl.constexpr, BITS: tl.constexpr,
                      S: tl.constexpr, L2: tl.constexpr, STOCH: tl.constexpr, MASKED: tl.constexpr):
    BLOCK: tl.constexpr = ROWS * BUCKET
    scale_ptr = pay_ptr.to(tl.pointer_type(tl.float32))  # the payload starts with the scales
    if FUSED:  # a 1D tile of ROWS whole buckets: scales computed here
        offs = pid * BLOCK + tl.arange(0, BLOCK)
        inb = offs < n
        x = _ld(x_ptr + offs, inb, 0.0, MASKED)
        scale = _tile_scales(x, ROWS, BUCKET)
        if L2:
            y = _div_tile(x, scale, ROWS, BUCKET, False, 0.0)
            l2 = scale * tl.sqrt_rn(_tile_sums(y * y, ROWS, BUCKET))
            # reference.cap_l2: a finite bucket's norm past float32's max is capped there
            scale = tl.where((l2 == float("inf")) & (scale < float("inf")), F32_MAX, l2)
        _store_scales(scale_ptr, scale, pid, nb, ROWS, MASKED)
        codes = _quantize(_div_tile(x, scale, ROWS, BUCKET, True, -1.0), offs, key, S, STOCH, True)
    else:  # (BLOCK,) elements of any buckets: scales precomputed, gathered
        offs = pid * BLOCK + tl.arange(0, BLOCK)
        inb = offs < n
        x = _ld(x_ptr + offs, inb, 0.0, MASKED)
        scale = _ld(scale_ptr + offs // bucket, inb, 1.0, MASKED)
        codes = _quantize(tl.div_rn(x, _safe(scale)), offs, key, S, STOCH, False)
    if MASKED:
        codes = tl.where(inb, codes, 0)
    _pack_store(codes, code_ptr, pid * BLOCK, nbytes, n, BLOCK, BITS, MASKED, BITS <= 2)


@triton.jit(do_not_specialize=["key"])
def _qsgd_encode_kernel(x_ptr, pay_ptr, code_ptr, n, nb, bucket, nbytes, key,
                        BUCKET: tl.constexpr, ROWS: tl.constexpr, FUSED: tl.constexpr, BITS: tl.constexpr,
                        S: tl.constexpr, L2: tl.constexpr, STOCH: tl.constexpr, I64: tl.constexpr):
    pid = _pid(I64, not FUSED)
    ukey = key.to(tl.uint32, bitcast=True)
    if (pid + 1) * (ROWS * BUCKET) <= n:
        _qsgd_encode_body(x_ptr, pay_ptr, code_ptr, n, nb, bucket, nbytes, ukey, pid,
                          BUCKET, ROWS, FUSED, BITS, S, L2, STOCH, False)
    else:
        _qsgd_encode_body(x_ptr, pay_ptr, code_ptr, n, nb, bucket, nbytes, ukey, pid,
                          BUCKET, ROWS, FUSED, BITS, S, L2, STOCH, True)


@triton.jit
def _partial_absmax(x_ptr, part_ptr, n, bucket, cpb, nunits,
                    CH: tl.constexpr, UR: tl.constexpr, I64: tl.constexpr):
    """Max |x| (NaN-propagating) of each unit = a chunk of CH elements of one bucket."""
    u = _pid(I64) * UR + tl.arange(0, UR)
    b = u // cpb
    c = u - b * cpb
    start = b * bucket + c * CH
    length = tl.minimum(bucket - c * CH, CH)
    col = tl.arange(0, CH)
    offs = start[:, None] + col[None, :]
    mask = (col[None, :] < length[:, None]) & (offs < n) & (u[:, None] < nunits)
    x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    tl.store(part_ptr + u, _row_absmax(x), mask=u < nunits)


@triton.jit
def _absmax_atomic_body(x_ptr, scale_bits_ptr, n, bucket, pid, BLOCK: tl.constexpr, MASKED: tl.constexpr):
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    x = _ld(x_ptr + offs, offs < n, 0.0, MASKED)
    # Integer max of the bits (see _absmax_bits), so the atomic max over blocks is exact too.
    tl.atomic_max(scale_bits_ptr + (pid * BLOCK) // bucket, _absmax_bits(x, 0))


@triton.jit
def _absmax_atomic(x_ptr, scale_bits_ptr, n, bucket, BLOCK: tl.constexpr, I64: tl.constexpr):
    """scale[b] = max(scale[b], max |x| of this block), as int32 bits; every block lies in one bucket."""
    pid = _pid(I64)
    if (pid + 1) * BLOCK <= n:
        _absmax_atomic_body(x_ptr, scale_bits_ptr, n, bucket, pid, BLOCK, False)
    else:
        _absmax_atomic_body(x_ptr, scale_bits_ptr, n, bucket, pid, BLOCK, True)


@triton.jit
def _step(scale, S: tl.constexpr, INV: tl.constexpr):
    """scale / S as the reference computes it on this device: torch divides by a Python scalar as a
    true division on CPU but as a multiplication by float32(1/S) on CUDA (INV != 0 then)."""
    if INV == 0.0:
        step = tl.div_rn(scale, S)
    else:
        step = scale * INV
    return step


@triton.jit
def _qsgd_dec_one(pp, cp, pid, n, nb, bucket, nbytes, BUCKET: tl.constexpr, ROWS: tl.constexpr,
                  FUSED: tl.constexpr, BITS: tl.constexpr, S: tl.constexpr, INV: tl.constexpr,
                  MASKED: tl.constexpr, CAP: tl.constexpr):
    """Decoded values of one payload for this program's tile, and the |scale| of each row (FUSED) or
    element. CAP: apply reference.cap_to_scale (needed only where some |scale| > F32_HALF_MAX)."""
    BLOCK: tl.constexpr = ROWS * BUCKET
    sp = pp.to(tl.pointer_type(tl.float32))  # the payload starts with the scales
    c = _load_codes(cp, pid * BLOCK, nbytes, n, BLOCK, BITS, MASKED)
    if FUSED:
        rows = pid * ROWS + tl.arange(0, ROWS)
        sc = _ld(sp + rows, rows < nb, 0.0, MASKED)
        v = (tl.reshape(c, (ROWS, BUCKET)).to(tl.float32) - S) * _step(sc, S, INV)[:, None]
        if CAP:
            v = _cap(v, tl.abs(sc)[:, None])
    else:
        offs = pid * BLOCK + tl.arange(0, BLOCK)
        sc = _ld(sp + offs // bucket, offs < n, 0.0, MASKED)
        v = (c.to(tl.float32) - S) * _step(sc, S, INV)
        if CAP:
            v = _cap(v, tl.abs(sc))
    return v, tl.abs(sc)


@triton.jit
def _qsgd_dec_sum(out_ptr, offs, inb, n, nb, bucket, nbytes, pid, ps, K: tl.constexpr, ACC: tl.constexpr,
                  FUSED: tl.constexpr, BUCKET: tl.constexpr, ROWS: tl.constexpr, BITS: tl.constexpr,
                  S: tl.constexpr, INV: tl.constexpr, MASKED: tl.constexpr, CAP: tl.constexpr):
    """[out +] dec(p0) + ... + dec(p_{K-1}) for the tile, left to right; the largest |scale| seen
    (per row or element)."""
    acc, big = _qsgd_dec_one(ps[0], ps[1], pid, n, nb, bucket, nbytes, BUCKET, ROWS, FUSED, BITS, S, INV, MASKED,
                             CAP)
    if ACC:
        acc = _ld(out_ptr + offs, inb, 0.0, MASKED) + acc
    for k in tl.static_range(1, K):
        v, a = _qsgd_dec_one(ps[2 * k], ps[2 * k + 1], pid, n, nb, bucket, nbytes, BUCKET, ROWS, FUSED, BITS, S,
                             INV, MASKED, CAP)
        acc = acc + v
        big = tl.maximum(big, a)
    return acc, big


@triton.jit
def _cap(v, cap):
    """reference.cap_to_scale: an overflow to +-inf becomes ±cap (= |scale|) where the scale is finite."""
    return tl.where((tl.abs(v) == float("inf")) & (cap < float("inf")), tl.where(v < 0, -cap, cap), v)


@triton.jit
def _qsgd_decode_body(out_ptr, n, nb, bucket, nbytes, pid, ps,
                      K: tl.constexpr, ACC: tl.constexpr, FUSED: tl.constexpr, BUCKET: tl.constexpr,
                      ROWS: tl.constexpr, BITS: tl.constexpr, S: tl.constexpr, INV: tl.constexpr,
                      MASKED: tl.constexpr, DIV: tl.constexpr, DINV: tl.constexpr):
    """out = [out +] dec(p0) + dec(p1) + ... + dec(p_{K-1}), added left to right in float32, then divided
    by DIV (when not 1) the way torch's ``out.div_(DIV)`` divides on this device (see _step).

    FUSED: a (ROWS, BUCKET) tile of whole buckets (BUCKET a power of two), one scale load per row;
    otherwise a (ROWS*BUCKET,) block with a gathered scale per element (any ``bucket``).
    ps = (p0, c0, p1, c1, ...): payload k (uint8, its scales first) and its code stream."""
    if FUSED:
        rows = pid * ROWS + tl.arange(0, ROWS)
        offs = rows[:, None] * BUCKET + tl.arange(0, BUCKET)[None, :]
    else:
        offs = pid * (ROWS * BUCKET) + tl.arange(0, ROWS * BUCKET)
    inb = offs < n
    acc, big = _qsgd_dec_sum(out_ptr, offs, inb, n, nb, bucket, nbytes, pid, ps, K, ACC, FUSED, BUCKET, ROWS,
                             BITS, S, INV, MASKED, False)
    # Only where some |scale| exceeds half float32's max can a decoded value overflow: such a tile (rare)
    # is decoded again with reference.cap_to_scale. One check per tile after all K payloads, so the
    # common path stays straight-line code (a branch per payload cost decode-and-sum half its speed).
    if tl.max(big) > F32_HALF_MAX:
        acc, big = _qsgd_dec_sum(out_ptr, offs, inb, n, nb, bucket, nbytes, pid, ps, K, ACC, FUSED, BUCKET, ROWS,
                                 BITS, S, INV, MASKED, True)
    if DIV != 1.0:
        acc = _step(acc, DIV, DINV)
    _st(out_ptr + offs, acc, inb, MASKED)


@triton.jit
def _qsgd_decode_kernel(out_ptr, n, nb, bucket, nbytes, ps,
                        K: tl.constexpr, ACC: tl.constexpr, FUSED: tl.constexpr, BUCKET: tl.constexpr,
                        ROWS: tl.constexpr, BITS: tl.constexpr, S: tl.constexpr, INV: tl.constexpr,
                        I64: tl.constexpr, DIV: tl.constexpr, DINV: tl.constexpr):
    """K (at most MAX_SUM) payloads per launch (K = 1: a plain decode); ACC adds onto out (the sum of the
    payloads before these); the last launch divides by DIV (1: no division)."""
    pid = _pid(I64)
    if (pid + 1) * (ROWS * BUCKET) <= n:
        _qsgd_decode_body(out_ptr, n, nb, bucket, nbytes, pid, ps, K, ACC, FUSED, BUCKET, ROWS, BITS, S, INV,
                          False, DIV, DINV)
    else:
        _qsgd_decode_body(out_ptr, n, nb, bucket, nbytes, pid, ps, K, ACC, FUSED, BUCKET, ROWS, BITS, S, INV,
                          True, DIV, DINV)


# ===================================================================================== onebit kernels
@triton.jit
def _onebit_encode_body(x_ptr, scale_ptr, code_ptr, n, nb, pid, nbytes,
                        BUCKET: tl.constexpr, ROWS: tl.constexpr, FUSED: tl.constexpr, MASKED: tl.constexpr):
    BLOCK: tl.constexpr = ROWS * BUCKET
    if FUSED:
        rows = pid * ROWS + tl.arange(0, ROWS)
        offs = rows[:, None] * BUCKET + tl.arange(0, BUCKET)[None, :]
    else:
        offs = pid * BLOCK + tl.arange(0, BLOCK)
    inb = offs < n
    x = _ld(x_ptr + offs, inb, 0.0, MASKED)
    pos = (x >= 0) | (x != x)  # ~(x < 0): NaN counts as non-negative
    if MASKED:
        pos = pos & inb
    if FUSED:
        neg = ~pos
        if MASKED:
            neg = neg & inb
        sum_pos = tl.sum(tl.where(pos, x, 0.0), axis=1)
        sum_neg = tl.sum(tl.where(neg, x, 0.0), axis=1)
        cnt_pos = tl.maximum(tl.sum(pos.to(tl.int32), axis=1), 1).to(tl.float32)
        cnt_neg = tl.maximum(tl.sum(neg.to(tl.int32), axis=1), 1).to(tl.float32)
        mean_pos = tl.div_rn(sum_pos, cnt_pos)
        mean_neg = tl.div_rn(sum_neg, cnt_neg)
        # reference.onebit_mean: a sum of finite values that overflowed is taken again of x * 2**-32
        # (only in tiles that have one, so the common path costs one more max)
        if tl.max(tl.maximum(tl.abs(sum_pos), tl.abs(sum_neg))) == float("inf"):
            xs = x * ONEBIT_SUM_SCALE
            mean_pos = _onebit_mean(sum_pos, tl.sum(tl.where(pos, xs, 0.0), axis=1), cnt_pos, mean_pos)
            mean_neg = _onebit_mean(sum_neg, tl.sum(tl.where(neg, xs, 0.0), axis=1), cnt_neg, mean_neg)
        _st(scale_ptr + 2 * rows, mean_pos, rows < nb, MASKED)
        _st(scale_ptr + 2 * rows + 1, mean_neg, rows < nb, MASKED)
    _pack_store(pos.to(tl.uint32), code_ptr, pid * BLOCK, nbytes, n, BLOCK, 1, MASKED)


@triton.jit
def _onebit_mean(total, scaled, cnt, mean):
    alt = tl.div_rn(scaled, cnt) * ONEBIT_SUM_UNSCALE
    alt = tl.where(alt == float("inf"), F32_MAX, tl.where(alt == -float("inf"), -F32_MAX, alt))
    fix = (tl.abs(total) == float("inf")) & (tl.abs(scaled) < float("inf"))
    return tl.where(fix, alt, mean)


@triton.jit
def _onebit_encode_kernel(x_ptr, scale_ptr, code_ptr, n, nb, nbytes,
                          BUCKET: tl.constexpr, ROWS: tl.constexpr, FUSED: tl.constexpr, I64: tl.constexpr):
    """FUSED: means and sign bits of whole buckets; otherwise sign bits only (means come from torch)."""
    pid = _pid(I64, not FUSED)
    if (pid + 1) * (ROWS * BUCKET) <= n:
        _onebit_encode_body(x_ptr, scale_ptr, code_ptr, n, nb, pid, nbytes, BUCKET, ROWS, FUSED, False)
    else:
        _onebit_encode_body(x_ptr, scale_ptr, code_ptr, n, nb, pid, nbytes, BUCKET, ROWS, FUSED, True)


@triton.jit
def _onebit_dec_one(scale_ptr, code_ptr, pid, n, nb, bucket, nbytes, BUCKET: tl.constexpr, ROWS: tl.constexpr,
                    FUSED: tl.constexpr, MASKED: tl.constexpr):
    """Decoded values of one payload for this program's tile: its bucket's mean of the sign's side."""
    BLOCK: tl.constexpr = ROWS * BUCKET
    bits = _load_codes(code_ptr, pid * BLOCK, nbytes, n, BLOCK, 1, MASKED)
    if FUSED:
        rows = pid * ROWS + tl.arange(0, ROWS)
        mp = _ld(scale_ptr + 2 * rows, rows < nb, 0.0, MASKED)[:, None]
        mn = _ld(scale_ptr + 2 * rows + 1, rows < nb, 0.0, MASKED)[:, None]
        b = tl.reshape(bits, (ROWS, BUCKET))
    else:
        offs = pid * BLOCK + tl.arange(0, BLOCK)
        g = offs // bucket
        mp = _ld(scale_ptr + 2 * g, offs < n, 0.0, MASKED)
        mn = _ld(scale_ptr + 2 * g + 1, offs < n, 0.0, MASKED)
        b = bits
    return tl.where(b != 0, mp, mn)


@triton.jit
def _onebit_decode_body(out_ptr, n, nb, bucket, nbytes, pid, ps, K: tl.constexpr, ACC: tl.constexpr,
                        BUCKET: tl.constexpr, ROWS: tl.constexpr, FUSED: tl.constexpr, MASKED: tl.constexpr,
                        DIV: tl.constexpr, DINV: tl.constexpr):
    """out = ([out +] dec(p0) + ... + dec(p_{K-1})) / DIV, added left to right in float32;
    ps = (s0, c0, s1, c1, ...): the means and the sign bits of each payload."""
    if FUSED:
        rows = pid * ROWS + tl.arange(0, ROWS)
        offs = rows[:, None] * BUCKET + tl.arange(0, BUCKET)[None, :]
    else:
        offs = pid * (ROWS * BUCKET) + tl.arange(0, ROWS * BUCKET)
    acc = _onebit_dec_one(ps[0], ps[1], pid, n, nb, bucket, nbytes, BUCKET, ROWS, FUSED, MASKED)
    if ACC:
        acc = _ld(out_ptr + offs, offs < n, 0.0, MASKED) + acc
    for k in tl.static_range(1, K):
        acc = acc + _onebit_dec_one(ps[2 * k], ps[2 * k + 1], pid, n, nb, bucket, nbytes, BUCKET, ROWS, FUSED,
                                    MASKED)
    if DIV != 1.0:
        acc = _step(acc, DIV, DINV)
    _st(out_ptr + offs, acc, offs < n, MASKED)


@triton.jit
def _onebit_decode_kernel(out_ptr, n, nb, bucket, nbytes, ps, K: tl.constexpr, ACC: tl.constexpr,
                          BUCKET: tl.constexpr, ROWS: tl.constexpr, FUSED: tl.constexpr, I64: tl.constexpr,
                          DIV: tl.constexpr, DINV: tl.constexpr):
    """K (at most MAX_SUM) payloads per launch (K = 1: a plain decode); ACC adds onto out; the last
    launch divides by DIV (1: none)."""
    pid = _pid(I64)
    if (pid + 1) * (ROWS * BUCKET) <= n:
        _onebit_decode_body(out_ptr, n, nb, bucket, nbytes, pid, ps, K, ACC, BUCKET, ROWS, FUSED, False, DIV,
                            DINV)
    else:
        _onebit_decode_body(out_ptr, n, nb, bucket, nbytes, pid, ps, K, ACC, BUCKET, ROWS, FUSED, True, DIV,
                            DINV)


# ===================================================================================== dettmers kernels
@triton.jit
def _dm_nearest(v, cell_ptr, SHIFT: tl.constexpr, KBASE: tl.constexpr, NCELL: tl.constexpr,
                SIGNED: tl.constexpr):
    """Code of the table value nearest to v: the count of midpoints below v, read off the cell table.

    SIGNED (dynamic_bnb, codes = sorted positions): entry = positions below the cell << 24 | offset
    of the cell's midpoint. Magnitudes (v >= +0, whose float bits already order like the values):
    entry = code below the midpoint << 25 | code above it << SHIFT | offset of the midpoint."""
    b = v.to(tl.int32, bitcast=True)
    if SIGNED:
        key = tl.where(b >= 0, b, b ^ 0x7FFFFFFF)  # order-preserving integer key of any float
        cell = tl.minimum(tl.maximum((key >> SHIFT) - KBASE, 0), NCELL - 1)
        e = tl.load(cell_ptr + cell)
        code = ((e >> 24) & 0xFF) + ((key & ((1 << SHIFT) - 1)) > (e & 0xFFFFFF)).to(tl.int32)
    else:
        e = tl.load(cell_ptr + (b >> SHIFT))
        above = (b & ((1 << SHIFT) - 1)) > (e & ((1 << SHIFT) - 1))
        code = tl.where(above, (e >> SHIFT) & 0x7F, (e >> 25) & 0x7F)
    return code


@triton.jit
def _dm_paper(m, t_ptr, lo, hi, PIVOT0: tl.constexpr, DYN: tl.constexpr):
    """The 2015 kernels' binary search (Dettmers._codes with search='paper')."""
    pivot = tl.full(m.shape, PIVOT0, tl.int32)
    lower = tl.zeros(m.shape, tl.int32)
    for i in tl.static_range(6):
        gt = m > tl.load(t_ptr + pivot)
        lower = tl.where(gt, pivot, lower)
        pivot = tl.where(gt, pivot + (32 >> i), pivot - (32 >> i))
    take = (tl.load(t_ptr + pivot) - m) < tl.abs(tl.load(t_ptr + lower) - m)
    codes = tl.where(take, pivot, lower)
    if DYN:
        codes = tl.where(codes == 126, 127, codes)
        codes = tl.where(m < 1.5e-6, 126, codes)
        codes = tl.where(m > 0.995703, 127, codes)
    else:
        codes = tl.where(m < lo, 0, codes)
        codes = tl.where(m > hi, 127, codes)
    return codes


@triton.jit
def _dm_codes(x, r, cell_ptr, t_ptr, lo, hi,
              NORM: tl.constexpr, SIGNED: tl.constexpr, PAPER: tl.constexpr, DYN: tl.constexpr,
              PIVOT0: tl.constexpr, SHIFT: tl.constexpr, KBASE: tl.constexpr, NCELL: tl.constexpr,
              BOUNDED: tl.constexpr = False):
    """Code byte of each x; NORM: r = x / its bucket's safe scale (ignored otherwise). BOUNDED: r is
    finite with |r| <= 1 already (_div_tile with NAN_TO=0), so the NaN test and the clamp are skipped."""
    if NORM:
        if not BOUNDED:
            r = tl.where(r != r, 0.0, r)
            # nan_to_num(posinf=1, neginf=-1). Finite |r| <= 1 unless the scale is NaN, and then values
            # past 1 get the same code as 1 (the largest), so clamping is exact.
            r = tl.minimum(tl.maximum(r, -1.0), 1.0)
    else:
        finite = tl.abs(x) < float("inf")  # False for NaN and +-inf
        r = tl.where(finite, x, 0.0)
    if SIGNED:
        codes = _dm_nearest(r, cell_ptr, SHIFT, KBASE, NCELL, True)
    else:
        m = tl.abs(r)
        if PAPER:
            codes = _dm_paper(m, t_ptr, lo, hi, PIVOT0, DYN)
        else:
            codes = _dm_nearest(m, cell_ptr, SHIFT, KBASE, NCELL, False)
        if NORM:
            codes = tl.where((r < 0) & (codes != 0), codes | 128, codes)
        else:
            codes = tl.where((x < 0) & (codes != 0), codes | 128, codes)
            codes = tl.where(finite, codes, 128)  # non-finite: the NaN marker 0x80
    return codes


@triton.jit
def _dm_encode_body(x_ptr, scale_ptr, code_ptr, cell_ptr, t_ptr, lo, hi, n, nb, bucket, pid,
                    BUCKET: tl.constexpr, ROWS: tl.constexpr, FUSED: tl.constexpr, NORM: tl.constexpr,
                    SIGNED: tl.constexpr, PAPER: tl.constexpr, DYN: tl.constexpr, PIVOT0: tl.constexpr,
                    SHIFT: tl.constexpr, KBASE: tl.constexpr, NCELL: tl.constexpr, MASKED: tl.constexpr):
    offs = pid * (ROWS * BUCKET) + tl.arange(0, ROWS * BUCKET)
    x = _ld(x_ptr + offs, offs < n, 0.0, MASKED)
    if FUSED:  # a 1D tile of ROWS whole buckets (see _tile_scales)
        scale = _tile_scales(x, ROWS, BUCKET)
        _store_scales(scale_ptr, scale, pid, nb, ROWS, MASKED)
        codes = _dm_codes(x, _div_tile(x, scale, ROWS, BUCKET, True, 0.0), cell_ptr, t_ptr, lo, hi, True,
                          SIGNED, PAPER, DYN, PIVOT0, SHIFT, KBASE, NCELL, True)
    else:
        if NORM:
            scale = _ld(scale_ptr + offs // bucket, offs < n, 1.0, MASKED)
            codes = _dm_codes(x, tl.div_rn(x, _safe(scale)), cell_ptr, t_ptr, lo, hi, NORM, SIGNED, PAPER,
                              DYN, PIVOT0, SHIFT, KBASE, NCELL)
        else:
            codes = _dm_codes(x, x, cell_ptr, t_ptr, lo, hi, NORM, SIGNED, PAPER, DYN, PIVOT0, SHIFT,
                              KBASE, NCELL)
    _st(code_ptr + offs, codes.to(tl.uint8), offs < n, MASKED)


@triton.jit
def _dm_encode_kernel(x_ptr, scale_ptr, code_ptr, cell_ptr, t_ptr, lo, hi, n, nb, bucket,
                      BUCKET: tl.constexpr, ROWS: tl.constexpr, FUSED: tl.constexpr, NORM: tl.constexpr,
                      SIGNED: tl.constexpr, PAPER: tl.constexpr, DYN: tl.constexpr, PIVOT0: tl.constexpr,
                      SHIFT: tl.constexpr, KBASE: tl.constexpr, NCELL: tl.constexpr, I64: tl.constexpr):
    pid = _pid(I64, not FUSED)
    if (pid + 1) * (ROWS * BUCKET) <= n:
        _dm_encode_body(x_ptr, scale_ptr, code_ptr, cell_ptr, t_ptr, lo, hi, n, nb, bucket, pid,
                        BUCKET, ROWS, FUSED, NORM, SIGNED, PAPER, DYN, PIVOT0, SHIFT, KBASE, NCELL,
                        False)
    else:
        _dm_encode_body(x_ptr, scale_ptr, code_ptr, cell_ptr, t_ptr, lo, hi, n, nb, bucket, pid,
                        BUCKET, ROWS, FUSED, NORM, SIGNED, PAPER, DYN, PIVOT0, SHIFT, KBASE, NCELL,
                        True)


@triton.jit
def _dm_one_scale_body(x_ptr, scale_ptr, code_ptr, cell_ptr, t_ptr, lo, hi, n, pid,
                       BLOCK: tl.constexpr, TILES: tl.constexpr, SIGNED: tl.constexpr, PAPER: tl.constexpr,
                       DYN: tl.constexpr, PIVOT0: tl.constexpr, SHIFT: tl.constexpr, KBASE: tl.constexpr,
                       NCELL: tl.constexpr, MASKED: tl.constexpr):
    base = pid * (BLOCK * TILES)
    scale = tl.load(scale_ptr)
    offs = base + (TILES - 1) * BLOCK + tl.arange(0, BLOCK)
    xn = _ld(x_ptr + offs, offs < n, 0.0, MASKED)
    for t in tl.static_range(TILES):  # tiles newest-read first; the next tile's load goes out first
        x = xn
        cur = offs
        if t + 1 < TILES:
            offs = base + (TILES - 2 - t) * BLOCK + tl.arange(0, BLOCK)
            xn = _ld(x_ptr + offs, offs < n, 0.0, MASKED)
        codes = _dm_codes(x, _div_tile(x, scale, 1, 1, True, 0.0), cell_ptr, t_ptr, lo, hi, True, SIGNED,
                          PAPER, DYN, PIVOT0, SHIFT, KBASE, NCELL, True)
        _st(code_ptr + cur, codes.to(tl.uint8), cur < n, MASKED)


@triton.jit
def _dm_one_scale_kernel(x_ptr, scale_ptr, code_ptr, cell_ptr, t_ptr, lo, hi, n,
                         BLOCK: tl.constexpr, TILES: tl.constexpr, SIGNED: tl.constexpr, PAPER: tl.constexpr,
                         DYN: tl.constexpr, PIVOT0: tl.constexpr, SHIFT: tl.constexpr, KBASE: tl.constexpr,
                         NCELL: tl.constexpr, I64: tl.constexpr):
    """Second pass of the Dettmers encode with one scale for the tensor (the first is _absmax_atomic):
    TILES tiles of BLOCK values per program, programs and tiles walking x backwards (so the first reads
    hit what the max pass left in L2), each tile's quantiser running while the next tile's load is in
    flight. Against one tile per program without the early load: 70 -> 76 % of copy at 64 MiB, 84 -> 92 %
    at 256 MiB and 88 -> 98 % at 1 GiB for this pass alone (H200, benchmarks/experiments/tune_onescale_gpu.py)."""
    pid = _pid(I64, True)
    if (pid + 1) * (BLOCK * TILES) <= n:
        _dm_one_scale_body(x_ptr, scale_ptr, code_ptr, cell_ptr, t_ptr, lo, hi, n, pid, BLOCK, TILES, SIGNED,
                           PAPER, DYN, PIVOT0, SHIFT, KBASE, NCELL, False)
    else:
        _dm_one_scale_body(x_ptr, scale_ptr, code_ptr, cell_ptr, t_ptr, lo, hi, n, pid, BLOCK, TILES, SIGNED,
                           PAPER, DYN, PIVOT0, SHIFT, KBASE, NCELL, True)


@triton.jit
def _dm_dec_one(scale_ptr, code_ptr, lut_ptr, offs, rows, inb, nb, bucket, NORM: tl.constexpr,
                FUSED: tl.constexpr, ONE_SCALE: tl.constexpr, MASKED: tl.constexpr):
    """Decoded values of one payload at offs: the 256-entry table lookup times the bucket's scale."""
    codes = _ld(code_ptr + offs, inb, 0, MASKED).to(tl.int32)
    vals = tl.load(lut_ptr + codes)
    if NORM:
        if FUSED:
            vals = vals * _ld(scale_ptr + rows, rows < nb, 0.0, MASKED)[:, None]
        elif ONE_SCALE:
            vals = vals * tl.load(scale_ptr)
        else:
            vals = vals * _ld(scale_ptr + offs // bucket, inb, 0.0, MASKED)
    return vals


@triton.jit
def _dm_decode_body(lut_ptr, out_ptr, n, nb, bucket, pid, ps, K: tl.constexpr, ACC: tl.constexpr,
                    BUCKET: tl.constexpr, ROWS: tl.constexpr, NORM: tl.constexpr, FUSED: tl.constexpr,
                    ONE_SCALE: tl.constexpr, MASKED: tl.constexpr, DIV: tl.constexpr, DINV: tl.constexpr):
    """out = ([out +] dec(p0) + ... + dec(p_{K-1})) / DIV, added left to right in float32
    (ps = (s0, c0, s1, c1, ...): the scales and the codes of each payload); DIV as torch's out.div_(DIV)
    on this device (see _step)."""
    rows = pid * ROWS + tl.arange(0, ROWS)
    if FUSED:
        offs = rows[:, None] * BUCKET + tl.arange(0, BUCKET)[None, :]
    else:
        offs = pid * (ROWS * BUCKET) + tl.arange(0, ROWS * BUCKET)
    inb = offs < n
    acc = _dm_dec_one(ps[0], ps[1], lut_ptr, offs, rows, inb, nb, bucket, NORM, FUSED, ONE_SCALE, MASKED)
    if ACC:
        acc = _ld(out_ptr + offs, inb, 0.0, MASKED) + acc
    for k in tl.static_range(1, K):
        acc = acc + _dm_dec_one(ps[2 * k], ps[2 * k + 1], lut_ptr, offs, rows, inb, nb, bucket, NORM, FUSED,
                                ONE_SCALE, MASKED)
    if DIV != 1.0:
        acc = _step(acc, DIV, DINV)
    _st(out_ptr + offs, acc, inb, MASKED)


@triton.jit
def _dm_decode_kernel(lut_ptr, out_ptr, n, nb, bucket, ps, K: tl.constexpr, ACC: tl.constexpr,
                      BUCKET: tl.constexpr, ROWS: tl.constexpr, NORM: tl.constexpr, FUSED: tl.constexpr,
                      ONE_SCALE: tl.constexpr, I64: tl.constexpr, DIV: tl.constexpr, DINV: tl.constexpr):
    """K (at most MAX_SUM) payloads per launch (K = 1: a plain decode); ACC adds onto out; the last
    launch divides by DIV (1: none)."""
    pid = _pid(I64)
    if (pid + 1) * (ROWS * BUCKET) <= n:
        _dm_decode_body(lut_ptr, out_ptr, n, nb, bucket, pid, ps, K, ACC, BUCKET, ROWS, NORM, FUSED, ONE_SCALE,
                        False, DIV, DINV)
    else:
        _dm_decode_body(lut_ptr, out_ptr, n, nb, bucket, pid, ps, K, ACC, BUCKET, ROWS, NORM, FUSED, ONE_SCALE,
                        True, DIV, DINV)


# ===================================================================================== host side
def _is_pow2(v: int) -> bool:
    return v > 0 and (v & (v - 1)) == 0


def _fused(bucket: int) -> bool:
    """Whole buckets fit a program's tile (a power of two, at least one packed byte of 1-bit codes)."""
    return _is_pow2(bucket) and 8 <= bucket <= CONFIG["max_fused_bucket"]


def _rows(bucket: int) -> int:
    return max(1, CONFIG["elems"] // bucket)


def _warps(block: int, most: int | None = None) -> int:
    return max(1, min(CONFIG["warps"] if most is None else most, block // 256))


def _i64(n: int, block: int) -> bool:
    return n + 2 * block + 16 >= 2**31


def _signed_key(seed: int) -> int:
    k = ref.seed_key(seed)
    return k - (1 << 32) if k >= (1 << 31) else k


def _aligned(payload: torch.Tensor) -> torch.Tensor:
    """A payload whose first byte is 4-byte aligned, so its scales can be read as float32 (a slice of
    a received buffer may not be: then it is copied). Triton compiles a variant with narrower loads
    for pointers that are not 16-byte aligned."""
    payload = payload.reshape(-1)
    if payload.data_ptr() % 4:
        payload = payload.clone()
    return payload


def _new_payload(head: int, total: int, device: torch.device) -> torch.Tensor:
    """An uninitialised (total,) uint8 payload whose code stream (from byte ``head``, a multiple of 4)
    starts 16-byte aligned, so the kernels store codes in 16-byte vectors: a view at offset 0, 4, 8 or
    12 of a slightly larger buffer."""
    buf = torch.empty(total + 16, dtype=torch.uint8, device=device)
    skew = (-(buf.data_ptr() + head)) % 16
    return buf[skew : skew + total]


def _scale_view(payload: torch.Tensor, nscales: int) -> torch.Tensor:
    return payload[: 4 * nscales].view(torch.float32)


def _tiling(bucket: int, fused: bool) -> tuple[int, int, int]:
    """(BUCKET, ROWS, block): a fused tile is ROWS whole buckets; a linear one ROWS=1 x CONFIG elems."""
    if fused:
        rows = _rows(bucket)
        return bucket, rows, rows * bucket
    return CONFIG["elems"], 1, CONFIG["elems"]


def _bucket_scales_general(x: torch.Tensor, bucket: int, scales: torch.Tensor) -> None:
    """scales[b] = max |x| over bucket b (NaN-propagating, as reference.bucket_absmax), any bucket."""
    n = x.numel()
    nb = scales.numel()
    ab = CONFIG["absmax_elems"]
    while ab > CONFIG["elems"] and nb > 1 and bucket % ab:
        ab //= 2
    if nb == 1 or bucket % ab == 0:  # every block lies in one bucket: one pass, atomic max
        scales.zero_()
        _absmax_atomic[(triton.cdiv(n, ab),)](x, scales.view(torch.int32), n, bucket, BLOCK=ab,
                                              I64=_i64(n, ab), num_warps=_warps(ab, 8), **_LAUNCH)
        return
    # Chunks of at most 4096 elements of one bucket each, UR chunks per program; then torch's amax.
    ch = min(1 << max(0, (bucket - 1).bit_length()), 4096)
    cpb = (bucket + ch - 1) // ch
    ur = max(1, 4096 // ch)
    nunits = nb * cpb
    part = torch.empty(nunits, dtype=torch.float32, device=x.device)
    _partial_absmax[(triton.cdiv(nunits, ur),)](x, part, n, bucket, cpb, nunits, CH=ch, UR=ur,
                                                I64=_i64(max(n, nunits * ch), ur * ch),
                                                num_warps=_warps(ur * ch), **_LAUNCH)
    scales.copy_(part if cpb == 1 else part.view(nb, cpb).amax(dim=1))  # amax propagates NaN


# ------------------------------------------------------------------------------------- qsgd
def qsgd_encode(
    x: torch.Tensor, bits: int, bucket: int, norm: str, stochastic: bool, seed: int, full: bool = False
) -> torch.Tensor:
    """x: (n,) float32 contiguous -> payload uint8: [scales (nb,) f32][codes packed at ``bits``]."""
    if bits not in PACKED_BITS:
        return ref.qsgd_encode(x, bits, bucket, norm, stochastic, seed, full)
    x = x.reshape(-1).contiguous()
    n = x.numel()
    nb = (n + bucket - 1) // bucket
    nbytes = ref.packed_nbytes(n, bits)
    payload = _new_payload(4 * nb, 4 * nb + nbytes, x.device)
    if n == 0:
        return payload
    fused = _fused(bucket)
    if not fused:
        scales = _scale_view(payload, nb)
        if norm == "l2":
            scales.copy_(ref.bucket_l2(ref.to_buckets(x, bucket)))
        else:
            _bucket_scales_general(x, bucket, scales)
    bsize, rows, block = _tiling(bucket, fused)
    _qsgd_encode_kernel[(triton.cdiv(n, block),)](
        x, payload, payload[4 * nb :], n, nb, bucket, nbytes, _signed_key(seed),
        BUCKET=bsize, ROWS=rows, FUSED=fused, BITS=bits, S=ref.qsgd_levels(bits, full), L2=norm == "l2",
        STOCH=bool(stochastic), I64=_i64(n, block), num_warps=_warps(block, CONFIG['qsgd_enc_warps']), **_LAUNCH)
    return payload


@functools.lru_cache(maxsize=None)
def _scalar_inverse(device: torch.device, bits: int, full: bool = False) -> float:
    """0.0 if torch computes ``t / s`` (a float32 tensor by a Python float) as a true division on
    ``device``, else float32(1/s), the reciprocal it multiplies by (torch's CUDA kernel does that for
    a CPU-scalar divisor). Probed once per device and bit width, so qsgd decode matches the reference
    bit for bit on whichever device it runs."""
    return _torch_scalar_division(device, ref.qsgd_levels(bits, full))


@functools.lru_cache(maxsize=None)
def _torch_scalar_division(device: torch.device, s: float) -> float:
    """How torch divides a float32 tensor by the Python number ``s`` on ``device`` (``t / s``,
    ``t.div_(s)``): 0.0 for a true division, else the float32 reciprocal it multiplies by."""
    inv = float(torch.tensor(1.0, dtype=torch.float32) / torch.tensor(s, dtype=torch.float32))
    if inv * s == 1.0:  # exact reciprocal (s = 0.5, 1): both ways agree
        return 0.0
    g = torch.Generator().manual_seed(0)
    t = (torch.rand(1 << 14, generator=g) * 2.0**torch.randint(-20, 20, (1 << 14,), generator=g)).to(device)
    torch_way = t / s
    true_div = t / torch.full_like(t, s)  # tensor / tensor: a true division everywhere
    if torch.equal(torch_way, true_div):
        return 0.0
    if torch.equal(torch_way, t * inv):
        return inv
    raise RuntimeError(f"lowbit: cannot tell how torch divides by a scalar on {device}")


def _sum_launches(args: list, device: torch.device, divide_by: int):
    """Launch plan of a decode (and sum) over payload argument pairs ``args`` (2 per payload): per launch
    the tuple of at most MAX_SUM pairs and the constants K, ACC (add onto out) and the divisor, which
    only the last launch applies (as torch's ``out.div_(divide_by)`` on ``device``). One payload with
    ``divide_by=1`` is a plain decode."""
    div = float(divide_by)
    dinv = _torch_scalar_division(device, div) if divide_by != 1 else 0.0
    for start in range(0, len(args), 2 * MAX_SUM):
        chunk = tuple(args[start : start + 2 * MAX_SUM])
        last = start + 2 * MAX_SUM >= len(args)
        yield chunk, dict(K=len(chunk) // 2, ACC=start > 0, DIV=div if last else 1.0, DINV=dinv if last else 0.0)


def _qsgd_decode_into(payloads: Sequence[torch.Tensor], n: int, bits: int, bucket: int,
                      out: torch.Tensor, divide_by: int = 1, full: bool = False) -> torch.Tensor:
    nb = (n + bucket - 1) // bucket
    nbytes = ref.packed_nbytes(n, bits)
    fused = _fused(bucket)
    bsize, rows, block = _tiling(bucket, fused)
    grid = (triton.cdiv(n, block),)
    meta = dict(FUSED=fused, BUCKET=bsize, ROWS=rows, BITS=bits, S=ref.qsgd_levels(bits, full),
                INV=_scalar_inverse(out.device, bits, full), I64=_i64(n, block), num_warps=_warps(block), **_LAUNCH)
    args = []
    for p in payloads:
        p = _aligned(p)
        args += [p, p[4 * nb :]]
    for chunk, launch in _sum_launches(args, out.device, divide_by):
        _qsgd_decode_kernel[grid](out, n, nb, bucket, nbytes, chunk, **launch, **meta)
    return out


def qsgd_decode(payload: torch.Tensor, n: int, bits: int, bucket: int, out: torch.Tensor,
                full: bool = False) -> torch.Tensor:
    if bits not in PACKED_BITS:
        return ref.qsgd_decode(payload, n, bits, bucket, out, full)
    if n == 0:
        return out
    return _qsgd_decode_into([payload], n, bits, bucket, out, full=full)


def qsgd_decode_sum(payloads: Sequence[torch.Tensor], n: int, bits: int, bucket: int,
                    out: torch.Tensor, divide_by: int = 1, full: bool = False) -> torch.Tensor:
    """out = (decode(p0) + decode(p1) + ...) / divide_by, added in this order in float32, in one pass
    over ``out`` per 8 payloads: bit-identical to summing reference decodes in the same order and then
    ``out.div_(divide_by)`` (an allreduce's mean without a second pass over the result)."""
    if len(payloads) == 0:
        raise ValueError("qsgd_decode_sum needs at least one payload")
    if n == 0:
        return out
    if bits not in PACKED_BITS:
        ref.qsgd_decode(payloads[0], n, bits, bucket, out, full)
        tmp = torch.empty_like(out)
        for p in payloads[1:]:
            out.add_(ref.qsgd_decode(p, n, bits, bucket, tmp, full))
        return out.div_(divide_by) if divide_by != 1 else out
    return _qsgd_decode_into(list(payloads), n, bits, bucket, out, divide_by, full)


# ------------------------------------------------------------------------------------- onebit
def onebit_encode_buckets(x: torch.Tensor, bucket: int) -> torch.Tensor:
    """x: (n,) -> [(mean_pos, mean_neg) per bucket: float32 x 2nb][sign bits: 1 = non-negative]."""
    x = x.reshape(-1).contiguous()
    n = x.numel()
    nb = (n + bucket - 1) // bucket
    nbytes = ref.packed_nbytes(n, 1)
    payload = _new_payload(8 * nb, 8 * nb + nbytes, x.device)
    if n == 0:
        return payload
    scales = _scale_view(payload, 2 * nb)
    fused = _fused(bucket)
    if not fused:
        xb = ref.to_buckets(x, bucket)
        valid = None
        if nb * bucket != n:
            valid = (torch.arange(nb * bucket, device=x.device) < n).view(nb, bucket)
        _, mp, mn = ref.onebit_stats(xb, valid)
        scales.view(nb, 2).copy_(torch.stack([mp, mn], dim=1))
    bsize, rows, block = _tiling(bucket, fused)
    _onebit_encode_kernel[(triton.cdiv(n, block),)](
        x, scales, payload[8 * nb :], n, nb, nbytes, BUCKET=bsize, ROWS=rows, FUSED=fused,
        I64=_i64(n, block), num_warps=_warps(block), **_LAUNCH)
    return payload


def onebit_decode_sum_buckets(payloads: Sequence[torch.Tensor], n: int, bucket: int, out: torch.Tensor,
                              divide_by: int = 1) -> torch.Tensor:
    """out = (decode(p0) + decode(p1) + ...) / divide_by, added in order in float32, one pass over
    ``out`` per 8 payloads (bit-identical to decoding one by one, adding, then ``out.div_``)."""
    if len(payloads) == 0:
        raise ValueError("onebit_decode_sum_buckets needs at least one payload")
    if n == 0:
        return out
    nb = (n + bucket - 1) // bucket
    fused = _fused(bucket)
    bsize, rows, block = _tiling(bucket, fused)
    args = []
    for p in payloads:
        p = _aligned(p)
        args += [_scale_view(p, 2 * nb), p[8 * nb :]]
    for chunk, launch in _sum_launches(args, out.device, divide_by):
        _onebit_decode_kernel[(triton.cdiv(n, block),)](
            out, n, nb, bucket, ref.packed_nbytes(n, 1), chunk, BUCKET=bsize, ROWS=rows, FUSED=fused,
            I64=_i64(n, block), num_warps=_warps(block), **launch, **_LAUNCH)
    return out


def onebit_decode_buckets(payload: torch.Tensor, n: int, bucket: int, out: torch.Tensor) -> torch.Tensor:
    return onebit_decode_sum_buckets([payload], n, bucket, out)


# ------------------------------------------------------------------------------------- dettmers


@functools.lru_cache(maxsize=64)
def _dm_tables(type_: str, offset: int, device: torch.device) -> dict:
    host = _dm_host_tables(type_, offset)
    out = dict(host)
    for k in ("cells", "paper", "lut"):
        out[k] = host[k].to(device)
    return out


def dettmers_encode(x: torch.Tensor, type_: str, search: str, bucket: int, offset: int) -> torch.Tensor:
    """Dettmers' 8-bit codec: x (n,) float32 -> [absmax f32 per bucket (normalised types)][code byte each].

    ``bucket=0`` means one scale for the whole tensor. Same bytes as ``Dettmers(...).encode`` for every
    type and both searches."""
    x = x.reshape(-1).contiguous()
    n = x.numel()
    if n == 0:
        return torch.empty(0, dtype=torch.uint8, device=x.device)
    norm, eff_bucket, nb = _dm_layout(n, type_, bucket)
    payload = _new_payload(4 * nb, 4 * nb + n, x.device)
    scales = _scale_view(payload, nb)
    t = _dm_tables(type_, offset, x.device)
    fused = norm and _fused(eff_bucket)
    if norm and not fused:
        _bucket_scales_general(x, eff_bucket, scales)
    if norm and nb == 1 and not fused:  # one scale for the tensor: the pipelined second pass
        block, tiles = CONFIG["one_scale_elems"], CONFIG["one_scale_tiles"]
        _dm_one_scale_kernel[(triton.cdiv(n, block * tiles),)](
            x, scales, payload[4:], t["cells"], t["paper"], float(t["lo"]), float(t["hi"]), n, BLOCK=block,
            TILES=tiles, PAPER=search == "paper", I64=_i64(n, block * tiles),
            num_warps=CONFIG["one_scale_warps"], **t["consts"], **_LAUNCH)
        return payload
    bsize, rows, block = _tiling(eff_bucket, fused)
    _dm_encode_kernel[(triton.cdiv(n, block),)](
        x, scales if norm else x, payload[4 * nb :], t["cells"], t["paper"], float(t["lo"]),
        float(t["hi"]), n, max(nb, 1), eff_bucket, BUCKET=bsize, ROWS=rows, FUSED=fused, NORM=norm,
        PAPER=search == "paper", I64=_i64(n, block), num_warps=_warps(block), **t["consts"], **_LAUNCH)
    return payload


def dettmers_decode_sum(payloads: Sequence[torch.Tensor], n: int, type_: str, bucket: int, offset: int,
                        out: torch.Tensor, divide_by: int = 1) -> torch.Tensor:
    """out = (decode(p0) + decode(p1) + ...) / divide_by, added in order in float32, one pass over
    ``out`` per 8 payloads: bit-identical to summing :func:`dettmers_decode` results in the same order
    and then ``out.div_(divide_by)``."""
    if len(payloads) == 0:
        raise ValueError("dettmers_decode_sum needs at least one payload")
    if n == 0:
        return out
    norm, eff_bucket, nb = _dm_layout(n, type_, bucket)
    t = _dm_tables(type_, offset, out.device)
    fused = norm and _fused(eff_bucket)
    bsize, rows, block = _tiling(eff_bucket, fused)
    args = []
    for p in payloads:
        p = _aligned(p)
        args += [_scale_view(p, nb) if nb else t["lut"], p[4 * nb :]]
    meta = dict(BUCKET=bsize, ROWS=rows, NORM=norm, FUSED=fused, ONE_SCALE=nb == 1 and not fused,
                I64=_i64(n, block), num_warps=_warps(block), **_LAUNCH)
    for chunk, launch in _sum_launches(args, out.device, divide_by):
        _dm_decode_kernel[(triton.cdiv(n, block),)](t["lut"], out, n, max(nb, 1), eff_bucket, chunk,
                                                    **launch, **meta)
    return out


def dettmers_decode(payload: torch.Tensor, n: int, type_: str, bucket: int, offset: int,
                    out: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`dettmers_encode`: 256-entry table lookup times the bucket's absmax."""
    return dettmers_decode_sum([payload], n, type_, bucket, offset, out)
    norm, eff_bucket, nb = _dm_layout(n, type_, bucket)
    payload = _aligned(payload)
    t = _dm_tables(type_, offset, payload.device)
    fused = norm and _fused(eff_bucket)
    bsize, rows, block = _tiling(eff_bucket, fused)
    _dm_decode_kernel[(triton.cdiv(n, block),)](
        _scale_view(payload, nb) if nb else t["lut"], payload[4 * nb :], t["lut"], out, n, max(nb, 1),
        eff_bucket, BUCKET=bsize, ROWS=rows, NORM=norm, FUSED=fused, ONE_SCALE=nb == 1 and not fused,
        I64=_i64(n, block),
        num_warps=_warps(block), **_LAUNCH)
    return out
