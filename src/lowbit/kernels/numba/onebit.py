"""numba kernels of the ``onebit`` codec per bucket (1bitSGD): the means of the non-negative and the
negative values of each bucket, summed in the order of torch's CPU cascade sum, and one sign bit per
value; decode in blocks of values. The per-column mode and a single bucket of at least 32768 values run
the reference (see :mod:`lowbit.kernels.numba`).
"""

from __future__ import annotations

import numpy as np
import torch
from numba import njit, prange

from lowbit.kernels import reference as ref
from lowbit.kernels.numba.common import (
    _BLOCK,
    _F0,
    _FMAX,
    _JIT,
    _PJIT,
    _chunk_buckets,
    _fast_input,
    _fast_output,
    _match_torch_threads,
    _np_in,
    _payload_np,
    _read_f32,
)

#: torch splits a single-row sum across threads from this size on (at::internal::GRAIN_SIZE).
_TORCH_GRAIN = 32768
_ONEBIT_SCALE = np.float32(2.0**-32)  # reference.ONEBIT_SUM_SCALE
_ONEBIT_UNSCALE = np.float32(2.0**32)


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


# --------------------------------------------------------------------------------- python API
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
