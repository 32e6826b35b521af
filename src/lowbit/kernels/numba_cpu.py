"""Compiled CPU kernels (numba) for QSGD and bucketed 1bitSGD, bit for bit equal to the reference.

:mod:`lowbit.kernels.reference` is the specification; these kernels produce the same payload bytes and
the same decoded floats, only faster (one pass over the data, all cores). Importing this module without
numba raises ImportError, and :mod:`lowbit.kernels.dispatch` then falls back to the reference.

How the work is split
    Encode: the buckets are grouped into chunks whose length is a multiple of 8 values, so every chunk
    starts on a byte boundary of the packed stream at any bit width and threads never share a byte.
    ``prange`` runs over the chunks; a chunk computes its buckets' scales, then quantises and packs its
    values while they are still in cache. When there are too few buckets to keep every core busy (huge
    buckets), the scales are computed first (one bucket per task) and the codes afterwards in blocks of
    values. Decode runs over blocks of values: unpack a sub-block of codes into a small buffer (1-7 bits),
    then ``(code - s) * (scale / s)`` bucket segment by bucket segment. ``qsgd_decode_sum`` does that for
    every payload while a block of the output is in cache: ``acc = v0; acc += v1; ...`` in float32.

Why the arithmetic is written out the way it is
    The payload must equal the reference's bytes, so every float32 operation follows the reference's
    order: ``q = (x / safe_scale) * s + s``, ``floor(q + u)`` or ``floor(q + 0.5)``, NaN -> 0, clamp to
    ``[0, 2s]``. ``fastmath=False`` keeps LLVM from contracting ``a * b + c`` into an FMA or reordering.
    The uniforms are the reference's counter hash (murmur3 ``fmix32``) in uint64 arithmetic masked to
    32 bits. Two scales are float32 reductions whose rounding depends on the summation order, so we
    replay the order of torch's CPU kernels (verified bit for bit on torch 2.13, x86-64, with the
    AVX512, AVX2 and DEFAULT kernel dispatch; ``tests/unit/test_kernels_numba.py`` checks it):

    * ``norm=l2``: ``torch.linalg.vector_norm`` of a contiguous row accumulates ``x*x`` into 8 float32
      lanes (element ``d`` into lane ``d % 8``, multiply then add), folds the lanes left to right, then
      adds the ``t = len % 8`` leftover squares one by one; in the AVX2/AVX512 builds the compiler
      turned the last ``t % 4`` of those into fused multiply-adds (the first ``4 * (t // 4)`` stay
      multiply-then-add), in the DEFAULT build none.
    * onebit's means: ``Tensor.sum(dim=1)`` is torch's cascade sum: 8-lane vectors, 4 interleaved
      accumulators, levels of 16, then the lanes folded left to right onto the scalar tail.

    If a future torch changes these kernels, the l2 scales / onebit means may differ from the reference
    in the last bit (the tests would say so); max-norm QSGD and all decoding do not depend on torch.

Not accelerated (left to the reference): onebit's per-column mode, inputs that are not float32, and
a single onebit bucket of at least 32768 values (torch then splits the sum across its threads, so the
reference's own rounding depends on the torch thread count).
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence

import numba
import numpy as np
import torch
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic

from lowbit.kernels import reference as ref
from lowbit.kernels.dettmers_tables import host_tables, layout

if sys.byteorder != "little":  # the wire format is little-endian; keep the reference on such hosts
    raise ImportError("lowbit.kernels.numba_cpu supports little-endian hosts only")

__all__ = [
    "qsgd_encode",
    "qsgd_decode",
    "qsgd_decode_sum",
    "onebit_encode_buckets",
    "onebit_decode_buckets",
    "dettmers_encode",
    "dettmers_decode",
]

_JIT = dict(cache=True, fastmath=False, error_model="numpy")
#: nogil: a communication thread can encode/decode while the training thread runs Python.
_PJIT = dict(parallel=True, nogil=True, **_JIT)

#: Values per task: encode chunks hold at least this many, decode blocks exactly this many.
_BLOCK = 16384
#: Codes unpacked/packed through a small buffer at a time (fits L1).
_SUB = 2048
#: torch splits a single-row sum across threads from this size on (at::internal::GRAIN_SIZE).
_TORCH_GRAIN = 32768

_CAPABILITY = torch.backends.cpu.get_cpu_capability()
#: Whether torch's l2-norm kernel fuses the last ``t % 4`` tail squares (see the module docstring).
_L2_TAIL_FMA = _CAPABILITY in ("AVX2", "AVX512")

_F0 = np.float32(0.0)
_F1 = np.float32(1.0)
_HALF = np.float32(0.5)
_U24 = np.float32(1.0 / (1 << 24))
_FMAX = np.float32(np.finfo(np.float32).max)
_ONEBIT_SCALE = np.float32(2.0**-32)  # reference.ONEBIT_SUM_SCALE
_ONEBIT_UNSCALE = np.float32(2.0**32)
_NAN = np.float32(np.nan)  # 0x7FC00000, the NaN torch's full_like(nan) writes
_M32 = np.uint64(0xFFFFFFFF)
_GOLDEN = np.uint64(0x9E3779B1)
_C1 = np.uint64(0x85EBCA6B)
_C2 = np.uint64(0xC2B2AE35)
_S16 = np.uint64(16)
_S13 = np.uint64(13)
_S8 = np.uint64(8)
_ABS_MASK = np.int64(0x7FFFFFFF)
_INF_BITS = np.int64(0x7F800000)


# --------------------------------------------------------------------------------- intrinsics
@intrinsic
def _fma32(typingctx, a, b, c):
    """Single-rounding float32 ``a * b + c`` (LLVM's llvm.fma)."""
    sig = types.float32(types.float32, types.float32, types.float32)

    def codegen(context, builder, signature, args):
        f32 = ir.FloatType()
        fn = builder.module.declare_intrinsic("llvm.fma", [f32], ir.FunctionType(f32, [f32, f32, f32]))
        return builder.call(fn, args)

    return sig, codegen


@intrinsic
def _bits_to_f32(typingctx, v):
    """Reinterpret the low 32 bits of an integer as a float32."""
    sig = types.float32(v)

    def codegen(context, builder, signature, args):
        i32 = ir.IntType(32)
        val = args[0]
        if val.type.width > 32:
            val = builder.trunc(val, i32)
        elif val.type.width < 32:
            val = builder.zext(val, i32)
        return builder.bitcast(val, ir.FloatType())

    return sig, codegen


@intrinsic
def _f32_to_bits(typingctx, v):
    """The bits of a float32 as an int32."""
    sig = types.int32(types.float32)

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.IntType(32))

    return sig, codegen


@intrinsic
def _u8_ptr(typingctx, addr):
    """A uint8 pointer from an integer address (payload lists reach the kernel as addresses: cheaper
    to compile and to call than a typed List of arrays; the caller keeps the tensors alive)."""
    sig = types.CPointer(types.uint8)(types.int64)

    def codegen(context, builder, signature, args):
        return builder.inttoptr(args[0], context.get_value_type(types.CPointer(types.uint8)))

    return sig, codegen


# --------------------------------------------------------------------------------- small helpers
@njit(inline="always", **_JIT)
def _uniform(key, i):
    """u(seed, i) of the reference: fmix32(((i * 0x9E3779B1) mod 2^32) ^ key) >> 8, times 2^-24."""
    h = ((np.uint64(i) * _GOLDEN) & _M32) ^ key
    h ^= h >> _S16
    h = (h * _C1) & _M32
    h ^= h >> _S13
    h = (h * _C2) & _M32
    h ^= h >> _S16
    return np.float32(np.int32(h >> _S8)) * _U24


@njit(inline="always", **_JIT)
def _read_f32(p, off):
    """float32 stored little-endian at byte ``off`` of ``p`` (payloads may be unaligned)."""
    w = (
        np.uint32(p[off])
        | (np.uint32(p[off + 1]) << np.uint32(8))
        | (np.uint32(p[off + 2]) << np.uint32(16))
        | (np.uint32(p[off + 3]) << np.uint32(24))
    )
    return _bits_to_f32(w)


@njit(**_JIT)
def _absmax(xi, lo, hi):
    """max |x| over x[lo:hi] (given as int32 bits), NaN if any value is NaN: reference.bucket_absmax.

    On the bit patterns with the sign cleared, integer order is float order and every NaN is above
    +inf, so one integer max gives both (and vectorises, unlike a float max that must see NaNs)."""
    v = xi[lo:hi]
    m = np.int64(0)
    for k in range(v.size):
        a = np.int64(v[k]) & _ABS_MASK
        m = a if a > m else m
    if m > _INF_BITS:
        return _NAN
    return _bits_to_f32(m)


@njit(**_JIT)
def _l2(x, lo, hi, bucket, m, tail_fma, sqbuf):
    """reference.bucket_l2 for the bucket starting at ``lo`` (values up to ``hi``, zeros after):
    ``m * ||x / safe(m)||`` with torch's vector_norm summation order (module docstring).
    ``sqbuf``: float32 scratch of _SUB + 8 values."""
    safe = m if m > _F0 else _F1
    if bucket == 1:  # torch's norm of a one-value row is |y| (a NaN comes out with its sign cleared)
        r = abs(x[lo] / safe)
        return r if r != r else m * r  # (|x| <= float32's max: no cap needed)
    vend = bucket - bucket % 8  # lanes take positions [0, vend), the scalar tail [vend, bucket)
    xs = x[lo:hi]
    L = xs.size
    nv = min(L, vend)
    a0 = a1 = a2 = a3 = a4 = a5 = a6 = a7 = _F0
    # Squares first, a sub-block at a time (a vectorised loop), then the 8 lane sums in order.
    # A partial last vector only happens in the zero-padded last bucket: the padding adds +0 (a no-op).
    for c0 in range(0, nv, _SUB):
        c1 = min(nv, c0 + _SUB)
        seg = xs[c0:c1]
        sq = sqbuf[: c1 - c0 + 8]
        for k in range(seg.size):
            y = seg[k] / safe
            sq[k] = y * y
        for k in range(seg.size, seg.size + 8):
            sq[k] = _F0
        for d in range((seg.size + 7) // 8):
            a0 = a0 + sq[8 * d]
            a1 = a1 + sq[8 * d + 1]
            a2 = a2 + sq[8 * d + 2]
            a3 = a3 + sq[8 * d + 3]
            a4 = a4 + sq[8 * d + 4]
            a5 = a5 + sq[8 * d + 5]
            a6 = a6 + sq[8 * d + 6]
            a7 = a7 + sq[8 * d + 7]
    b = a0 + a1
    b = b + a2
    b = b + a3
    b = b + a4
    b = b + a5
    b = b + a6
    b = b + a7
    t = bucket - vend
    nplain = (t // 4) * 4 if tail_fma else t
    for k in range(max(0, min(t, L - vend))):
        y = xs[vend + k] / safe
        if k < nplain:
            b = b + y * y
        else:
            b = _fma32(y, y, b)
    r = np.sqrt(b)
    # m is NaN or inf exactly when r is NaN; torch's m * r then returns r's NaN (its payload and sign)
    if r != r:
        return r
    l2 = m * r
    return _FMAX if l2 > _FMAX else l2  # reference.cap_l2 (m is finite here)


@njit(**_JIT)
def _bucket_scale(x, xi, lo, hi, bucket, use_l2, tail_fma, sqbuf):
    m = _absmax(xi, lo, hi)
    if use_l2:
        return _l2(x, lo, hi, bucket, m, tail_fma, sqbuf)
    return m


# --------------------------------------------------------------------------------- qsgd encode
@njit(**_JIT)
def _codes_segment(x, lo, hi, scale, s, two_s, stochastic, key, dst, d0):
    """Codes of x[lo:hi] (one bucket's scale) into dst[d0 : d0 + hi - lo], as reference.qsgd_encode."""
    safe = scale if scale > _F0 else _F1
    # zero-based views: numba then knows the indices are non-negative and the loops vectorise
    xs = x[lo:hi]
    ds = dst[d0 : d0 + hi - lo]
    if stochastic:
        for k in range(xs.size):
            q = (xs[k] / safe) * s + s
            f = np.floor(q + _uniform(key, lo + k))
            f = f if f > _F0 else _F0  # NaN -> 0 (nan_to_num), -inf -> 0
            f = f if f < two_s else two_s
            ds[k] = f
    else:
        for k in range(xs.size):
            q = (xs[k] / safe) * s + s
            f = np.floor(q + _HALF)
            f = f if f > _F0 else _F0
            f = f if f < two_s else two_s
            ds[k] = f


@njit(**_JIT)
def _codes_segment16(x, lo, hi, scale, s, two_s, stochastic, key, stream):
    """16-bit codes of x[lo:hi] written little-endian straight into the stream."""
    safe = scale if scale > _F0 else _F1
    xs = x[lo:hi]
    ds = stream[2 * lo : 2 * hi]
    for k in range(xs.size):
        q = (xs[k] / safe) * s + s
        if stochastic:
            f = np.floor(q + _uniform(key, lo + k))
        else:
            f = np.floor(q + _HALF)
        f = f if f > _F0 else _F0
        f = f if f < two_s else two_s
        c = np.uint32(f)
        ds[2 * k] = c & np.uint32(0xFF)
        ds[2 * k + 1] = c >> np.uint32(8)


@njit(inline="always", **_JIT)
def _pack_groups(codes, out, nbytes, bits):
    ub = np.uint64(bits)
    full = nbytes // bits  # groups written whole; the last one may be cut at the stream's end
    for g in range(full):
        w = np.uint64(0)
        for k in range(8):
            w |= np.uint64(codes[8 * g + k]) << (np.uint64(k) * ub)
        for t in range(bits):
            out[bits * g + t] = (w >> np.uint64(8 * t)) & np.uint64(0xFF)
    if full * bits < nbytes:
        w = np.uint64(0)
        for k in range(8):
            w |= np.uint64(codes[8 * full + k]) << (np.uint64(k) * ub)
        for t in range(nbytes - full * bits):
            out[bits * full + t] = (w >> np.uint64(8 * t)) & np.uint64(0xFF)


@njit(**_JIT)
def _pack(codes, m, bits, stream, byte0):
    """Pack codes[0:m] (m a multiple of 8, zero beyond the tensor) at ``bits`` bits into
    stream[byte0 : byte0 + m*bits/8], cut at the end of the stream."""
    nbytes = min(m * bits // 8, stream.size - byte0)
    out = stream[byte0 : byte0 + nbytes]
    if bits == 4:
        for j in range(nbytes):
            out[j] = codes[2 * j] | (codes[2 * j + 1] << np.uint8(4))
    elif bits == 2:
        for j in range(nbytes):
            out[j] = (
                codes[4 * j]
                | (codes[4 * j + 1] << np.uint8(2))
                | (codes[4 * j + 2] << np.uint8(4))
                | (codes[4 * j + 3] << np.uint8(6))
            )
    elif bits == 1:
        for j in range(nbytes):
            out[j] = (
                codes[8 * j]
                | (codes[8 * j + 1] << np.uint8(1))
                | (codes[8 * j + 2] << np.uint8(2))
                | (codes[8 * j + 3] << np.uint8(3))
                | (codes[8 * j + 4] << np.uint8(4))
                | (codes[8 * j + 5] << np.uint8(5))
                | (codes[8 * j + 6] << np.uint8(6))
                | (codes[8 * j + 7] << np.uint8(7))
            )
    elif bits == 3:  # 3, 5, 6, 7: 8 codes make ``bits`` bytes (a literal width unrolls the loops)
        _pack_groups(codes, out, nbytes, 3)
    elif bits == 5:
        _pack_groups(codes, out, nbytes, 5)
    elif bits == 6:
        _pack_groups(codes, out, nbytes, 6)
    else:
        _pack_groups(codes, out, nbytes, 7)


@njit(**_JIT)
def _encode_range(x, n, lo, hi, bits, bucket, s, stochastic, key, scales, stream):
    """Quantise and pack x[lo:hi] (lo a multiple of 8) with the scales already in ``scales``."""
    two_s = s + s
    if bits == 8:
        i = lo
        while i < hi:
            b = i // bucket
            e = min(hi, (b + 1) * bucket)
            _codes_segment(x, i, e, scales[b], s, two_s, stochastic, key, stream, i)
            i = e
        return
    if bits == 16:
        i = lo
        while i < hi:
            b = i // bucket
            e = min(hi, (b + 1) * bucket)
            _codes_segment16(x, i, e, scales[b], s, two_s, stochastic, key, stream)
            i = e
        return
    buf = np.empty(_SUB + 8, np.uint8)
    for a in range(lo, hi, _SUB):
        z = min(hi, a + _SUB)
        i = a
        while i < z:
            b = i // bucket
            e = min(z, (b + 1) * bucket)
            _codes_segment(x, i, e, scales[b], s, two_s, stochastic, key, buf, i - a)
            i = e
        m = z - a
        m8 = (m + 7) // 8 * 8
        for k in range(m, m8):
            buf[k] = 0
        _pack(buf, m8, bits, stream, a // 8 * bits)


#: Task kinds of _qsgd_encode_kernel.
_FUSED, _SCALES, _CODES = 0, 1, 2


@njit(**_PJIT)
def _qsgd_encode_kernel(x, xi, n, bits, bucket, use_l2, tail_fma, s, stochastic, key, scales, stream, kind, per_task):
    """One parallel loop for every encode task kind (fewer parallel regions to compile):
    _FUSED: task = ``per_task`` buckets (a multiple of 8 values): their scales, then their codes;
    _SCALES: task = ``per_task`` buckets' scales only;  _CODES: task = _BLOCK values' codes."""
    nb = scales.size
    ntasks = (n + _BLOCK - 1) // _BLOCK if kind == _CODES else (nb + per_task - 1) // per_task
    for c in prange(ntasks):
        if kind == _CODES:
            lo = c * _BLOCK
            _encode_range(x, n, lo, min(n, lo + _BLOCK), bits, bucket, s, stochastic, key, scales, stream)
        else:
            sqbuf = np.empty(_SUB + 8, np.float32)
            b0 = c * per_task
            b1 = min(nb, b0 + per_task)
            for b in range(b0, b1):
                lo = b * bucket
                scales[b] = _bucket_scale(x, xi, lo, min(n, lo + bucket), bucket, use_l2, tail_fma, sqbuf)
            if kind == _FUSED:
                _encode_range(x, n, b0 * bucket, min(n, b1 * bucket), bits, bucket, s, stochastic, key, scales, stream)


# --------------------------------------------------------------------------------- qsgd decode
@njit(inline="always", **_JIT)
def _unpack_groups(src, m, buf, bits):
    ub = np.uint64(bits)
    mask = np.uint64((1 << bits) - 1)
    groups = (m + 7) // 8
    full = min(groups, src.size // bits)
    for g in range(full):
        w = np.uint64(0)
        for t in range(bits):
            w |= np.uint64(src[bits * g + t]) << np.uint64(8 * t)
        for k in range(8):
            buf[8 * g + k] = (w >> (np.uint64(k) * ub)) & mask
    for g in range(full, groups):  # the stream's last group may be cut short
        w = np.uint64(0)
        for t in range(src.size - bits * g):
            w |= np.uint64(src[bits * g + t]) << np.uint64(8 * t)
        for k in range(8):
            buf[8 * g + k] = (w >> (np.uint64(k) * ub)) & mask


@njit(**_JIT)
def _unpack(stream, lo, m, bits, buf):
    """Codes of values [lo, lo+m) (lo a multiple of 8) into buf[0:m] for bits in 1..7."""
    b0 = lo // 8 * bits
    src = stream[b0 : min(stream.size, b0 + (m + 7) // 8 * bits)]
    if bits == 4:
        for j in range((m + 1) // 2):
            v = src[j]
            buf[2 * j] = v & np.uint8(15)
            buf[2 * j + 1] = v >> np.uint8(4)
    elif bits == 2:
        for j in range((m + 3) // 4):
            v = src[j]
            buf[4 * j] = v & np.uint8(3)
            buf[4 * j + 1] = (v >> np.uint8(2)) & np.uint8(3)
            buf[4 * j + 2] = (v >> np.uint8(4)) & np.uint8(3)
            buf[4 * j + 3] = v >> np.uint8(6)
    elif bits == 1:
        for j in range((m + 7) // 8):
            v = src[j]
            for k in range(8):
                buf[8 * j + k] = (v >> np.uint8(k)) & np.uint8(1)
    elif bits == 3:
        _unpack_groups(src, m, buf, 3)
    elif bits == 5:
        _unpack_groups(src, m, buf, 5)
    elif bits == 6:
        _unpack_groups(src, m, buf, 6)
    else:
        _unpack_groups(src, m, buf, 7)


@njit(**_JIT)
def _values_segment(codes, c0, lo, hi, s, step, cap, out, accumulate):
    """out[lo:hi] (+)= (codes[c0 + i - lo] - s) * step, an overflow to +-inf set to ±cap (= |scale|, finite),
    as reference.qsgd_decode. Only a bucket whose top level overflows can have one, so only such buckets
    take the capping loop."""
    cs = codes[c0 : c0 + hi - lo]
    ov = out[lo:hi]
    if abs(s * step) == np.inf and cap < np.inf:
        for k in range(ov.size):
            v = _cap((np.float32(cs[k]) - s) * step, cap)
            ov[k] = ov[k] + v if accumulate else v
    elif accumulate:
        for k in range(ov.size):
            ov[k] = ov[k] + (np.float32(cs[k]) - s) * step
    else:
        for k in range(ov.size):
            ov[k] = (np.float32(cs[k]) - s) * step


@njit(inline="always", **_JIT)
def _cap(v, cap):
    """reference.cap_to_scale for one value of a bucket with a finite scale (NaN passes)."""
    if v == np.inf:
        return cap
    if v == -np.inf:
        return -cap
    return v


@njit(**_JIT)
def _values_segment16(stream, lo, hi, s, step, cap, out, accumulate):
    cs = stream[2 * lo : 2 * hi]
    ov = out[lo:hi]
    if abs(s * step) == np.inf and cap < np.inf:
        for k in range(ov.size):
            c = np.uint32(cs[2 * k]) | (np.uint32(cs[2 * k + 1]) << np.uint32(8))
            v = _cap((np.float32(c) - s) * step, cap)
            ov[k] = ov[k] + v if accumulate else v
    elif accumulate:
        for k in range(ov.size):
            c = np.uint32(cs[2 * k]) | (np.uint32(cs[2 * k + 1]) << np.uint32(8))
            ov[k] = ov[k] + (np.float32(c) - s) * step
    else:
        for k in range(ov.size):
            c = np.uint32(cs[2 * k]) | (np.uint32(cs[2 * k + 1]) << np.uint32(8))
            ov[k] = (np.float32(c) - s) * step


@njit(**_JIT)
def _decode_range(payload, nb, lo, hi, bits, bucket, s, out, accumulate, buf):
    """Decode values [lo, hi) (lo a multiple of 8) of one payload into out (or add them)."""
    stream = payload[4 * nb :]
    if bits == 8 or bits == 16:
        i = lo
        while i < hi:
            b = i // bucket
            e = min(hi, (b + 1) * bucket)
            scale = _read_f32(payload, 4 * b)
            step = scale / s
            if bits == 8:
                _values_segment(stream, i, i, e, s, step, abs(scale), out, accumulate)
            else:
                _values_segment16(stream, i, e, s, step, abs(scale), out, accumulate)
            i = e
        return
    for a in range(lo, hi, _SUB):
        z = min(hi, a + _SUB)
        _unpack(stream, a, z - a, bits, buf)
        i = a
        while i < z:
            b = i // bucket
            e = min(z, (b + 1) * bucket)
            scale = _read_f32(payload, 4 * b)
            step = scale / s
            _values_segment(buf, i - a, i, e, s, step, abs(scale), out, accumulate)
            i = e


@njit(**_PJIT)
def _qsgd_decode_kernel(addrs, nbytes, n, nb, bits, bucket, s, out, block, div):
    """Decode the K payloads at byte addresses ``addrs`` (each ``nbytes`` long) and sum them in order
    into out, a block of ``block`` values per task (K = 1: plain decode), then divide the block by
    ``div`` (float32; 1: not at all) while it is in cache, as torch's CPU ``out.div_(div)`` does."""
    nblocks = (n + block - 1) // block
    for c in prange(nblocks):
        buf = np.empty(_SUB + 8, np.uint8)
        lo = c * block
        hi = min(n, lo + block)
        for k in range(addrs.size):
            payload = numba.carray(_u8_ptr(addrs[k]), nbytes)
            _decode_range(payload, nb, lo, hi, bits, bucket, s, out, k > 0, buf)
        if div != _F1:
            for i in range(lo, hi):
                out[i] = out[i] / div


# --------------------------------------------------------------------------------- onebit
@njit(**_JIT)
def _ceil_log2(v):
    if v <= 2:
        return 1
    r = 0
    w = v - 1
    while w > 0:
        r += 1
        w >>= 1
    return r


@njit(**_JIT)
def _torch_row_sum(row, L, acc):
    """Tensor.sum of the contiguous float32 row[0:L] in the order of torch's CPU cascade_sum
    (vectorized_inner_sum for L >= 8, scalar_inner_sum below), including the final ``0 + sum`` store.
    ``acc`` is a (4, 4, 8) float32 scratch: levels x interleaved accumulators x lanes."""
    W = 8
    acc[:] = _F0
    if L >= W:
        nvec = L // W
        si = nvec // 4
        lp = max(4, _ceil_log2(si) // 4)
        step = 1 << lp
        mask = step - 1
        i = 0
        while i + step <= si:
            for _ in range(step):
                base = i * 4 * W
                for k in range(4):
                    for ln in range(W):
                        acc[0, k, ln] = acc[0, k, ln] + row[base + k * W + ln]
                i += 1
            for lev in range(1, 4):
                for k in range(4):
                    for ln in range(W):
                        acc[lev, k, ln] = acc[lev, k, ln] + acc[lev - 1, k, ln]
                        acc[lev - 1, k, ln] = _F0
                if (i & (mask << (lev * lp))) != 0:
                    break
        while i < si:
            base = i * 4 * W
            for k in range(4):
                for ln in range(W):
                    acc[0, k, ln] = acc[0, k, ln] + row[base + k * W + ln]
            i += 1
        for lev in range(1, 4):
            for k in range(4):
                for ln in range(W):
                    acc[0, k, ln] = acc[0, k, ln] + acc[lev, k, ln]
        for v in range(si * 4, nvec):
            for ln in range(W):
                acc[0, 0, ln] = acc[0, 0, ln] + row[v * W + ln]
        for k in range(1, 4):
            for ln in range(W):
                acc[0, 0, ln] = acc[0, 0, ln] + acc[0, k, ln]
        total = _F0
        for t in range(nvec * W, L):
            total = total + row[t]
        for ln in range(W):
            total = total + acc[0, 0, ln]
        return _F0 + total
    # scalar_inner_sum: row_sum with 4 interleaved scalar accumulators (fewer than 16 groups: no levels)
    si = L // 4
    p0 = p1 = p2 = p3 = _F0
    for i in range(si):
        p0 = p0 + row[4 * i]
        p1 = p1 + row[4 * i + 1]
        p2 = p2 + row[4 * i + 2]
        p3 = p3 + row[4 * i + 3]
    p0 = p0 + _F0  # the three empty higher levels are added back in (a no-op unless p == -0)
    p1 = p1 + _F0
    p2 = p2 + _F0
    p3 = p3 + _F0
    p0 = p0 + _F0
    p1 = p1 + _F0
    p2 = p2 + _F0
    p3 = p3 + _F0
    p0 = p0 + _F0
    p1 = p1 + _F0
    p2 = p2 + _F0
    p3 = p3 + _F0
    for t in range(si * 4, L):
        p0 = p0 + row[t]
    p0 = p0 + p1
    p0 = p0 + p2
    p0 = p0 + p3
    return _F0 + p0


@njit(**_JIT)
def _onebit_sums_small(xs, acc):
    """(sum of x >= 0 or NaN, sum of x < 0, count of x < 0) of a full bucket of fewer than 512 values,
    in the order of _torch_row_sum (fewer than 16 groups of 4 vectors: no level flush happens, and the
    accumulators start at +0 and never become -0, so skipping the additions of empty levels is exact).
    ``acc``: (64,) float32 scratch, 32 accumulators (4 interleaved x 8 lanes) per sign."""
    L = xs.size
    cn = 0
    if L < 8:
        p0 = p1 = p2 = p3 = n0 = n1 = n2 = n3 = _F0
        for i in range(L // 4):
            v0 = xs[4 * i]
            v1 = xs[4 * i + 1]
            v2 = xs[4 * i + 2]
            v3 = xs[4 * i + 3]
            p0 = p0 + (_F0 if v0 < _F0 else v0)
            p1 = p1 + (_F0 if v1 < _F0 else v1)
            p2 = p2 + (_F0 if v2 < _F0 else v2)
            p3 = p3 + (_F0 if v3 < _F0 else v3)
            n0 = n0 + (v0 if v0 < _F0 else _F0)
            n1 = n1 + (v1 if v1 < _F0 else _F0)
            n2 = n2 + (v2 if v2 < _F0 else _F0)
            n3 = n3 + (v3 if v3 < _F0 else _F0)
        for t in range(L // 4 * 4, L):
            v = xs[t]
            p0 = p0 + (_F0 if v < _F0 else v)
            n0 = n0 + (v if v < _F0 else _F0)
        for t in range(L):
            cn += 1 if xs[t] < _F0 else 0
        return _F0 + (((p0 + p1) + p2) + p3), _F0 + (((n0 + n1) + n2) + n3), cn
    nvec = L // 8
    si = nvec // 4
    for j in range(64):
        acc[j] = _F0
    for i in range(si):
        for j in range(32):
            v = xs[32 * i + j]
            neg = v < _F0
            acc[j] = acc[j] + (_F0 if neg else v)
            acc[32 + j] = acc[32 + j] + (v if neg else _F0)
    for vi in range(si * 4, nvec):
        for ln in range(8):
            v = xs[8 * vi + ln]
            neg = v < _F0
            acc[ln] = acc[ln] + (_F0 if neg else v)
            acc[32 + ln] = acc[32 + ln] + (v if neg else _F0)
    for k in range(1, 4):
        for ln in range(8):
            acc[ln] = acc[ln] + acc[8 * k + ln]
            acc[32 + ln] = acc[32 + ln] + acc[32 + 8 * k + ln]
    tp = _F0
    tn = _F0
    for t in range(nvec * 8, L):
        v = xs[t]
        neg = v < _F0
        tp = tp + (_F0 if neg else v)
        tn = tn + (v if neg else _F0)
    for ln in range(8):
        tp = tp + acc[ln]
        tn = tn + acc[32 + ln]
    for t in range(L):
        cn += 1 if xs[t] < _F0 else 0
    return _F0 + tp, _F0 + tn, cn


@njit(**_JIT)
def _onebit_mean(r, total, cnt, bucket, acc):
    """reference.onebit_mean: total / cnt, unless the sum of the (finite) values in r overflowed; then the
    same sum of r * 2**-32 (r is scaled in place: it is scratch), divided, scaled back, capped."""
    if abs(total) != np.inf:
        return total / cnt
    for k in range(bucket):
        r[k] = r[k] * _ONEBIT_SCALE
    scaled = _torch_row_sum(r, bucket, acc)
    if abs(scaled) == np.inf or scaled != scaled:
        return total / cnt  # an Inf among the values: the mean stays non-finite
    alt = (scaled / cnt) * _ONEBIT_UNSCALE
    if alt > _FMAX:
        return _FMAX
    if alt < -_FMAX:
        return -_FMAX
    return alt


@njit(**_PJIT)
def _onebit_encode(x, n, bucket, scales, stream, per_chunk):
    nb = scales.size // 2
    nchunks = (nb + per_chunk - 1) // per_chunk
    for c in prange(nchunks):
        rp = np.empty(bucket, np.float32)
        rn = np.empty(bucket, np.float32)
        acc = np.empty((4, 4, 8), np.float32)
        acc_small = np.empty(64, np.float32)
        b0 = c * per_chunk
        b1 = min(nb, b0 + per_chunk)
        for b in range(b0, b1):
            lo = b * bucket
            hi = min(n, lo + bucket)
            xs = x[lo:hi]
            if xs.size == bucket and bucket < 512:
                sp, sn, cn = _onebit_sums_small(xs, acc_small)
                cp = bucket - cn
                if abs(sp) != np.inf and abs(sn) != np.inf:  # else overflow or an Inf: the general path below
                    scales[2 * b] = sp / np.float32(max(cp, 1))
                    scales[2 * b + 1] = sn / np.float32(max(cn, 1))
                    continue
            cn = 0
            for k in range(xs.size):
                v = xs[k]
                neg = v < _F0  # NaN counts as non-negative, as in reference.onebit_stats
                rp[k] = _F0 if neg else v
                rn[k] = v if neg else _F0
                cn += 1 if neg else 0
            for k in range(xs.size, bucket):  # padding of the last bucket: masked out, adds +0
                rp[k] = _F0
                rn[k] = _F0
            cp = xs.size - cn
            sp = _torch_row_sum(rp, bucket, acc)
            sn = _torch_row_sum(rn, bucket, acc)
            scales[2 * b] = _onebit_mean(rp, sp, np.float32(max(cp, 1)), bucket, acc)
            scales[2 * b + 1] = _onebit_mean(rn, sn, np.float32(max(cn, 1)), bucket, acc)
        # sign bits of the chunk (it starts on a byte boundary)
        lo = b0 * bucket
        hi = min(n, b1 * bucket)
        xs = x[lo:hi]
        st = stream[lo // 8 : (hi + 7) // 8]
        for j in range(xs.size // 8):
            w = np.uint8(0)
            for k in range(8):
                w |= np.uint8(0 if xs[8 * j + k] < _F0 else 1) << np.uint8(k)
            st[j] = w
        if xs.size % 8:
            j = xs.size // 8
            w = np.uint8(0)
            for k in range(xs.size - 8 * j):
                w |= np.uint8(0 if xs[8 * j + k] < _F0 else 1) << np.uint8(k)
            st[j] = w


@njit(**_PJIT)
def _onebit_decode(payload, n, nb, bucket, out):
    stream = payload[8 * nb :]
    nblocks = (n + _BLOCK - 1) // _BLOCK
    for c in prange(nblocks):
        lo = c * _BLOCK
        hi = min(n, lo + _BLOCK)
        i = lo
        while i < hi:
            b = i // bucket
            e = min(hi, (b + 1) * bucket)
            mp = _read_f32(payload, 8 * b)
            mn = _read_f32(payload, 8 * b + 4)
            sb = stream[i >> 3 :]
            ov = out[i:e]
            off = i & 7
            for k in range(ov.size):
                t = off + k
                ov[k] = mp if (sb[t >> 3] >> np.uint8(t & 7)) & np.uint8(1) else mn
            i = e


# --------------------------------------------------------------------------------- dettmers
_DM_TINY = np.float32(1.5e-6)
_DM_TOP = np.float32(0.995703)


@njit(inline="always", **_JIT)
def _dm_nearest(v, cells, shift, kbase, ncell, signed):
    """Code of the table value nearest to v via the cell table (see triton_kernels._dm_nearest)."""
    b = np.int64(_f32_to_bits(v))
    if signed:
        key = b if b >= 0 else b ^ 0x7FFFFFFF
        cell = min(max((key >> shift) - kbase, 0), ncell - 1)
        e = np.int64(cells[cell])
        return ((e >> 24) & 0xFF) + (1 if (key & ((1 << shift) - 1)) > (e & 0xFFFFFF) else 0)
    e = np.int64(cells[b >> shift])
    mask = (1 << shift) - 1
    if (b & mask) > (e & mask):
        return (e >> shift) & 0x7F
    return (e >> 25) & 0x7F


@njit(inline="always", **_JIT)
def _dm_paper(m, tbl, lo, hi, pivot0, dyn):
    """The 2015 kernels' binary search (see triton_kernels._dm_paper), in float32."""
    pivot = pivot0
    lower = 0
    for i in range(6):
        if m > tbl[pivot]:
            lower = pivot
            pivot = pivot + (32 >> i)
        else:
            pivot = pivot - (32 >> i)
    code = pivot if (tbl[pivot] - m) < abs(tbl[lower] - m) else lower
    if dyn:
        if code == 126:
            code = 127
        if m < _DM_TINY:
            code = 126
        if m > _DM_TOP:
            code = 127
    else:
        if m < lo:
            code = 0
        if m > hi:
            code = 127
    return code


@njit(inline="always", **_JIT)
def _dm_code(x, safe, norm, signed, paper, dyn, cells, shift, kbase, ncell, tbl, lo, hi, pivot0):
    """Code byte of one value (see triton_kernels._dm_codes): the codec's Dettmers encode."""
    if norm:  # v = x / its scale, NaN -> 0, clamped to [-1, 1]
        v = x / safe
        if v != v:
            v = _F0
        v = min(max(v, np.float32(-1.0)), _F1)
        if signed:
            return _dm_nearest(v, cells, shift, kbase, ncell, True)
    else:  # absolute values; NaN and +-inf get the NaN marker
        if not abs(x) < np.float32(np.inf):
            return 128
        v = x
    m = abs(v)
    code = _dm_paper(m, tbl, lo, hi, pivot0, dyn) if paper else _dm_nearest(m, cells, shift, kbase, ncell, False)
    if v < _F0 and code != 0:
        code = code | 128
    return code


@njit(**_JIT)
def _dm_absmax(x, lo, hi):
    """max |x[lo:hi]|, NaN (0x7FC00000) if any value is NaN (reference.bucket_absmax)."""
    m = _F0
    for i in range(lo, hi):
        a = abs(x[i])
        if a != a:
            return _NAN
        if a > m:
            m = a
    return m


@njit(**_PJIT)
def _dm_encode_kernel(x, n, bucket, norm, signed, paper, dyn, cells, shift, kbase, ncell, tbl, lo, hi,
                      pivot0, scales, codes, chunk):
    """Scales (normalised types: max |x| per bucket of ``bucket``, 0 = the whole tensor) and a code
    byte per value; ``chunk`` values per task (a multiple of ``bucket`` when bucketed)."""
    nchunks = (n + chunk - 1) // chunk
    if norm and bucket == 0:
        part = np.empty(nchunks, np.float32)
        for c in prange(nchunks):
            part[c] = _dm_absmax(x, c * chunk, min(n, (c + 1) * chunk))
        scales[0] = _dm_absmax(part, 0, nchunks)  # the partial maxima are >= 0 or NaN
    for c in prange(nchunks):
        lo_i = c * chunk
        hi_i = min(n, lo_i + chunk)
        if norm and bucket > 0:
            b = lo_i // bucket
            while b * bucket < hi_i:
                e = min(n, (b + 1) * bucket)
                sc = _dm_absmax(x, b * bucket, e)
                scales[b] = sc
                safe = sc if sc > _F0 else _F1
                for i in range(b * bucket, e):
                    codes[i] = _dm_code(x[i], safe, norm, signed, paper, dyn, cells, shift, kbase, ncell, tbl,
                                        lo, hi, pivot0)
                b += 1
        else:
            safe = _F1
            if norm:
                safe = scales[0] if scales[0] > _F0 else _F1
            for i in range(lo_i, hi_i):
                codes[i] = _dm_code(x[i], safe, norm, signed, paper, dyn, cells, shift, kbase, ncell, tbl,
                                    lo, hi, pivot0)


@njit(**_PJIT)
def _dm_decode_kernel(codes, scales, lut, n, bucket, norm, out, chunk):
    """out[i] = lut[code i] (times its bucket's scale for normalised types), in float32."""
    nchunks = (n + chunk - 1) // chunk
    for c in prange(nchunks):
        for i in range(c * chunk, min(n, (c + 1) * chunk)):
            v = lut[codes[i]]
            if norm:
                v = v * scales[i // bucket if bucket > 0 else 0]
            out[i] = v


# --------------------------------------------------------------------------------- python API
def _match_torch_threads() -> None:
    """Run numba's parallel loops on as many threads as torch's intra-op pool.

    Launchers and users size that pool (torchrun sets OMP_NUM_THREADS=1 for several ranks per node);
    numba's default is every core. A larger team oversubscribes the cores, and then every parallel
    call waits at its closing barrier for a preempted worker.

    Also undoes a side effect: numba's OpenMP layer sets OpenMP's thread count to NUMBA_NUM_THREADS
    when it starts its pool, and torch shares that OpenMP runtime, so the first numba call would
    silently raise torch's own thread count (1 -> all cores under torchrun)."""
    torch_threads = torch.get_num_threads()  # before numba's pool starts (numba.get_num_threads starts it)
    want = max(1, min(torch_threads, numba.config.NUMBA_NUM_THREADS))
    if numba.get_num_threads() != want:
        numba.set_num_threads(want)
    if torch.get_num_threads() != torch_threads:
        torch.set_num_threads(torch_threads)


def _np_in(x: torch.Tensor) -> np.ndarray:
    return x.detach().reshape(-1).numpy()


def _fast_input(x: torch.Tensor) -> bool:
    return x.device.type == "cpu" and x.dtype == torch.float32 and x.is_contiguous()


def _fast_output(out: torch.Tensor) -> bool:
    return out.device.type == "cpu" and out.dtype == torch.float32 and out.is_contiguous()


def _payload_np(payload: torch.Tensor) -> np.ndarray:
    return payload.detach().reshape(-1).contiguous().numpy()


def _chunk_buckets(bucket: int) -> int:
    """Buckets per encode chunk: whole buckets, a multiple of 8 values, at least _BLOCK values."""
    g0 = 8 // math.gcd(bucket, 8)
    unit = g0 * bucket
    return g0 * max(1, -(-_BLOCK // unit))


def _check_bits(bits: int) -> None:
    if not (1 <= bits <= 8 or bits == 16):
        raise ValueError(f"qsgd: bits must be 1..8 or 16, got {bits}")


def qsgd_encode(x: torch.Tensor, bits: int, bucket: int, norm: str, stochastic: bool, seed: int,
                full: bool = False) -> torch.Tensor:
    """x: (n,) float32 -> payload uint8 ``[scales (nb,) f32][codes packed at bits]`` (reference.qsgd_encode)."""
    _check_bits(bits)
    if not _fast_input(x):
        return ref.qsgd_encode(x, bits, bucket, norm, stochastic, seed, full)
    n = x.numel()
    nb = (n + bucket - 1) // bucket
    payload = torch.empty(4 * nb + ref.packed_nbytes(n, bits), dtype=torch.uint8)
    if n == 0:
        return payload
    xa = _np_in(x)  # (n,) float32
    p = payload.numpy()
    scales = p[: 4 * nb].view(np.float32)  # fresh allocation: aligned
    stream = p[4 * nb :]
    s = np.float32(ref.qsgd_levels(bits, full))
    key = np.uint64(ref.seed_key(seed))
    per_chunk = _chunk_buckets(bucket)
    use_l2 = norm == "l2"
    _match_torch_threads()
    args = (xa, xa.view(np.int32), n, bits, bucket, use_l2, _L2_TAIL_FMA, s, bool(stochastic), key, scales, stream)
    if -(-nb // per_chunk) >= 2 * numba.get_num_threads():
        _qsgd_encode_kernel(*args, _FUSED, per_chunk)
    else:  # few, large buckets: the scales first (a bucket per task), then the codes in blocks of values
        _qsgd_encode_kernel(*args, _SCALES, 1)
        _qsgd_encode_kernel(*args, _CODES, 1)
    return payload


def _decode_payloads(
    payloads: Sequence[torch.Tensor], n: int, bits: int, bucket: int, out: torch.Tensor, block: int,
    divide_by: int = 1, full: bool = False,
) -> None:
    nb = (n + bucket - 1) // bucket
    nbytes = 4 * nb + ref.packed_nbytes(n, bits)
    arrays = [_payload_np(p) for p in payloads]  # referenced until the kernel returns
    for a in arrays:
        if a.size != nbytes:
            raise ValueError(f"qsgd: payload has {a.size} bytes, expected {nbytes}")
    addrs = np.array([a.ctypes.data for a in arrays], dtype=np.int64)
    s = np.float32(ref.qsgd_levels(bits, full))
    _match_torch_threads()
    _qsgd_decode_kernel(addrs, nbytes, n, nb, bits, bucket, s, out.detach().view(-1).numpy(), block,
                        np.float32(divide_by))


def qsgd_decode(payload: torch.Tensor, n: int, bits: int, bucket: int, out: torch.Tensor,
                full: bool = False) -> torch.Tensor:
    """Decode into ``out`` (n,) float32 and return it (reference.qsgd_decode)."""
    _check_bits(bits)
    if not _fast_output(out):
        return ref.qsgd_decode(payload, n, bits, bucket, out, full)
    if n == 0:
        return out
    _decode_payloads([payload], n, bits, bucket, out, _BLOCK, full=full)
    return out


def qsgd_decode_sum(
    payloads: Sequence[torch.Tensor], n: int, bits: int, bucket: int, out: torch.Tensor, divide_by: int = 1,
    full: bool = False,
) -> torch.Tensor:
    """Sum of the decoded payloads into ``out``, added in the given order in float32
    (``acc = p0; acc += p1; ...``, as Codec.decode_sum over reference.qsgd_decode), then divided by
    ``divide_by`` as ``out.div_(divide_by)`` would, in one pass."""
    _check_bits(bits)
    if len(payloads) == 0:
        raise ValueError("decode_sum needs at least one payload")
    if not _fast_output(out):
        acc = ref.qsgd_decode(payloads[0], n, bits, bucket, out, full)
        tmp = torch.empty_like(acc)
        for p in payloads[1:]:
            acc.add_(ref.qsgd_decode(p, n, bits, bucket, tmp, full))
        return acc.div_(divide_by) if divide_by != 1 else acc
    if n == 0:
        return out
    # a block of the output stays in L1/L2 while the K payloads are added to it (and divided)
    _decode_payloads(payloads, n, bits, bucket, out, 4096, divide_by, full)
    return out


def onebit_encode_buckets(x: torch.Tensor, bucket: int) -> torch.Tensor:
    """x: (n,) -> ``[(mean_pos, mean_neg) per bucket][sign bits]`` (reference.onebit_encode_buckets)."""
    n = x.numel()
    nb = (n + bucket - 1) // bucket
    if not _fast_input(x) or (nb == 1 and n >= _TORCH_GRAIN):
        return ref.onebit_encode_buckets(x, bucket)
    payload = torch.empty(8 * nb + (n + 7) // 8, dtype=torch.uint8)
    if n == 0:
        return payload
    p = payload.numpy()
    _match_torch_threads()
    _onebit_encode(_np_in(x), n, bucket, p[: 8 * nb].view(np.float32), p[8 * nb :], _chunk_buckets(bucket))
    return payload


def onebit_decode_buckets(payload: torch.Tensor, n: int, bucket: int, out: torch.Tensor) -> torch.Tensor:
    """Decode into ``out`` (n,) float32 and return it (reference.onebit_decode_buckets)."""
    if not _fast_output(out):
        return ref.onebit_decode_buckets(payload, n, bucket, out)
    if n == 0:
        return out
    nb = (n + bucket - 1) // bucket
    p = _payload_np(payload)
    if p.size != 8 * nb + (n + 7) // 8:
        raise ValueError(f"onebit: payload has {p.size} bytes, expected {8 * nb + (n + 7) // 8}")
    _match_torch_threads()
    _onebit_decode(p, n, nb, bucket, out.detach().view(-1).numpy())
    return out


# --------------------------------------------------------------------------------- dettmers (host)
def _dm_args(type_: str, offset: int) -> tuple:
    t = host_tables(type_, offset)
    c = t["consts"]
    return (t["cells"].numpy(), c["SHIFT"], c["KBASE"], c["NCELL"], t["paper"].numpy(), np.float32(t["lo"]),
            np.float32(t["hi"]), c["PIVOT0"], bool(c["SIGNED"]), bool(c["DYN"]), t["lut"].numpy())


def dettmers_encode(x: torch.Tensor, type_: str, search: str, bucket: int, offset: int) -> torch.Tensor:
    """Dettmers' 8-bit codec: x (n,) float32 -> [absmax f32 per bucket (normalised types)][code byte each],
    the same bytes as ``Dettmers(...).encode``; ``bucket=0`` is one scale for the whole tensor."""
    x = x.reshape(-1).to(torch.float32).contiguous()
    n = x.numel()
    norm, _, nb = layout(n, type_, bucket)
    payload = torch.empty(4 * nb + n, dtype=torch.uint8)
    if n == 0:
        return payload
    cells, shift, kbase, ncell, tbl, lo, hi, pivot0, signed, dyn, _ = _dm_args(type_, offset)
    bkt = bucket if norm else 0
    chunk = bkt * max(1, _BLOCK // bkt) if bkt else _BLOCK
    p = payload.numpy()
    scales = p[: 4 * nb].view(np.float32) if nb else np.empty(1, np.float32)  # fresh allocation: aligned
    _match_torch_threads()
    _dm_encode_kernel(_np_in(x), n, bkt, norm, signed, search == "paper", dyn, cells, shift, kbase, ncell, tbl,
                      lo, hi, pivot0, scales, p[4 * nb :], chunk)
    return payload


def dettmers_decode(payload: torch.Tensor, n: int, type_: str, bucket: int, offset: int,
                    out: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`dettmers_encode` into ``out`` (n,) float32: table lookup times the scale."""
    if n == 0:
        return out
    norm, _, nb = layout(n, type_, bucket)
    p = _payload_np(payload)
    if p.size != 4 * nb + n:
        raise ValueError(f"dettmers: payload has {p.size} bytes, expected {4 * nb + n}")
    scales = np.ascontiguousarray(p[: 4 * nb]).view(np.float32) if nb else np.ones(1, np.float32)
    lut = _dm_args(type_, offset)[-1]
    target = out if _fast_output(out) else torch.empty(n, dtype=torch.float32)
    _match_torch_threads()
    _dm_decode_kernel(p[4 * nb :], scales, lut, n, bucket if norm else 0, norm, target.detach().view(-1).numpy(),
                      _BLOCK)
    if target is not out:
        out.copy_(target)
    return out
