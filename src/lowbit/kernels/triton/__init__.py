"""Fused Triton kernels for the codecs: one pass over the input, near memory bandwidth.

One module per codec family: :mod:`.qsgd`, :mod:`.onebit` (1bitSGD per bucket) and :mod:`.dettmers`
(Dettmers' 8-bit types), over :mod:`.common` (the tuning ``CONFIG``, the jit helpers they share, the
general path's scale passes and the host-side tiling and payload helpers). This package exports every
backend function the dispatcher looks up.

Every function has the name, signature and return convention of its counterpart in
:mod:`lowbit.kernels.reference` (the executable specification of the wire format) and produces the same
bytes: bit for bit in every mode, with two documented exceptions where Triton sums in its own order
(``norm="l2"`` scales and the onebit means; see below).

Plan of the encoders (qsgd, onebit, dettmers)
    When the bucket is a power of two between 8 and 8192 ("fused path"), one program owns ``ROWS``
    whole buckets: it loads them once, reduces each bucket to its scale, quantises, packs the codes and
    writes scales and codes. Input is read exactly once. The qsgd and dettmers tiles are 1D (per-bucket
    values reach the elements through a reshape): a ``(ROWS, BUCKET)`` tile made the Dettmers gather
    1.8x slower on an H200 (benchmarks/experiments/tune_encode_gpu.py).
    Other buckets (odd sizes, larger than 8192, dettmers' ``bucket=0`` = one scale for the tensor) take
    the "general path", reading the input twice: first the scales (an atomic integer max per block of
    ``absmax_elems`` when every block lies in one bucket, else chunk partials and a small ``amax`` in
    torch), then a linear kernel over blocks that gathers each element's scale, walking the blocks
    backwards so that it starts on the part of the input the first pass left in L2. Dettmers with one
    scale has its own second pass (dettmers._dm_one_scale_kernel): several tiles per program, the next tile's
    load issued before the current tile's arithmetic.
    Every kernel compiles a full-tile variant without masks (16-byte loads and stores whatever ``n``
    is) and a masked one for the last tile.

Division by the scale
    Where every scale of a tile is 0 or within [2**-60, 2**126) (_fast_ok) -- always, unless a bucket
    holds inf or NaN or is extreme -- x / scale is computed as Markstein's correction of x * (1/scale):
    three instructions instead of a full ``div.rn`` each, and the same correctly rounded quotient
    (tested against numpy's division and, on a GPU, against ``div.rn`` for every float x <= scale at
    dozens of scales). Such quotients are finite with |r| <= 1, so the code after them skips the NaN
    tests and clamps; other tiles take ``div_rn`` and the checks (_div_tile).

Bit-exactness
    * Arithmetic mirrors the reference op by op in float32: true divisions use ``div_rn`` (Triton's
      ``/`` is approximate), and kernels are compiled with ``enable_fp_fusion=False`` so ``a*b+c`` is
      not contracted into an FMA (torch runs those as separate elementwise kernels). torch divides a
      tensor by a Python scalar as a true division on CPU but as a multiplication by the float32
      reciprocal on CUDA; qsgd decode probes which (once per device) and does the same.
    * Stochastic rounding draws ``u(seed, i)`` from the same murmur3-fmix32 counter hash, in uint32.
      16-bit qsgd rounds the exact level (reference.qsgd_round_exact): two explicit ``tl.fma`` (the
      residuals the reference takes exactly in float64) and a dozen float32 operations more per value,
      no float64; the general path gathers each bucket's ``k = S / scale`` from a small host-side array.
      On an H200 that costs 16-bit stochastic encode 16-24 % of its bandwidth at 1 GiB (bucket 8192:
      3670 -> 3080 GB/s; 512: 4340 -> 3290), nearest 8 %; 8-bit and below are unchanged.
    * Max-norm scales are exact (max does not depend on order; NaN comes out as the reference's NaN).
      ``norm="l2"`` scales are a float32 sum of squares in Triton's reduction order; the reference's
      (``reference.tree_sum``, pairwise) differs, so they agree to a few ulps, and a
      code can differ by one level where that moves a value across a rounding boundary. Onebit means
      likewise (sums of same-signed values, a relative difference below 1e-6); sign bits are exact.

Packing
    Codes form the LSB-first bit stream of :func:`lowbit.kernels.reference.pack_bits`. 8- and 16-bit
    codes are stored as uint8/uint16 elements; 1/2/4-bit codes are reshaped to ``(BLOCK/cpb, cpb)``
    (``cpb`` codes per byte) and summed after shifting, one byte per row. 3/5/6/7-bit codes are not
    handled here: those calls run the reference. Encoders return a payload whose code stream starts
    16-byte aligned (a view at offset 0/4/8/12 of a buffer 16 bytes longer); a payload to decode is
    fastest when ``(data_ptr + scale bytes) % 16 == 0`` too, and must be 4-byte aligned or it is copied.

Measured (H200, Triton 3.6, GPU time per call, benchmarks/results/kernels_gpu_h200_91d36ad.json): see
docs/results.md ("Codec kernels") for the table against a device-to-device copy of the same bytes.

Importing this package raises ImportError when Triton is missing (the dispatcher then falls back).
"""

from __future__ import annotations

# common first: it raises the ImportError that names Triton when Triton is missing
from lowbit.kernels.triton.common import CONFIG, MAX_SUM
from lowbit.kernels.triton.dettmers import dettmers_decode, dettmers_decode_sum, dettmers_encode
from lowbit.kernels.triton.onebit import onebit_decode_buckets, onebit_decode_sum_buckets, onebit_encode_buckets
from lowbit.kernels.triton.qsgd import PACKED_BITS, qsgd_decode, qsgd_decode_sum, qsgd_encode, signed_key

__all__ = [
    "qsgd_encode",
    "signed_key",
    "qsgd_decode",
    "qsgd_decode_sum",
    "onebit_encode_buckets",
    "onebit_decode_buckets",
    "onebit_decode_sum_buckets",
    "dettmers_encode",
    "dettmers_decode",
    "dettmers_decode_sum",
    "CONFIG",
    "MAX_SUM",
    "PACKED_BITS",
]
