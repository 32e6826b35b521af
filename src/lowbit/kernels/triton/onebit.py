"""Triton kernels of the ``onebit`` codec per bucket (1bitSGD): the means of the non-negative and the
negative values of each bucket and one sign bit per value, and a decode that sums up to ``MAX_SUM``
payloads per launch with the mean in the same pass. Sign bits are exact; the means are float32 sums in
Triton's order (see :mod:`lowbit.kernels.triton`, "Bit-exactness"). The per-column mode runs the
reference.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from lowbit.kernels import reference as ref
from lowbit.kernels.triton.common import (
    F32_MAX,
    _LAUNCH,
    _aligned,
    _canon_nan,
    _fused,
    _i64,
    _ld,
    _load_codes,
    _new_payload,
    _pack_store,
    _pid,
    _scale_view,
    _st,
    _step,
    _sum_launches,
    _tiling,
    _warps,
)

ONEBIT_SUM_SCALE = tl.constexpr(ref.ONEBIT_SUM_SCALE)
ONEBIT_SUM_UNSCALE = tl.constexpr(1.0 / ref.ONEBIT_SUM_SCALE)


# ===================================================================================== onebit kernels
@triton.jit
def _sides(x, inb, MASKED: tl.constexpr):
    """(non-negative, negative) masks of a tile: NaN counts as non-negative (~(x < 0)); with MASKED, the
    lanes past the end are on neither side. (Inlined: a mask the caller leaves unused costs nothing.)"""
    pos = (x >= 0) | (x != x)
    if MASKED:
        pos = pos & inb
    neg = ~pos
    if MASKED:
        neg = neg & inb
    return pos, neg


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
    pos, neg = _sides(x, inb, MASKED)
    if FUSED:
        sum_pos = tl.sum(tl.where(pos, x, 0.0), axis=1)
        sum_neg = tl.sum(tl.where(neg, x, 0.0), axis=1)
        cnt_pos = tl.maximum(tl.sum(pos.to(tl.int32), axis=1), 1).to(tl.float32)
        cnt_neg = tl.maximum(tl.sum(neg.to(tl.int32), axis=1), 1).to(tl.float32)
        mean_pos = tl.div_rn(sum_pos, cnt_pos)
        mean_neg = tl.div_rn(sum_neg, cnt_neg)
        # reference.onebit_mean: a sum of finite values that overflowed is taken again of x * 2**-32
        # (only in tiles that have one, so the common path costs one more max). The branch loads x
        # again and makes its own sides: a tile kept live across it (x, or the negative side) cost the
        # common path registers and bandwidth
        if tl.max(tl.maximum(tl.abs(sum_pos), tl.abs(sum_neg))) == float("inf"):
            xr = _ld(x_ptr + offs, inb, 0.0, MASKED)
            pr, nr = _sides(xr, inb, MASKED)
            xs = xr * ONEBIT_SUM_SCALE
            mean_pos = _onebit_mean(sum_pos, tl.sum(tl.where(pr, xs, 0.0), axis=1), cnt_pos, mean_pos)
            mean_neg = _onebit_mean(sum_neg, tl.sum(tl.where(nr, xs, 0.0), axis=1), cnt_neg, mean_neg)
        _st(scale_ptr + 2 * rows, _canon_nan(mean_pos), rows < nb, MASKED)
        _st(scale_ptr + 2 * rows + 1, _canon_nan(mean_neg), rows < nb, MASKED)
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


# ===================================================================================== host side
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
