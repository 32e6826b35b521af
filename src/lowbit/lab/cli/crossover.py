"""``lowbit predict --localsgd H``: per-step compression or local steps, from the speed model
(:mod:`lowbit.lab.perfmodel.localsgd`), and ``lowbit predict --localsgd-check RESULTS``: its cross-over
against a study's measured one (:mod:`lowbit.lab.study.crossover`).

    lowbit predict --localsgd 16 --params 136960 --compute-ms 40 --gpus 2 --gpus-per-node 2 \\
                   --intra bw=100Mbit/s,lat=0 --codec qsgd:bits=4,bucket=512 --steps-ratio 2
    lowbit predict --localsgd 100 --network gpt2_small --gpus 16 --gpus-per-node 8 --inter 10gbit \\
                   --outer-codec qsgd:bits=2,bucket=512 --fragments 4
    lowbit predict --localsgd-check benchmarks/results/localsgd_cpu_k2
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from typing import Any

from lowbit.lab.perfmodel.localsgd import LINK_RULES, SchemeStep, crossover, ddp_step, localsgd_step, model_layers, \
    slow_link, with_bandwidth
from lowbit.lab.perfmodel.model import Cluster, Layer, layers_for_network
from lowbit.lab.study.crossover import check, format_check

__all__ = ["add_arguments", "run_localsgd", "run_check", "format_localsgd", "describe_bandwidth", "SWEEP_BPS"]

#: The bandwidths of the table against bandwidth, bytes/s: 10 Mbit/s to 100 Gbit/s.
SWEEP_BPS = (10e6 / 8, 100e6 / 8, 1e9 / 8, 10e9 / 8, 100e9 / 8)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The local SGD options of ``lowbit predict``."""
    g = p.add_argument_group("local SGD against per-step compression (docs/perfmodel.md, section 11)")
    g.add_argument("--localsgd", type=int, metavar="H", default=None,
                   help="compare DDP with --codec every step against local SGD with H local steps and "
                   "--outer-codec for the weight change; prints each scheme's step and the cross-over bandwidth")
    g.add_argument("--outer-codec", default=None, metavar="SPEC",
                   help="with --localsgd: the outer exchange's codec (default: --codec)")
    g.add_argument("--fragments", type=int, default=1, metavar="F",
                   help="with --localsgd: streaming fragments (default 1)")
    g.add_argument("--steps-ratio", type=float, default=1.0, metavar="RHO",
                   help="with --localsgd: local SGD's steps to the target over DDP's (default 1: the speed "
                   "alone; measure it, e.g. from a study's steps to target)")
    g.add_argument("--params", type=float, default=None, metavar="N",
                   help="with --localsgd: the model's parameters (instead of --network; with --compute-ms)")
    g.add_argument("--compute-ms", type=float, default=None, metavar="MS",
                   help="with --localsgd and --params: forward + backward + optimizer ms per step")
    g.add_argument("--link-rule", default="ring", choices=LINK_RULES,
                   help="with --localsgd: price real ring collectives (default) or the study's emulated link")
    g.add_argument("--localsgd-check", metavar="RESULTS", default=None,
                   help="the speed model's cross-over against the one measured by a localsgd study "
                   "(a directory holding results.jsonl, or the .jsonl)")


def describe_bandwidth(bps: float) -> str:
    """``12.5e6`` -> ``100 Mbit/s``; ``inf`` -> ``every link``; 0 -> ``no link``."""
    if math.isinf(bps):
        return "every link"
    if bps <= 0:
        return "no link"
    bits = bps * 8
    for unit, scale in (("Tbit/s", 1e12), ("Gbit/s", 1e9), ("Mbit/s", 1e6), ("kbit/s", 1e3)):
        if bits >= scale:
            return f"{bits / scale:.3g} {unit}"
    return f"{bits:.3g} bit/s"


def _layers(args: argparse.Namespace) -> tuple[list[Layer], str]:
    if args.params is not None or args.compute_ms is not None:
        if args.params is None or args.compute_ms is None:
            raise ValueError("--params and --compute-ms go together (the model's size and its compute per step)")
        if args.network:
            raise ValueError("give --network or --params/--compute-ms, not both")
        if not (args.params >= 1 and float(args.params).is_integer()):
            raise ValueError(f"--params must be a positive whole number, got {args.params:g}")
        layers = model_layers(int(args.params), args.compute_ms / 1e3)
        return layers, f"{int(args.params):,} params, {args.compute_ms:g} ms compute per step"
    if not args.network:
        raise ValueError("--localsgd needs --network (with --batch, --device-tflops) or --params and --compute-ms")
    layers = layers_for_network(args.network, args.batch, args.device_tflops or 100.0)
    total = sum(layer.compute_s for layer in layers)
    return layers, (f"{args.network}: {sum(la.params for la in layers) / 1e6:.1f}M params, batch {args.batch}/GPU, "
                    f"{total * 1e3:.3g} ms compute per step")


def _rates(args: argparse.Namespace) -> dict[str, Any]:
    out = {}
    for what in ("encode", "decode"):
        v = getattr(args, f"{what}_gbps")
        if not (v >= 0 and math.isfinite(v)):
            raise ValueError(f"--{what}-gbps must be >= 0, got {v}")
        out[f"{what}_Bps"] = None if v == 0 else v * 1e9
    return out


def _setup(args: argparse.Namespace) -> dict[str, Any]:
    if args.localsgd < 1:
        raise ValueError(f"--localsgd must be a positive number of local steps, got {args.localsgd}")
    if args.fragments < 1:
        raise ValueError(f"--fragments must be a positive integer, got {args.fragments}")
    if not (args.steps_ratio > 0 and math.isfinite(args.steps_ratio)):
        raise ValueError(f"--steps-ratio must be a finite number > 0, got {args.steps_ratio}")
    layers, what = _layers(args)
    cluster = Cluster(gpus=args.gpus, gpus_per_node=args.gpus_per_node, intra=args.intra or "nvlink",
                      inter=args.inter, nics_per_node=args.nics_per_node)
    outer = args.outer_codec or args.codec
    common = dict(_rates(args), link_rule=args.link_rule)
    ddp = {c: (lambda cl, c=c: ddp_step(layers, cl, c, algorithm=args.algorithm, overlap=not args.no_overlap,
                                         **common)) for c in dict.fromkeys(["fp32", args.codec])}
    loc = {c: (lambda cl, c=c: localsgd_step(layers, cl, c, args.localsgd, fragments=args.fragments,
                                              algorithm=args.algorithm, **common))
           for c in dict.fromkeys(["fp32", outer])}
    crosses = [crossover(layers, cluster, ddp_codec=d, local_codec=lc, local_steps=args.localsgd,
                         fragments=args.fragments, steps_ratio=args.steps_ratio, algorithm=args.algorithm,
                         overlap=not args.no_overlap, **common)
               for lc in loc for d in ddp]
    return {"layers": layers, "what": what, "cluster": cluster, "ddp": ddp, "local": loc, "crossovers": crosses}


def run_localsgd(args: argparse.Namespace) -> int:
    """``lowbit predict --localsgd H``: prints :func:`format_localsgd` (or JSON)."""
    s = _setup(args)
    if args.json:
        cl = s["cluster"]
        print(json.dumps({
            "model": s["what"], "steps_ratio": args.steps_ratio, "local_steps": args.localsgd,
            "fragments": args.fragments, "link_rule": args.link_rule,
            "schemes": [dataclasses.asdict(f(cl)) for f in [*s["ddp"].values(), *s["local"].values()]],
            "sweep": [{"bandwidth_Bps": b, "step_s": {f(with_bandwidth(cl, b)).label: f(with_bandwidth(cl, b)).step_s
                                                      for f in [*s["ddp"].values(), *s["local"].values()]}}
                      for b in SWEEP_BPS],
            "crossovers": [{"ddp": x.ddp.label, "local": x.local.label, "steps_ratio": x.steps_ratio,
                            "bandwidth_Bps": None if math.isinf(x.bandwidth_Bps) else x.bandwidth_Bps,
                            "pays_everywhere": math.isinf(x.bandwidth_Bps)} for x in s["crossovers"]],
        }, indent=2))
    else:
        print(format_localsgd(s, args))
    return 0


def _row(st: SchemeStep, rho: float, ref: float) -> str:
    steps = rho if st.scheme == "localsgd" else 1.0
    return (f"{st.label[:34]:<34} {st.algorithm:<14} {st.bits_per_value:>6.3g} {st.bytes_per_exchange / 1e6:>9.3f} "
            f"{st.bytes_per_step / 1e3:>10.1f} {st.compute_s * 1e3:>9.2f} {st.comm_s * 1e3:>9.2f} "
            f"{st.codec_s * 1e3:>8.2f} {st.step_s * 1e3:>9.2f} {steps * st.step_s / ref:>9.2f}")


def format_localsgd(s: dict[str, Any], args: argparse.Namespace) -> str:
    """The comparison as text: the schemes at the given link, their steps against bandwidth, the cross-overs."""
    cl: Cluster = s["cluster"]
    topo = cl.topology()
    link = slow_link(cl)
    rho = args.steps_ratio
    schemes = [f(cl) for f in [*s["ddp"].values(), *s["local"].values()]]
    ref = schemes[0].step_s
    lines = [f"model: {s['what']}",
             f"{cl.gpus} ranks on {topo.nodes} node(s); the slow link: {link.name or 'custom'} "
             f"({describe_bandwidth(link.bandwidth_Bps)}, {link.latency_s * 1e6:g} us a message; rule "
             f"{args.link_rule})" + ("; fp32 DDP inside each node" if topo.nodes > 1 and topo.local > 1 else ""),
             f"local SGD: H={args.localsgd}, F={args.fragments}; steps ratio {rho:g} (local SGD's steps to the target "
             f"over DDP's{': the speed alone' if rho == 1 else ''})", ""]
    head = (f"{'scheme':<34} {'algorithm':<14} {'bits':>6} {'MB/exch.':>9} {'kB/step':>10} {'compute':>9} "
            f"{'comm ms':>9} {'codec ms':>8} {'step ms':>9} {'to target':>9}")
    lines += [head, "-" * len(head)] + [_row(st, rho, ref) for st in schemes]
    lines.append(f"(per rank on the slow link; comm and codec amortised over H; 'to target': steps ratio x step, "
                 f"relative to {schemes[0].label})")
    lines += ["", "step ms against the slow link's bandwidth:"]
    w = max(12, *(len(st.label) for st in schemes))
    head2 = f"{'bandwidth':>12} " + " ".join(f"{st.label:>{w}}" for st in schemes)
    lines += [head2, "-" * len(head2)]
    for b in SWEEP_BPS:
        c = with_bandwidth(cl, b)
        lines.append(f"{describe_bandwidth(b):>12} " + " ".join(
            f"{f(c).step_s * 1e3:>{w}.2f}" for f in [*s["ddp"].values(), *s["local"].values()]))
    lines += ["", f"cross-over (local SGD reaches the target sooner below it, at steps ratio {rho:g}):"]
    for x in s["crossovers"]:
        b = x.bandwidth_Bps
        where = ("at every bandwidth searched" if math.isinf(b) else "at no bandwidth searched" if b == 0
                 else f"below {describe_bandwidth(b)}")
        lines.append(f"  {x.local.label} vs {x.ddp.label}: {where}")
    return "\n".join(lines)


def run_check(args: argparse.Namespace) -> int:
    """``lowbit predict --localsgd-check RESULTS``: :func:`lowbit.lab.study.crossover.check`, as text or JSON."""
    rep = check(args.localsgd_check)
    print(json.dumps(rep, indent=1, default=str) if args.json else format_check(rep))
    return 0
