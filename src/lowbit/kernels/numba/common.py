"""What the numba kernel families share: the jit options, the task sizes and float constants, LLVM
intrinsics (fma, bit casts, pointers from addresses), the reference's counter hash, little-endian reads,
bit packing at 1-8 bits and the host-side helpers (thread count, numpy views, chunking). How the work is
split and why the arithmetic is written out as it is: see :mod:`lowbit.kernels.numba`.

numba's on-disk cache (``cache=True``) is keyed on the source file of each compiled function, not on the
files of the functions it calls: after editing this module, delete the ``*.nbi``/``*.nbc`` files of
``lowbit/kernels/numba/__pycache__`` (a release never changes the files, so users are not affected).

Importing this module without numba raises ImportError, as on big-endian hosts.
"""

from __future__ import annotations

import math
import sys

import numba
import numpy as np
import torch
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

if sys.byteorder != "little":  # the wire format is little-endian; keep the reference on such hosts
    raise ImportError("lowbit.kernels.numba supports little-endian hosts only")

_JIT = dict(cache=True, fastmath=False, error_model="numpy")
#: nogil: a communication thread can encode/decode while the training thread runs Python.
_PJIT = dict(parallel=True, nogil=True, **_JIT)

#: Values per task: encode chunks hold at least this many, decode blocks exactly this many.
_BLOCK = 16384
#: Codes unpacked/packed through a small buffer at a time (fits L1).
_SUB = 2048

#: Leaves per block of _tree_sum (a power of two; reference.tree_sum's tree over an aligned block of
#: this length is the block's own tree).
_TREE_BLOCK = 2048

_F0 = np.float32(0.0)
_F1 = np.float32(1.0)
_HALF = np.float32(0.5)
_U24 = np.float32(1.0 / (1 << 24))
_FMAX = np.float32(np.finfo(np.float32).max)
_NAN = np.float32(np.nan)  # 0x7FC00000, the NaN torch's full_like(nan) writes
_ONEBIT_SCALE = np.float32(2.0**-32)  # reference.ONEBIT_SUM_SCALE
#: Leaf kinds of _tree_sum: (x / safe)^2; the non-negative (or NaN) values; the negative ones; the
#: same two times 2**-32 (reference.onebit_stats' overflow-free sums).
_SQ, _POS, _NEG, _POS_SCALED, _NEG_SCALED = 0, 1, 2, 3, 4
_M32 = np.uint64(0xFFFFFFFF)
_GOLDEN = np.uint64(0x9E3779B1)
_C1 = np.uint64(0x85EBCA6B)
_C2 = np.uint64(0xC2B2AE35)
_S16 = np.uint64(16)
_S13 = np.uint64(13)
_S8 = np.uint64(8)


# --------------------------------------------------------------------------------- intrinsics
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


# --------------------------------------------------------------------------------- bit packing
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


# --------------------------------------------------------------------------------- sums
@njit(inline="always", **_JIT)
def _pow2(n):
    """The smallest power of two >= n (1 for n <= 1)."""
    p = 1
    while p < n:
        p *= 2
    return p


@njit(**_JIT)
def _tree_reduce(buf, p):
    """Sum of buf[0:p] (p a power of two) in reference.tree_sum's order; buf is overwritten."""
    while p > 8:
        p //= 2
        for i in range(p):
            buf[i] = buf[2 * i] + buf[2 * i + 1]
    if p == 8:
        return _tree8(buf[0], buf[1], buf[2], buf[3], buf[4], buf[5], buf[6], buf[7])
    if p == 4:
        return (buf[0] + buf[1]) + (buf[2] + buf[3])
    if p == 2:
        return buf[0] + buf[1]
    return buf[0]


@njit(inline="always", **_JIT)
def _tree8(a0, a1, a2, a3, a4, a5, a6, a7):
    """The tree of 8 neighbouring leaves (its first three levels)."""
    return ((a0 + a1) + (a2 + a3)) + ((a4 + a5) + (a6 + a7))


@njit(inline="always", **_JIT)
def _leaf(v, kind, safe):
    if kind == _SQ:
        y = v / safe
        return y * y
    neg = v < _F0  # NaN counts as non-negative, as in reference.onebit_stats
    if kind == _POS:
        return _F0 if neg else v
    if kind == _NEG:
        return v if neg else _F0
    if kind == _POS_SCALED:
        return _F0 if neg else v * _ONEBIT_SCALE
    return v * _ONEBIT_SCALE if neg else _F0


@njit(inline="always", **_JIT)
def _leaf_at(v, k, kind, safe):
    """Leaf k of the values v: _leaf(v[k]), or the +0 of the padding past v's end."""
    return _leaf(v[k], kind, safe) if k < v.size else _F0


@njit(inline="always", **_JIT)
def _tree8_at(v, k, kind, safe):
    """_tree8 of the leaves k..k+7 of v, all inside v."""
    return _tree8(_leaf(v[k], kind, safe), _leaf(v[k + 1], kind, safe), _leaf(v[k + 2], kind, safe),
                  _leaf(v[k + 3], kind, safe), _leaf(v[k + 4], kind, safe), _leaf(v[k + 5], kind, safe),
                  _leaf(v[k + 6], kind, safe), _leaf(v[k + 7], kind, safe))


@njit(inline="always", **_JIT)
def _tree8_tail(v, k, kind, safe):
    """_tree8 of the leaves k..k+7 of v where v ends among them (the +0 of the padding after)."""
    return _tree8(_leaf_at(v, k, kind, safe), _leaf_at(v, k + 1, kind, safe), _leaf_at(v, k + 2, kind, safe),
                  _leaf_at(v, k + 3, kind, safe), _leaf_at(v, k + 4, kind, safe), _leaf_at(v, k + 5, kind, safe),
                  _leaf_at(v, k + 6, kind, safe), _leaf_at(v, k + 7, kind, safe))


@njit(inline="always", **_JIT)
def _tree_scratch(p):
    """(buf, sums): the scratch _tree_sum needs for ``p`` leaves (buf also fits _sign_sums' p // 8)."""
    return np.empty(max(1, min(p, _TREE_BLOCK) // 8), np.float32), np.empty(max(1, p // _TREE_BLOCK), np.float32)


@njit(**_JIT)
def _tree_sum(xs, p, kind, safe, buf, sums):
    """reference.tree_sum of ``p`` leaves (a power of two >= xs.size): leaf k is _leaf(xs[k]) for
    k < xs.size, +0 after. Blocks of _TREE_BLOCK leaves first, then the blocks' sums (the same tree);
    a block's first three levels are added as its leaves are made. Scratch: ``buf`` of
    max(1, min(p, _TREE_BLOCK) // 8) values, ``sums`` of max(1, p // _TREE_BLOCK)."""
    n = xs.size
    if p == 1:
        return _leaf_at(xs, 0, kind, safe)
    if p == 2:
        return _leaf_at(xs, 0, kind, safe) + _leaf_at(xs, 1, kind, safe)
    if p == 4:
        return ((_leaf_at(xs, 0, kind, safe) + _leaf_at(xs, 1, kind, safe))
                + (_leaf_at(xs, 2, kind, safe) + _leaf_at(xs, 3, kind, safe)))
    b = min(p, _TREE_BLOCK)
    nblk = p // b
    g = b // 8
    for j in range(nblk):
        lo = j * b
        if lo >= n:  # a block of padding: its tree of +0 is +0
            sums[j] = _F0
            continue
        v = xs[lo : min(n, lo + b)]
        full = v.size // 8
        for i in range(full):
            buf[i] = _tree8_at(v, 8 * i, kind, safe)
        if full < g:
            buf[full] = _tree8_tail(v, 8 * full, kind, safe)
            for i in range(full + 1, g):
                buf[i] = _F0
        sums[j] = _tree_reduce(buf, g)
    return _tree_reduce(sums, nblk)


@njit(inline="always", **_JIT)
def _sign_sums(xs, p, bp, bn):
    """(tree_sum of the non-negative or NaN leaves, tree_sum of the negative ones, how many are
    negative) of ``xs`` over ``p`` leaves, 8 <= p <= _TREE_BLOCK: one pass for both signs (onebit's
    buckets). Scratch ``bp``, ``bn``: p // 8 values each."""
    g = p // 8
    full = xs.size // 8
    cn = 0
    for i in range(full):
        bp[i] = _tree8_at(xs, 8 * i, _POS, _F1)
        bn[i] = _tree8_at(xs, 8 * i, _NEG, _F1)
    if full < g:
        bp[full] = _tree8_tail(xs, 8 * full, _POS, _F1)
        bn[full] = _tree8_tail(xs, 8 * full, _NEG, _F1)
        for i in range(full + 1, g):
            bp[i] = _F0
            bn[i] = _F0
    for k in range(xs.size):
        cn += 1 if xs[k] < _F0 else 0
    return _tree_reduce(bp, g), _tree_reduce(bn, g), cn


# --------------------------------------------------------------------------------- host side
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
