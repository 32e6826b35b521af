"""Triton codec kernels on one GPU: time, effective bandwidth, and speedup over the torch reference.

For fp32 inputs of 4 MiB .. 1 GiB, each kernel's median GPU time per call (CUDA graphs of an L2 flush and
the call, less the flushes: benchmarks/gputime.py; ``--timing do_bench`` for triton's do_bench, which
also counts host time the GPU waits for) is turned into an effective bandwidth, counting the fewest bytes the operation must
move (input read once, output written once: ``4n + payload`` for encode, ``payload + 4n`` for decode),
and set next to a device-to-device copy of the same input measured in the same run (``2 * 4n`` bytes).
The torch reference kernels (:mod:`lowbit.kernels.reference`, i.e. ``LOWBIT_KERNELS=reference``) are
timed on the same GPU for the speedup.

    PYTHONPATH=src python3 benchmarks/bench_kernels_gpu.py --out $OUT/kernels_gpu.json [--sweep]

Writes JSON (card, torch and triton versions, every number) and prints a short table last.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import time

import torch
import triton
from triton.testing import do_bench

import lowbit
from lowbit.kernels import reference as ref
from lowbit.kernels import triton as tk

try:
    from gputime import copy_ms, graph_ms, warm_up
except ImportError:  # run from elsewhere
    from benchmarks.gputime import copy_ms, graph_ms, warm_up

MiB = 1 << 20

# (label, codec spec)
CASES = [
    ("qsgd8 b512", "qsgd:bits=8,bucket=512"),
    ("qsgd4 b512", "qsgd:bits=4,bucket=512"),
    ("qsgd2 b128", "qsgd:bits=2,bucket=128"),
    ("qsgd1 b512", "qsgd:bits=1,bucket=512"),
    ("onebit b64", "onebit:bucket=64"),
    ("dettmers dyn b0", "dettmers:type=dynamic"),
    ("dettmers dyn b4096", "dettmers:type=dynamic,bucket=4096"),
]


def ops(spec: str):
    """(triton encode, triton decode, reference encode, reference decode, codec) for a codec spec."""
    c = lowbit.get_codec(spec)
    if c.name == "qsgd":
        st = c.rounding == "stochastic"
        return (
            lambda x: tk.qsgd_encode(x, c.bits, c.bucket, c.norm, st, 1),
            lambda p, out: tk.qsgd_decode(p, out.numel(), c.bits, c.bucket, out),
            lambda x: ref.qsgd_encode(x, c.bits, c.bucket, c.norm, st, 1),
            lambda p, out: ref.qsgd_decode(p, out.numel(), c.bits, c.bucket, out),
            c,
        )
    if c.name == "onebit":
        return (
            lambda x: tk.onebit_encode_buckets(x, c.bucket),
            lambda p, out: tk.onebit_decode_buckets(p, out.numel(), c.bucket, out),
            lambda x: ref.onebit_encode_buckets(x, c.bucket),
            lambda p, out: ref.onebit_decode_buckets(p, out.numel(), c.bucket, out),
            c,
        )
    # Dettmers: the codec's own torch code is the reference (forced with LOWBIT_KERNELS=reference).
    return (
        lambda x: tk.dettmers_encode(x, c.type, c.search, c.bucket, c.offset),
        lambda p, out: tk.dettmers_decode(p, out.numel(), c.type, c.bucket, c.offset, out),
        lambda x: c.encode(x),
        lambda p, out: c.decode(p, out.numel(), out=out, shape=c.flat_shape(out.numel())),
        c,
    )


DRY_RUN = False  # --device cpu: a functional dry run under TRITON_INTERPRET=1, timings meaningless


TIMING = "graph"  # or "do_bench" (--timing)


def bench(fn, big: bool, reps: int | None = None) -> float:
    """Median milliseconds of one call: GPU time from CUDA graphs (gputime.graph_ms), or do_bench's."""
    if DRY_RUN:
        t0 = time.perf_counter()
        fn()
        return 1e3 * (time.perf_counter() - t0)
    if TIMING == "graph":
        try:
            return graph_ms(fn, reps=reps or (8 if big else 20))
        except Exception as exc:  # noqa: BLE001 - a call that cannot be captured: say so, time it eagerly
            print(f"graph capture failed ({type(exc).__name__}: {str(exc)[:80]}); do_bench for this one",
                  flush=True)
            torch.cuda.synchronize()
    return float(do_bench(fn, warmup=10 if big else 25, rep=40 if big else 100, return_mode="median"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="kernels_gpu.json")
    ap.add_argument("--sizes-mib", default="4,16,64,256,1024")
    ap.add_argument("--no-reference", action="store_true", help="skip the torch reference timings")
    ap.add_argument("--sweep", action="store_true", help="also sweep tile size / warps")
    ap.add_argument("--sweep-mib", type=int, default=64)
    ap.add_argument("--budget-s", type=float, default=420.0, help="stop starting new work after this")
    ap.add_argument("--extra-mib", type=int, default=64, help="size of the odd-n / decode_sum rows")
    ap.add_argument("--device", default="cuda", help="cpu: functional dry run (TRITON_INTERPRET=1)")
    ap.add_argument("--module", default="", help="time the kernels of this file instead of "
                    "lowbit.kernels.triton (an earlier single-file version, for a before/after in one session)")
    ap.add_argument("--timing", choices=("graph", "do_bench"), default="graph",
                    help="graph: GPU time per call from CUDA graphs (no host overhead, cold L2); do_bench: "
                    "triton.testing.do_bench (includes host time the GPU waits for)")
    args = ap.parse_args()
    global DRY_RUN, tk, TIMING
    TIMING = args.timing
    if args.module:
        spec = importlib.util.spec_from_file_location("lowbit_kernels_under_test", args.module)
        tk = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(tk)
    DRY_RUN = args.device == "cpu"
    os.environ["LOWBIT_KERNELS"] = "reference"  # codec calls below are the reference
    assert DRY_RUN or torch.cuda.is_available(), "needs a CUDA GPU"
    t_start = time.time()
    dev = torch.device(args.device)
    info = {
        "device": torch.cuda.get_device_name() if not DRY_RUN else "cpu (dry run)",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "sm_count": torch.cuda.get_device_properties(dev).multi_processor_count if not DRY_RUN else 0,
        "config": dict(tk.CONFIG),
        "module": args.module or "lowbit.kernels.triton",
        "method": ("GPU time per call from CUDA graphs of (L2 flush, call) minus the flushes (benchmarks/"
                   "gputime.py)" if args.timing == "graph" else "triton.testing.do_bench median (L2 flushed "
                   "between runs)") + "; effective GB/s = (bytes read + written) / time, minimal bytes; "
                   "copy = dst.copy_(src) of the fp32 input",
    }
    print(json.dumps(info), flush=True)
    sizes = [int(s) for s in args.sizes_mib.split(",")]
    if not DRY_RUN:
        warm_up(dev)
    copies, rows, sweep, extra = [], [], [], []

    def save() -> None:
        with open(args.out, "w") as f:
            json.dump({**info, "copy": copies, "results": rows, "extra": extra, "sweep": sweep}, f, indent=1)

    g = torch.Generator(device=dev).manual_seed(0)
    for mib in sizes:
        n = mib * MiB // 4
        big = mib >= 256
        x = torch.randn(n, device=dev, generator=g)
        dst = torch.empty_like(x)
        t_copy = bench(lambda: dst.copy_(x), big) if DRY_RUN else copy_ms(dst, x, lambda fn: bench(fn, big))
        copy_gbps = 2 * 4 * n / t_copy / 1e6
        copies.append({"size_mib": mib, "ms": t_copy, "GBps": copy_gbps})
        print(f"copy {mib} MiB: {t_copy:.4f} ms  {copy_gbps:.0f} GB/s", flush=True)
        out = torch.empty_like(x)
        for label, spec in CASES:
            if time.time() - t_start > args.budget_s:
                print("time budget reached; skipping the rest", flush=True)
                break
            enc, dec, renc, rdec, codec = ops(spec)
            p = enc(x)
            nbytes = p.numel()
            r = {"case": label, "spec": codec.spec, "size_mib": mib, "payload_bytes": nbytes}
            for op, fn, moved in (("encode", lambda: enc(x), 4 * n + nbytes),
                                  ("decode", lambda: dec(p, out), nbytes + 4 * n)):
                t = bench(fn, big)
                r[f"{op}_ms"] = t
                r[f"{op}_GBps"] = moved / t / 1e6
                r[f"{op}_pct_copy"] = 100.0 * r[f"{op}_GBps"] / copy_gbps
            if not args.no_reference:
                try:
                    r["ref_encode_ms"] = bench(lambda: renc(x), big, reps=3)
                    r["ref_decode_ms"] = bench(lambda: rdec(p, out), big, reps=3)
                    r["encode_speedup"] = r["ref_encode_ms"] / r["encode_ms"]
                    r["decode_speedup"] = r["ref_decode_ms"] / r["decode_ms"]
                except torch.OutOfMemoryError:
                    r["ref_error"] = "out of memory"
                torch.cuda.empty_cache()
            rows.append(r)
            print(json.dumps(r), flush=True)
            del p
        save()
        # Extra rows at 64 MiB: odd n (masked tail, misaligned code stream when received into an exact
        # buffer), and decode_sum of 8 payloads.
        if mib == args.extra_mib and time.time() - t_start < args.budget_s:
            for bits, bucket in ((8, 512), (4, 512)):
                m = n + 3 + bucket  # n % 16 != 0 and nb % 4 == 1
                xo = torch.randn(m, device=dev, generator=g)
                po = tk.qsgd_encode(xo, bits, bucket, "max", True, 1)
                recv = torch.empty(po.numel() + 64, dtype=torch.uint8, device=dev)[:po.numel()]
                recv.copy_(po)  # exact-size, 256-aligned base: code stream at 4*nb, not 16-aligned
                oo = torch.empty(m, device=dev)
                e = {"case": f"qsgd{bits} b{bucket} odd n", "n": m, "payload_bytes": po.numel(),
                     "encode_ms": bench(lambda: tk.qsgd_encode(xo, bits, bucket, "max", True, 1), False),
                     "decode_aligned_ms": bench(lambda: tk.qsgd_decode(po, m, bits, bucket, oo), False),
                     "decode_received_ms": bench(lambda: tk.qsgd_decode(recv, m, bits, bucket, oo), False)}
                for k in ("encode", "decode_aligned", "decode_received"):
                    e[k + "_pct_copy"] = 100.0 * (4 * m + po.numel()) / e[k + "_ms"] / 1e6 / copy_gbps
                ps = [tk.qsgd_encode(torch.randn(n, device=dev, generator=g), bits, bucket, "max", True, k)
                      for k in range(8)]
                e["decode_sum8_ms"] = bench(lambda: tk.qsgd_decode_sum(ps, n, bits, bucket, out), False)
                e["decode_sum8_ref_ms"] = bench(lambda: _ref_sum(ps, n, bits, bucket, out), False)
                e["decode_sum8_pct_copy"] = (100.0 * (8 * ps[0].numel() + 4 * n) / e["decode_sum8_ms"] / 1e6
                                             / copy_gbps)
                extra.append(e)
                print(json.dumps(e), flush=True)
                del ps
            save()
        del x, dst, out
        torch.cuda.empty_cache()

    if args.sweep:  # tile size / warps per program, at the size where the targets are tightest
        mib = args.sweep_mib if not DRY_RUN else sizes[0]
        n = mib * MiB // 4
        x = torch.randn(n, device=dev, generator=g)
        out = torch.empty_like(x)
        copy_gbps = next((c["GBps"] for c in copies if c["size_mib"] == mib), None)
        saved = dict(tk.CONFIG)
        for elems, warps in ((1024, 2), (1024, 4), (2048, 2), (2048, 4), (4096, 4), (4096, 8)):
            if time.time() - t_start > args.budget_s:
                print("time budget reached; sweep cut short", flush=True)
                break
            tk.CONFIG.update(elems=elems, warps=warps, qsgd_enc_warps=warps)
            for label, spec in CASES:
                enc, dec, _, _, _ = ops(spec)
                p = enc(x)
                s = {"case": label, "elems": elems, "warps": warps, "size_mib": mib,
                     "encode_ms": bench(lambda: enc(x), True), "decode_ms": bench(lambda: dec(p, out), True)}
                if copy_gbps:
                    for op in ("encode", "decode"):
                        s[op + "_pct_copy"] = 100.0 * (4 * n + p.numel()) / s[op + "_ms"] / 1e6 / copy_gbps
                sweep.append(s)
                print(json.dumps(s), flush=True)
        tk.CONFIG.clear()
        tk.CONFIG.update(saved)
        save()

    # Host cost of one call (Python, argument handling, launch): back-to-back calls on 1 MiB.
    if not DRY_RUN:
        n = MiB // 4
        x = torch.randn(n, device=dev, generator=g)
        out = torch.empty_like(x)
        for label, spec in CASES:
            enc, dec, _, _, _ = ops(spec)
            p = enc(x)
            for op, fn in (("encode", lambda: enc(x)), ("decode", lambda: dec(p, out))):
                fn()
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                for _ in range(200):
                    fn()
                torch.cuda.synchronize()
                extra.append({"case": label, "op": op, "host_us_per_call_1MiB": (time.perf_counter() - t0) / 200 * 1e6})
        save()

    save()
    # ---------------------------------------------------------------- short table, last
    print(f"\n{info['device']}  torch {info['torch']}  triton {info['triton']}  ({time.time() - t_start:.0f} s)")
    print("copy GB/s: " + ", ".join(f"{c['size_mib']}MiB {c['GBps']:.0f}" for c in copies))
    print(f"{'case':20s} {'MiB':>5s} {'enc GB/s':>9s} {'%copy':>6s} {'x ref':>6s} {'dec GB/s':>9s} {'%copy':>6s} {'x ref':>6s}")
    for r in rows:
        print(f"{r['case']:20s} {r['size_mib']:5d} {r['encode_GBps']:9.0f} {r['encode_pct_copy']:6.1f} "
              f"{r.get('encode_speedup', float('nan')):6.1f} {r['decode_GBps']:9.0f} {r['decode_pct_copy']:6.1f} "
              f"{r.get('decode_speedup', float('nan')):6.1f}")
    for e in extra:
        if "host_us_per_call_1MiB" in e:
            continue
        print(f"{e['case']:20s} enc {e['encode_pct_copy']:.0f}% dec {e['decode_aligned_pct_copy']:.0f}% "
              f"dec(received) {e['decode_received_pct_copy']:.0f}% sum8 {e['decode_sum8_pct_copy']:.0f}% "
              f"(x{e['decode_sum8_ref_ms'] / e['decode_sum8_ms']:.1f} ref)")
    host = [f"{e['case']} {e['op'][:3]} {e['host_us_per_call_1MiB']:.0f}" for e in extra if "host_us_per_call_1MiB" in e]
    if host:
        print("us per call, back to back at 1 MiB: " + ", ".join(host))
    for s in sweep:
        print(f"sweep {s['case']:18s} elems={s['elems']:5d} warps={s['warps']:2d} enc {s.get('encode_pct_copy', 0):.0f}% "
              f"dec {s.get('decode_pct_copy', 0):.0f}%")


def _ref_sum(ps, n, bits, bucket, out):
    ref.qsgd_decode(ps[0], n, bits, bucket, out)
    tmp = torch.empty_like(out)
    for p in ps[1:]:
        out.add_(ref.qsgd_decode(p, n, bits, bucket, tmp))
    return out


if __name__ == "__main__":
    main()
