"""``lowbit predict``: the speed model from the command line (``lowbit advise``: :mod:`lowbit.lab.cli.advise`).

    lowbit predict --network vgg19 --gpus 64 --gpus-per-node 8 --intra nvlink --inter 100gbit \\
                   --codec qsgd:bits=4 [--algorithm scatter_gather] [--batch 64] [--device-tflops 100]
    lowbit predict --network resnet50 --sweep --out sweep.png     # GPUs 1, 2, 4, ..., 1024 + a plot
    lowbit predict --network alexnet --json                       # machine-readable
    lowbit predict --dettmers                                     # Dettmers' two tables vs the paper
    lowbit predict --calibrate BENCH.json [RESULTS] --save-calibration cal.json
    lowbit predict --validate RESULTS [--calibration cal.json | --bench BENCH.json] [--json]
    lowbit predict --network vgg19 --gpus 2 --calibration cal.json  # measured links and codec costs
    lowbit predict --localsgd 16 --params 136960 --compute-ms 40 --gpus 2 --intra bw=100Mbit/s  # local SGD
    lowbit predict --localsgd-check RESULTS                       # its cross-over vs a localsgd study's
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lowbit.lab.cli.advise import _one_of, add_cluster_arguments, add_codec_rate_arguments, describe_link, speed_setup
from lowbit.lab.cli import crossover as crossover_cli
from lowbit.lab.cli.bench import load_bench
from lowbit.extras import require
from lowbit.lab.perfmodel import advise as advise_mod
from lowbit.lab.perfmodel import dettmers, overhead
from lowbit.lab.perfmodel.calibrate import HUGE_BW, Calibration
from lowbit.lab.perfmodel.fit import calibrate
from lowbit.lab.perfmodel.collectives import modeled_algorithms
from lowbit.lab.perfmodel.links import PRESETS
from lowbit.lab.perfmodel.model import Cluster, Prediction, bits_per_value, codec_fact, predict_network, short_codec
from lowbit.lab.perfmodel.networks import NETWORKS, get_network
from lowbit.lab.perfmodel.validate import TARGET_MEDIAN_ABS_ERROR, RunPrediction, ValidationReport, validate
from lowbit.lab.study.store import load_run_records, resolve_results_path

__all__ = ["register", "run_predict", "format_prediction", "format_sweep", "format_dettmers", "sweep",
           "run_calibrate", "run_validate", "format_validation", "validation_json", "validation_method", "fitted_lines"]


def register(subparsers: Any) -> None:
    """Add ``predict`` to the ``lowbit`` command."""
    p = subparsers.add_parser(
        "predict",
        help="predict step time, samples/s and speedup of low-precision communication",
        description="Alpha-beta speed model of data-parallel training with compressed gradients "
        "(docs/perfmodel.md). Known networks: " + ", ".join(NETWORKS) + ". Link presets: "
        + ", ".join(sorted(PRESETS)) + " (or bw=5GB/s,lat=10us).",
    )
    p.add_argument("--network", help="a known network (" + ", ".join(NETWORKS) + ")")
    g = p.add_argument_group("calibration and validation (docs/perfmodel.md, sections 5 and 8)")
    g.add_argument("--calibrate", nargs="+", metavar="PATH",
                   help="fit links, codec costs and compute from `lowbit bench allreduce --json` files and/or "
                   "study results (a directory holding results.jsonl, or the .jsonl)")
    g.add_argument("--save-calibration", metavar="PATH", help="with --calibrate: write the calibration JSON here")
    g.add_argument("--overhead", metavar="BENCH.json", action="append",
                   help="results of benchmarks/bench_overhead.py: the link bandwidth per GPU below which each "
                   "configuration pays, from its measured overhead (docs/perfmodel.md)")
    g.add_argument("--validate", metavar="RESULTS",
                   help="predicted vs measured step time for every run of these study results")
    g.add_argument("--calibration", metavar="PATH",
                   help="a saved calibration: for --validate, or to predict with measured links/costs")
    g.add_argument("--bench", action="append", metavar="BENCH.json",
                   help="for --validate: links and codec costs from this bench file (repeatable)")
    g.add_argument("--holdout", default="config", choices=("config", "run"),
                   help="for --validate: leave out every seed of the predicted run's configuration (config, "
                   "default) or only the run itself (run)")
    g.add_argument("--transport", default=None, help="with --calibration: which calibrated transport")
    g.add_argument("--strict", action="store_true",
                   help="for --validate: lines of results.jsonl that are not readable rows are an error (default: "
                        "skipped with one warning naming them)")
    add_cluster_arguments(p)
    p.add_argument("--codec", default="qsgd:bits=8,bucket=512",
                   help="codec spec (default qsgd:bits=8,bucket=512)")
    p.add_argument("--bits", type=float, default=None, help="bits per value; overrides what --codec implies")
    p.add_argument("--algorithm", default="auto", type=_one_of(lambda: ("auto",) + modeled_algorithms()),
                   metavar="ALG", help=f"{' | '.join(('auto',) + modeled_algorithms())} (and those of "
                   "$LOWBIT_PLUGINS); auto: as lowbit.all_reduce resolves it on GPUs (allreduce for 16/32-bit floats, "
                   "allgather for 2 GPUs and per-tensor codecs, scatter_gather above)")
    p.add_argument("--batch", type=int, default=64, help="samples per GPU per step (default 64)")
    p.add_argument("--device-tflops", type=float, default=None,
                   help="sustained TFLOP/s of one GPU on this network (default 100, or the calibrated device rate)")
    add_codec_rate_arguments(p)
    p.add_argument("--bucket-mb", type=float, default=25.0,
                   help="gradient bucket size in MiB (default 25; 0 = per layer)")
    p.add_argument("--no-overlap", action="store_true", help="communicate only after the backward pass")
    p.add_argument("--sweep", action="store_true",
                   help="table over GPUs 1, 2, 4, ..., --max-gpus and a PNG plot")
    p.add_argument("--max-gpus", type=int, default=1024, help="largest GPU count of --sweep (default 1024)")
    p.add_argument("--out", default="predict_sweep.png",
                   help="PNG written by --sweep (default predict_sweep.png)")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.add_argument("--dettmers", action="store_true",
                   help="print Dettmers' 4-GPU and 96-GPU tables vs the paper")
    crossover_cli.add_arguments(p)
    p.set_defaults(func=run_predict)


# ------------------------------------------------------------------------------------------ running
def _rate(gbps: float, what: str) -> float | None:
    if gbps < 0 or math.isnan(gbps):
        raise ValueError(f"--{what}-gbps must be >= 0, got {gbps}")
    return None if gbps == 0 else gbps * 1e9


def _predict(args: argparse.Namespace, gpus: int) -> Prediction:
    cluster = Cluster(gpus=gpus, gpus_per_node=args.gpus_per_node, intra=args.intra,
                      inter=args.inter, nics_per_node=args.nics_per_node)
    codec: str | float = args.codec if args.bits is None else args.bits
    return predict_network(
        args.network, cluster, batch_per_gpu=args.batch, device_tflops=args.device_tflops, codec=codec,
        algorithm=args.algorithm, encode_Bps=_rate(args.encode_gbps, "encode"),
        decode_Bps=_rate(args.decode_gbps, "decode"), overlap=not args.no_overlap,
        bucket_bytes=args.bucket_mb * 2**20,
    )


def _validate(args: argparse.Namespace) -> None:
    if not args.network:
        raise ValueError(f"--network is required (known networks: {', '.join(NETWORKS)}) unless --dettmers")
    get_network(args.network)  # unknown network -> ValueError with the list
    if args.gpus < 1:
        raise ValueError(f"--gpus must be a positive integer, got {args.gpus}")
    if args.gpus_per_node < 1:
        raise ValueError(f"--gpus-per-node must be a positive integer, got {args.gpus_per_node}")
    if args.batch < 1:
        raise ValueError(f"--batch must be a positive integer, got {args.batch}")
    if not args.device_tflops > 0:
        raise ValueError(f"--device-tflops must be > 0, got {args.device_tflops}")
    if args.max_gpus < 1:
        raise ValueError(f"--max-gpus must be a positive integer, got {args.max_gpus}")
    if args.bits is None:
        bits_per_value(args.codec)  # unknown codec -> ValueError before any work


def sweep(args: argparse.Namespace) -> list[Prediction]:
    """Predictions at 1, 2, 4, ... up to ``--max-gpus`` GPUs."""
    counts, g = [], 1
    while g <= args.max_gpus:
        counts.append(g)
        g *= 2
    return [_predict(args, k) for k in counts]


def run_calibrate(args: argparse.Namespace) -> int:
    """``--calibrate PATH...``: each path is a bench JSON (an object with meta/rows) or study results."""

    bench, results = [], []
    for path in args.calibrate:
        p = Path(path)
        if not p.exists():
            raise ValueError(f"--calibrate {path!r}: no such file or directory")
        if p.is_dir() or p.suffix == ".jsonl":
            results.append(path)
        else:
            bench.append(path)
    cal = calibrate([load_bench(b) for b in bench],
                    {str(resolve_results_path(r)): load_run_records(r) for r in results})
    if args.save_calibration:
        cal.save(args.save_calibration)
    if args.json:
        print(json.dumps(cal.to_dict(), indent=2, sort_keys=True))
    else:
        print(f"calibration from {len(bench)} bench file(s) and {len(results)} study result set(s):")
        print(format_calibration(cal))
        if args.save_calibration:
            print(f"written to {args.save_calibration}")
    return 0


def format_calibration(cal: Calibration) -> str:
    """The calibration's fitted links, codec costs, compute, factors and overheads, a line each."""
    lines = fitted_lines(cal)
    for k, v in sorted(cal.compute.items()):
        lines.append(f"compute [{k}] {v['step_s'] * 1e3:.3f} ms/step at 1 worker "
                     f"({v['per_sample_s'] * 1e6:.2f} us/sample; {v['runs']} runs)")
    for k, v in sorted(cal.world_factor.items()):
        lines.append(f"compute factor [{k}] x{v['factor']:.2f} over 1 worker ({v['settings']} settings)")
    for k, v in sorted(cal.step_overhead_s.items()):
        lines.append(f"step overhead [{k}] {v['seconds'] * 1e3:+.3f} ms/step (median of measured - modelled "
                     f"step over {v['runs']} runs)")
    return "\n".join(lines) if lines else "(empty calibration)"


def validate_path(results: str, *, calibration_path: str | None = None, bench_paths: list[str] | tuple[str, ...] = (),
                  holdout: str = "config", strict: bool = False) -> ValidationReport:
    """:func:`lowbit.lab.perfmodel.validate.validate` on a results directory / ``.jsonl``, with an optional
    saved calibration and bench files (``strict``: refuse results holding lines that are not readable rows)."""
    runs = load_run_records(results, strict=strict)
    cal = Calibration.load(calibration_path) if calibration_path else None
    bench = calibrate([load_bench(b) for b in bench_paths]) if bench_paths else None
    return validate(runs, calibration=cal, bench=bench, holdout=holdout,
                    results_path=str(resolve_results_path(results)))


def run_validate(args: argparse.Namespace) -> int:

    rep = validate_path(args.validate, calibration_path=args.calibration, bench_paths=args.bench or [],
                        holdout=args.holdout, strict=args.strict)
    print(json.dumps(validation_json(rep), indent=1, default=str) if args.json else format_validation(rep))
    return 0


def validation_json(rep: ValidationReport) -> dict[str, Any]:
    """The validation as ``lowbit predict --validate --json`` prints it."""
    def run(p: RunPrediction) -> dict[str, Any]:
        r = p.run
        return {
            "key": r.key, "network": r.network, "dataset": r.dataset, "batch": r.batch, "world": r.world,
            "backend": r.backend, "device": r.device, "codec": r.codec, "algorithm": r.algorithm, "seed": r.seed,
            "measured_step_s": r.step_s, "predicted_step_s": p.step_s, "rel_error": p.error,
            "measured_samples_per_s": p.measured_samples_per_s, "predicted_samples_per_s": p.samples_per_s,
            "measured": {"compute_s": r.compute_s, "exposed_s": r.exposed_s, "encode_s": r.encode_s,
                         "comm_s": r.comm_s, "decode_s": r.decode_s},
            "predicted": {"compute_s": p.compute_s, "encode_s": p.encode_s, "comm_s": p.comm_s,
                          "decode_s": p.decode_s, "overhead_s": p.overhead_s},
            "compute_source": p.compute_source, "comm_source": p.comm_source, "holdout": p.holdout,
        }
    return {"results": rep.results_path, "method": validation_method(rep),
            "calibration": "\n".join(_parameter_lines(rep)), "machine": _machine(rep), "summary": rep.summary(),
            "runs": [run(p) for p in rep.predictions],
            "skipped": [{"key": r.key, "network": r.network, "codec": r.codec, "world": r.world, "reason": why}
                        for r, why in rep.skipped]}


def validation_method(rep: ValidationReport) -> str:
    """How the validation kept every prediction off the run it predicts, in words."""
    method = ("every run is predicted from parameters fitted WITHOUT it: study-derived parameters (compute, "
              "compute at K workers, hook overhead" + (", and the in-situ links and codec costs" if rep.in_situ else "")
              + ") are refitted for each prediction "
              + ("leaving out every run of the predicted run's configuration (all seeds: leave-one-config-out); "
                 "1-worker runs leave out only themselves (leave-one-run-out: their compute comes from the other "
                 "seeds)" if rep.holdout == "config" else "leaving out the predicted run (leave-one-run-out)"))
    if rep.served is not None:
        method += (f"; the saved calibration's study-derived parts served {rep.served[0]} runs they were not "
                   f"fitted on, and were replaced by held-out refits for {rep.served[1]} runs they were fitted on")
    return method


def _machine(rep: ValidationReport) -> str:
    runs = [p.run for p in rep.predictions] + [r for r, _ in rep.skipped]
    return "; ".join(f"{d} ({b})" for d, b in sorted({(r.device_name or r.device, r.backend) for r in runs}))


def _parameter_lines(rep: ValidationReport) -> list[str]:
    lines = fitted_lines(rep.parameters, short_codec)
    if rep.in_situ:
        lines.append(f"links and codec costs for {', '.join(rep.in_situ)}: in situ from the held-out "
                     "study runs' communicate/encode/decode times (no bench file for this backend)")
    return lines


def fitted_lines(cal: Calibration, codec_name: Callable[[str], str] = lambda c: c) -> list[str]:
    """One line per fitted link and per fitted codec cost (``codec_name`` shortens the specs)."""
    def rate(spb: float) -> str:
        return f"{1e-9 / spb:.3g} GB/s" if spb > 0 else "free per byte"
    lines = []
    for t, by in sorted(cal.links.items()):
        for a, f in sorted(by.items()):
            bw = "no per-byte cost" if f.bandwidth_Bps >= HUGE_BW else f"{f.bandwidth_Bps / 1e9:.3g} GB/s"
            lines.append(f"link [{t}] {f.algorithm}: latency {f.latency_s * 1e6:.1f} us/step, {bw} "
                         f"({f.points} points, rms rel. error {100 * f.rms_rel_error:.0f}%; {f.source})")
    for t, by in sorted(cal.codecs.items()):
        for a, by_c in sorted(by.items()):
            for c, f in sorted(by_c.items()):
                lines.append(f"codec [{t}] {codec_name(c)} @ {a}: encode {f.encode_call_s * 1e3:.3f} ms/call + "
                             f"{rate(f.encode_s_per_byte)}, decode {f.decode_call_s * 1e3:.3f} ms/call + "
                             f"{rate(f.decode_s_per_byte)} ({f.points} points; {f.source})")
    return lines


def format_validation(rep: ValidationReport) -> str:
    s = rep.summary()
    lines = [
        f"Speed-model validation on {len(rep.predictions)} measured runs of {rep.results_path}",
        f"machine: {_machine(rep)}",
        "method: " + validation_method(rep) + ".",
    ]
    if _parameter_lines(rep):
        lines += ["parameters:"] + ["  " + ln for ln in _parameter_lines(rep)]
    lines.append("model: step = compute + encode + exposed communication + decode on the overlap timeline of "
                 "lowbit.lab.perfmodel.model (DDP buckets: 1 MiB first, then 25 MiB) + per-step overhead; "
                 "samples/s = workers x batch / step")
    head = (f"{'network/data':<18} {'bs':>3} {'backend':<7} {'K':>2} {'codec':<13} {'seed':>4} "
            f"{'meas ms':>8} {'pred ms':>8} {'err %':>7} {'meas s/s':>9} {'pred s/s':>9}  "
            f"{'pred comp/enc/exp.comm/dec/ovh ms':<34} compute from")
    lines += ["", head, "-" * len(head)]
    for p in rep.predictions:
        r = p.run
        parts = "/".join(f"{v * 1e3:.2f}" for v in (p.compute_s, p.encode_s, p.comm_s, p.decode_s, p.overhead_s))
        lines.append(
            f"{r.label[:18]:<18} {r.batch:>3} {r.backend:<7} {r.world:>2} {short_codec(r.codec):<13} {r.seed:>4} "
            f"{r.step_s * 1e3:>8.3f} {p.step_s * 1e3:>8.3f} {100 * p.error:>+7.1f} "
            f"{p.measured_samples_per_s:>9,.0f} {p.samples_per_s:>9,.0f}  {parts:<34} {p.compute_source}"
        )
    comm_sources = sorted({p.comm_source for p in rep.predictions if p.run.world > 1})
    if comm_sources:
        lines += ["", "communication parameters from: " + " | ".join(comm_sources)]
    if rep.skipped:
        lines += ["", f"not predicted ({len(rep.skipped)} runs):"]
        for r, why in rep.skipped[:20]:
            lines.append(f"  {r.label} K={r.world} {short_codec(r.codec)} seed {r.seed}: {why}")

    def line(name: str, st: dict[str, Any], unit: str = "runs") -> str:
        if not st.get("runs"):
            return f"  {name}: no {unit}"
        return (f"  {name}: {st['runs']} {unit}, median |error| {100 * st['median_abs_error']:.1f}%, "
                f"mean {100 * st['mean_abs_error']:.1f}%, max {100 * st['max_abs_error']:.0f}%, "
                f"{100 * st['within_15pct']:.0f}% within 15%")

    lines += ["", "summary (relative error of the step time = of samples/s^-1):",
              line("all runs", s["all"]), line("multi-worker runs", s["multi_worker"]),
              line("1-worker runs", s["single_worker"]),
              (f"  median signed error {100 * s['median_signed_error']:+.1f}% (positive = model too slow)"
               if s["all"].get("runs") else "  median signed error: no runs")]
    if s["median_abs_error_by_codec_multi_worker"]:
        lines.append("  median |error| by codec (multi-worker): " + ", ".join(
            f"{k} {100 * v:.0f}%" for k, v in s["median_abs_error_by_codec_multi_worker"].items()))
    lines += ["per configuration (prediction vs the mean over its seeds):",
              line("all configurations", s["config_mean"], "configurations"),
              line("multi-worker configurations", s["config_mean_multi_worker"], "configurations"),
              "noise floor (each run predicted by the mean of the OTHER seeds of its own configuration, "
              "i.e. knowing that configuration's timing):",
              line("all runs", s["seed_scatter"]), line("multi-worker runs", s["seed_scatter_multi_worker"])]
    med = s["multi_worker"].get("median_abs_error", s["all"].get("median_abs_error", math.nan))
    verdict = "met" if med <= TARGET_MEDIAN_ABS_ERROR else "NOT met"
    lines.append(f"  target median |error| <= {100 * TARGET_MEDIAN_ABS_ERROR:.0f}% (multi-worker runs): "
                 + (f"{100 * med:.2f}%, {verdict}" if s["all"].get("runs") else "no runs predicted"))
    return "\n".join(lines)


def _predict_calibrated(args: argparse.Namespace) -> Prediction:
    """One prediction with the calibration's links, codec costs, device rate and overheads."""

    bits_per_value(args.codec)
    setup = speed_setup(argparse.Namespace(
        gpus=args.gpus, gpus_per_node=args.gpus_per_node, batch=args.batch, encode_gbps=args.encode_gbps,
        decode_gbps=args.decode_gbps, calibration=args.calibration, transport=args.transport, intra=args.intra,
        inter=args.inter, nics_per_node=args.nics_per_node, device_tflops=args.device_tflops,
        algorithm="scatter_gather" if args.algorithm in ("auto", "allreduce", "hierarchical") else args.algorithm))
    net = get_network(args.network)
    codec = codec_fact(args.codec, "spec", args.codec)
    assignment = {g: codec for g in advise_mod.network_groups(net)}
    args.intra = setup.cluster.intra
    args.device_tflops = setup.device_tflops
    return advise_mod.predict_assignment(net, assignment, setup)


def run_overhead(args: argparse.Namespace) -> int:
    """``--overhead FILE...``: :func:`lowbit.lab.perfmodel.overhead.breakeven` of each file."""
    docs = []
    for path in args.overhead:
        try:
            docs.append(json.loads(Path(path).read_text()))
        except (OSError, ValueError) as e:
            raise ValueError(f"--overhead {path}: not a bench_overhead.py result ({e})") from e
        if not isinstance(docs[-1], dict) or "rows" not in docs[-1]:
            raise ValueError(f"--overhead {path}: not a bench_overhead.py result (no 'rows')")
    if args.json:
        print(json.dumps([{"file": p, "rows": [dataclasses.asdict(b) for b in overhead.breakeven(d)]}
                          for p, d in zip(args.overhead, docs)], indent=2))
    else:
        print("\n\n".join(overhead.format_breakeven(d) for d in docs))
    return 0


def run_predict(args: argparse.Namespace) -> int:
    if args.dettmers:
        print(json.dumps(_dettmers_json(), indent=2) if args.json else format_dettmers())
        return 0
    if args.save_calibration and not args.calibrate:
        raise ValueError("--save-calibration needs --calibrate BENCH.json [RESULTS]")
    if args.overhead:
        return run_overhead(args)
    if args.localsgd_check:
        return crossover_cli.run_check(args)
    if args.localsgd is not None:
        return crossover_cli.run_localsgd(args)
    if args.calibrate:
        return run_calibrate(args)
    if args.validate:
        return run_validate(args)
    if args.bench:
        raise ValueError("--bench is for --validate (to calibrate, use --calibrate BENCH.json)")
    if args.calibration:
        _validate(argparse.Namespace(**{**vars(args), "device_tflops": args.device_tflops or 1.0}))
        if args.sweep:
            raise ValueError("--sweep with --calibration is not supported; give explicit links instead")
        pred = _predict_calibrated(args)
        print(json.dumps(dataclasses.asdict(pred), indent=2) if args.json else
              format_prediction(pred, args) + f"\n  (calibration {args.calibration}: links, codec costs"
              f"{', device rate' if args.device_tflops else ''} and per-step overheads measured)")
        return 0
    if args.intra is None:
        args.intra = "nvlink"
    if args.device_tflops is None:
        args.device_tflops = 100.0
    _validate(args)
    if args.sweep:
        rows = sweep(args)
        path = plot_sweep(rows, args.out)
        if args.json:
            print(json.dumps({"sweep": [dataclasses.asdict(r) for r in rows], "plot": path}, indent=2))
        else:
            print(format_sweep(rows, args))
            print(f"plot written to {path}")
        return 0
    pred = _predict(args, args.gpus)
    print(json.dumps(dataclasses.asdict(pred), indent=2) if args.json else format_prediction(pred, args))
    return 0


# ------------------------------------------------------------------------------------------ output
def _ms(s: float) -> str:
    return f"{s * 1e3:.2f} ms"


def _mb(b: float) -> str:
    return f"{b / 1e6:.1f} MB"


def _header(args: argparse.Namespace, bits: float) -> str:
    cluster = Cluster(gpus=max(args.gpus, 1), gpus_per_node=args.gpus_per_node, intra=args.intra,
                      inter=args.inter)
    net = get_network(args.network)
    return (
        f"network {net.name}: {net.params / 1e6:.1f}M params, {net.fwd_bwd_gflops:.3g} GFLOP/sample fwd+bwd; "
        f"batch {args.batch}/GPU at {args.device_tflops:g} TFLOP/s\n"
        f"links: intra {describe_link(cluster.intra)}, inter {describe_link(cluster.inter) if cluster.inter else '-'}, "
        f"{args.gpus_per_node} GPUs/node\n"
        f"codec {args.codec if args.bits is None else f'{args.bits:g} bits'} ({bits:.4g} bits/value)"
    )


def format_prediction(pred: Prediction, args: argparse.Namespace) -> str:
    b = pred.breakdown
    nodes = math.ceil(pred.gpus / pred.gpus_per_node)
    lines = [
        _header(args, pred.bits_per_value),
        f"{pred.gpus} GPUs on {nodes} node(s), algorithm {pred.algorithm}, {pred.buckets} buckets",
        f"  step time            {_ms(pred.step_s)}",
        f"  samples/s            {pred.samples_per_s:,.1f}   (1 GPU: {pred.single_gpu_samples_per_s:,.1f})",
        f"  scaling efficiency   {100 * pred.scaling_efficiency:.1f}%",
        f"  speedup over 32-bit  {pred.speedup_vs_fp32:.2f}x   (32-bit step {_ms(pred.fp32_step_s)})",
        f"  breakdown: compute {_ms(b.compute_s)} | exposed comm {_ms(b.exposed_comm_s)} | "
        f"encode {_ms(b.encode_s)} | decode {_ms(b.decode_s)}",
        f"  comm stream busy {_ms(b.comm_s)}; {_mb(pred.bytes_per_rank)} sent per rank per step",
    ]
    return "\n".join(lines)


def format_sweep(rows: list[Prediction], args: argparse.Namespace) -> str:
    head = f"{'GPUs':>5} {'nodes':>5} {'step ms':>9} {'samples/s':>12} {'eff %':>6} " \
           f"{'32-bit s/s':>12} {'speedup':>8} {'exposed ms':>10} {'enc+dec ms':>10}"
    out = [_header(args, rows[0].bits_per_value if rows else 32.0), head, "-" * len(head)]
    for r in rows:
        fp32_sps = r.gpus * r.batch_per_gpu / r.fp32_step_s
        b = r.breakdown
        out.append(
            f"{r.gpus:>5} {math.ceil(r.gpus / r.gpus_per_node):>5} {r.step_s * 1e3:>9.2f} "
            f"{r.samples_per_s:>12,.0f} {100 * r.scaling_efficiency:>6.1f} {fp32_sps:>12,.0f} "
            f"{r.speedup_vs_fp32:>7.2f}x {b.exposed_comm_s * 1e3:>10.2f} "
            f"{(b.encode_s + b.decode_s) * 1e3:>10.2f}"
        )
    return "\n".join(out)


def plot_sweep(rows: list[Prediction], path: str) -> str:
    """Samples/s (model, 32-bit, ideal) and speedup over 32-bit against GPUs; PNG at ``path``."""

    matplotlib = require("matplotlib", "study", "the --plot figure")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    gpus = [r.gpus for r in rows]
    sps = [r.samples_per_s for r in rows]
    fp32 = [r.gpus * r.batch_per_gpu / r.fp32_step_s for r in rows]
    ideal = [r.gpus * r.single_gpu_samples_per_s for r in rows]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    label = f"{rows[0].codec} ({rows[0].bits_per_value:.3g} bits, {rows[0].algorithm})" if rows else ""
    ax1.plot(gpus, ideal, "k:", label="linear scaling")
    ax1.plot(gpus, fp32, "o-", color="tab:cyan", label="32-bit allreduce")
    ax1.plot(gpus, sps, "s-", color="tab:red", label=label)
    ax1.set_xscale("log", base=2)
    ax1.set_yscale("log")
    ax1.set_xlabel("GPUs")
    ax1.set_ylabel("samples/s")
    ax1.set_title(f"{rows[0].network if rows else ''}: predicted throughput")
    ax1.legend(fontsize=8)
    ax1.grid(True, which="both", alpha=0.3)
    ax2.plot(gpus, [r.speedup_vs_fp32 for r in rows], "s-", color="tab:red")
    ax2.axhline(1.0, color="k", lw=0.8)
    if rows:
        ax2.axhline(32.0 / rows[0].bits_per_value, color="gray", ls="--", lw=0.8, label="32/b bound")
        ax2.legend(fontsize=8)
    ax2.set_xscale("log", base=2)
    ax2.set_xlabel("GPUs")
    ax2.set_ylabel("speedup over 32-bit")
    ax2.set_title("speedup of low-precision communication")
    ax2.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)


def format_dettmers() -> str:
    out = ["Dettmers (ICLR 2016), Appendix 5.1: AlexNet, 1 node x 4 GPUs (model vs paper)",
           f"{'baseline':<11} {'bits':>4} {'model':>8} {'paper':>6}  detail"]
    for r in dettmers.single_node_table():
        out.append(f"{r.baseline:<11} {r.bits:>4} {r.speedup:>7.3f}x {r.paper:>5.2f}x  {r.detail}")
    out += ["", "Dettmers (ICLR 2016), Appendix 5.2: AlexNet, 32 nodes x 3 GPUs = 96 GPUs, speedup over 1 GPU",
            "NervanaGPU baseline (96 x 104.1 ms); convnet2 baseline (96 x 177 ms) in parentheses",
            f"{'sub-batch':>9} {'bits':>4}  {'Table 6 chain':>18}  {'exact formula':>18}  {'paper':>16}"]
    chain = {(r.sub_batch, r.bits, r.baseline): r for r in dettmers.cluster_table(source="table6")}
    exact = {(r.sub_batch, r.bits, r.baseline): r for r in dettmers.cluster_table(source="formula")}
    for b in sorted({k[0] for k in chain}):
        for bits in (32, 8):
            def cell(rows: dict, b: int = b, bits: int = bits) -> str:
                n, c = rows[(b, bits, "nervanagpu")].speedup, rows[(b, bits, "convnet2")].speedup
                return f"{n:6.2f}x ({c:6.2f}x)"
            p = dettmers.PAPER_CLUSTER[(b, bits)]
            out.append(f"{b:>9} {bits:>4}  {cell(chain):>18}  {cell(exact):>18}  {p[0]:>5}x ({p[1]:>5}x)")
    out.append("Table 6 chain: Dettmers' printed fc-stage totals; "
               "exact formula: forward + 31*max(0, t_sync - 1.3 ms).")
    return "\n".join(out)


def _dettmers_json() -> dict[str, Any]:
    return {
        "single_node": [dataclasses.asdict(r) for r in dettmers.single_node_table()],
        "cluster_table6": [dataclasses.asdict(r) for r in dettmers.cluster_table(source="table6")],
        "cluster_formula": [dataclasses.asdict(r) for r in dettmers.cluster_table(source="formula")],
    }
