"""Compiled CPU kernels (numba) for QSGD and bucketed 1bitSGD, bit for bit equal to the reference.

One module per codec family: :mod:`.qsgd`, :mod:`.onebit` (1bitSGD per bucket) and :mod:`.dettmers`
(Dettmers' 8-bit types), over :mod:`.common` (the jit options, constants and intrinsics, the counter
hash, bit packing and the host-side helpers they share). This package exports every backend function
the dispatcher looks up.

:mod:`lowbit.kernels.reference` is the specification; these kernels produce the same payload bytes and
the same decoded floats, only faster (one pass over the data, all cores). Importing this package without
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
    ``[0, 2s]``; at 16 bits the exact level's residual of reference.qsgd_round_exact, its two FMAs taken
    in float64 as the reference takes them (exact there). ``fastmath=False`` keeps LLVM from contracting
    ``a * b + c`` into an FMA or reordering.
    The uniforms are the reference's counter hash (murmur3 ``fmix32``) in uint64 arithmetic masked to
    32 bits. Two scales are float32 sums, whose rounding depends on the order of the additions: the
    reference defines that order (:func:`lowbit.kernels.reference.tree_sum`: pairwise, neighbours first,
    over the row padded with +0 to a power of two) and these kernels replay it, a block of 2048 leaves
    at a time and then the blocks' sums (the same tree), with the first three levels added as the
    leaves are made. So the L2 scales and onebit's means are the same bits on every CPU, whatever torch's own
    kernels do. The L2 scale's square root is the correctly rounded one (taken in float64, as the
    reference does: torch's float32 sqrt on CPU is not correctly rounded).

Not accelerated (left to the reference): onebit's per-column mode and inputs that are not float32.
"""

from __future__ import annotations

from lowbit.kernels.numba.dettmers import dettmers_decode, dettmers_encode
from lowbit.kernels.numba.onebit import onebit_decode_buckets, onebit_encode_buckets
from lowbit.kernels.numba.qsgd import qsgd_decode, qsgd_decode_sum, qsgd_encode

__all__ = [
    "qsgd_encode",
    "qsgd_decode",
    "qsgd_decode_sum",
    "onebit_encode_buckets",
    "onebit_decode_buckets",
    "dettmers_encode",
    "dettmers_decode",
]
