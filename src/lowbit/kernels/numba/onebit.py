"""numba kernels of the ``onebit`` codec per bucket (1bitSGD): the means of the non-negative and the
negative values of each bucket, summed in reference.tree_sum's order, and one sign bit per value;
decode in blocks of values. The per-column mode runs the reference (see :mod:`lowbit.kernels.numba`).
"""

from __future__ import annotations

import numpy as np
import torch
from numba import njit, prange

from lowbit.kernels import reference as ref
from lowbit.kernels.numba.common import (
    _BLOCK,
    _F0,
    _F1,
    _FMAX,
    _JIT,
    _NAN,
    _NEG,
    _NEG_SCALED,
    _PJIT,
    _POS,
    _POS_SCALED,
    _TREE_BLOCK,
    _chunk_buckets,
    _fast_input,
    _fast_output,
    _match_torch_threads,
    _np_in,
    _payload_np,
    _pow2,
    _read_f32,
    _sign_sums,
    _tree_scratch,
    _tree_sum,
)

_ONEBIT_UNSCALE = np.float32(2.0**32)


# --------------------------------------------------------------------------------- onebit
@njit(inline="always", **_JIT)
def _onebit_mean(xs, p, kind, total, count, buf, sums):
    """reference.onebit_mean of one sign's values of ``xs`` (``kind``: _POS or _NEG; ``total``: their
    tree_sum, ``count``: how many): total / count, unless that sum of finite values overflowed; then
    the same sum of the values times 2**-32, divided, scaled back, capped."""
    cnt = np.float32(max(count, 1))
    if total != total:
        return _NAN  # the canonical NaN, as the reference
    if abs(total) != np.inf:
        return total / cnt
    scaled = _tree_sum(xs, p, _POS_SCALED if kind == _POS else _NEG_SCALED, _F1, buf, sums)
    if abs(scaled) == np.inf or scaled != scaled:
        return total / cnt  # an Inf among the values: the mean stays non-finite (inf / cnt: inf)
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
    p = _pow2(bucket)
    small = 8 <= p <= _TREE_BLOCK
    for c in prange(nchunks):
        buf, sums = _tree_scratch(p)
        buf2 = np.empty_like(buf)
        b0 = c * per_chunk
        b1 = min(nb, b0 + per_chunk)
        for b in range(b0, b1):
            lo = b * bucket
            xs = x[lo : min(n, lo + bucket)]  # the last bucket's padding: leaves of +0, as the masked reference
            if small:
                sp, sn, cn = _sign_sums(xs, p, buf, buf2)
            else:
                cn = 0
                for k in range(xs.size):
                    cn += 1 if xs[k] < _F0 else 0  # NaN counts as non-negative
                sp = _tree_sum(xs, p, _POS, _F1, buf, sums)
                sn = _tree_sum(xs, p, _NEG, _F1, buf, sums)
            scales[2 * b] = _onebit_mean(xs, p, _POS, sp, xs.size - cn, buf, sums)
            scales[2 * b + 1] = _onebit_mean(xs, p, _NEG, sn, cn, buf, sums)
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
    if not _fast_input(x):
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
