"""``lowbit study``, ``lowbit report`` and ``lowbit export``.

    lowbit study                                   # the embedded default study, then its report
    lowbit study --preset seeds --out benchmarks/results/study_cpu_default
    lowbit study --config my.toml --codecs fp32 qsgd:bits=4,bucket=512 --epochs 2 --dry-run
    lowbit report study-results/ --price-per-gpu-hour 0.9
    lowbit study --tensorboard runs/                # also log every epoch to TensorBoard (extra)
    lowbit export study-results/ --csv out/ --tensorboard runs/

``study`` resumes: runs already in ``OUT/results.jsonl`` are skipped. Flags override the config's keys.
Under torchrun every rank runs ``lowbit study`` (see docs/study.md); rank 0 writes results and report.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from lowbit.auto.options import default_allow
from lowbit.lab.baselines import get_baseline, is_baseline
from lowbit.codecs.base import get_codec, parse_codec_list
from lowbit.comm.allreduce import algorithms
from lowbit.env import launched_rank_and_size, under_torchrun
from lowbit.extras import require
from lowbit.kernels.dispatch import warm_up
from lowbit.lab.study.config import PRESETS, auto_level, auto_spec, is_auto
from lowbit.lab.study.export import export_tensorboard, output_folder, write_csv, write_curves_csv
from lowbit.lab.study.loading import load_config
from lowbit.lab.study.report import DEFAULT_PRICE_PER_GPU_HOUR, load_runs, write_report
from lowbit.lab.study.runner import StudyInterrupted, plan_study, run_study
from lowbit.lab.study.store import resolve_results_path

__all__ = ["register"]

_STRICT_HELP = ("lines of results.jsonl that are not readable rows (garbage, a torn write, wrong types) are an "
                "error; by default they are skipped with one warning naming them")


def _csv_or_list(values: list[str] | None) -> list[str] | None:
    return values if values else None


def _ints(values: list[str] | None, key: str) -> list[int] | None:
    if not values:
        return None
    out = []
    for v in values:
        for part in v.split(","):
            if not part.strip():
                continue
            try:
                out.append(int(part))
            except ValueError:
                raise ValueError(f"--{key}: {part!r} is not an integer") from None
    return out


def _batches(values: list[str] | None) -> list[int | str] | None:
    if not values:
        return None
    return [int(v) if v.isdigit() else v for v in values]


def _study_spec(spec: str) -> str | None:
    """What --codecs takes beside codecs, as its canonical spec: codec="auto" at a level (auto, auto:bold)
    and PyTorch's hooks (torch:fp16, torch:powersgd:rank=4)."""
    if is_auto(spec):
        return auto_spec(auto_level(spec))  # (a ValueError names an unknown level)
    return get_baseline(spec).spec if is_baseline(spec) else None


def _overrides(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "networks": _csv_or_list(args.networks),
        "datasets": _csv_or_list(args.datasets),
        "codecs": (parse_codec_list(args.codecs, what="--codecs", other=_study_spec)
                   if args.codecs else None),
        "algorithms": _csv_or_list(args.algorithms),
        "world_sizes": _ints(args.world_sizes, "world-sizes"),
        "nodes": _ints(args.emulate_nodes, "emulate-nodes"),
        "parallelism": _csv_or_list(args.parallelism),
        "sub_batches": args.sub_batches,
        "backends": _csv_or_list(args.backend),
        "batch_sizes": _batches(args.batch_sizes),
        "epochs": args.epochs,
        "optimizer": args.optimizer,
        "lr": args.lr,
        "seeds": _ints(args.seeds, "seeds"),
        "max_train_samples": args.max_train_samples,
        "threads_per_worker": args.threads_per_worker,
        "device": args.device,
        "time_budget_s": args.time_budget_s,
    }


def _warm_up(cfg: Any, out: str) -> None:
    """Compile (or load from numba's cache) the CPU kernels of every codec still to run, here, before any
    worker or process group exists: a cold compile inside the first collective can outlast its timeout."""
    runs, finished, _ = plan_study(cfg, out)
    todo = [r for r in runs if (r.awaits_target or r.key() not in finished) and r.device == "cpu" and r.world_size > 1]
    specs = [s for r in todo for s in (default_allow(auto_level(r.codec)) if is_auto(r.codec) else (r.codec,))]
    for spec in dict.fromkeys(specs):  # (auto: the codecs it may probe)
        if not is_baseline(spec):
            warm_up(get_codec(spec), "cpu")


def _study(args: argparse.Namespace) -> int:
    for flag in ("out", "report_out", "tensorboard"):  # before any worker starts
        if getattr(args, flag):
            output_folder(getattr(args, flag), "--" + flag.replace("_", "-"))

    cfg = load_config(args.config, args.preset, _overrides(args))
    if args.dry_run:
        runs, finished, store = plan_study(cfg, args.out)
        done = {r.key() for r in runs if not r.awaits_target} & finished
        print(f"study {cfg.name!r}: {len(runs)} runs ({len(runs) - len(done)} to do), results in {store.path}")
        for r in runs:
            if r.awaits_target:  # its key holds the target, known once its target_from run has run
                print(f"  todo  {'(target to come)':<16}  {r.describe()}  [target: {r.target_from}'s final loss]")
                continue
            mark = "done" if r.key() in finished else "todo"
            print(f"  {mark}  {r.key()}  {r.describe()}")
        return 0
    _warm_up(cfg, args.out)
    try:
        result = run_study(cfg, args.out, launcher=args.launcher, progress=not args.no_progress,
                           tensorboard=args.tensorboard)
    except StudyInterrupted as exc:
        print(f"lowbit study: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"\nlowbit study: interrupted; finished runs are saved in {args.out}. "
              "Rerun the same command to resume.", file=sys.stderr)
        return 130
    launched_rank = launched_rank_and_size()[0] if (args.launcher == "torchrun" or under_torchrun()) else 0
    if launched_rank != 0:
        return 0
    print(f"{result.ran} run(s) done, {result.skipped} already there, in {result.elapsed_s:.0f} s; "
          f"results: {result.results_path}")
    if args.no_report:
        return 0

    index = write_report(result.results_path, args.report_out, args.price_per_gpu_hour)
    print(f"report: {index}")
    return 0


def _report(args: argparse.Namespace) -> int:

    if args.out:
        output_folder(args.out, "--out")
    index = write_report(args.results, args.out, args.price_per_gpu_hour, strict=args.strict)
    print(f"report: {index} (tables: runs.csv, epochs.csv beside it)")
    return 0


def _export(args: argparse.Namespace) -> int:

    if not args.csv and not args.tensorboard:
        raise ValueError("nothing to export to: give --csv DIR and/or --tensorboard DIR")
    if args.csv:
        output_folder(args.csv, "--csv")
    if args.tensorboard:
        output_folder(args.tensorboard, "--tensorboard")
        require("tensorboard", "tensorboard", "--tensorboard")
    runs, _ = load_runs(resolve_results_path(args.results), strict=args.strict)
    if not runs:
        raise ValueError(f"no finished runs in {resolve_results_path(args.results)}")
    if args.csv:
        for path in (*write_csv(runs, args.csv), write_curves_csv(runs, args.csv)):
            if path is not None:
                print(f"csv: {path}")
    if args.tensorboard:
        n = export_tensorboard(runs, args.tensorboard)
        print(f"tensorboard: {n} run(s) in {args.tensorboard} (tensorboard --logdir {args.tensorboard})")
    return 0


def register(sub: Any) -> None:

    p = sub.add_parser(
        "study", help="run a study grid (resumable) and write its report",
        description="Train every point of a study grid (networks x data x codecs x algorithms x world sizes x "
                    "backends x batch sizes x seeds) with DDP + lowbit, append results as runs finish (an "
                    "interrupted study resumes), then write the HTML report. Flags override config keys; "
                    "list flags take space-separated values (codec specs contain commas).",
    )
    src = p.add_mutually_exclusive_group()
    src.add_argument("--config", metavar="PATH", help="study config (TOML); see docs/study.md")
    src.add_argument("--preset", choices=PRESETS, help="embedded preset (default: default)")
    p.add_argument("--out", default="study-results/", metavar="DIR", help="results directory (default: %(default)s)")
    p.add_argument("--networks", nargs="+", metavar="NET")
    p.add_argument("--datasets", nargs="+", metavar="DATA")
    p.add_argument("--codecs", action="extend", nargs="+", metavar="SPEC",
                   help="codec specs separated by spaces, ';' or ',' as for every lowbit command, "
                   "e.g. fp32 qsgd:bits=4,bucket=512 onebit:bucket=64")
    p.add_argument("--algorithms", nargs="+", metavar="ALG", help=" | ".join(algorithms()))
    p.add_argument("--world-sizes", nargs="+", metavar="K")
    p.add_argument("--emulate-nodes", nargs="+", metavar="N",
                   help="also split each world size into N emulated nodes on this host (NCCL_HOSTID per node, "
                        "sockets between them; e.g. --emulate-nodes 1 2); docs/multinode.md")
    p.add_argument("--parallelism", nargs="+", metavar="P",
                   help="data | model | hybrid (Dettmers: the codec also carries activations; model splits mlp, "
                        "hybrid alexnet, vgg*, small_cnn); docs/parallel.md")
    p.add_argument("--sub-batches", type=int, metavar="S", help="hybrid runs: sub-batches (default 1)")
    p.add_argument("--backend", nargs="+", metavar="BACKEND", help="gloo | nccl | mpi")
    p.add_argument("--batch-sizes", nargs="+", metavar="B", help="per worker: 32, fig4, fig4:resnet110, global:256")
    p.add_argument("--epochs", type=int)
    p.add_argument("--optimizer", choices=("sgd", "rmsprop", "adam"), help="optimizer of every run (default sgd)")
    p.add_argument("--lr", type=float, metavar="LR", help="learning rate of every run")
    p.add_argument("--seeds", nargs="+", metavar="SEED", help="e.g. --seeds 0 1 2")
    p.add_argument("--max-train-samples", type=int, metavar="N", help="train on the first N samples only")
    p.add_argument("--threads-per-worker", type=int, metavar="T", help="CPU threads per worker (0: cores / workers)")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"])
    p.add_argument("--time-budget-s", type=float, metavar="S",
                   help="time to accuracy: training seconds per run (with target_from, the run that sets the target; "
                        "the others get target_budget_factor times more); docs/study.md")
    p.add_argument("--launcher", choices=["auto", "spawn", "torchrun"], default="auto",
                   help="spawn local workers, or run as one rank of a torchrun launch (auto: torchrun if its "
                        "environment is set)")
    p.add_argument("--dry-run", action="store_true", help="list the runs (done / to do) and exit")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--no-report", action="store_true", help="do not write the report at the end")
    p.add_argument("--report-out", metavar="DIR", help="report directory (default: OUT/report)")
    p.add_argument("--price-per-gpu-hour", type=float, default=DEFAULT_PRICE_PER_GPU_HOUR, metavar="USD",
                   help="price of a worker-hour for the price/accuracy plot (default: %(default)s, the seed's K80)")
    p.add_argument("--tensorboard", metavar="DIR",
                   help="also log every epoch of every run to TensorBoard in DIR (pip install 'lowbit[tensorboard]')")
    p.set_defaults(func=_study)

    r = sub.add_parser("report", help="write the HTML report of study results",
                       description="Turn study results (a results directory or its results.jsonl) into an HTML "
                                   "page with PNG plots in the seed's style.")
    r.add_argument("results", metavar="RESULTS", help="results directory or .jsonl file")
    r.add_argument("--out", metavar="DIR", help="report directory (default: report/ beside the results)")
    r.add_argument("--price-per-gpu-hour", type=float, default=DEFAULT_PRICE_PER_GPU_HOUR, metavar="USD",
                   help="price of a worker-hour for the price/accuracy plot (default: %(default)s)")
    r.add_argument("--strict", action="store_true", help=_STRICT_HELP)
    r.set_defaults(func=_report)

    e = sub.add_parser("export", help="export study results as CSV and/or TensorBoard logs",
                       description="Write runs.csv (a row per finished run: configuration and summary) and "
                                   "epochs.csv (a row per epoch) and/or TensorBoard event files (a run per "
                                   "study run, scalars per epoch) from a results directory or results.jsonl.")
    e.add_argument("results", metavar="RESULTS", help="results directory or .jsonl file")
    e.add_argument("--csv", metavar="DIR", help="write runs.csv and epochs.csv into DIR")
    e.add_argument("--tensorboard", metavar="DIR", help="write TensorBoard logs into DIR (tensorboard extra)")
    e.add_argument("--strict", action="store_true", help=_STRICT_HELP)
    e.set_defaults(func=_export)
