"""What the Triton kernel families share: the tuning ``CONFIG``, the jit helpers (masked loads and
stores, the counter hash, max |x| and the division shortcut, bit packing), the general path's scale
passes (_absmax_atomic, _partial_absmax), torch's scalar division (_step) and the host-side tiling,
payload and launch helpers. The plan, the bit-exactness rules and the packing are described in
:mod:`lowbit.kernels.triton`.

``CONFIG`` is one dict for every family: change its entries in place (``CONFIG.update(...)``), never
rebind the name.

Importing this module raises ImportError when Triton is missing (the dispatcher then falls back).
"""

from __future__ import annotations

import functools

import torch

try:
    import triton
    import triton.language as tl
except Exception as exc:  # pragma: no cover - exercised only where Triton is absent
    raise ImportError(f"lowbit.kernels.triton needs Triton: {exc}") from exc

from lowbit.kernels import reference as ref

#: Tuning knobs: elements per program and warps per program (the benchmark sweeps them).
#: absmax_elems: block of the atomic max |x| pass of the general path (a read-only pass: larger blocks
#: mean fewer atomics on one address and more bytes in flight).
#: qsgd_enc_warps: warps of the qsgd encoder (2 beat 4 on an H200: more programs in flight per SM).
#: one_scale_*: the Dettmers quantiser with one scale per tensor (_dm_one_scale_kernel): tiles of
#: one_scale_elems values, one_scale_tiles of them per program with the next tile's load in flight.
CONFIG: dict[str, int] = {"elems": 2048, "warps": 4, "qsgd_enc_warps": 2, "max_fused_bucket": 8192,
                          "absmax_elems": 16384, "one_scale_elems": 1024, "one_scale_tiles": 4,
                          "one_scale_warps": 4}

#: Payloads at most this many are decoded and summed in one launch (more: chained launches).
MAX_SUM = 8
#: reference's overflow guards, as Triton constants
F32_MAX = tl.constexpr(ref.F32_MAX)

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
def _canon_nan(v):
    """v with every NaN made the canonical 0x7FC00000 (the reference's NaN: which NaN a sum of NaNs
    carries depends on the order of each addition's operands)."""
    b = v.to(tl.int32, bitcast=True)
    return tl.where(v != v, 0x7FC00000, b).to(tl.float32, bitcast=True)


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
def _div_tile(x, scale, ROWS: tl.constexpr, BUCKET: tl.constexpr, SANITIZE: tl.constexpr, NAN_TO: tl.constexpr,
              INF_SIGN: tl.constexpr = False):
    """r = x / safe scale of its bucket, rounded as tl.div_rn, for a 1D tile of whole buckets (or any x
    with ROWS == 1 and a scalar scale). Where every scale passes _fast_ok, _markstein divides and r is
    finite with |r| <= 1 already; otherwise div_rn, and with SANITIZE NaN -> NAN_TO and a clamp to
    [-1, 1] make r bounded too (the codecs' own handling of those values, see _quantize, _dm_codes), so
    that the code after this needs no checks either way. INF_SIGN: then ±1 where x is ±Inf
    (:func:`_inf_sign`); only this branch can meet an infinity (the fast one's x are all finite), so the
    common path pays nothing for it (in every element it cost qsgd's encode 9-14 % of its bandwidth at
    1 GiB on an H200: benchmarks/results/kernels_h200_encode_regression/)."""
    safe = _safe(scale)
    s = _per_elem(safe, ROWS, BUCKET)
    if _tile_fast(scale, ROWS):
        r = _markstein(x, s, _per_elem(tl.div_rn(1.0, safe), ROWS, BUCKET))
    else:
        r = tl.div_rn(x, s)
        if SANITIZE:
            r = tl.where(r != r, NAN_TO, r)
            r = tl.minimum(tl.maximum(r, -1.0), 1.0)
        if INF_SIGN:
            r = _inf_sign(x, r)
    return r


@triton.jit
def _inf_sign(x, r):
    """reference.inf_sign: r = x / scale, with ±1 where x is ±Inf (an infinity keeps its sign)."""
    return tl.where(x == float("inf"), 1.0, tl.where(x == float("-inf"), -1.0, r))


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


# ===================================================================================== general-path scales
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


@functools.lru_cache(maxsize=None)
def _torch_scalar_division(device: torch.device, s: float) -> float:
    """How torch divides a float32 tensor by the Python number ``s`` on ``device`` (``t / s``,
    ``t.div_(s)``): 0.0 for a true division, else the float32 reciprocal it multiplies by."""
    inv = float(torch.tensor(1.0, dtype=torch.float32) / torch.tensor(s, dtype=torch.float32))
    if inv * s == 1.0:  # exact reciprocal (s = 0.5, 1): both ways agree
        return 0.0
    g = torch.Generator().manual_seed(0)
    # (drawn on the CPU explicitly: the caller may run under ``with torch.device("cuda")``)
    t = torch.rand(1 << 14, generator=g, device="cpu")
    t = (t * 2.0 ** torch.randint(-20, 20, (1 << 14,), generator=g, device="cpu")).to(device)
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
