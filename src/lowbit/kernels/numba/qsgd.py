"""numba kernels of the ``qsgd`` codec at every width (1-8 and 16 bits): scales (max or L2 norm, the
latter summed in reference.tree_sum's order), quantisation and packing chunk by chunk, and a
decode that sums several payloads while a block of the output is in cache. See
:mod:`lowbit.kernels.numba` for how the work is split and why the arithmetic reads as it does.
"""

from __future__ import annotations

from collections.abc import Sequence

import numba
import numpy as np
import torch
from numba import njit, prange

from lowbit.kernels import reference as ref
from lowbit.kernels.numba.common import (
    _BLOCK,
    _F0,
    _F1,
    _FMAX,
    _HALF,
    _JIT,
    _NAN,
    _PJIT,
    _SQ,
    _SUB,
    _bits_to_f32,
    _chunk_buckets,
    _fast_input,
    _fast_output,
    _match_torch_threads,
    _np_in,
    _pack,
    _payload_np,
    _pow2,
    _read_f32,
    _tree_scratch,
    _tree_sum,
    _u8_ptr,
    _uniform,
    _unpack,
)

_ABS_MASK = np.int64(0x7FFFFFFF)
_INF_BITS = np.int64(0x7F800000)
_PINF = np.float32(np.inf)
_FM1 = np.float32(-1.0)


@njit(inline="always", **_JIT)
def _ratio(v, safe):
    """v / safe, ±1 where v is ±Inf: reference.inf_sign (an infinity keeps its sign)."""
    r = v / safe
    r = _F1 if v == _PINF else r
    return _FM1 if v == -_PINF else r


@njit(inline="always", **_JIT)
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
def _l2(x, lo, hi, p, m, buf, sums):
    """reference.bucket_l2 for the bucket starting at ``lo`` (values up to ``hi``, zeros after, ``p``
    leaves): ``m * sqrt(tree_sum((x / safe(m))^2))``, capped at float32's max."""
    safe = m if m > _F0 else _F1
    r = np.float32(np.sqrt(np.float64(_tree_sum(x[lo:hi], p, _SQ, safe, buf, sums))))  # as the reference
    if r != r:  # a NaN or Inf in the bucket: the canonical NaN, as the reference
        return _NAN
    l2 = m * r
    return _FMAX if l2 > _FMAX else l2  # reference.cap_l2 (m is finite here)


@njit(inline="always", **_JIT)
def _bucket_scale(x, xi, lo, hi, p, use_l2, buf, sums):
    m = _absmax(xi, lo, hi)
    if use_l2:
        return _l2(x, lo, hi, p, m, buf, sums)
    return m


# --------------------------------------------------------------------------------- qsgd encode
@njit(**_JIT)
def _slow_code(v, safe, s, two_s, stochastic, key, i):
    """One code as reference.qsgd_encode makes it, for a bucket whose scale is Inf or NaN (the only
    buckets that can hold an Inf): an infinity takes the top or bottom code (reference.inf_sign)."""
    q = _ratio(v, safe) * s + s
    f = np.floor(q + (_uniform(key, i) if stochastic else _HALF))
    f = f if f > _F0 else _F0
    return f if f < two_s else two_s


@njit(**_JIT)
def _codes_segment(x, lo, hi, scale, s, two_s, stochastic, key, dst, d0):
    """Codes of x[lo:hi] (one bucket's scale) into dst[d0 : d0 + hi - lo], as reference.qsgd_encode."""
    safe = scale if scale > _F0 else _F1
    # zero-based views: numba then knows the indices are non-negative and the loops vectorise
    xs = x[lo:hi]
    ds = dst[d0 : d0 + hi - lo]
    if not scale < _PINF:  # Inf or NaN: kept out of the vectorised loops below (no x there is infinite)
        for k in range(xs.size):
            ds[k] = _slow_code(xs[k], safe, s, two_s, stochastic, key, lo + k)
    elif stochastic:
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


@njit(inline="always", **_JIT)
def _exact_code(v, safe, ks, s, add):
    """reference.qsgd_round_exact for one finite v of a bucket with a finite scale (``ks = s / safe``, 0
    where that overflowed): floor(q* + add) of the exact level q* = q + c. The two FMAs of
    reference.qsgd_level_residual are taken in float64 as the reference takes them (exact there)."""
    r = v / safe
    p = r * s
    q = p + s
    p_lo = np.float32(np.float64(r) * np.float64(s) - np.float64(p))
    q_lo = p - (q - s)
    rem = np.float32(np.float64(v) - np.float64(r) * np.float64(safe))
    c = (q_lo + p_lo) + rem * ks
    fl = np.floor(q)
    return fl + np.floor((q - fl) + (c + add))


@njit(**_JIT)
def _codes_segment16(x, lo, hi, scale, s, two_s, stochastic, key, stream):
    """16-bit codes of x[lo:hi] written little-endian straight into the stream (rounding the exact
    level: _exact_code)."""
    safe = scale if scale > _F0 else _F1
    ks = s / safe
    ks = ks if ks < _PINF else _F0
    xs = x[lo:hi]
    ds = stream[2 * lo : 2 * hi]
    finite = scale < _PINF  # else the bucket may hold an Inf (_slow_code)
    for k in range(xs.size):
        if finite:
            f = _exact_code(xs[k], safe, ks, s, _uniform(key, lo + k) if stochastic else _HALF)
            f = f if f > _F0 else _F0
            f = f if f < two_s else two_s
        else:
            f = _slow_code(xs[k], safe, s, two_s, stochastic, key, lo + k)
        c = np.uint32(f)
        ds[2 * k] = c & np.uint32(0xFF)
        ds[2 * k + 1] = c >> np.uint32(8)


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
def _qsgd_encode_kernel(x, xi, n, bits, bucket, use_l2, s, stochastic, key, scales, stream, kind, per_task):
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
            p = _pow2(bucket)
            buf, sums = _tree_scratch(p if use_l2 else 1)
            b0 = c * per_task
            b1 = min(nb, b0 + per_task)
            for b in range(b0, b1):
                lo = b * bucket
                scales[b] = _bucket_scale(x, xi, lo, min(n, lo + bucket), p, use_l2, buf, sums)
            if kind == _FUSED:
                _encode_range(x, n, b0 * bucket, min(n, b1 * bucket), bits, bucket, s, stochastic, key, scales, stream)


# --------------------------------------------------------------------------------- qsgd decode
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


# --------------------------------------------------------------------------------- python API
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
    args = (xa, xa.view(np.int32), n, bits, bucket, use_l2, s, bool(stochastic), key, scales, stream)
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
