"""Which codec for which tensor: the one decision rule of ``lowbit advise`` and ``codec="auto"``.

Both produce *tried* assignments (tensor or layer group -> codec spec), each with a predicted speedup over
fp32 everywhere and its parameter-weighted bits per value, and :func:`pick` chooses among them:

* fp32 everywhere when no assignment is predicted at least ``faster_than_fp32`` times faster (fast links
  and compute-bound networks: the seed's NCCL finding, Grubic et al. 2018, Sec. 5.2);
* else, among the assignments within ``within_best`` of the fastest, the one with the most bits (accuracy
  first when speed is a wash).

``lowbit advise`` predicts its assignments from a network profile and link specs (:mod:`lowbit.lab.perfmodel`);
``codec="auto"`` (:mod:`lowbit.auto`) from what it measured on the running job: when each DDP
bucket's gradients became ready during the first fp32 steps (a :class:`Timeline`), what each codec's
exchange costs on this link at two message sizes and what its encoding costs on this device
(:class:`CodecCost`), and each codec's error on each tensor's own gradient. :func:`simulate` replays a
step on that timeline the way the DDP hook sends it (message groups of consecutive tensors with one
codec, natively summed tensors per DDP bucket, one link serving messages in the order they are issued,
encoding on the compute timeline) and :func:`decide` searches assignments, in the manner of L-GreCo
(Alimohammadi, Markov, Frantar and Alistarh, arXiv 2210.17357): a dynamic program over tensors chooses,
under a total-error budget relative to uniform 8-bit QSGD, the codecs with the least link time, and
size thresholds and fp32 prefixes around it are tried too; every candidate is replayed and :func:`pick`
chooses.

An assignment's value is a *choice*: a codec spec, or on several nodes a spec and the algorithm its
tensor goes by (:func:`choice`: ``"qsgd:bits=8,bucket=512@hierarchical"``); each choice has its own
measured cost (:class:`CodecCost`, whose ``algorithm`` names what carries it), so flat and hierarchical
exchanges compete tensor by tensor like codecs do.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Collection, Mapping, Sequence
from typing import Any, Union

from lowbit.timeline import (AUTO_MESSAGE_MIN, AUTO_MESSAGE_SHARE, DDP_BUCKET_BYTES, DDP_FIRST_BUCKET_BYTES, StepPlan,
                             closes_after, ddp_buckets, message_limit, plan_step)

__all__ = ["ALGORITHM_SEP", "choice", "split_choice", "Tried", "pick", "TensorTiming", "Timeline", "CodecCost", "step_plan", "simulate", "decide", "Decision",
           "compute_time", "explain", "weighted_bits",
           "ddp_bucket_caps", "WITHIN_BEST", "FASTER_THAN_FP32", "AUTO_FASTER_THAN_FP32",
           # the step's plan (lowbit.timeline), as lowbit.ddp, lowbit.auto and the benchmarks import it from here
           "AUTO_MESSAGE_MIN", "AUTO_MESSAGE_SHARE", "DDP_BUCKET_BYTES", "DDP_FIRST_BUCKET_BYTES", "closes_after",
           "ddp_buckets", "message_limit"]

#: ``lowbit advise``: below this predicted speedup, fp32 is the answer (its predictions are extrapolated)
FASTER_THAN_FP32 = 1.05
#: ``codec="auto"``: the same rule on measured costs, so a smaller margin
AUTO_FASTER_THAN_FP32 = 1.02
#: assignments this close to the fastest count as ties; more bits wins a tie
WITHIN_BEST = 0.97

#: a fixed codec's assignment, as lowbit.Policy's size rule makes it: smaller tensors stay fp32
UNIFORM_MIN_NUMEL = 10_000

#: between a choice's codec spec and the algorithm it names (codec specs never hold it)
ALGORITHM_SEP = "@"


def choice(spec: str, algorithm: str | None = None) -> str:
    """The assignment value for ``spec`` sent by ``algorithm`` (None: the DDP state's own algorithm)."""
    return spec if not algorithm else f"{spec}{ALGORITHM_SEP}{algorithm}"


def split_choice(key: str) -> tuple[str, str | None]:
    """(codec spec, algorithm or None) of an assignment value made by :func:`choice`."""
    spec, sep, algorithm = key.partition(ALGORITHM_SEP)
    return spec, (algorithm or None) if sep else None


def ddp_bucket_caps(ddp_model: Any) -> tuple[float, float]:
    """(first bucket's cap, the others' cap) in bytes of a DistributedDataParallel model, as its reducer
    rebuilds its buckets: torch gives the first bucket 1 MiB only when ``bucket_cap_mb`` is left at its
    default, else the cap itself."""
    cap = float(getattr(ddp_model, "bucket_bytes_cap", DDP_BUCKET_BYTES))
    config = getattr(ddp_model, "_bucket_config", None)
    if config is not None and hasattr(config, "first_bucket_bytes_cap"):
        return float(config.first_bucket_bytes_cap), cap
    default = getattr(ddp_model, "bucket_bytes_cap_default", True)
    return (float(DDP_FIRST_BUCKET_BYTES) if default else cap), cap


# ------------------------------------------------------------------------------------------ the rule
@dataclasses.dataclass(frozen=True)
class Tried:
    """One assignment that was predicted: ``speedup`` over fp32 everywhere, ``bits`` per value weighted
    by parameters (more: closer to fp32). ``extra`` carries the caller's prediction object."""

    assignment: Mapping[str, str]
    speedup: float
    bits: float
    extra: Any = None


def pick(tried: Sequence[Tried], fp32: Tried, *, within_best: float = WITHIN_BEST,
         faster_than_fp32: float = FASTER_THAN_FP32) -> tuple[Tried, bool]:
    """The chosen assignment, and whether it is fp32 everywhere because nothing paid (module doc)."""
    if not tried:
        return fp32, True
    fastest = max(t.speedup for t in tried)
    if fastest < faster_than_fp32:
        return fp32, True
    near = [t for t in tried if t.speedup >= within_best * fastest]
    return max(near, key=lambda t: (t.bits, t.speedup)), False


# ------------------------------------------------------------------------------------------ measured step
@dataclasses.dataclass(frozen=True)
class TensorTiming:
    """A parameter tensor: its size, when its gradient was ready (seconds after the forward pass began,
    its DDP bucket's hook call) and its DDP bucket (natively summed tensors are reduced per bucket)."""

    name: str
    numel: int
    ready_s: float
    bucket: int


@dataclasses.dataclass(frozen=True)
class Timeline:
    """One measured fp32 step: tensors in the order their gradients became ready, when the backward pass
    ended (the last bucket ready), the whole step (forward start to the next forward start), and the
    hook's ``message_mb``; ``ride``: the quantised codecs go by ``allgather``, in whose messages the fp32
    tensors ride raw instead of going out as allreduces of their own."""

    tensors: tuple[TensorTiming, ...]
    backward_end_s: float
    step_s: float
    message_mb: Union[float, str] = "auto"
    ride: bool = False

    def __post_init__(self) -> None:
        if not self.tensors:
            raise ValueError("a timeline needs at least one tensor")
        if not (self.step_s > 0 and math.isfinite(self.step_s)):
            raise ValueError(f"step time must be a finite number > 0 s, got {self.step_s!r}")


@dataclasses.dataclass(frozen=True)
class CodecCost:
    """What one codec costs here: ``alpha_s + s_per_value * n`` seconds for a message of ``n`` values
    (collective and decoding: the link's time), ``encode_s_per_value * n`` seconds of encoding on the
    compute timeline. ``native``: summed on the wire (fp32, fp16, bf16), one allreduce per DDP bucket;
    ``per_tensor``: the codec sends each tensor as its own message; ``algorithm``: the collective that
    carries it ("allreduce", "allgather", "scatter_gather", "hierarchical"; "" when not recorded, as in
    older checkpoints: taken to be allgather's when fp32 rides)."""

    spec: str
    bits: float
    native: bool
    alpha_s: float
    s_per_value: float
    encode_s_per_value: float = 0.0
    per_tensor: bool = False
    algorithm: str = ""

    def __post_init__(self) -> None:
        for f in ("alpha_s", "s_per_value", "encode_s_per_value"):
            v = getattr(self, f)
            if not (v >= 0 and math.isfinite(v)):
                raise ValueError(f"{self.spec}: {f} must be a finite number >= 0, got {v!r}")

    def time(self, n: float) -> float:
        return self.alpha_s + self.s_per_value * n


def step_plan(timeline: Timeline, assignment: Mapping[str, str], costs: Mapping[str, CodecCost]) -> StepPlan:
    """The messages the hook sends for ``assignment`` on the timeline's tensors and measured buckets
    (:func:`lowbit.timeline.plan_step`, the plan lowbit.ddp's hook sends)."""
    specs = [assignment[t.name] for t in timeline.tensors]
    rider = None
    if timeline.ride and any(not costs[s].native for s in assignment.values()):
        rider = next((s for s in specs if costs[s].native and costs[s].bits >= 32), None)
    return plan_step([t.numel for t in timeline.tensors], specs, native={s for s in specs if costs[s].native},
                     per_tensor={s for s in specs if costs[s].per_tensor}, rider=rider,
                     message_mb=timeline.message_mb, buckets=[t.bucket for t in timeline.tensors],
                     riderless={s for s in specs if not costs[s].native and costs[s].algorithm not in ("", "allgather")})


def simulate(timeline: Timeline, assignment: Mapping[str, str], costs: Mapping[str, CodecCost]) -> float:
    """Seconds the step takes beyond its compute: encoding plus communication not hidden behind the
    backward pass, for ``assignment`` (tensor name -> codec spec, a key of ``costs``), replaying
    :func:`step_plan`: a message goes out once its last tensor is ready (riders counted in its codec's
    values, 32/bits each), encoded on the compute timeline; a bucket's native tensors when it ends."""
    plan = step_plan(timeline, assignment, costs)
    tensors = timeline.tensors
    completes = {m.last: m for m in plan.messages}
    native = set(plan.native)
    free = 0.0      # when the link is next idle
    shift = 0.0     # encoding so far, which delays the rest of the backward pass
    units: dict[str, float] = {}
    for i, t in enumerate(tensors):
        m = completes.get(i)
        if m is not None:
            c = costs[m.spec]
            n = sum(tensors[j].numel for j in m.members) + sum(tensors[j].numel for j in m.riders) * 32 / c.bits
            enc = c.encode_s_per_value * n
            free = max(t.ready_s + shift + enc, free) + c.time(n)
            shift += enc
        if i in native:
            spec = assignment[t.name]
            units[spec] = units.get(spec, 0.0) + t.numel
        if i + 1 == len(tensors) or tensors[i + 1].bucket != t.bucket:  # the bucket's native units go out
            for spec in sorted(units):
                free = max(t.ready_s + shift, free) + costs[spec].time(units[spec])
            units = {}
    end = timeline.backward_end_s + shift
    return shift + max(0.0, free - end)


# ------------------------------------------------------------------------------------------ the search
@dataclasses.dataclass
class Decision:
    """What ``decide`` chose: the assignment, the predicted step times, and per tensor the predicted
    saving (seconds a step gains from its codec against sending that tensor in fp32, the rest unchanged)."""

    assignment: dict[str, str]
    fp32_is_best: bool
    step_s: float
    fp32_step_s: float
    tried: int
    rows: list[dict[str, Any]]
    error: float | None = None
    error_limit: float | None = None
    #: the best predicted assignments, to be tried on the job: (label, assignment, predicted step s)
    finalists: list[tuple[str, dict[str, str], float]] = dataclasses.field(default_factory=list)
    #: when they were tried: label -> measured step s ("fp32": the measured fp32 step)
    measured_s: dict[str, float] = dataclasses.field(default_factory=dict)
    chosen: str = ""
    #: each choice (assignment value) -> the algorithm that carries it
    algorithms: dict[str, str] = dataclasses.field(default_factory=dict)
    #: the finalists' labels that were tried twice, their measured_s the mean of both passes (finalists
    #: measured close: lowbit.auto.trials). A plain default, so a Decision pickled before it reads ()
    retried: tuple[str, ...] = ()

    @property
    def speedup(self) -> float:
        return self.fp32_step_s / self.step_s

    def algorithms_of(self, assignment: Mapping[str, str]) -> list[str]:
        """The algorithms that carry ``assignment``'s tensors, in the order of first use (fp32's
        "allreduce" included)."""
        seen: dict[str, None] = {}
        for key in assignment.values():
            seen.setdefault(self.algorithms.get(key) or _algorithm_of_key(key), None)
        return list(seen)

    def table(self) -> str:
        lines = [f"{'tensor':<44} {'numel':>11}  {'codec':<28} {'algorithm':<15} {'saving/step':>12}"]
        for r in self.rows:
            spec, _ = split_choice(r["codec"])
            algo = r.get("algorithm") or self.algorithms.get(r["codec"]) or _algorithm_of_key(r["codec"])
            lines.append(f"{r['name'][:44]:<44} {r['numel']:>11,}  {spec[:28]:<28} {algo[:15]:<15} "
                         f"{r['saving_s'] * 1e3:>9.3f} ms")
        for label, assignment, pred in self.finalists:
            got = self.measured_s.get(label)
            lines.append(f"tried {label:<36} [{', '.join(self.algorithms_of(assignment))}] "
                         f"predicted {pred * 1e3:9.2f} ms/step"
                         + (f", measured {got * 1e3:9.2f} ms/step" if got is not None else "")
                         + (" (2 passes)" if got is not None and label in self.retried else ""))
        if "fp32" in self.measured_s:
            lines.append(f"measured fp32 step {self.measured_s['fp32'] * 1e3:.2f} ms")
        lines.append(f"chosen: {self.chosen or 'predicted best'} [{', '.join(self.algorithms_of(self.assignment))}]; "
                     f"predicted step {self.step_s * 1e3:.2f} ms, "
                     f"fp32 everywhere {self.fp32_step_s * 1e3:.2f} ms ({self.speedup:.2f}x), {self.tried} "
                     "assignments replayed" + (" — fp32: nothing pays" if self.fp32_is_best else ""))
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _algorithm_of_key(key: str) -> str:
    """A choice's algorithm when no cost recorded it: the one it names, else the state's ("default")."""
    return split_choice(key)[1] or "default"


def weighted_bits(timeline: Timeline, assignment: Mapping[str, str], costs: Mapping[str, CodecCost]) -> float:
    """Bits per value of ``assignment`` over the timeline's tensors, weighted by their sizes."""
    total = sum(t.numel for t in timeline.tensors) or 1
    return sum(t.numel * costs[assignment[t.name]].bits for t in timeline.tensors) / total


def compute_time(timeline: Timeline, costs: Mapping[str, CodecCost], fp32: str = "fp32") -> float:
    """The step's compute (forward, backward, optimizer): the measured fp32 step less what the replay says
    fp32 communication added to it; never less than the measured backward pass itself (when the step was
    measured on a faster path than the probes, e.g. DDP's own allreduce on another link)."""
    return max(timeline.step_s - simulate(timeline, {t.name: fp32 for t in timeline.tensors}, costs),
               timeline.backward_end_s)


def _dp(timeline: Timeline, specs: Sequence[str], costs: Mapping[str, CodecCost],
        errors: Mapping[str, Mapping[str, float]], limit: float, bins: int = 256,
        only: Mapping[str, Collection[str]] | None = None) -> dict[str, str]:
    """L-GreCo's dynamic program: per tensor the codec with the least link + encode time, such that the
    summed error stays within ``limit`` (errors rounded up to ``limit / bins``); ``only``: the choices a
    tensor may take, where it names the tensor."""
    unit = limit / bins if limit > 0 else 0.0
    inf = float("inf")
    best = [0.0] + [inf] * bins   # least time for each used error budget
    choice: list[list[tuple[int, str] | None]] = []
    for t in timeline.tensors:
        new = [inf] * (bins + 1)
        arg: list[tuple[int, str] | None] = [None] * (bins + 1)
        for spec in specs:
            if only is not None and t.name in only and spec not in only[t.name]:
                continue
            c = costs[spec]
            err = errors.get(t.name, {}).get(spec, 0.0)
            w = 0 if err <= 0 else (bins + 1 if unit == 0 else math.ceil(err / unit - 1e-9))
            if w > bins:
                continue
            cost = (c.s_per_value + c.encode_s_per_value) * t.numel
            for b in range(bins + 1 - w):
                if best[b] == inf:
                    continue
                v = best[b] + cost
                if v < new[b + w]:
                    new[b + w], arg[b + w] = v, (b, spec)
        best = new
        choice.append(arg)
    end = min(range(bins + 1), key=lambda b: best[b])
    if best[end] == inf:
        return {}
    out: dict[str, str] = {}
    for t, arg in zip(reversed(timeline.tensors), reversed(choice)):
        prev, spec = arg[end]  # type: ignore[misc]
        out[t.name] = spec
        end = prev
    return out


def decide(timeline: Timeline, costs: Mapping[str, CodecCost],
           errors: Mapping[str, Mapping[str, float]] | None = None, *, error_limit: float | None = None,
           fp32: str = "fp32", within_best: float = WITHIN_BEST,
           faster_than_fp32: float = AUTO_FASTER_THAN_FP32, max_finalists: int = 4,
           only: Mapping[str, Collection[str]] | None = None) -> Decision:
    """Search assignments of ``costs``' codecs to the timeline's tensors (module doc) and :func:`pick`.

    ``errors[name][spec]``: the squared error of ``spec`` on that tensor's gradient; ``error_limit``: the
    most the summed error of an assignment may reach (None: no limit). ``fp32`` names the uncompressed
    codec, which must be in ``costs``. Unless fp32 wins, the decision lists up to ``max_finalists``
    assignments worth trying on the job: the chosen one, then each compressed codec applied as a fixed
    codec would be (tensors of at least ``UNIFORM_MIN_NUMEL`` values), fastest predicted first.
    ``only[name]``: the choices that tensor may take (codec="auto"'s guard keeps a tensor it stepped up
    at its new precision or above); a candidate that gives it another takes the one with the fewest
    bits among them instead. Choices that differ only in their algorithm (flat or hierarchical) also
    split by size: one for the large tensors, the other for the small.
    """
    if fp32 not in costs:
        raise ValueError(f"the codec costs must include {fp32!r} (the baseline)")
    errors = errors or {}
    names = [t.name for t in timeline.tensors]
    specs = sorted(costs, key=lambda s: -costs[s].bits)
    compressed = [s for s in specs if s != fp32]
    cands: dict[tuple[str, ...], dict[str, str]] = {}
    floor = {n: min(keys, key=lambda k: (costs[k].bits, k)) for n, keys in (only or {}).items() if keys}

    def fit(a: Mapping[str, str]) -> dict[str, str]:
        return {n: s if only is None or n not in only or s in only[n] else floor[n] for n, s in a.items()}

    def add(a: Mapping[str, str]) -> None:
        a = fit(a)
        cands.setdefault(tuple(a[n] for n in names), a)

    def same_codec(a: str, b: str) -> bool:
        return a != b and split_choice(a)[0] == split_choice(b)[0]

    all32 = {n: fp32 for n in names}
    add(all32)
    sizes = sorted({t.numel for t in timeline.tensors})
    for spec in compressed:
        for low in [fp32] + [s for s in compressed if costs[s].bits > costs[spec].bits or same_codec(s, spec)]:
            for size in sizes:
                add({t.name: spec if t.numel >= size else low for t in timeline.tensors})
    if errors and error_limit is not None:
        dp = _dp(timeline, specs, costs, errors, error_limit, only=only)
        if dp:
            add(dp)
            ready = sorted(timeline.tensors, key=lambda t: t.ready_s)
            for frac in (0.1, 0.25, 0.5):
                early = {t.name for t in ready[: int(len(ready) * frac)]}
                add({n: fp32 if n in early else s for n, s in dp.items()})

    def err(a: Mapping[str, str]) -> float:
        return sum(errors.get(n, {}).get(s, 0.0) for n, s in a.items())

    def over_budget(a: Mapping[str, str]) -> bool:
        return error_limit is not None and bool(errors) and err(a) > error_limit * (1 + 1e-9)

    compute = compute_time(timeline, costs, fp32)

    def step(a: Mapping[str, str]) -> float:
        return compute + simulate(timeline, a, costs)

    fp32_step = step(all32)

    tried = []
    for a in cands.values():
        if over_budget(a):
            continue
        s = step(a)
        tried.append(Tried(a, fp32_step / s, weighted_bits(timeline, a, costs), s))
    fp32_tried = Tried(all32, 1.0, 32.0, fp32_step)
    chosen, fp32_best = pick(tried, fp32_tried, within_best=within_best, faster_than_fp32=faster_than_fp32)
    assignment = dict(chosen.assignment)
    finalists = [] if fp32_best else [("predicted best", assignment, float(chosen.extra))]
    if not fp32_best:
        for spec in compressed:  # each codec as a fixed choice would apply it: the seed's size rule
            a = fit({t.name: spec if t.numel >= UNIFORM_MIN_NUMEL else fp32 for t in timeline.tensors})
            if a == assignment or over_budget(a) or any(a == f[1] for f in finalists):
                continue
            finalists.append((f"{spec} (tensors >= {UNIFORM_MIN_NUMEL:,} values)", a, step(a)))
        finalists = finalists[:1] + sorted(finalists[1:], key=lambda f: f[2])[: max_finalists - 1]
    rows = explain(timeline, costs, assignment, compute, fp32)
    return Decision(assignment, fp32_best, float(chosen.extra), fp32_step, len(tried), rows,
                    err(assignment) if errors else None, error_limit, finalists,
                    algorithms={k: c.algorithm or ("allreduce" if c.native else "default") for k, c in costs.items()})


def explain(timeline: Timeline, costs: Mapping[str, CodecCost], assignment: Mapping[str, str], compute: float,
            fp32: str = "fp32") -> list[dict[str, Any]]:
    """Per tensor: its codec and the predicted saving (seconds a step gains from that codec against
    sending this tensor in fp32, the rest unchanged)."""
    base = compute + simulate(timeline, assignment, costs)
    rows = []
    for t in timeline.tensors:
        spec = assignment[t.name]
        saving = 0.0
        if spec != fp32:
            saving = compute + simulate(timeline, {**assignment, t.name: fp32}, costs) - base
        c = costs[spec]
        rows.append({"name": t.name, "numel": t.numel, "codec": spec, "saving_s": saving,
                     "algorithm": c.algorithm or ("allreduce" if c.native else "default")})
    return rows
