"""Dettmers' encode with one scale per tensor (two passes): where the time goes, and what overlaps.

Issue 4's one cell still short (43 % of copy at 64 MiB on an H200, target 50 %). This script times,
against a copy measured in the same run and as GPU time per call (benchmarks/gputime.py):

* the library's pieces on their own: the zero fill of the scale, the max |x| pass, the quantiser
  (with the scale already known), and the whole library encode;
* the quantiser alone under tile sizes, warps, an ``evict_first`` hint on x and a forward walk;
* the whole encode rebuilt from the same pieces:
    - ``plain``: fill, max pass, quantiser (the library's plan, as a check of the harness);
    - ``pdl``: the quantiser launched as a programmatic dependent launch (Hopper): its programs load
      their x while the max pass is still running and wait (``griddepcontrol.wait``) only before reading
      the scale;
    - ``ticket``: no fill: the max pass keeps its running max in a workspace that it leaves at zero
      (the last program to finish, found by an atomic ticket, moves the max into the payload and resets
      the workspace); ``ticket+pdl`` both.
Every rebuilt encode is checked byte for byte against the library's payload.

    PYTHONPATH=src python3 benchmarks/experiments/tune_onescale_gpu.py --out $OUT/tune_onescale.json

Results: benchmarks/experiments/results/tune_onescale_*.json.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import triton
import triton.language as tl

from lowbit.kernels import triton as tk
from lowbit.kernels.triton import common as tkc
from lowbit.kernels.triton import dettmers as tkd

import os as _os
import sys as _sys

_sys.path.insert(0, _os.path.join(_os.path.dirname(_os.path.abspath(__file__)), ".."))  # benchmarks/gputime.py

from gputime import copy_ms, graph_ms, print_rows, warm_up

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
    HAVE_GDC = True
except Exception:  # pragma: no cover - older Triton
    HAVE_GDC = False

    @triton.jit
    def gdc_wait():
        pass

    @triton.jit
    def gdc_launch_dependents():
        pass

MiB = 1 << 20


@triton.jit
def _amax(x_ptr, ws_ptr, out_ptr, n, BLOCK: tl.constexpr, TRIGGER: tl.constexpr, TICKET: tl.constexpr):
    """max |x| bits into ws[0] (atomic); TICKET: the last program moves it to out and zeroes ws."""
    if TRIGGER:
        gdc_launch_dependents()
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n, other=0.0)
    tl.atomic_max(ws_ptr, tkc._absmax_bits(x, 0))
    if TICKET:
        tl.debug_barrier()
        t = tl.atomic_add(ws_ptr + 1, 1)
        if t == tl.num_programs(0) - 1:
            v = tl.atomic_xchg(ws_ptr, 0)
            tl.store(out_ptr, v)
            tl.atomic_xchg(ws_ptr + 1, 0)


@triton.jit
def _amax_hint(x_ptr, ws_ptr, n, keep_from, BLOCK: tl.constexpr):
    """The max pass with an evict_last hint on blocks at or past keep_from (the part of x the
    quantiser, walking backwards, reads first), evict_first before it."""
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    if pid * BLOCK >= keep_from:
        x = tl.load(x_ptr + offs, mask=offs < n, other=0.0, eviction_policy="evict_last")
    else:
        x = tl.load(x_ptr + offs, mask=offs < n, other=0.0, eviction_policy="evict_first")
    tl.atomic_max(ws_ptr, tkc._absmax_bits(x, 0))


@triton.jit
def _amax_bal(x_ptr, ws_ptr, n, chunk, TILE: tl.constexpr):
    """Balanced persistent max pass: program p reads x[p*chunk, (p+1)*chunk) two tiles per step, so
    every program has the same work and they finish together (no tail of a last, partial wave)."""
    start = tl.program_id(0).to(tl.int64) * chunk
    acc = tl.zeros((TILE,), tl.int32)
    for i in range(0, chunk, 2 * TILE):
        o = start + i + tl.arange(0, TILE)
        a = tl.load(x_ptr + o, mask=o < n, other=0.0)
        b = tl.load(x_ptr + o + TILE, mask=o + TILE < n, other=0.0)
        acc = tl.maximum(acc, tl.abs(a).to(tl.int32, bitcast=True))
        acc = tl.maximum(acc, tl.abs(b).to(tl.int32, bitcast=True))
    m = tl.max(acc, axis=0)
    tl.atomic_max(ws_ptr, tl.where(m > 0x7F800000, 0x7FC00000, m))


@triton.jit
def _quant_store(x, s, code_ptr, offs, cell_ptr, n, SHIFT: tl.constexpr, KBASE: tl.constexpr,
                 NCELL: tl.constexpr, STORE_CS: tl.constexpr = False):
    """Dettmers dynamic nearest codes of the tile x (one scale s), stored at offs (the library's
    helpers, as _dm_one_scale_kernel uses them). STORE_CS: a streaming store, so the codes need not
    stay in L2 where x is wanted."""
    codes = tkd._dm_codes(x, tkc._div_tile(x, s, 1, 1, True, 0.0), cell_ptr, cell_ptr, 0.0, 0.0, True, False,
                          False, True, 63, SHIFT, KBASE, NCELL, True).to(tl.uint8)
    if STORE_CS:
        tl.store(code_ptr + offs, codes, mask=offs < n, cache_modifier=".cs")
    else:
        tl.store(code_ptr + offs, codes, mask=offs < n)


@triton.jit
def _quant(x_ptr, s_ptr, code_ptr, cell_ptr, n, BLOCK: tl.constexpr, PDL: tl.constexpr,
           REVERSE: tl.constexpr, EVICT: tl.constexpr, SHIFT: tl.constexpr, KBASE: tl.constexpr,
           NCELL: tl.constexpr, STORE_CS: tl.constexpr = False):
    pid = tl.program_id(0)
    if REVERSE:
        pid = tl.num_programs(0) - 1 - pid
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    if EVICT:
        x = tl.load(x_ptr + offs, mask=offs < n, other=0.0, eviction_policy="evict_first")
    else:
        x = tl.load(x_ptr + offs, mask=offs < n, other=0.0)
    if PDL:
        gdc_wait()
    s = tl.load(s_ptr)
    _quant_store(x, s, code_ptr, offs, cell_ptr, n, SHIFT, KBASE, NCELL, STORE_CS)


@triton.jit
def _quant_pipe(x_ptr, s_ptr, code_ptr, cell_ptr, n, BLOCK: tl.constexpr, TILES: tl.constexpr,
                SHIFT: tl.constexpr, KBASE: tl.constexpr, NCELL: tl.constexpr):
    """The quantiser over TILES tiles per program, walking backwards, with the next tile's load issued
    before the current tile's arithmetic (software pipelining by hand: ncu showed the one-tile quantiser
    stalled on its loads half the time, with DRAM at 59 % of peak)."""
    pid = tl.num_programs(0) - 1 - tl.program_id(0)
    base = pid * (BLOCK * TILES)
    s = tl.load(s_ptr)
    offs = base + (TILES - 1) * BLOCK + tl.arange(0, BLOCK)
    xn = tl.load(x_ptr + offs, mask=offs < n, other=0.0)
    for t in tl.static_range(TILES):
        xc = xn
        oc = offs
        if t + 1 < TILES:
            offs = base + (TILES - 2 - t) * BLOCK + tl.arange(0, BLOCK)
            xn = tl.load(x_ptr + offs, mask=offs < n, other=0.0)
        _quant_store(xc, s, code_ptr, oc, cell_ptr, n, SHIFT, KBASE, NCELL)


@triton.jit
def _quant_pipe2(x_ptr, s_ptr, code_ptr, cell_ptr, n, BLOCK: tl.constexpr, TILES: tl.constexpr,
                 SHIFT: tl.constexpr, KBASE: tl.constexpr, NCELL: tl.constexpr):
    """_quant_pipe with two tiles' loads in flight ahead of the arithmetic instead of one."""
    pid = tl.num_programs(0) - 1 - tl.program_id(0)
    base = pid * (BLOCK * TILES)
    s = tl.load(s_ptr)
    o1 = base + (TILES - 1) * BLOCK + tl.arange(0, BLOCK)
    x1 = tl.load(x_ptr + o1, mask=o1 < n, other=0.0)
    o2 = o1 - BLOCK
    x2 = tl.load(x_ptr + o2, mask=(o2 >= base) & (o2 < n), other=0.0)
    for t in tl.static_range(TILES):
        xc = x1
        oc = o1
        x1 = x2
        o1 = o2
        if t + 2 < TILES:
            o2 = base + (TILES - 3 - t) * BLOCK + tl.arange(0, BLOCK)
            x2 = tl.load(x_ptr + o2, mask=o2 < n, other=0.0)
        _quant_store(xc, s, code_ptr, oc, cell_ptr, n, SHIFT, KBASE, NCELL)


@triton.jit
def _amax_pipe(x_ptr, ws_ptr, n, BLOCK: tl.constexpr, TILES: tl.constexpr):
    """The max pass over TILES tiles per program, the next tile's load issued before the current max."""
    base = tl.program_id(0) * (BLOCK * TILES)
    offs = base + tl.arange(0, BLOCK)
    xn = tl.load(x_ptr + offs, mask=offs < n, other=0.0)
    acc = tl.zeros((BLOCK,), tl.int32)
    for t in tl.static_range(TILES):
        xc = xn
        if t + 1 < TILES:
            offs = base + (t + 1) * BLOCK + tl.arange(0, BLOCK)
            xn = tl.load(x_ptr + offs, mask=offs < n, other=0.0)
        acc = tl.maximum(acc, tl.abs(xc).to(tl.int32, bitcast=True))
    m = tl.max(acc, axis=0)
    tl.atomic_max(ws_ptr, tl.where(m > 0x7F800000, 0x7FC00000, m))


@triton.jit
def _coop(x_ptr, scale_ptr, code_ptr, cell_ptr, ws_ptr, n, per, ntiles, TILE: tl.constexpr,
          SHIFT: tl.constexpr, KBASE: tl.constexpr, NCELL: tl.constexpr):
    """One launch, all programs resident (cooperative grid): program p owns x[p*per, (p+1)*per).
    Phase 1 folds max |x| over its tiles, the next tile's load always in flight, into ws[0]; a grid
    barrier (ws[1] counts arrivals); phase 2 quantises its tiles newest first (mostly L2 hits), again
    with the next load in flight. Unlike the one-pass variant of commit 93161e4 (one program per SM,
    part of x held in registers, phase 2 one load at a time), many programs per SM and no register
    hoard."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    start = pid * per
    ar = tl.arange(0, TILE)
    acc = tl.zeros((TILE,), tl.int32)
    offs = start + ar
    xn = tl.load(x_ptr + offs, mask=offs < n, other=0.0)
    for i in range(ntiles):
        xc = xn
        offs = offs + TILE
        xn = tl.load(x_ptr + offs, mask=(offs < start + per) & (offs < n), other=0.0)
        acc = tl.maximum(acc, tl.abs(xc).to(tl.int32, bitcast=True))
    m = tl.max(acc, axis=0)
    tl.atomic_max(ws_ptr, tl.where(m > 0x7F800000, 0x7FC00000, m), sem="relaxed")
    tl.atomic_add(ws_ptr + 1, 1, sem="release")
    arrived = tl.atomic_add(ws_ptr + 1, 0, sem="acquire")
    while arrived < nprog:
        arrived = tl.atomic_add(ws_ptr + 1, 0, sem="acquire")
    s = tl.atomic_max(ws_ptr, 0, sem="acquire").to(tl.float32, bitcast=True)
    if pid == 0:
        tl.store(scale_ptr, s)
    offs = start + (ntiles - 1) * TILE + ar
    xn = tl.load(x_ptr + offs, mask=(offs >= start) & (offs < n), other=0.0, eviction_policy="evict_first")
    for i in range(ntiles):
        xc = xn
        oc = offs
        offs = offs - TILE
        xn = tl.load(x_ptr + offs, mask=(offs >= start) & (offs < n), other=0.0, eviction_policy="evict_first")
        _quant_store(xc, s, code_ptr, oc, cell_ptr, n, SHIFT, KBASE, NCELL)


def _size_setup(mib: int, dev: torch.device):
    """One size of a study: n, the input x (seeded randn), a copy destination, the copy row measured now
    (the baseline), the library's one-scale payload and the bytes the percentages count."""
    n = mib * MiB // 4
    x = torch.randn(n, device=dev, generator=torch.Generator(device=dev).manual_seed(mib))
    dst = torch.empty_like(x)
    t_copy = copy_ms(dst, x, graph_ms)
    copy_row = {"size_mib": mib, "what": "copy", "ms": t_copy, "GBps": 8 * n / t_copy / 1e6}
    ref = tk.dettmers_encode(x, "dynamic", "nearest", 0, 0)
    return n, x, dst, copy_row, ref, 4 * n + ref.numel()


def pipe_study(args) -> None:
    """Pipelined quantiser and max pass (several tiles per program, next load issued first)."""
    dev = torch.device("cuda")
    info = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
            "method": "GPU time per call (gputime.graph_ms, memset flush); pct = (4n + n + 4) bytes / time vs "
            "copy 8n"}
    t = tkd._dm_tables("dynamic", 0, dev)
    cells, c = t["cells"], t["consts"]
    rows = []
    warm_up(dev)
    for mib in [int(s) for s in args.sizes_mib.split(",")]:
        n, x, dst, copy_row, ref, moved = _size_setup(mib, dev)
        rows.append(copy_row)
        gbps = copy_row["GBps"]
        pay = tkc._new_payload(4, 4 + n, dev)
        sbits = pay[:4].view(torch.int32)
        codes = pay[4:]

        def add(what, fn, check=True):
            r = {"size_mib": mib, "what": what}
            try:
                pay.zero_()
                fn()
                torch.cuda.synchronize()
                if check:
                    r["same_bytes"] = bool(torch.equal(pay, ref))
                r["ms"] = graph_ms(fn)
                r["pct_copy"] = 100.0 * moved / r["ms"] / 1e6 / gbps
            except Exception as exc:
                r["failed"] = f"{type(exc).__name__}: {exc}"[:300]
            rows.append(r)
            print(json.dumps(r), flush=True)

        def amax(block, tiles, warps):
            sbits.zero_()
            if tiles == 0:
                tkc._absmax_atomic[(triton.cdiv(n, block),)](x, sbits, n, n, BLOCK=block, I64=False,
                                                             num_warps=warps)
            else:
                _amax_pipe[(triton.cdiv(n, block * tiles),)](x, sbits, n, BLOCK=block, TILES=tiles,
                                                             num_warps=warps)

        def quant(block, tiles, warps):
            if tiles < 0:  # two loads ahead
                _quant_pipe2[(triton.cdiv(n, block * -tiles),)](x, pay[:4].view(torch.float32), codes, cells, n,
                                                                BLOCK=block, TILES=-tiles, SHIFT=c["SHIFT"],
                                                                KBASE=c["KBASE"], NCELL=c["NCELL"],
                                                                num_warps=warps, enable_fp_fusion=False)
            elif tiles == 0:
                _quant[(triton.cdiv(n, block),)](x, pay[:4].view(torch.float32), codes, cells, n, BLOCK=block,
                                                 PDL=False, REVERSE=True, EVICT=False, SHIFT=c["SHIFT"],
                                                 KBASE=c["KBASE"], NCELL=c["NCELL"], num_warps=warps,
                                                 enable_fp_fusion=False)
            else:
                _quant_pipe[(triton.cdiv(n, block * tiles),)](x, pay[:4].view(torch.float32), codes, cells, n,
                                                              BLOCK=block, TILES=tiles, SHIFT=c["SHIFT"],
                                                              KBASE=c["KBASE"], NCELL=c["NCELL"],
                                                              num_warps=warps, enable_fp_fusion=False)

        amaxes = [(16384, 0, 8), (2048, 4, 4), (2048, 8, 4), (4096, 4, 8), (1024, 8, 4), (1024, 16, 4)]
        quants = [(2048, 0, 4), (1024, 2, 4), (1024, 4, 4), (2048, 2, 4), (2048, 4, 4), (512, 4, 2),
                  (1024, 2, 2), (1024, 4, 2)]
        if args.sweep2:
            amaxes = amaxes[:1]
            quants = [(1024, 4, 4), (512, 4, 2), (512, 8, 2), (1024, 8, 4), (512, 8, 4), (256, 8, 1), (256, 16, 2),
                      (1024, 4, 8), (1024, -4, 4), (512, -8, 2), (1024, -8, 4), (512, -4, 2)]
        for a in amaxes:
            add(f"piece: fill + max block={a[0]} tiles={a[1]} warps={a[2]}", lambda a=a: amax(*a), check=False)
        amax(16384, 0, 8)
        want = sbits.clone()
        for a in amaxes:
            amax(*a)
            assert torch.equal(sbits, want), a
        for q in quants:
            def fq(q=q):
                quant(*q)
            pay[:4].view(torch.int32).copy_(want)
            fq()
            torch.cuda.synchronize()
            r = {"size_mib": mib, "what": f"piece: quantise block={q[0]} tiles={q[1]} warps={q[2]}",
                 "same_bytes": bool(torch.equal(pay, ref)), "ms": graph_ms(fq)}
            r["pct_copy"] = 100.0 * moved / r["ms"] / 1e6 / gbps
            rows.append(r)
            print(json.dumps(r), flush=True)
        if args.coop:
            amaxes, quants = amaxes[:2], [(2048, 0, 4), (1024, 4, 4), (512, 4, 2)]
            sms = torch.cuda.get_device_properties(dev).multi_processor_count
            for per_sm, warps, tile in ((2, 8, 4096), (4, 4, 2048), (4, 8, 2048), (8, 4, 2048), (8, 4, 1024),
                                        (16, 2, 1024), (8, 2, 1024), (4, 4, 1024)):
                nprog = per_sm * sms
                per = triton.cdiv(triton.cdiv(n, nprog), tile) * tile
                grid = triton.cdiv(n, per)

                def fc(per=per, grid=grid, warps=warps, tile=tile):
                    ws = torch.zeros(2, dtype=torch.int32, device=dev)
                    _coop[(grid,)](x, pay[:4].view(torch.float32), codes, cells, ws, n, per, per // tile,
                                   TILE=tile, SHIFT=c["SHIFT"], KBASE=c["KBASE"], NCELL=c["NCELL"],
                                   num_warps=warps, launch_cooperative_grid=True, enable_fp_fusion=False)
                add(f"encode one launch (cooperative) {per_sm}/SM warps={warps} tile={tile}", fc)
        for a in amaxes[:3]:
            for q in quants:
                add(f"encode max {a} quant {q}", lambda a=a, q=q: (amax(*a), quant(*q)))
        del x, dst, pay
        torch.cuda.empty_cache()
        with open(args.out, "w") as fh:
            json.dump({**info, "rows": rows}, fh, indent=1)
    print_rows(f"{info['device']} torch {info['torch']} triton {info['triton']}", rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="tune_onescale.json")
    ap.add_argument("--sizes-mib", default="64,256,1024")
    ap.add_argument("--flush-study", action="store_true",
                    help="instead: copy and the library encoders timed after each L2 flush (gputime._flusher)")
    ap.add_argument("--sweep2", action="store_true", help="with --pipe: more quantiser shapes, two loads ahead")
    ap.add_argument("--coop", action="store_true", help="with --pipe: the one-launch cooperative encode too")
    ap.add_argument("--pipe", action="store_true",
                    help="instead: the pipelined quantiser and max pass (several tiles per program)")
    args = ap.parse_args()
    if args.pipe:
        return pipe_study(args)
    if args.flush_study:
        return flush_study(args)
    dev = torch.device("cuda")
    info = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
            "gdc": HAVE_GDC, "method": "GPU time per call (gputime.graph_ms); pct = (4n + n + 4) bytes / time "
            "vs copy 8n"}
    t = tkd._dm_tables("dynamic", 0, dev)
    cells, c = t["cells"], t["consts"]
    rows, t0 = [], time.time()
    warm_up(dev)
    for mib in [int(s) for s in args.sizes_mib.split(",")]:
        n, x, dst, copy_row, ref, moved = _size_setup(mib, dev)
        rows.append(copy_row)
        gbps = copy_row["GBps"]

        def add(what, fn, check=None):
            r = {"size_mib": mib, "what": what}
            try:
                p = fn()
                torch.cuda.synchronize()
                if check is not None:
                    r["same_bytes"] = bool(torch.equal(check(p), ref))
                r["ms"] = graph_ms(fn)
                r["pct_copy"] = 100.0 * moved / r["ms"] / 1e6 / gbps
            except Exception as exc:  # a variant this Triton or driver cannot run: recorded, not fatal
                r["failed"] = f"{type(exc).__name__}: {exc}"[:300]
            rows.append(r)
            print(json.dumps(r), flush=True)

        pay = tkc._new_payload(4, 4 + n, dev)
        sc = pay[:4].view(torch.float32)
        sbits = sc.view(torch.int32)
        codes = pay[4:]
        ws = torch.zeros(2, dtype=torch.int32, device=dev)
        amax_block = tk.CONFIG["absmax_elems"]
        g_amax = (triton.cdiv(n, amax_block),)

        def amax(trigger=False, ticket=False):
            if not ticket:
                sbits.zero_()
            _amax[g_amax](x, sbits if not ticket else ws, sbits, n, BLOCK=amax_block, TRIGGER=trigger,
                          TICKET=ticket, num_warps=8)

        def quant(block=2048, warps=4, pdl=False, reverse=True, evict=False, cs=False):
            kw = {"launch_pdl": True} if pdl else {}
            _quant[(triton.cdiv(n, block),)](x, sc, codes, cells, n, BLOCK=block, PDL=pdl, REVERSE=reverse,
                                             EVICT=evict, SHIFT=c["SHIFT"], KBASE=c["KBASE"], NCELL=c["NCELL"],
                                             STORE_CS=cs, num_warps=warps, enable_fp_fusion=False, **kw)

        sms = torch.cuda.get_device_properties(dev).multi_processor_count

        def amax_var(kind):
            """kind: ('atomic', block, warps) | ('hint', block, warps, keep_mib) | ('bal', per_sm, tile, warps)"""
            sbits.zero_()
            if kind[0] == "atomic":
                _, b, w = kind
                _amax[(triton.cdiv(n, b),)](x, sbits, sbits, n, BLOCK=b, TRIGGER=False, TICKET=False, num_warps=w)
            elif kind[0] == "hint":
                _, b, w, keep = kind
                _amax_hint[(triton.cdiv(n, b),)](x, sbits, n, max(0, n - keep * MiB // 4), BLOCK=b, num_warps=w)
            else:
                _, per_sm, tile, w = kind
                grid = per_sm * sms
                chunk = triton.cdiv(triton.cdiv(n, grid), 2 * tile) * 2 * tile
                _amax_bal[(triton.cdiv(n, chunk),)](x, sbits, n, chunk, TILE=tile, num_warps=w)

        want_scale = ref[:4].clone()
        amax_kinds = [("atomic", 16384, 8), ("atomic", 8192, 8), ("atomic", 8192, 4), ("atomic", 4096, 4),
                      ("atomic", 2048, 4), ("bal", 4, 2048, 8), ("bal", 8, 2048, 4), ("bal", 2, 4096, 8),
                      ("bal", 4, 4096, 4), ("hint", 16384, 8, 32), ("hint", 16384, 8, 48)]
        for kind in amax_kinds:
            add(f"piece: fill + max {kind}", lambda k=kind: amax_var(k),
                check=lambda p: torch.cat([pay[:4], ref[4:]]))
        for kind in amax_kinds[:1] + amax_kinds[4:]:
            for qv in ((2048, 4, False, False), (2048, 4, True, False), (2048, 4, True, True),
                       (2048, 4, False, True), (1024, 2, True, True)):
                def f(k=kind, q=qv):
                    amax_var(k)
                    quant(q[0], q[1], evict=q[2], cs=q[3])
                    return pay
                pay.zero_()
                add(f"encode max {kind} quant block={qv[0]} warps={qv[1]} evict_first={qv[2]} store_cs={qv[3]}",
                    f, check=lambda p: p)
        assert torch.equal(want_scale, ref[:4])

        same = lambda p: pay  # noqa: E731 - the rebuilt encodes write into pay
        add("library encode (fill + max + quantise)", lambda: tk.dettmers_encode(x, "dynamic", "nearest", 0, 0),
            check=lambda p: p)
        add("piece: fill of the scale", lambda: sbits.zero_())
        add("piece: fill + max pass", lambda: amax())
        add("piece: max pass, ticket (no fill)", lambda: amax(ticket=True))
        amax()
        for block, warps in ((2048, 4), (1024, 2), (4096, 4), (4096, 8), (8192, 8)):
            add(f"piece: quantise block={block} warps={warps}", lambda b=block, w=warps: quant(b, w), check=same)
        add("piece: quantise block=2048 warps=4 evict_first", lambda: quant(evict=True), check=same)
        add("piece: quantise block=2048 warps=4 forward", lambda: quant(reverse=False), check=same)
        for block, warps in ((2048, 4), (4096, 8)):
            for mode in ("plain", "pdl", "ticket", "ticket+pdl"):
                def f(b=block, w=warps, m=mode):
                    amax(trigger="pdl" in m, ticket="ticket" in m)
                    quant(b, w, pdl="pdl" in m)
                    return pay
                pay.zero_()
                add(f"encode {mode} block={block} warps={warps}", f, check=lambda p: p)
        del x, dst, pay
        torch.cuda.empty_cache()
        with open(args.out, "w") as fh:
            json.dump({**info, "rows": rows}, fh, indent=1)

    print_rows(f"{info['device']} torch {info['torch']} triton {info['triton']} gdc {HAVE_GDC} "
                f"({time.time() - t0:.0f} s)", rows)


def flush_study(args) -> None:
    """The same calls after a memset flush (dirty L2), a memset and a read (clean cold L2), or none."""
    dev = torch.device("cuda")
    info = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
            "method": "GPU time per call (gputime.graph_ms, flush as named); pct = bytes / time vs copy 8n "
            "timed after the same flush"}
    rows = []
    warm_up(dev)
    for mib in [int(s) for s in args.sizes_mib.split(",")]:
        n = mib * MiB // 4
        x = torch.randn(n, device=dev, generator=torch.Generator(device=dev).manual_seed(mib))
        dst = torch.empty_like(x)
        out = torch.empty(n, device=dev)
        calls = {
            "dettmers one scale": lambda: tk.dettmers_encode(x, "dynamic", "nearest", 0, 0),
            "dettmers bucket 4096": lambda: tk.dettmers_encode(x, "dynamic", "nearest", 4096, 0),
            "qsgd8 bucket 512": lambda: tk.qsgd_encode(x, 8, 512, "max", True, 1),
            "qsgd2 bucket 128": lambda: tk.qsgd_encode(x, 2, 128, "max", True, 1),
        }
        pays = {k: f() for k, f in calls.items()}
        dec = {"decode dettmers one scale": lambda: tk.dettmers_decode(pays["dettmers one scale"], n, "dynamic",
                                                                       0, 0, out),
               "decode qsgd8 bucket 512": lambda: tk.qsgd_decode(pays["qsgd8 bucket 512"], n, 8, 512, out)}
        for flush in ("zero", "clean", "none"):
            t_copy = min(graph_ms(lambda: dst.copy_(x), flush=flush), graph_ms(lambda: dst.copy_(x), flush=flush))
            gbps = 8 * n / t_copy / 1e6
            rows.append({"size_mib": mib, "flush": flush, "what": "copy", "ms": t_copy, "GBps": gbps})
            for k, f in list(calls.items()) + list(dec.items()):
                key = k.replace("decode ", "")
                ms = graph_ms(f, flush=flush)
                moved = 4 * n + pays[key].numel()
                rows.append({"size_mib": mib, "flush": flush, "what": k, "ms": ms,
                             "pct_copy": 100.0 * moved / ms / 1e6 / gbps})
                print(json.dumps(rows[-1]), flush=True)
        del x, dst, out, pays
        torch.cuda.empty_cache()
        with open(args.out, "w") as fh:
            json.dump({**info, "rows": rows}, fh, indent=1)
    print_rows(f"{info['device']} torch {info['torch']} triton {info['triton']}", rows)


if __name__ == "__main__":
    main()
