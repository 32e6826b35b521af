"""``lowbit predict`` and ``lowbit advise``: the speed model from the command line.

    lowbit predict --network vgg19 --gpus 64 --gpus-per-node 8 --intra nvlink --inter 100gbit \\
                   --codec qsgd:bits=4 [--algorithm scatter_gather] [--batch 64] [--device-tflops 100]
    lowbit predict --network resnet50 --sweep --out sweep.png     # GPUs 1, 2, 4, ..., 1024 + a plot
    lowbit predict --network alexnet --json                       # machine-readable
    lowbit predict --dettmers                                     # Dettmers' two tables vs the paper
    lowbit predict --calibrate BENCH.json [RESULTS] --save-calibration cal.json
    lowbit predict --validate RESULTS [--calibration cal.json | --bench BENCH.json] [--json]
    lowbit predict --network vgg19 --gpus 2 --calibration cal.json  # measured links and codec costs
    lowbit advise --network vgg19 --gpus 64 --gpus-per-node 8 --intra nvlink --inter 100gbit
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
from pathlib import Path
from typing import Any

from lowbit.extras import require
from lowbit.perfmodel import advise as advise_mod
from lowbit.perfmodel import dettmers
from lowbit.perfmodel.advise import SpeedSetup, advise, default_evidence_path, format_advice
from lowbit.perfmodel.calibrate import Calibration, OverheadKey, RunRecord, ScaleKey, canonical_spec
from lowbit.perfmodel.fit import calibrate
from lowbit.perfmodel.collectives import modeled_algorithms
from lowbit.perfmodel.links import PRESETS
from lowbit.perfmodel.model import Cluster, Prediction, bits_per_value, predict_network
from lowbit.perfmodel.networks import NETWORKS, get_network
from lowbit.perfmodel.validate import ValidationReport, format_validation, validate
from lowbit.study.store import load_run_records, resolve_results_path

__all__ = ["register", "run_predict", "format_prediction", "format_sweep", "format_dettmers", "sweep",
           "run_calibrate", "run_validate"]


def _one_of(known: Any) -> Any:
    """An argparse type checking a name against ``known()`` when the command line is parsed, not when
    the parser is built: ``$LOWBIT_PLUGINS`` (which can add algorithms) is imported then, not for --help."""
    def check(value: str) -> str:
        try:
            names = known()
        except ValueError as exc:  # a $LOWBIT_PLUGINS module that does not import
            raise argparse.ArgumentTypeError(str(exc)) from None
        if value not in names:
            raise argparse.ArgumentTypeError(f"invalid choice: {value!r} (choose from {', '.join(names)})")
        return value
    check.__name__ = "algorithm"
    return check


def add_cluster_arguments(p: argparse.ArgumentParser) -> None:
    """The cluster options shared by ``lowbit predict`` and ``lowbit advise``."""
    p.add_argument("--gpus", type=int, default=8, help="number of GPUs / workers (default 8)")
    p.add_argument("--gpus-per-node", type=int, default=8, help="GPUs per node (default 8)")
    p.add_argument("--intra", default=None, help="intra-node link (default nvlink, or the calibrated link)")
    p.add_argument("--inter", default="100gbit", help="inter-node link (default 100gbit)")
    p.add_argument("--nics-per-node", type=int, default=1, help="inter-node links per node (default 1)")


def add_codec_rate_arguments(p: argparse.ArgumentParser) -> None:
    """The codec throughput options shared by ``lowbit predict`` and ``lowbit advise``."""
    p.add_argument("--encode-gbps", type=float, default=200.0,
                   help="encode throughput, GB/s of float32 input (default 200; 0 = free)")
    p.add_argument("--decode-gbps", type=float, default=200.0,
                   help="decode throughput, GB/s of float32 output (default 200; 0 = free)")


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
    p.set_defaults(func=run_predict)

    a = subparsers.add_parser(
        "advise",
        help="recommend a codec per layer type (a lowbit.Policy) for a network and cluster",
        description="Recommends a lowbit.Policy (codec per layer type) from the speed model's predicted speedup "
        "over fp32 on the given cluster and the accuracy evidence of study results or, without it, the seeds' "
        "published findings (docs/perfmodel.md, section 9). Known networks: " + ", ".join(NETWORKS) + ".",
    )
    add_advise_arguments(a)
    a.set_defaults(func=run_advise)


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
    cal = calibrate(bench, {str(resolve_results_path(r)): load_run_records(r) for r in results})
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
    lines = cal.link_codec_lines()
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
    """:func:`lowbit.perfmodel.validate.validate` on a results directory / ``.jsonl``, with an optional
    saved calibration and bench files (``strict``: refuse results holding lines that are not readable rows)."""
    runs = load_run_records(results, strict=strict)
    cal = Calibration.load(calibration_path) if calibration_path else None
    bench = calibrate(list(bench_paths)) if bench_paths else None
    return validate(runs, calibration=cal, bench=bench, holdout=holdout,
                    results_path=str(resolve_results_path(results)))


def run_validate(args: argparse.Namespace) -> int:

    rep = validate_path(args.validate, calibration_path=args.calibration, bench_paths=args.bench or [],
                        holdout=args.holdout, strict=args.strict)
    print(json.dumps(rep.to_dict(), indent=1, default=str) if args.json else format_validation(rep))
    return 0


def _predict_calibrated(args: argparse.Namespace) -> Prediction:
    """One prediction with the calibration's links, codec costs, device rate and overheads."""

    bits_per_value(args.codec)
    setup = _setup(argparse.Namespace(
        gpus=args.gpus, gpus_per_node=args.gpus_per_node, batch=args.batch, encode_gbps=args.encode_gbps,
        decode_gbps=args.decode_gbps, calibration=args.calibration, transport=args.transport, intra=args.intra,
        inter=args.inter, nics_per_node=args.nics_per_node, device_tflops=args.device_tflops,
        algorithm="scatter_gather" if args.algorithm in ("auto", "allreduce", "hierarchical") else args.algorithm))
    net = get_network(args.network)
    codec = canonical_spec(args.codec)
    assignment = {g: codec for g in advise_mod.network_groups(net)}
    args.intra = setup.cluster.intra
    args.device_tflops = setup.device_tflops
    return advise_mod.predict_assignment(net, assignment, setup)


def run_predict(args: argparse.Namespace) -> int:
    if args.dettmers:
        print(json.dumps(_dettmers_json(), indent=2) if args.json else format_dettmers())
        return 0
    if args.save_calibration and not args.calibrate:
        raise ValueError("--save-calibration needs --calibrate BENCH.json [RESULTS]")
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
        print(json.dumps(pred.to_dict(), indent=2) if args.json else
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
            print(json.dumps({"sweep": [r.to_dict() for r in rows], "plot": path}, indent=2))
        else:
            print(format_sweep(rows, args))
            print(f"plot written to {path}")
        return 0
    pred = _predict(args, args.gpus)
    print(json.dumps(pred.to_dict(), indent=2) if args.json else format_prediction(pred, args))
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
        f"links: intra {cluster.intra.describe()}, inter {cluster.inter.describe() if cluster.inter else '-'}, "
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


# ------------------------------------------------------------------------------------------ advise
def add_advise_arguments(p: argparse.ArgumentParser) -> None:

    p.add_argument("--network", required=True, help="a known network (lowbit predict --help lists them)")
    add_cluster_arguments(p)
    p.add_argument("--tolerance", type=float, default=0.5,
                   help="final test accuracy loss allowed, in percentage points (default 0.5)")
    p.add_argument("--evidence", default=None,
                   help="study results (directory or results.jsonl) for the accuracy side; default: the "
                   "3-seed CPU study shipped with lowbit (perfmodel/data/evidence_cpu_default.jsonl); 'none' for none")
    p.add_argument("--calibration", default=None,
                   help="calibration JSON (lowbit predict --calibrate ... --save-calibration): measured links, "
                   "codec costs, device rate and overheads")
    p.add_argument("--transport", default=None, help="which calibrated transport (default: the only/first one)")
    known = lambda: ("auto",) + modeled_algorithms(quantised=True)  # noqa: E731
    p.add_argument("--algorithm", default="auto", type=_one_of(known), metavar="ALG",
                   help=f"{' | '.join(known())} (and those of $LOWBIT_PLUGINS): collective for the quantised "
                   "codecs; auto (default) takes the fastest of scatter_gather, allgather and (on several nodes) "
                   "hierarchical for each assignment")
    p.add_argument("--batch", type=int, default=64, help="samples per GPU per step (default 64)")
    p.add_argument("--device-tflops", type=float, default=None,
                   help="sustained TFLOP/s of one GPU (default 100, or the calibrated device rate)")
    add_codec_rate_arguments(p)
    p.add_argument("--json", action="store_true", help="print JSON")


def _setup(args: argparse.Namespace) -> SpeedSetup:
    if args.gpus < 1:
        raise ValueError(f"--gpus must be a positive integer, got {args.gpus}")
    if args.gpus_per_node < 1:
        raise ValueError(f"--gpus-per-node must be a positive integer, got {args.gpus_per_node}")
    if args.batch < 1:
        raise ValueError(f"--batch must be a positive integer, got {args.batch}")
    for what in ("encode", "decode"):
        v = getattr(args, f"{what}_gbps")
        if not (v >= 0 and math.isfinite(v)):
            raise ValueError(f"--{what}-gbps must be >= 0, got {v}")
    cal = Calibration.load(args.calibration) if args.calibration else None
    transport, tflops, factor, o_nat, o_comp = "", args.device_tflops, 1.0, 0.0, 0.0
    intra: Any = args.intra or "nvlink"
    if cal is not None:
        transports = sorted(cal.links) or sorted(cal.codecs)
        if not transports:
            raise ValueError(f"calibration {args.calibration!r} holds no links or codec costs")
        transport = args.transport or transports[0]
        if transport not in transports:
            raise ValueError(f"--transport {transport!r} not in the calibration (it has {', '.join(transports)})")
        fit, _ = cal.link_for(transport, "allreduce")
        if args.intra is None and fit is not None:
            intra = fit.link(f"calibrated {transport}")
        rates = [v["flops_per_s"] for v in cal.compute.values() if v.get("flops_per_s")]
        if tflops is None and rates:
            tflops = statistics.median(rates) / 1e12
        backend = transport.split("/")[0]
        for key, v in cal.world_factor.items():
            sk = ScaleKey.parse(key)
            if sk.backend == backend and sk.world == args.gpus and sk.nodes == 1:
                factor = float(v["factor"])
        for key, v in cal.step_overhead_s.items():
            ok = OverheadKey.parse(key)
            if isinstance(ok, OverheadKey) and ok.scale.backend == backend and ok.scale.world == args.gpus \
                    and ok.scale.nodes == 1:
                if ok.native:
                    o_nat = float(v["seconds"])
                else:
                    o_comp = float(v["seconds"])
    if tflops is None:
        tflops = 100.0
    if not (tflops > 0 and math.isfinite(tflops)):
        raise ValueError(f"--device-tflops must be > 0, got {tflops}")
    cluster = Cluster(gpus=args.gpus, gpus_per_node=args.gpus_per_node, intra=intra, inter=args.inter,
                      nics_per_node=args.nics_per_node)
    return SpeedSetup(cluster, args.batch, tflops, args.algorithm,
                      None if args.encode_gbps == 0 else args.encode_gbps * 1e9,
                      None if args.decode_gbps == 0 else args.decode_gbps * 1e9,
                      cal, transport, factor, o_nat, o_comp)


def run_advise(args: argparse.Namespace) -> int:
    get_network(args.network)  # unknown network -> ValueError with the list, before any work
    setup = _setup(args)
    runs: list[RunRecord] = []
    source = ""
    if args.evidence is None:
        path = default_evidence_path()
        if path is not None:
            runs, source = load_run_records(path), f"{path} (default)"
    elif args.evidence.lower() != "none":
        runs, source = load_run_records(args.evidence), args.evidence
    advice = advise(args.network, setup, tolerance=args.tolerance, evidence=runs, evidence_source=source)
    print(json.dumps(advice.to_dict(), indent=2, default=str) if args.json else format_advice(advice))
    return 0
