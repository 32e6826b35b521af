"""Where do the Triton encoders spend their time on a GPU?  Diagnostic sweeps for issue 4.

Default: Dettmers' dynamic-tree encode, at each size, against a copy measured in the same run:

* the max |x| pass of the two-pass encode (one scale per tensor): block sizes, and a persistent grid;
* the quantise pass alone, with one cost removed at a time (the true division replaced by a
  multiplication or by the Markstein-corrected one the library uses, the cell-table gather replaced
  by bit arithmetic or by a gather confined to 128 entries). Variants marked same_bytes=False compute
  wrong codes on purpose: they only weigh each cost;
* the fused encode (one bucket per program) with the gather swapped, cache hints, a 1D against a
  (1, BUCKET) 2D tile, the fast/slow division branch, and the library's own helpers. This is where the
  2D tile turned out to cost 1.8x (H200, Triton 3.6: 48% against 86% of copy at 256 MiB), which is why
  the library's encoders now work on 1D tiles;
* the library's whole encode (bucket 0 and per-bucket) under tile sizes and warps.

With ``--qsgd``: the qsgd encoder over bit widths x buckets x elements per program x warps.
Timing is GPU time per call from CUDA graphs (benchmarks/gputime.py) unless ``--timing do_bench``.

    PYTHONPATH=src python3 benchmarks/experiments/tune_encode_gpu.py --out $OUT/tune_encode.json [--qsgd]

Writes JSON and prints a short table last. Results: benchmarks/experiments/results/tune_encode_*.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import triton
import triton.language as tl
from triton.testing import do_bench

from lowbit.kernels import triton as tk
from lowbit.kernels.triton import common as tkc
from lowbit.kernels.triton import dettmers as tkd

import os as _os
import sys as _sys

_sys.path.insert(0, _os.path.join(_os.path.dirname(_os.path.abspath(__file__)), ".."))  # benchmarks/gputime.py

from gputime import copy_ms, graph_ms, print_rows, warm_up

MiB = 1 << 20
# Dettmers encode: (bucket, elements per program, warps); bucket 0 = one scale, two passes
FUSED_CONFIGS = [(0, 2048, 4), (4096, 2048, 4), (4096, 4096, 8), (512, 2048, 4), (1024, 2048, 4)]


@triton.jit
def _diag_quantize(x_ptr, s_ptr, code_ptr, cell_ptr, n, BLOCK: tl.constexpr, DIV: tl.constexpr,
                   GATHER: tl.constexpr, SHIFT: tl.constexpr, CG: tl.constexpr = False):
    """Dettmers dynamic nearest codes with one scale; DIV 0: div_rn, 1: x * (1/s), 2: Markstein."""
    pid = tl.num_programs(0) - 1 - tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    if CG:  # stream x past L1, leaving L1 to the cell table
        x = tl.load(x_ptr + offs, mask=m, other=0.0, cache_modifier=".cg")
    else:
        x = tl.load(x_ptr + offs, mask=m, other=0.0)
    s = tl.load(s_ptr)
    safe = tl.where(s > 0, s, 1.0)
    if DIV == 0:
        r = tl.div_rn(x, safe)
    elif DIV == 1:
        r = x * tl.div_rn(1.0, safe)
    else:
        y = tl.div_rn(1.0, safe)
        q = x * y
        e = tl.fma(-q, safe, x)
        r = tl.fma(e, y, q)
    r = tl.where(r != r, 0.0, r)
    r = tl.minimum(tl.maximum(r, -1.0), 1.0)
    b = tl.abs(r).to(tl.int32, bitcast=True)
    if GATHER == 2:  # diagnostic: the same index into a 16-bit table (half the cache lines)
        ent = tl.load(cell_ptr.to(tl.pointer_type(tl.int16)) + (b >> SHIFT)).to(tl.int32)
        code = ent & 0x7F
    elif GATHER == 3:  # diagnostic: a gather confined to 128 entries (at most 4 cache lines)
        ent = tl.load(cell_ptr + ((b >> SHIFT) & 127))
        code = ent & 0x7F
    elif GATHER == 1:
        ent = tl.load(cell_ptr + (b >> SHIFT))
        above = (b & ((1 << SHIFT) - 1)) > (ent & ((1 << SHIFT) - 1))
        code = tl.where(above, (ent >> SHIFT) & 0x7F, (ent >> 25) & 0x7F)
    else:
        code = (b >> SHIFT) & 0x7F
    code = tl.where((r < 0) & (code != 0), code | 128, code)
    tl.store(code_ptr + offs, code.to(tl.uint8), mask=m)


@triton.jit
def _diag_fused(x_ptr, scale_ptr, code_ptr, cell_ptr, t_ptr, n, BUCKET: tl.constexpr, GATHER: tl.constexpr,
                HINTS: tl.constexpr, SHIFT: tl.constexpr, TWO_D: tl.constexpr = False,
                BRANCH: tl.constexpr = False, LIB: tl.constexpr = False):
    """The fused (one bucket per program) Dettmers dynamic encode, bounded fast path only, with the
    gather swapped: GATHER 1 the cell table (right codes), 3 a 128-entry gather, 0 none. HINTS: x loads
    evict_first and table loads evict_last. TWO_D: a (1, BUCKET) tile as the library has; BRANCH: the
    library's runtime fast/slow branch; LIB: the library's _div_tile and _dm_codes (1D only)."""
    pid = tl.program_id(0)
    if TWO_D:
        rows = pid + tl.arange(0, 1)
        offs = rows[:, None] * BUCKET + tl.arange(0, BUCKET)[None, :]
    else:
        offs = pid * BUCKET + tl.arange(0, BUCKET)
    if HINTS:
        x = tl.load(x_ptr + offs, eviction_policy="evict_first")
    else:
        x = tl.load(x_ptr + offs)
    if TWO_D:
        scale = tl.max(tl.abs(x).to(tl.int32, bitcast=True), axis=1).to(tl.float32, bitcast=True)
        tl.store(scale_ptr + rows, scale)
    else:
        scale = tl.max(tl.abs(x).to(tl.int32, bitcast=True), axis=0).to(tl.float32, bitcast=True)
        tl.store(scale_ptr + pid, scale)
    if LIB:
        code = tkd._dm_codes(x, tkc._div_tile(x, scale, 1, BUCKET, True, 0.0), cell_ptr, t_ptr, 0.0, 0.0, True,
                             False, False, True, 63, SHIFT, 0, 8161, True)
    else:
        safe = tl.where(scale > 0, scale, 1.0)
        if TWO_D:
            safe = safe[:, None]
        inv = tl.div_rn(1.0, safe)
        if TWO_D:
            fast = tkc._all_fast(scale)
        else:
            fast = tkc._fast_ok(scale)
        if BRANCH:
            if fast:
                q = x * inv
                r = tl.fma(tl.fma(-q, safe, x), inv, q)
            else:
                r = tl.div_rn(x, safe)
                r = tl.where(r != r, 0.0, r)
                r = tl.minimum(tl.maximum(r, -1.0), 1.0)
        else:
            q = x * inv
            r = tl.fma(tl.fma(-q, safe, x), inv, q)
        b = tl.abs(r).to(tl.int32, bitcast=True)
        if GATHER == 1:
            if HINTS:
                ent = tl.load(cell_ptr + (b >> SHIFT), eviction_policy="evict_last")
            else:
                ent = tl.load(cell_ptr + (b >> SHIFT))
            above = (b & ((1 << SHIFT) - 1)) > (ent & ((1 << SHIFT) - 1))
            code = tl.where(above, (ent >> SHIFT) & 0x7F, (ent >> 25) & 0x7F)
        elif GATHER == 3:
            code = tl.load(cell_ptr + ((b >> SHIFT) & 127)) & 0x7F
        else:
            code = (b >> SHIFT) & 0x7F
        code = tl.where((r < 0) & (code != 0), code | 128, code)
    if HINTS:
        tl.store(code_ptr + offs, code.to(tl.uint8), eviction_policy="evict_first")
    else:
        tl.store(code_ptr + offs, code.to(tl.uint8))


@triton.jit
def _persistent_absmax(x_ptr, bits_ptr, n, BLOCK: tl.constexpr):
    """max |x| as int32 bits: each program strides over blocks, keeps a running max, one atomic."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    acc = tl.zeros((BLOCK,), tl.int32)
    nblocks = tl.cdiv(n, BLOCK)
    for blk in range(pid, nblocks, nprog):
        offs = blk * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + offs, mask=offs < n, other=0.0)
        acc = tl.maximum(acc, tl.abs(x).to(tl.int32, bitcast=True))
    mx = tl.max(acc, axis=0)
    tl.atomic_max(bits_ptr, tl.where(mx > 0x7F800000, 0x7FC00000, mx))


def qsgd_rows(x, n, add, bench):
    """qsgd encode (stochastic, max norm) over bit widths, buckets, elements per program and warps."""
    saved = dict(tk.CONFIG)
    for bits in (8, 4, 2):
        for bucket in (128, 512, 2048):
            for elems, warps in ((2048, 2), (2048, 4), (4096, 2), (4096, 4), (1024, 2), (8192, 4)):
                tk.CONFIG.update(elems=elems, qsgd_enc_warps=warps)
                fn = lambda: tk.qsgd_encode(x, bits, bucket, "max", True, 1)
                p = fn()
                add(f"qsgd{bits} b{bucket} elems={elems} warps={warps}", bench(fn), 4 * n + p.numel())
    tk.CONFIG.clear()
    tk.CONFIG.update(saved)


def library_rows(x, n, add, bench):
    """The library's whole encode: dettmers with one scale (two passes) and per bucket (fused), qsgd."""
    saved = dict(tk.CONFIG)
    for bucket, elems, warps in FUSED_CONFIGS:
        tk.CONFIG.update(elems=elems, warps=warps)
        fn = lambda bucket=bucket: tk.dettmers_encode(x, "dynamic", "nearest", bucket, 0)
        p = fn()
        add(f"library encode dettmers b{bucket} elems={elems} warps={warps}", bench(fn), 4 * n + p.numel())
    tk.CONFIG.clear()
    tk.CONFIG.update(saved)
    for label, fn in (("library encode qsgd8 b512", lambda: tk.qsgd_encode(x, 8, 512, "max", True, 1)),
                      ("library encode qsgd4 b512", lambda: tk.qsgd_encode(x, 4, 512, "max", True, 1)),
                      ("library encode qsgd2 b128", lambda: tk.qsgd_encode(x, 2, 128, "max", True, 1))):
        p = fn()
        add(label, bench(fn), 4 * n + p.numel())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="tune_encode.json")
    ap.add_argument("--sizes-mib", default="64,256,1024")
    ap.add_argument("--skip-diag", action="store_true", help="only the library encode rows")
    ap.add_argument("--timing", choices=("graph", "do_bench"), default="graph", help="see bench_kernels_gpu")
    ap.add_argument("--qsgd", action="store_true", help="instead: qsgd encode over bits x bucket x tile x warps")
    args = ap.parse_args()
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    info = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
            "sm_count": sms, "method": "GPU time per call (gputime.graph_ms) or do_bench (--timing); pct = bytes / time vs "
            "copy 8n"}
    rows = []
    t0 = time.time()

    def bench(fn):
        return graph_ms(fn) if args.timing == "graph" else float(do_bench(fn, warmup=25, rep=100,
                                                                          return_mode="median"))

    warm_up(dev)
    for mib in [int(s) for s in args.sizes_mib.split(",")]:
        n = mib * MiB // 4
        g = torch.Generator(device=dev).manual_seed(mib)
        x = torch.randn(n, device=dev, generator=g)
        dst = torch.empty_like(x)
        t_copy = copy_ms(dst, x, bench)
        copy_gbps = 8 * n / t_copy / 1e6
        rows.append({"size_mib": mib, "what": "copy", "ms": t_copy, "GBps": copy_gbps})

        def add(what, ms, moved):
            r = {"size_mib": mib, "what": what, "ms": ms, "pct_copy": 100.0 * moved / ms / 1e6 / copy_gbps}
            rows.append(r)
            print(json.dumps(r), flush=True)

        if args.qsgd:
            qsgd_rows(x, n, add, bench)
        else:
            if not args.skip_diag:
                diag_rows(x, n, sms, add, bench)
            library_rows(x, n, add, bench)
        del x, dst
        torch.cuda.empty_cache()
        with open(args.out, "w") as f:
            json.dump({**info, "rows": rows}, f, indent=1)

    print_rows(f"{info['device']} torch {info['torch']} triton {info['triton']} ({time.time() - t0:.0f} s)", rows)


def diag_rows(x, n, sms, add, bench):
    """Each pass of the two-pass encode alone, and the quantise pass with one cost removed at a time."""
    dev = x.device
    # -- absmax pass alone (read 4n)
    bits = torch.zeros(1, dtype=torch.int32, device=dev)
    for block, warps in ((2048, 4), (8192, 8), (16384, 8)):
        def absmax(block=block, warps=warps):
            bits.zero_()
            tkc._absmax_atomic[(triton.cdiv(n, block),)](x, bits, n, n, BLOCK=block, I64=False,
                                                         num_warps=warps)
        absmax()
        add(f"absmax atomic block={block} warps={warps}", bench(absmax), 4 * n)
    for per_sm, block, warps in ((2, 4096, 8), (4, 2048, 4), (8, 2048, 4)):
        def pabs(per_sm=per_sm, block=block, warps=warps):
            bits.zero_()
            _persistent_absmax[(per_sm * sms,)](x, bits, n, BLOCK=block, num_warps=warps)
        pabs()
        assert bits.view(torch.float32).item() == x.abs().max().item()
        add(f"absmax persistent {per_sm}/SM block={block} warps={warps}", bench(pabs), 4 * n)

    # -- the fused encode (bucket 4096), gather swapped, warps and cache hints
    t = tkd._dm_tables("dynamic", 0, dev)
    shift = t["consts"]["SHIFT"]
    codes = torch.empty(n, dtype=torch.uint8, device=dev)
    scales = torch.empty(n // 4096, device=dev)
    want = tk.dettmers_encode(x, "dynamic", "nearest", 4096, 0)
    for gather, hints, warps, two_d, branch, lib in (
            (1, 0, 4, 0, 0, 0), (1, 1, 4, 0, 0, 0), (0, 0, 4, 0, 0, 0), (1, 0, 4, 1, 0, 0), (1, 0, 4, 0, 1, 0),
            (1, 0, 4, 1, 1, 0), (1, 0, 4, 0, 0, 1)):
        def f(gather=gather, hints=hints, warps=warps, two_d=two_d, branch=branch, lib=lib):
            _diag_fused[(n // 4096,)](x, scales, codes, t["cells"], t["paper"], n, BUCKET=4096, GATHER=gather,
                                      HINTS=hints, SHIFT=shift, TWO_D=two_d, BRANCH=branch, LIB=lib,
                                      num_warps=warps, enable_fp_fusion=False)
        f()
        same = bool(torch.equal(codes, want[4 * (n // 4096):]))
        add(f"fused b4096 gather={gather} hints={hints} warps={warps} 2d={two_d} branch={branch} lib={lib} "
            f"same_bytes={same}", bench(f), 5 * n)
    tk.CONFIG["warps"], saved_w = 2, tk.CONFIG["warps"]
    fn = lambda: tk.dettmers_encode(x, "dynamic", "nearest", 4096, 0)
    add("library encode dettmers b4096 warps=2", bench(fn), 5 * n)
    tk.CONFIG["warps"] = saved_w
    # -- quantise pass alone (read 4n, write n), scale known
    t = tkd._dm_tables("dynamic", 0, dev)
    shift = t["consts"]["SHIFT"]
    scale = x.abs().max().reshape(1)
    codes = torch.empty(n, dtype=torch.uint8, device=dev)
    want = tk.dettmers_encode(x, "dynamic", "nearest", 0, 0)[4:]
    for div, gather, name in ((0, 1, "div_rn + gather (library)"), (1, 1, "mul + gather"),
                              (2, 1, "markstein + gather"), (0, 0, "div_rn, no gather"),
                              (1, 0, "mul, no gather"), (0, 2, "div_rn + int16 gather"),
                              (0, 3, "div_rn + 128-entry gather"), (2, 1, "markstein + gather, x .cg"),
                              (2, 0, "markstein, no gather")):
        for block, warps in ((2048, 4), (4096, 8)):
            def q(div=div, gather=gather, block=block, warps=warps, cg="cg" in name):
                _diag_quantize[(triton.cdiv(n, block),)](x, scale, codes, t["cells"], n, BLOCK=block,
                                                         DIV=div, GATHER=gather, SHIFT=shift, CG=cg,
                                                         num_warps=warps, enable_fp_fusion=False)
            q()
            same = bool(torch.equal(codes, want))
            add(f"quantise {name} block={block} warps={warps} same_bytes={same}", bench(q), 5 * n)



if __name__ == "__main__":
    main()
