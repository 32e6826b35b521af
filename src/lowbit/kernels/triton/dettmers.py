"""Triton kernels of the ``dettmers`` codec: Dettmers' 8-bit types (dynamic, linear, static, mantissa)
and the bitsandbytes dynamic map, both searches, per bucket or with one scale per tensor, and a decode
that sums up to ``MAX_SUM`` payloads per launch with the mean in the same pass. The tables come from
:mod:`lowbit.kernels.dettmers_tables`; the specification is :func:`lowbit.kernels.reference.dettmers_encode`.

Dettmers' nearest search
    Instead of a binary search (8 dependent gathers), a cell table indexed by the top bits of the value's
    order-preserving integer key gives, per cell, the codes below and above the one midpoint inside it
    (cells are fine enough that none holds two): one gather and one compare per value, bit-identical
    to ``torch.bucketize`` over the reference's float32 midpoints. ``search="paper"`` emulates the 2015
    binary search with table gathers, as the reference does.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from lowbit.kernels.dettmers_tables import host_tables as _dm_host_tables
from lowbit.kernels.dettmers_tables import layout as _dm_layout
from lowbit.kernels.triton.common import (
    CONFIG,
    _LAUNCH,
    _aligned,
    _bucket_scales_general,
    _div_tile,
    _fused,
    _i64,
    _ld,
    _new_payload,
    _pid,
    _safe,
    _scale_view,
    _st,
    _step,
    _store_scales,
    _sum_launches,
    _tile_scales,
    _tiling,
    _warps,
)


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
    """The 2015 kernels' binary search (reference.dettmers_codes with search='paper')."""
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
