"""numba kernels of the ``dettmers`` codec: Dettmers' 8-bit types and the bitsandbytes dynamic map,
both searches (the cell-table nearest search of :mod:`lowbit.kernels.triton.dettmers` and the 2015
binary search), per bucket or with one scale per tensor, and the table-lookup decode. The tables come
from :mod:`lowbit.kernels.dettmers_tables`; the specification is
:func:`lowbit.kernels.reference.dettmers_encode`.
"""

from __future__ import annotations

import numpy as np
import torch
from numba import njit, prange

from lowbit.kernels.dettmers_tables import host_tables, layout
from lowbit.kernels.numba.common import (
    _BLOCK,
    _F0,
    _F1,
    _JIT,
    _NAN,
    _PJIT,
    _f32_to_bits,
    _fast_output,
    _match_torch_threads,
    _np_in,
    _payload_np,
)

_DM_TINY = np.float32(1.5e-6)
_DM_TOP = np.float32(0.995703)


@njit(inline="always", **_JIT)
def _dm_nearest(v, cells, shift, kbase, ncell, signed):
    """Code of the table value nearest to v via the cell table (see lowbit.kernels.triton.dettmers._dm_nearest)."""
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
    """The 2015 kernels' binary search (see lowbit.kernels.triton.dettmers._dm_paper), in float32."""
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
    """Code byte of one value (see lowbit.kernels.triton.dettmers._dm_codes): reference.dettmers_encode."""
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
