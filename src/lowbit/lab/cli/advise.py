"""``lowbit advise``: a codec per layer type (a :class:`lowbit.Policy`) from the speed model and the
accuracy evidence (:mod:`lowbit.lab.perfmodel.advise` decides; this module reads the arguments and prints).

    lowbit advise --network vgg19 --gpus 64 --gpus-per-node 8 --intra nvlink --inter 100gbit
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
from typing import Any

from lowbit.lab.perfmodel.advise import (CANDIDATES, CONV_FINDING, SEED_FINDINGS, Advice, Cell, SpeedSetup,
                                     advise, auto_algorithms, default_evidence_path)
from lowbit.lab.perfmodel.calibrate import Calibration
from lowbit.lab.perfmodel.collectives import modeled_algorithms
from lowbit.lab.perfmodel.links import Link
from lowbit.lab.perfmodel.model import Cluster, short_codec
from lowbit.lab.perfmodel.networks import NETWORKS, get_network
from lowbit.lab.study.records import OverheadKey, RunRecord, ScaleKey
from lowbit.lab.study.store import load_run_records

__all__ = ["register", "run_advise", "format_advice", "advice_json", "policy_code", "speed_setup", "describe_link",
           "add_cluster_arguments", "add_codec_rate_arguments"]


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
    """Add ``advise`` to the ``lowbit`` command."""
    a = subparsers.add_parser(
        "advise",
        help="recommend a codec per layer type (a lowbit.Policy) for a network and cluster",
        description="Recommends a lowbit.Policy (codec per layer type) from the speed model's predicted speedup "
        "over fp32 on the given cluster and the accuracy evidence of study results or, without it, the seeds' "
        "published findings (docs/perfmodel.md, section 9). Known networks: " + ", ".join(NETWORKS) + ".",
    )
    add_advise_arguments(a)
    a.set_defaults(func=run_advise)


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


def speed_setup(args: argparse.Namespace) -> SpeedSetup:
    """The cluster, batch, device rate, codec rates and calibration the arguments give."""
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
    setup = speed_setup(args)
    runs: list[RunRecord] = []
    source = ""
    if args.evidence is None:
        path = default_evidence_path()
        if path is not None:
            runs, source = load_run_records(path), f"{path} (default)"
    elif args.evidence.lower() != "none":
        runs, source = load_run_records(args.evidence), args.evidence
    advice = advise(args.network, setup, tolerance=args.tolerance, evidence=runs, evidence_source=source)
    print(json.dumps(advice_json(advice), indent=2, default=str) if args.json else format_advice(advice))
    return 0


def advice_json(a: Advice) -> dict[str, Any]:
    """The advice as ``lowbit advise --json`` prints it (``lowbit.Policy(**d["policy"])`` accepts its policy)."""
    p = a.prediction
    return {
        "network": a.network,
        "cluster": {"gpus": a.setup.cluster.gpus, "gpus_per_node": a.setup.cluster.gpus_per_node,
                    "intra": _link_txt(a.setup.cluster.intra), "inter": _link_txt(a.setup.cluster.inter),
                    "batch_per_gpu": a.setup.batch, "device_tflops": a.setup.device_tflops,
                    "algorithm": a.setup.algorithm, "calibrated_transport": a.setup.transport or None},
        "tolerance_points": a.tolerance,
        "fp32_is_best": a.fp32_is_best,
        "groups": {g: {"codec": a.assignment[g], "param_share": v["params"], "flop_share": v["flops"]}
                   for g, v in a.groups.items()},
        "policy": a.policy_dict(),
        "algorithm": a.prediction.algorithm,
        "python": policy_code(a.policy_dict(), a.fp32_is_best, a.prediction.algorithm),
        "predicted": {"speedup_vs_fp32": p.speedup_vs_fp32, "step_s": p.step_s, "fp32_step_s": p.fp32_step_s,
                      "samples_per_s": p.samples_per_s, "bytes_per_rank": p.bytes_per_rank},
        "options": a.options,
        "accuracy": {
            "evidence": a.evidence_source,
            "evidence_on_this_network": a.direct_evidence,
            "verdicts": {c: {g: dataclasses.asdict(v) for g, v in by.items()} for c, by in a.verdicts.items()},
            "cells": {c: [dict(dataclasses.asdict(x), mean=x.mean, std=x.std, matches=x.matches(a.tolerance),
                               noisy=x.noisy(a.tolerance)) for x in cs] for c, cs in a.cells.items()},
            "seed_findings": {k: v[1] for k, v in SEED_FINDINGS.items()},
            "conv_finding": CONV_FINDING,
        },
        "notes": a.notes,
    }


def _describe(cell: Cell, tol: float) -> str:
    mark = "OK " if cell.matches(tol) else "NO "
    noisy = " (noisy)" if cell.noisy(tol) else ""
    return (f"{mark}{cell.network}/{cell.dataset} K={cell.world}: {cell.mean:+.2f} +- {cell.std:.2f} points "
            f"vs fp32 {cell.fp32_acc:.2f}% ({len(cell.diffs)} seed{'s' if len(cell.diffs) != 1 else ''})"
            f"{noisy}")


def describe_link(link: Link) -> str:
    """``name (12 GB/s, 5 us)``."""
    bw = link.bandwidth_Bps
    return (f"{link.name or 'custom'} ({f'{bw / 1e9:.3g} GB/s' if bw >= 1e8 else f'{bw / 1e6:.3g} MB/s'}, "
            f"{link.latency_s * 1e6:.3g} us)")


def _link_txt(link: Any) -> str | None:
    return describe_link(link) if isinstance(link, Link) else None


def policy_code(policy: dict[str, Any], fp32: bool = False, algorithm: str = "scatter_gather") -> str:
    """Python to paste: ``policy = lowbit.Policy(...)`` and the register call."""
    lines = ["import lowbit", "", "policy = lowbit.Policy(", f"    default={policy['default']!r},"]
    if policy["by_type"]:
        lines += ["    by_type={", *(f"        {t!r}: {spec!r}," for t, spec in policy["by_type"].items()), "    },"]
    lines.append(")")
    if fp32:
        lines.append("# fp32 everywhere: plain DDP is the same thing; registering lowbit changes nothing but adds "
                     "a hook")
    algo = "" if algorithm in ("scatter_gather", "allreduce") else f", algorithm={algorithm!r}"
    with_ef = " and ".join(c.name for c in sorted(CANDIDATES, key=lambda c: c.rung) if c.error_feedback)
    lines.append(f"state = lowbit.ddp.register(ddp_model, policy=policy{algo})  # error_feedback='auto': on for "
                 f"{with_ef}")
    return "\n".join(lines)


def format_advice(a: Advice) -> str:
    s, p = a.setup, a.prediction
    c = s.cluster
    inter = f", inter {describe_link(c.inter)}" if isinstance(c.inter, Link) and c.gpus > c.gpus_per_node else ""
    lines = [
        f"lowbit advise: {a.network} on {c.gpus} GPU(s), {c.gpus_per_node} per node; intra "
        f"{describe_link(c.intra) if isinstance(c.intra, Link) else c.intra}{inter}",
        f"  batch {s.batch}/GPU at {s.device_tflops:.3g} TFLOP/s; quantised codecs via "
        f"{' or '.join(auto_algorithms(s.cluster)) if s.algorithm == 'auto' else s.algorithm}; "
        f"accuracy tolerance {a.tolerance:g} points"
        + (f"; links and codec costs calibrated ({s.transport})" if s.calibration is not None else
           f"; encode/decode at {_gbps(s.encode_Bps)}/{_gbps(s.decode_Bps)}"),
        "  layer groups: " + ", ".join(f"{g} {100 * v['params']:.0f}% of params / {100 * v['flops']:.0f}% of FLOPs"
                                       for g, v in a.groups.items()),
        "",
    ]
    if a.fp32_is_best:
        lines.append(f"RECOMMENDATION: fp32 (no compression). Best admissible codec is predicted at only "
                     f"{max(o['speedup_vs_fp32'] for o in a.options):.2f}x of fp32 here.")
    else:
        lines.append("RECOMMENDATION: " + ", ".join(f"{g} -> {short_codec(spec)}" for g, spec in a.assignment.items())
                     + f"   predicted {p.speedup_vs_fp32:.2f}x over fp32 "
                     f"(step {p.step_s * 1e3:.1f} ms vs {p.fp32_step_s * 1e3:.1f} ms; {p.samples_per_s:,.0f} samples/s)")
    lines += ["", policy_code(a.policy_dict(), a.fp32_is_best, p.algorithm), "",
              "fastest admissible assignments (predicted speedup over fp32):"]
    lines += ["  " + ", ".join(f"{g} {v}" for g, v in o["assignment"].items())
              + f" ({o['algorithm']}): {o['speedup_vs_fp32']:.2f}x" for o in a.options[:6]]
    lines += ["", f"accuracy (tolerance {a.tolerance:g} points; evidence: {a.evidence_source or 'none'}):"]
    if not a.direct_evidence:
        lines.append(f"  No study results for {a.network} in the evidence: the accuracy side rests on the seeds' "
                     "published findings only. Verify on your model (e.g. `lowbit study` with this network) "
                     "before relying on it.")
    for cand in CANDIDATES:
        by = a.verdicts.get(cand.name, {})
        parts = [f"{g}: {'yes' if v.admissible else 'no'} ({v.basis})" for g, v in by.items()]
        lines.append(f"  {cand.label:<16} " + "; ".join(parts))
        lines += [f"      {r}" for r in sorted({v.detail for v in by.values()})]
        lines += [f"      {_describe(cell, a.tolerance)}" for cell in a.cells.get(cand.name, [])]
    if not a.direct_evidence:
        lines += ["", "seed findings used:"] + [f"  {k}: {v[1]}" for k, v in SEED_FINDINGS.items()]
    for n in a.notes:
        lines += ["", n]
    return "\n".join(lines)


def _gbps(bps: float | None) -> str:
    return "free" if bps is None else f"{bps / 1e9:g} GB/s"
