"""Triton kernels of the ``qsgd`` codec (1/2/4/8/16 bits; other widths run the reference): a fused
encode of whole buckets (max or L2 norm, stochastic or nearest rounding) or the general path, and a
decode that sums up to ``MAX_SUM`` payloads per launch and divides by the mean's divisor in the same
pass. See :mod:`lowbit.kernels.triton` for the plan and the bit-exactness rules.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from lowbit.kernels import reference as ref
from lowbit.kernels.triton.common import (
    CONFIG,
    F32_MAX,
    _LAUNCH,
    _aligned,
    _bucket_scales_general,
    _canon_nan,
    _div_tile,
    _inf_sign,
    _fused,
    _i64,
    _ld,
    _load_codes,
    _new_payload,
    _pack_store,
    _per_elem,
    _pid,
    _safe,
    _scale_view,
    _st,
    _step,
    _store_scales,
    _sum_launches,
    _tile_scales,
    _tile_sums,
    _tiling,
    _torch_scalar_division,
    _uniform,
    _warps,
)

#: Bit widths with a packed Triton path; others run the reference.
PACKED_BITS = (1, 2, 4, 8, 16)
#: below this |scale| no decoded qsgd value can overflow (|code - s| <= s, step <= 2 |scale|)
F32_HALF_MAX = tl.constexpr(ref.F32_MAX / 2)


@triton.jit
def _quantize(r, idx, key, S: tl.constexpr, STOCH: tl.constexpr, BOUNDED: tl.constexpr):
    """QSGD code of each r = x / (its bucket's safe scale): uint32 in [0, 2S] (bits <= 8).

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
def _level_ratio(safe, S: tl.constexpr):
    """reference.qsgd_level_residual's k = S / safe (0 where it overflows), per bucket."""
    ks = tl.div_rn(S, safe)
    return tl.where(ks < float("inf"), ks, 0.0)


@triton.jit
def _quantize_exact(x, r, scale, safe, ks, idx, key, S: tl.constexpr, STOCH: tl.constexpr,
                    BOUNDED: tl.constexpr):
    """QSGD code of each x (bits > 8): reference.qsgd_round_exact, floor(q* + u) of the exact level
    q* = q + c, where its bucket's ``scale`` (``safe``, ``ks = _level_ratio(safe)``, all per element) is
    finite; the float32 floor(q + u) elsewhere. r as in _quantize (r = -1 for a NaN, bounded or not):
    uint32 in [0, 2S]. BOUNDED: r is finite (_div_tile with SANITIZE), so no code is NaN.
    About a dozen float32 operations more than _quantize, two of them FMAs."""
    p = r * S
    q = p + S
    if STOCH:
        add = _uniform(idx, key)
    else:
        add = 0.5
    p_lo = tl.fma(r, S, -p)
    q_lo = p - (q - S)
    rem = tl.fma(-r, safe, x)
    c = (q_lo + p_lo) + rem * ks
    fl = tl.floor(q)
    code = tl.where(scale < float("inf"), fl + tl.floor((q - fl) + (c + add)), q + add)
    if not BOUNDED:
        code = tl.where(code == code, code, 0.0)
    return tl.minimum(tl.maximum(code, 0.0), 2 * S).to(tl.uint32)


# ===================================================================================== qsgd kernels
@triton.jit
def _qsgd_encode_body(x_ptr, pay_ptr, code_ptr, ks_ptr, n, nb, bucket, nbytes, key, pid,
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
            scale = _canon_nan(tl.where((l2 == float("inf")) & (scale < float("inf")), F32_MAX, l2))
        _store_scales(scale_ptr, scale, pid, nb, ROWS, MASKED)
        r = _div_tile(x, scale, ROWS, BUCKET, True, -1.0, True)
        if BITS > 8:  # per-bucket terms, then broadcast
            safe = _safe(scale)
            se = _per_elem(scale, ROWS, BUCKET)
            sf = _per_elem(safe, ROWS, BUCKET)
            ks = _per_elem(_level_ratio(safe, S), ROWS, BUCKET)
            codes = _quantize_exact(x, r, se, sf, ks, offs, key, S, STOCH, True)
        else:
            codes = _quantize(r, offs, key, S, STOCH, True)
    else:  # (BLOCK,) elements of any buckets: scales precomputed, gathered
        offs = pid * BLOCK + tl.arange(0, BLOCK)
        inb = offs < n
        x = _ld(x_ptr + offs, inb, 0.0, MASKED)
        scale = _ld(scale_ptr + offs // bucket, inb, 1.0, MASKED)
        safe = _safe(scale)
        r = _inf_sign(x, tl.div_rn(x, safe))
        if BITS > 8:  # k of each bucket precomputed on the host (no division per element)
            ks = _ld(ks_ptr + offs // bucket, inb, 0.0, MASKED)
            codes = _quantize_exact(x, r, scale, safe, ks, offs, key, S, STOCH, False)
        else:
            codes = _quantize(r, offs, key, S, STOCH, False)
    if MASKED:
        codes = tl.where(inb, codes, 0)
    _pack_store(codes, code_ptr, pid * BLOCK, nbytes, n, BLOCK, BITS, MASKED, BITS <= 2)


@triton.jit(do_not_specialize=["key"])
def _qsgd_encode_kernel(x_ptr, pay_ptr, code_ptr, ks_ptr, n, nb, bucket, nbytes, key,
                        BUCKET: tl.constexpr, ROWS: tl.constexpr, FUSED: tl.constexpr, BITS: tl.constexpr,
                        S: tl.constexpr, L2: tl.constexpr, STOCH: tl.constexpr, I64: tl.constexpr,
                        KEY_PTR: tl.constexpr = False):
    pid = _pid(I64, not FUSED)
    if KEY_PTR:  # the key in device memory (int32): a CUDA graph replays with the key written before it
        ukey = tl.load(key).to(tl.uint32, bitcast=True)
    else:
        ukey = key.to(tl.uint32, bitcast=True)
    if (pid + 1) * (ROWS * BUCKET) <= n:
        _qsgd_encode_body(x_ptr, pay_ptr, code_ptr, ks_ptr, n, nb, bucket, nbytes, ukey, pid,
                          BUCKET, ROWS, FUSED, BITS, S, L2, STOCH, False)
    else:
        _qsgd_encode_body(x_ptr, pay_ptr, code_ptr, ks_ptr, n, nb, bucket, nbytes, ukey, pid,
                          BUCKET, ROWS, FUSED, BITS, S, L2, STOCH, True)


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


# ===================================================================================== host side
def _signed_key(seed: int) -> int:
    k = ref.seed_key(seed)
    return k - (1 << 32) if k >= (1 << 31) else k


def signed_key(seed: int) -> int:
    """The rounding key of ``seed`` as the int32 that a device key tensor holds (:func:`qsgd_encode`)."""
    return _signed_key(seed)


def qsgd_encode(
    x: torch.Tensor, bits: int, bucket: int, norm: str, stochastic: bool, seed: int | torch.Tensor,
    full: bool = False
) -> torch.Tensor:
    """x: (n,) float32 contiguous -> payload uint8: [scales (nb,) f32][codes packed at ``bits``].

    ``seed`` may be a one-element int32 tensor on x's device holding :func:`signed_key` of the seed: the
    kernel reads the key from memory, so a CUDA graph captured once encodes with whatever key is written
    there before each replay (same bits as the int seed)."""
    key_ptr = isinstance(seed, torch.Tensor)
    if bits not in PACKED_BITS:
        if key_ptr:
            raise ValueError(f"qsgd_encode: a device key needs a packed width ({sorted(PACKED_BITS)}), not {bits} bits")
        return ref.qsgd_encode(x, bits, bucket, norm, stochastic, seed, full)
    x = x.reshape(-1).contiguous()
    n = x.numel()
    nb = (n + bucket - 1) // bucket
    nbytes = ref.packed_nbytes(n, bits)
    payload = _new_payload(4 * nb, 4 * nb + nbytes, x.device)
    if n == 0:
        return payload
    fused = _fused(bucket)
    s = ref.qsgd_levels(bits, full)
    ks = payload  # (unused unless the general path rounds the exact level)
    if not fused:
        scales = _scale_view(payload, nb)
        if norm == "l2":
            scales.copy_(ref.bucket_l2(ref.to_buckets(x, bucket)))
        else:
            _bucket_scales_general(x, bucket, scales)
        if bits > ref.QSGD_EXACT_ABOVE_BITS:
            ks = ref.qsgd_level_ratio(torch.where(scales > 0, scales, torch.ones_like(scales)), s)
    bsize, rows, block = _tiling(bucket, fused)
    # The exact rounding keeps more values live: at 16 bits a thread takes at most 16 values (on an H200,
    # 1 GiB, bucket 8192: 980 GB/s with 2 warps, 2530 with 4, 3030 with 8).
    warps = _warps(block // 2, 8) if bits > ref.QSGD_EXACT_ABOVE_BITS else _warps(block, CONFIG['qsgd_enc_warps'])
    _qsgd_encode_kernel[(triton.cdiv(n, block),)](
        x, payload, payload[4 * nb :], ks, n, nb, bucket, nbytes, seed if key_ptr else _signed_key(seed),
        BUCKET=bsize, ROWS=rows, FUSED=fused, BITS=bits, S=s, L2=norm == "l2",
        STOCH=bool(stochastic), I64=_i64(n, block), num_warps=warps, KEY_PTR=key_ptr, **_LAUNCH)
    return payload


@functools.lru_cache(maxsize=None)
def _scalar_inverse(device: torch.device, bits: int, full: bool = False) -> float:
    """0.0 if torch computes ``t / s`` (a float32 tensor by a Python float) as a true division on
    ``device``, else float32(1/s), the reciprocal it multiplies by (torch's CUDA kernel does that for
    a CPU-scalar divisor). Probed once per device and bit width, so qsgd decode matches the reference
    bit for bit on whichever device it runs."""
    return _torch_scalar_division(device, ref.qsgd_levels(bits, full))


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
