"""``lowbit codecs``: the table of every codec (arguments and output; the measuring is
:mod:`lowbit.lab.codec_report`)."""

from __future__ import annotations

import argparse
import json
import platform
from pathlib import Path

import torch

from lowbit.codecs.base import parse_codec_list
from lowbit.lab.codec_report import DEFAULT_SPECS, format_table, measure


#: Samples per distribution: the quick default, and what Dettmers' Table 2 comparison needs (``--paper``).
QUICK_SAMPLES = 1_000_000
PAPER_SAMPLES = 25_000_000


def _check(args: argparse.Namespace) -> None:
    """Every argument checked before any work: one line naming the problem (the CLI exits with 2)."""
    if args.samples is not None and args.paper:
        raise ValueError("--samples and --paper both set the samples per distribution: give one")
    if args.samples is None:
        args.samples = PAPER_SAMPLES if args.paper else QUICK_SAMPLES
    for name, lo in (("samples", 1), ("bench_numel", 1), ("reps", 1)):
        v = getattr(args, name)
        if v < lo:
            raise ValueError(f"--{name.replace('_', '-')} must be >= {lo}, got {v}")
    specs(args)
    if args.json:
        path = Path(args.json)
        existed = path.exists()
        try:  # can we write there? (found now, not after the whole table is computed)
            with open(path, "a"):
                pass
            if not existed:
                path.unlink()
        except OSError as exc:
            raise ValueError(f"--json {args.json}: cannot write there ({exc.strerror or exc})") from None


def specs(args: argparse.Namespace) -> list[str]:
    """The codecs to measure: ``--codec`` values in the codec-list syntax of every command, else the default set."""
    return parse_codec_list(args.codec, what="--codec") if args.codec else list(DEFAULT_SPECS)


def run(args: argparse.Namespace) -> int:
    _check(args)
    rows = measure(specs(args), args.samples, args.bench_numel, args.reps, progress=not args.quiet)
    meta = {
        "machine": platform.node(),
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "samples": args.samples,
        "bench_numel": args.bench_numel,
    }
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
    print(format_table(rows))
    print(f"machine: {meta['machine']} ({meta['processor']}, {meta['threads']} threads, torch {meta['torch']})")
    if args.json:
        print(f"rows written to {args.json}")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("codecs", help="table of every codec: bits on the wire, error, throughput")
    p.add_argument("--codec", action="append", metavar="SPEC",
                   help="codec specs to measure (repeatable), separated by ';' or ',' (a 'key=value' item "
                        "continues the spec before it), as for every lowbit command; default: a standard set")
    p.add_argument("--samples", type=int, default=None,
                   help=f"samples per distribution (default {QUICK_SAMPLES:,}: about 10-20 s on 2 cores; --paper: "
                        f"{PAPER_SAMPLES:,})")
    p.add_argument("--paper", action="store_true",
                   help=f"{PAPER_SAMPLES:,} samples per distribution, as Table 2's comparison needs (fewer leave its "
                        "N(0,1) column ~0.1 points off): minutes")
    p.add_argument("--bench-numel", type=int, default=1 << 22, help="elements for the throughput runs")
    p.add_argument("--reps", type=int, default=5, help="timed repetitions (median reported)")
    p.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=run)
