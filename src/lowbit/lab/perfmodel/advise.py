"""``lowbit advise``: which codec for which layers, on this cluster, at this accuracy tolerance?
(docs/perfmodel.md, section 9)

Layers are grouped by module type (``Conv2d`` with their norms, ``Linear``, ``LSTM``). A codec of the ladder
(``data/advise_ladder.json``) is admissible for a group on the accuracy evidence: study runs on this network
(every (data set, workers) cell's mean over seeds of its final test accuracy minus fp32's >= -tolerance
points), or without them the seeds' published findings unless the study clearly contradicts them on other
networks with that layer type; Conv2d layers then get at least one rung more bits than Linear ones. Every
admissible assignment is predicted (:func:`lowbit.lab.perfmodel.model.predict`) and :func:`lowbit.choose.pick`,
the one decision rule, chooses (more bits within 3% of the fastest; fp32 unless one is 1.05x faster).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import statistics
from importlib import resources
from pathlib import Path
from typing import Any

import torch

from lowbit.choose import FASTER_THAN_FP32, WITHIN_BEST, Tried, pick
from lowbit.codecs.base import Codec, get_codec
from lowbit.lab.models import build_model
from lowbit.lab.perfmodel.calibrate import Calibration, Run
from lowbit.lab.perfmodel.collectives import modeled_algorithms
from lowbit.lab.perfmodel.links import Link
from lowbit.lab.perfmodel.model import (Cluster, LayerCodec, Prediction, bits_per_value, codec_fact, layers_for_network,
                                    predict, short_codec)
from lowbit.lab.perfmodel.networks import Network, get_network
from lowbit.policy import Policy

__all__ = ["Candidate", "CANDIDATES", "SEED_FINDINGS", "Advice", "advise", "default_evidence_path", "GROUP_TYPES",
           "SpeedSetup", "auto_algorithms"]


def auto_algorithms(cluster: Cluster) -> tuple[str, ...]:
    """The collectives ``--algorithm auto`` compares for quantised codecs: the registry's modelled flat ones
    (scatter_gather, allgather, a plugin's with a cost), and across nodes the multi-node ones (hierarchical)."""
    multi = modeled_algorithms(quantised=True, multi_node=True) if cluster.gpus > cluster.gpus_per_node else ()
    return modeled_algorithms(quantised=True, multi_node=False) + multi


#: Layer group -> the module type names ``lowbit.Policy(by_type=...)`` matches.
GROUP_TYPES = {"Conv2d": ("Conv2d",), "Linear": ("Linear",), "LSTM": ("LSTM",)}


@dataclasses.dataclass(frozen=True)
class Candidate:
    """A codec that advice may assign and what the seeds published about its accuracy: ``seed_bounds``, the loss
    in points per layer group (none given: a loss no tolerance covers), and ``seed_finding``, the finding cited;
    the rest the codec says (its rung, whether it needs error feedback, its label)."""

    name: str
    spec: str
    seed_bounds: dict[str, float | None] = dataclasses.field(default_factory=dict, hash=False)
    seed_finding: str = ""

    @property
    def codec(self) -> Codec:
        return get_codec(self.spec)

    @property
    def canonical(self) -> str:
        return self.codec.spec

    @property
    def rung(self) -> int:  # the bits ladder (lowbit.Codec.rung): higher = more bits
        return self.codec.rung

    @property
    def error_feedback(self) -> bool:  # whether lowbit.ddp's error_feedback="auto" turns it on
        return self.codec.biased and not self.codec.sums_on_wire

    @property
    def label(self) -> str:
        return self.codec.short_label + (" +EF" if self.error_feedback else "")


FP32 = Candidate("fp32", "fp32")
#: What advice chooses among, most bits first, and what the seeds found (data/advise_ladder.json).
_LADDER = json.loads((resources.files("lowbit.lab.perfmodel") / "data" / "advise_ladder.json").read_text())
CANDIDATES: tuple[Candidate, ...] = tuple(Candidate(c["name"], c["spec"], c["bounds"], c["finding"])
                                          for c in _LADDER["candidates"])
#: The candidates' findings by name: (loss bound per group, the finding).
SEED_FINDINGS: dict[str, tuple[dict[str, float | None], str]] = {
    c.name: (c.seed_bounds, c.seed_finding) for c in CANDIDATES}
CONV_FINDING: str = _LADDER["conv_finding"]
NCCL_FINDING: str = _LADDER["nccl_finding"]


def _norm(name: str) -> str:
    return name.strip().lower().replace("-", "_")


def default_evidence_path() -> Path | None:
    """The accuracy evidence shipped with the package: the committed 3-seed CPU study's finished runs
    (benchmarks/results/study_cpu_default, slimmed by benchmarks/make_advise_evidence.py)."""
    p = Path(str(resources.files("lowbit.lab.perfmodel") / "data" / "evidence_cpu_default.jsonl"))
    return p if p.is_file() else None


# ------------------------------------------------------------------------------------------ groups
def layer_group(layer_name: str) -> str:
    """Profile layer name -> ``Linear`` (fc*), ``LSTM`` (lstm*) or ``Conv2d`` (conv*, residual blocks)."""
    n = layer_name.lower()
    return "Linear" if n.startswith("fc") else "LSTM" if n.startswith("lstm") else "Conv2d"


def network_groups(net: Network) -> dict[str, dict[str, float]]:
    """Group -> ``{"params", "flops"}`` shares of the network."""
    layers = net.layers()
    p_total = sum(p for _, p, _ in layers) or 1
    f_total = sum(f for _, _, f in layers) or 1
    out: dict[str, dict[str, float]] = {}
    for name, p, f in layers:
        g = out.setdefault(layer_group(name), {"params": 0.0, "flops": 0.0})
        g["params"] += p / p_total
        g["flops"] += f / f_total
    return out


def _model_groups(network: str) -> set[str]:
    """Module-type groups with parameters in a ``lowbit.lab.models`` network (built on the meta device)."""
    try:
        with torch.device("meta"):
            model = build_model(network)
    except Exception:  # noqa: BLE001 - an unknown network: guess from the name
        n = network.lower()
        return {"LSTM", "Linear"} if "lstm" in n else {"Linear"} if "mlp" in n else {"Conv2d", "Linear"}
    types = {type(m).__name__ for m in model.modules() if next(m.parameters(recurse=False), None) is not None}
    return {"Conv2d" if t.startswith("Conv") else t for t in types if t.startswith("Conv") or t in ("Linear", "LSTM")}


# ------------------------------------------------------------------------------------------ evidence
@dataclasses.dataclass(frozen=True)
class Cell:
    """One (network, data, workers) cell: codec minus fp32 final test accuracy, points, over seeds."""

    network: str
    dataset: str
    world: int
    codec: str
    diffs: tuple[float, ...]
    fp32_acc: float
    params: int

    @property
    def mean(self) -> float:
        return statistics.fmean(self.diffs)

    @property
    def std(self) -> float:
        return statistics.stdev(self.diffs) if len(self.diffs) > 1 else 0.0

    def matches(self, tol: float) -> bool:
        return self.mean >= -tol

    def noisy(self, tol: float) -> bool:
        return self.mean - self.std <= -tol <= self.mean + self.std and len(self.diffs) > 1

    def clear_fail(self, tol: float) -> bool:
        return not self.matches(tol) and not self.noisy(tol)


def evidence_cells(runs: list[Run]) -> dict[str, list[Cell]]:
    """Candidate name -> cells, pairing each run with the fp32 run of the same setting and seed."""
    real = [r for r in runs if not r.synthetic and r.world > 1 and math.isfinite(r.final_test_acc)]

    def pair_key(r: Run) -> tuple[Any, ...]:
        return (r.network, r.dataset, r.batch, r.world, r.backend, r.device, r.config_rest, r.seed)

    base = {pair_key(r): r for r in real if r.codec_name == "fp32"}
    by: dict[tuple[str, tuple[Any, ...]], list[tuple[float, float, Run]]] = {}
    canon = {c.canonical: c for c in CANDIDATES}
    for r in real:
        cand = canon.get(r.codec)
        if cand is None or r.error_feedback != cand.error_feedback:
            continue
        b = base.get(pair_key(r))
        if b is None:
            continue
        cell = (r.network, r.dataset, r.batch, r.world, r.backend, r.device, r.config_rest)
        by.setdefault((cand.name, cell), []).append((100 * (r.final_test_acc - b.final_test_acc),
                                                     100 * b.final_test_acc, r))
    out: dict[str, list[Cell]] = {}
    for (name, cell), vals in sorted(by.items(), key=lambda kv: (kv[0][0], str(kv[0][1]))):
        out.setdefault(name, []).append(Cell(cell[0], cell[1], cell[3], name, tuple(v[0] for v in vals),
                                             statistics.fmean(v[1] for v in vals), vals[0][2].params))
    return out


@dataclasses.dataclass(frozen=True)
class Verdict:
    admissible: bool
    basis: str        # "study" (this network), "seed" (seed findings, not contradicted), "seed, contradicted"
    detail: str


def judge(cand: Candidate, group: str, network: str, cells: dict[str, list[Cell]], tol: float,
          groups_of: dict[str, set[str]]) -> Verdict:
    """Is ``cand`` admissible for ``group`` of ``network`` at tolerance ``tol`` (module doc, step 2)?"""
    mine = [c for c in cells.get(cand.name, []) if _norm(c.network) == _norm(network)]
    if mine:
        fails = [c for c in mine if not c.matches(tol)]
        detail = (f"on {mine[0].network}: matched fp32 within {tol:g} points in all {len(mine)} study cells"
                  if not fails else f"on {mine[0].network}: missed fp32 by more than {tol:g} points in {len(fails)} of "
                  f"{len(mine)} study cells")
        return Verdict(not fails, "study", detail)
    if not cand.seed_bounds:
        return Verdict(False, "seed", "no study runs on this network and no published finding")
    bound = cand.seed_bounds.get(group)
    if bound is None:
        return Verdict(False, "seed", f"the seed reports a loss of 1 point or more for {group} layers")
    if bound > tol:
        return Verdict(False, "seed", f"the seed bounds its loss by {bound:g} points > tolerance {tol:g}")
    others = [c for c in cells.get(cand.name, []) if group in groups_of.get(c.network, set())]
    bad = [c for c in others if c.clear_fail(tol)]
    if bad:
        worst = min(bad, key=lambda c: c.mean)
        return Verdict(False, "seed, contradicted",
                       f"seed finding contradicted by the study on other networks with {group} layers "
                       f"({len(bad)} of {len(others)} cells clearly below -{tol:g}, e.g. "
                       f"{worst.network}/{worst.dataset} {worst.mean:+.2f} +- {worst.std:.2f})")
    return Verdict(True, "seed", f"seed finding (loss <= {bound:g} points)"
                   + (f"; not contradicted by {len(others)} study cells on other networks" if others else ""))


# ------------------------------------------------------------------------------------------ speed
@dataclasses.dataclass(frozen=True)
class SpeedSetup:
    cluster: Cluster
    batch: int
    device_tflops: float
    algorithm: str
    encode_Bps: float | None
    decode_Bps: float | None
    calibration: Calibration | None = None
    transport: str = ""
    compute_factor: float = 1.0
    overhead_native_s: float = 0.0
    overhead_compressed_s: float = 0.0


def _layer_codec(spec: str, setup: SpeedSetup) -> LayerCodec:
    codec = get_codec(spec)
    algo = "allreduce" if codec.sums_on_wire else setup.algorithm
    kw: dict[str, Any] = dict(encode_Bps=setup.encode_Bps, decode_Bps=setup.decode_Bps)
    link: Link | None = None
    cal = setup.calibration
    if cal is not None:
        fit, _ = cal.link_for(setup.transport, algo)
        if fit is not None and setup.cluster.gpus <= setup.cluster.gpus_per_node:
            link = fit.link()  # measured on one node: it describes the intra-node path
        if codec.name != "fp32":
            cost, _ = cal.codec_for(setup.transport, algo, codec.spec)
            if cost is not None:
                kw = cost.terms()
    return LayerCodec(bits_per_value(spec), algo, link=link, label=spec, **kw)


def predict_assignment(net: Network, assignment: dict[str, str], setup: SpeedSetup) -> Prediction:
    """Step time of ``net`` with each layer group's codec (``{"Conv2d": spec, ...}``)."""
    layers = layers_for_network(net, setup.batch, setup.device_tflops)
    if setup.compute_factor != 1.0:
        layers = [dataclasses.replace(layer, compute_s=layer.compute_s * setup.compute_factor) for layer in layers]
    by_spec = {spec: _layer_codec(spec, setup) for spec in set(assignment.values())}
    codecs = [by_spec[assignment[layer_group(name)]] for name, _, _ in net.layers()]
    fp32 = _layer_codec("fp32", setup)
    pred = predict(layers, setup.cluster, batch_per_gpu=setup.batch, network=net.name, layer_codecs=codecs)
    base = predict(layers, setup.cluster, batch_per_gpu=setup.batch, network=net.name,
                   layer_codecs=[fp32] * len(layers))
    native = all(codec_fact(s, "sums_on_wire", False) for s in assignment.values())
    k = setup.cluster.gpus  # the per-step overheads (of a calibration) on several GPUs only
    step = pred.step_s + ((setup.overhead_native_s if native else setup.overhead_compressed_s) if k > 1 else 0.0)
    fp32_step = base.step_s + (setup.overhead_native_s if k > 1 else 0.0)
    return dataclasses.replace(pred, step_s=step, fp32_step_s=fp32_step, speedup_vs_fp32=fp32_step / step,
                               samples_per_s=k * setup.batch / step, scaling_efficiency=pred.breakdown.compute_s / step)


# ------------------------------------------------------------------------------------------ advice
@dataclasses.dataclass
class Advice:
    network: str
    groups: dict[str, dict[str, float]]
    assignment: dict[str, str]          # group -> canonical codec spec ("fp32" everywhere when fp32)
    fp32_is_best: bool
    prediction: Prediction
    options: list[dict[str, Any]]       # every assignment tried: groups, speedup, admissible
    verdicts: dict[str, dict[str, Verdict]]
    cells: dict[str, list[Cell]]
    evidence_source: str
    direct_evidence: bool
    tolerance: float
    setup: SpeedSetup
    notes: list[str]

    def policy_dict(self) -> dict[str, Any]:
        specs = sorted(set(self.assignment.values()))
        if len(specs) == 1:
            return {"default": specs[0], "by_type": {}, "by_name": {}}
        # the most bits (the codec's rung); of a tie (qsgd8, dettmers), the first in spec order
        default = max(specs, key=lambda s: codec_fact(s, "rung", 0))
        by_type = {t: spec for g, spec in sorted(self.assignment.items()) for t in GROUP_TYPES[g]}
        return {"default": default, "by_type": by_type, "by_name": {}}

    def policy(self) -> Any:
        return Policy(**self.policy_dict())


def advise(network: str, setup: SpeedSetup, *, tolerance: float = 0.5, evidence: list[Run] | None = None,
           evidence_source: str = "") -> Advice:
    """The recommendation (module doc)."""
    if not (tolerance >= 0 and math.isfinite(tolerance)):
        raise ValueError(f"--tolerance must be a number of accuracy points >= 0, got {tolerance!r}")
    net = get_network(network)
    groups = network_groups(net)
    cells = evidence_cells(evidence or [])
    groups_of = {c.network: _model_groups(c.network) for cs in cells.values() for c in cs}
    direct = any(_norm(c.network) == _norm(net.name) for cs in cells.values() for c in cs)
    verdicts: dict[str, dict[str, Verdict]] = {}
    allowed: dict[str, list[Candidate]] = {g: [FP32] for g in groups}
    for cand in CANDIDATES:
        for g in groups:
            v = judge(cand, g, net.name, cells, tolerance, groups_of)
            verdicts.setdefault(cand.name, {})[g] = v
            if v.admissible:
                allowed[g].append(cand)
    notes: list[str] = []
    sizes = sorted({c.params for cs in cells.values() for c in cs if _norm(c.network) == _norm(net.name)})
    if sizes and any(abs(p / net.params - 1) > 0.05 for p in sizes if p):
        notes.append(f"the study's {net.name} has {', '.join(f'{p:,}' for p in sizes)} parameters, the speed model's "
                     f"{net.params:,}: same architecture family, different size; the accuracy evidence is for the "
                     "study's.")
    conv_rule = "Conv2d" in groups and "Linear" in groups and not direct
    names = list(groups)
    tried: list[Tried] = []  # every admissible assignment with its prediction (extra) at its fastest algorithm
    for combo in itertools.product(*(allowed[g] for g in names)):
        by_group = dict(zip(names, combo))
        if conv_rule and by_group["Conv2d"].rung <= by_group["Linear"].rung and by_group["Conv2d"].rung < FP32.rung:
            continue
        assignment = {g: c.canonical for g, c in by_group.items()}
        quantised = any(not c.codec.sums_on_wire for c in combo)
        algos = ((auto_algorithms(setup.cluster) if setup.algorithm == "auto" else (setup.algorithm,)) if quantised
                 else ("allreduce",))
        algo, pred = max(((al, predict_assignment(net, assignment, dataclasses.replace(setup, algorithm=al)))
                          for al in algos), key=lambda t: t[1].speedup_vs_fp32)
        weighted_bits = sum(groups[g]["params"] * bits_per_value(assignment[g]) for g in names)
        tried.append(Tried(assignment, pred.speedup_vs_fp32, weighted_bits, dataclasses.replace(pred, algorithm=algo)))
    fp32 = next(t for t in tried if dict(t.assignment) == {g: FP32.canonical for g in names})
    chosen, fp32_best = pick(tried, fp32, within_best=WITHIN_BEST, faster_than_fp32=FASTER_THAN_FP32)
    if fp32_best:
        notes.append(f"no admissible assignment is predicted >= {FASTER_THAN_FP32:.2f}x faster than fp32 "
                     f"(fastest {max(t.speedup for t in tried):.2f}x): keep fp32. {NCCL_FINDING}.")
    if conv_rule:
        notes.append("Conv2d layers were kept at least one rung above Linear layers (no study evidence on this "
                     f"network): {CONV_FINDING}.")
    options = sorted(({"assignment": {g: short_codec(s) for g, s in t.assignment.items()},
                       "algorithm": t.extra.algorithm, "speedup_vs_fp32": t.speedup, "step_s": t.extra.step_s}
                      for t in tried), key=lambda o: -o["speedup_vs_fp32"])
    return Advice(net.name, groups, dict(chosen.assignment), fp32_best, chosen.extra, options, verdicts, cells,
                  evidence_source, direct, tolerance, setup, notes)
