"""``codec="auto"``: the DDP hook measures this job, then chooses per parameter tensor a codec that pays.

    state = lowbit.ddp.register(model, codec="auto")                       # fp32, bf16, 8-bit QSGD
    state = lowbit.ddp.register(model, codec="auto", allow=["fp32", "bf16", "qsgd:bits=8", "qsgd:bits=4"])

How (on the job's own first steps, nothing extra for the user to run):

1. **Measure** (``measure_steps`` steps, default 3, after DDP's bucket rebuild and two warm-up steps,
   with DDP's own fp32 allreduce: :func:`lowbit.ddp.register` installs no hook yet): when each parameter's gradient became
   ready (post-accumulate-grad hooks), counted from the forward pass's start (CUDA events on the compute
   stream on a GPU, the host clock on a CPU), and the whole step; on the last of them a sample of every
   gradient, for each allowed codec's squared error.
2. **Probe** (once, at the next forward pass, all ranks together): each allowed codec's exchange (the
   collective the hook would run: encode, send, decode) at two message sizes on this group's link, and
   its encoding alone, timed with the device synchronised.
3. **Agree**: every rank's measurements are gathered and averaged in rank order, so every rank decides
   the same from the same numbers, however differently it measured.
4. **Predict** with :func:`lowbit.choose.decide`: a replay of the step for each candidate assignment on
   the measured timeline; L-GreCo's dynamic program under an error budget (``error_budget`` times uniform
   8-bit QSGD's error, default 1.0). If nothing is predicted at least 2 % faster than fp32, that is the
   decision and no hook is ever installed: plain DDP.
5. **Try**: otherwise lowbit's hook is registered and the finalists (the predicted best, each allowed
   codec as a fixed codec would apply it) run one warm-up and ``trial_steps`` timed steps each;
   :func:`lowbit.choose.pick` (the rule ``lowbit advise`` uses) chooses on the measured step times against
   the measured fp32 step.

The decision is logged once (rank 0, ``logging.INFO``, a table: tensor, numel, codec, predicted saving,
the finalists predicted and measured; a ``WARNING`` with the reason when it keeps fp32 everywhere), kept
on ``state.auto.decision``, saved in ``state.state_dict()`` (a resumed run uses it without measuring
again) and, with ``remeasure_every=N``, probed and tried again every N steps, fp32 and the current plan
among the finalists, in case the link changed (the backward timeline and the errors are kept); a tensor
whose codec changes then starts with an empty error-feedback residual. A hook registered by a framework
(:func:`lowbit.ddp.make_state`) reduces in fp32 until the decision.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Mapping
from typing import Any, Callable, Optional, Protocol, Sequence

import torch
import torch.distributed as dist

from lowbit.choose import (AUTO_FASTER_THAN_FP32, WITHIN_BEST, CodecCost, Decision, TensorTiming, Timeline, Tried,
                           compute_time, ddp_buckets, decide, explain, pick, simulate, weighted_bits)
from lowbit.codecs.base import Codec, get_codec
from lowbit.comm import collectives as C
from lowbit.comm.allreduce import resolve_algorithm, start

__all__ = ["AutoTuner", "DEFAULT_ALLOW", "BASELINE", "TunedState"]

log = logging.getLogger("lowbit.ddp")

#: what ``codec="auto"`` chooses among unless told otherwise
DEFAULT_ALLOW = ("fp32", "bf16", "qsgd:bits=8,bucket=512")
#: the error budget is relative to this codec everywhere (L-GreCo's uniform baseline)
BASELINE = "qsgd:bits=8,bucket=512"
#: values of each tensor whose compression error is measured (a prefix; scaled to the tensor)
ERROR_SAMPLE = 1 << 16
_FP32 = get_codec("fp32").spec


class TunedState(Protocol):
    """What ``codec="auto"`` reads from the DDP hook's state and the methods it changes it through:
    :class:`lowbit.ddp.LowbitState` (a layer above, so named here by its shape, not imported)."""

    plan: Mapping[str, Codec]             # parameter name -> codec (read; changed through set_plan)
    order: Mapping[str, int]              # parameter name -> position in model order
    process_group: Optional[dist.ProcessGroup]
    iter: int                             # read; changed through count_step / hook_starts
    bucket_bytes: float                   # DDP's bucket caps
    first_bucket_bytes: float

    @property
    def start_iter(self) -> int: ...
    @property
    def algorithm(self) -> str: ...
    @property
    def message_mb(self) -> Any: ...
    @property
    def node_size(self) -> Optional[int]: ...
    @property
    def numels(self) -> Mapping[str, int]: ...
    def world(self) -> tuple[int, int]: ...
    def set_plan(self, assignment: dict[str, str]) -> None: ...
    def count_step(self, step: int) -> None: ...
    def hook_starts(self, step: int) -> None: ...


class AutoTuner:
    """The measurements and the decision of ``codec="auto"`` (module doc); lives on ``state.auto``.
    Its options come validated (:class:`lowbit.ddp.DDPConfig`); ``allow`` is kept as canonical specs,
    fp32 first unless listed."""

    def __init__(self, allow: Optional[Sequence[str]] = None, error_budget: Optional[float] = 1.0,
                 measure_steps: int = 3, remeasure_every: int = 0,
                 faster_than_fp32: float = AUTO_FASTER_THAN_FP32) -> None:
        canon = [get_codec(s).spec for s in (DEFAULT_ALLOW if allow is None else allow)]
        if _FP32 not in canon:
            canon.insert(0, _FP32)
        self.allow = list(dict.fromkeys(canon))
        self.error_budget = error_budget
        self.measure_steps = measure_steps
        self.remeasure_every = remeasure_every
        self.faster_than_fp32 = faster_than_fp32
        self._said_fp32 = False  # the warning that auto keeps fp32 everywhere, given once
        self.warmup_steps = 2  # steps after start_iter not measured: DDP's first steps run slow (cuDNN
        #                        autotuning, NCCL's socket connections, allocator growth); measured from
        #                        the first step on, auto's fp32 step was 7-17 % above the steady one
        #                        (ResNet-50, AlexNet, 2x H100 over sockets; docs/results.md)
        self.trial_steps = 2   # timed steps per finalist (after one warm-up step); 0: trust the prediction
        self.max_trials = 4    # finalists tried at most
        self.phase = "measure"  # -> "trial" -> "done"
        self._pending: Optional[Decision] = None
        self._trial, self._marks, self._trial_times = 0, [], []  # type: ignore[var-annotated]
        self.decision: Optional[Decision] = None
        self.decided_iter: Optional[int] = None
        self.measured: Optional[dict[str, Any]] = None  # the agreed measurements the decision came from
        self._steps: list[dict[str, Any]] = []  # per measured step: forward mark and gradient marks
        self._samples: dict[str, tuple[torch.Tensor, int]] = {}
        self.forwards = 0  # training forward passes seen (= the step about to run)
        self._handle: Any = None
        self._grad_handles: list[Any] = []
        self._install: Optional[Callable[[], None]] = None
        self._state: Optional[TunedState] = None
        self._device = torch.device("cpu")

    # ------------------------------------------------------------------------------ configuration
    def config(self) -> dict[str, Any]:
        return {"allow": self.allow, "error_budget": self.error_budget, "measure_steps": self.measure_steps,
                "remeasure_every": self.remeasure_every}

    def attach(self, module: torch.nn.Module, state: TunedState,
               install: Optional[Callable[[], None]] = None) -> None:
        """Watch ``module`` (the model DDP wraps): count its training forward passes, mark when each one
        starts and when each parameter's gradient is ready (post-accumulate-grad hooks), and decide at the
        forward pass after the measured ones. ``install``: registers lowbit's hook on the DDP model, called
        only once compression pays (until then DDP's own allreduce runs untouched); None: the hook is
        already installed and reduces in fp32 until the decision. DDP's bucket caps are the state's."""
        self.detach()
        self._state, self._install = state, install
        self._device = _device_of(module)
        self._handle = module.register_forward_pre_hook(self._on_forward)
        self._grad_handles = [p.register_post_accumulate_grad_hook(self._on_grad(name))
                              for name, p in module.named_parameters() if p.requires_grad and name in state.plan]

    def last_decision_step(self, start_iter: int) -> int:
        """The step whose forward pass takes the first decision at the latest: ``start_iter``, the warm-up
        and measured steps, then every finalist's warm-up and timed steps (fewer finalists decide earlier)."""
        return start_iter + self.warmup_steps + self.measure_steps + (1 + self.trial_steps) * self.max_trials

    def detach(self) -> None:
        """Remove the hooks on the module (measuring stops)."""
        self._release(keep_forward=False)

    def _release(self, keep_forward: bool) -> None:
        """Remove the gradient hooks and, unless ``keep_forward`` (re-measuring counts steps), the
        forward pre-hook."""
        for h in self._grad_handles:
            h.remove()
        self._grad_handles = []
        if self._handle is not None and not keep_forward:
            self._handle.remove()
            self._handle = None

    def _on_grad(self, name: str) -> Callable[[torch.Tensor], None]:
        def hook(p: torch.Tensor) -> None:
            step = self.forwards - 1
            st = self._state
            first = st.start_iter + self.warmup_steps
            if self.phase != "measure" or not first <= step < first + self.measure_steps:
                return
            if self._steps:
                self._steps[-1]["grads"].append((name, _mark(self._device)))
            if step == first + self.measure_steps - 1 and p.grad is not None:
                g = p.grad.reshape(-1)
                self._samples[name] = (g[: min(g.numel(), ERROR_SAMPLE)].detach().float().clone(), g.numel())
        return hook

    def _on_forward(self, module: torch.nn.Module, _inp: Any) -> None:
        if not (module.training and torch.is_grad_enabled()):
            return  # evaluation passes are not steps
        step = self.forwards
        self.forwards += 1
        st = self._state
        if self._install is not None:  # lowbit's hook is not installed (yet): count the steps for it
            st.count_step(step)
        if self.phase == "measure":
            first = st.start_iter + self.warmup_steps
            if step >= first:
                self._steps.append({"forward": _mark(self._device), "grads": []})
            if step >= first + self.measure_steps:
                self._predict(st, step)
        elif self.phase == "trial":
            self._trial_mark(st, step)
        elif self.remeasure_every and self.decided_iter is not None and \
                step - self.decided_iter >= self.remeasure_every:
            self._predict(st, step)

    # ------------------------------------------------------------------------------ steps 2-5
    def _predict(self, state: TunedState, step: int) -> None:
        """Probe, agree and predict (module doc); fp32 when nothing pays, else try the finalists."""
        group = state.process_group
        device = self._device
        rank, world = C.world(group)
        if self.measured is None:
            timeline = self._timeline(state)
            specs = self.allow + [get_codec(BASELINE).spec]
            errors = {name: _errors(x, n, specs) for name, (x, n) in self._samples.items()}
            self._samples = {}
        else:  # re-measuring: the link only
            timeline = _timeline_of(self.measured, state.message_mb, self._rides(state))
            errors = self.measured["errors"]
        mine = {"tensors": [dict(name=t.name, numel=t.numel, ready_s=t.ready_s, bucket=t.bucket)
                            for t in timeline.tensors],
                "backward_end_s": timeline.backward_end_s, "step_s": timeline.step_s,
                "costs": self._probe(state, group, device, timeline, world),
                "errors": errors}
        agreed = _average(C.all_gather_object(mine, group))  # the same numbers on every rank
        costs = {s: CodecCost(**c) for s, c in agreed["costs"].items()}
        timeline = _timeline_of(agreed, state.message_mb, self._rides(state))
        limit = None
        base = get_codec(BASELINE).spec
        if self.error_budget is not None and agreed["errors"]:
            limit = self.error_budget * sum(e.get(base, 0.0) for e in agreed["errors"].values())
        pred = decide(timeline, costs, agreed["errors"], error_limit=limit, fp32=_FP32,
                      within_best=WITHIN_BEST, faster_than_fp32=self.faster_than_fp32,
                      max_finalists=self.max_trials)
        self.measured = agreed
        self._steps = []
        self._release(keep_forward=True)  # (the forward pre-hook times the trials)
        finalists = list(pred.finalists)
        if self.decision is not None:  # re-measuring: the current plan and fp32 are tried again too
            if not self.decision.fp32_is_best and all(a != self.decision.assignment for _, a, _ in finalists):
                finalists.append(("current", dict(self.decision.assignment), float("nan")))
            finalists.append(("fp32", {n: _FP32 for n in state.plan}, pred.fp32_step_s))
        pred.measured_s = {"fp32": timeline.step_s}
        if pred.fp32_is_best and (self.decision is None or self.decision.fp32_is_best):
            pred.chosen = "fp32 (predicted: nothing pays)"
            self._finish(state, step, pred)
            return
        if self.trial_steps == 0:
            pred.chosen = "predicted best (not tried: trial_steps=0)"
            self._finish(state, step, pred)
            return
        pred.finalists = finalists
        self._pending, self._trial, self._marks, self._trial_times = pred, 0, [], []
        self.phase = "trial"
        self._maybe_install(state, step)
        self._trial_mark(state, step)

    def _trial_mark(self, state: TunedState, step: int) -> None:
        """At a forward pass during the trials: the first step of each finalist warms up, the next
        ``trial_steps`` are timed (forward start to forward start); then the next finalist."""
        pred = self._pending
        if not self._marks:
            state.set_plan(pred.finalists[self._trial][1])
        self._marks.append(_mark(self._device))
        if len(self._marks) < self.trial_steps + 2:
            return
        periods = [_elapsed(a, b) for a, b in zip(self._marks[1:], self._marks[2:])]
        self._trial_times.append(statistics.median(periods))
        self._trial += 1
        self._marks = []
        if self._trial < len(pred.finalists):
            self._trial_mark(state, step)  # this forward pass starts the next finalist's warm-up step
            return
        times = _average(C.all_gather_object(self._trial_times, state.process_group))  # agree
        for (label, _, _), t in zip(pred.finalists, times):
            pred.measured_s[label] = t  # (a re-measured "fp32" replaces the first measurement)
        fp32_s = pred.measured_s["fp32"]
        timeline = _timeline_of(self.measured, state.message_mb, self._rides(state))
        costs = {s: CodecCost(**c) for s, c in self.measured["costs"].items()}
        tried = [Tried(assignment, fp32_s / t, weighted_bits(timeline, assignment, costs), label)
                 for (label, assignment, _), t in zip(pred.finalists, times) if label != "fp32"]
        fp32 = Tried({n: _FP32 for n in state.plan}, 1.0, 32.0, "fp32")
        best, none_pays = pick(tried, fp32, within_best=WITHIN_BEST, faster_than_fp32=self.faster_than_fp32)
        pred.chosen = f"{best.extra} (measured)" if not none_pays else "fp32 (measured: nothing paid)"
        if best.extra != pred.finalists[0][0] or none_pays:  # the predicted best lost: describe the winner
            compute = compute_time(timeline, costs, _FP32)
            pred.assignment = dict(best.assignment)
            pred.rows = explain(timeline, costs, pred.assignment, compute, _FP32)
            pred.step_s = compute + simulate(timeline, pred.assignment, costs)
            pred.fp32_is_best = none_pays
        self._pending = None
        self._finish(state, step, pred)

    def _finish(self, state: TunedState, step: int, decision: Decision) -> None:
        rank, world = C.world(state.process_group)
        self.decision, self.decided_iter, self.phase = decision, step, "done"
        self._release(keep_forward=bool(self.remeasure_every))
        state.set_plan(decision.assignment)
        if rank == 0 and decision.fp32_is_best and not getattr(self, "_said_fp32", False):  # (older pickles)
            # the one outcome where auto compresses nothing: said once, as a warning, with the reason
            self._said_fp32 = True
            log.warning("lowbit.ddp codec='auto' at step %d (%d ranks) keeps fp32 everywhere, so gradients are not "
                        "compressed: no allowed codec (%s) was %s to make the step at least %.0f %% faster than "
                        "fp32 (%.2f ms measured); DDP's fp32 allreduce runs\n%s", step, world, ", ".join(self.allow),
                        "measured" if "measured" in decision.chosen else "predicted",
                        (self.faster_than_fp32 - 1) * 100, decision.measured_s.get("fp32", decision.fp32_step_s) * 1e3,
                        decision.table())
        elif rank == 0:
            log.info("lowbit.ddp codec='auto' at step %d (%d ranks):\n%s", step, world, decision.table())
        self._maybe_install(state, step)

    def _maybe_install(self, state: TunedState, step: int) -> None:
        """Register lowbit's hook once something compressed is to run (never again after)."""
        if self._install is None:
            return
        if self.phase == "done" and (self.decision is None or self.decision.fp32_is_best):
            return
        state.hook_starts(step)  # the hook counts steps from here on
        install, self._install = self._install, None
        install()

    def _timeline(self, state: TunedState) -> Timeline:
        """Median gradient-ready offsets over the measured steps (the first measured step is a warm-up
        when there are more than one); DDP's buckets rebuilt from the ready order and the bucket cap."""
        done = [(s, nxt) for s, nxt in zip(self._steps, self._steps[1:]) if s["grads"]]
        if len(done) > 1:
            done = done[1:]
        if not done:
            raise RuntimeError("lowbit codec='auto': no step was measured (no gradient became ready after a "
                               "training forward pass of the registered module)")
        offsets: dict[str, list[float]] = {}
        periods = []
        for s, nxt in done:
            f = s["forward"]
            for name, m in s["grads"]:
                offsets.setdefault(name, []).append(_elapsed(f, m))
            periods.append(_elapsed(f, nxt["forward"]))
        ready = {name: statistics.median(v) for name, v in offsets.items()}
        names = sorted(ready, key=lambda n: (ready[n], -state.order.get(n, 0)))
        cut = ddp_buckets([state.numels[n] for n in names], state.bucket_bytes, first_bytes=state.first_bucket_bytes)
        bucket_ready: dict[int, float] = {}  # a bucket is handed to the hook when its last gradient is ready
        for n, b in zip(names, cut):
            bucket_ready[b] = max(bucket_ready.get(b, ready[n]), ready[n])
        tensors = [TensorTiming(n, state.numels[n], bucket_ready[b], b) for n, b in zip(names, cut)]
        backward_end = max(ready.values())
        step = statistics.median(periods)
        return Timeline(tuple(tensors), backward_end, max(step, backward_end), state.message_mb, self._rides(state))

    def _rides(self, state: TunedState) -> bool:
        """Whether the fp32 tensors would ride in the quantised codecs' messages (allgather)."""
        quantised = [get_codec(s) for s in self.allow if not get_codec(s).sums_on_wire]
        k = state.world()[1]
        return bool(quantised) and resolve_algorithm(state.algorithm, quantised[0], k) == "allgather"

    def _probe(self, state: TunedState, group: Optional[dist.ProcessGroup], device: torch.device,
               timeline: Timeline, k: int) -> dict[str, dict[str, Any]]:
        """Each allowed codec's exchange at two sizes, and its encoding alone: fitted as seconds per message
        plus seconds per value."""
        total = sum(t.numel for t in timeline.tensors)
        big = int(min(max(total // 3, 1 << 16), 1 << 24))
        small = max(big // 16, 1 << 12)
        def probe(data: torch.Tensor) -> dict[str, dict[str, Any]]:
            out: dict[str, dict[str, Any]] = {}
            for spec in self.allow:
                codec = get_codec(spec)
                algo = "allreduce" if codec.sums_on_wire else resolve_algorithm(state.algorithm, codec, k)
                times = [_min_time(lambda n=n: start(data[:n].clone(), codec, group, algo, "mean",
                                                     node_size=state.node_size).wait(), device)
                         for n in (small, big)]
                enc = 0.0 if codec.sums_on_wire else _min_time(lambda: codec.encode(data, seed=1), device) / big
                slope = max((times[1] - times[0]) / (big - small), 0.0)
                alpha = max(times[0] - slope * small, 0.0)
                link = max(slope - enc, slope * 0.05)  # what is left for the link and decoding
                out[spec] = {"spec": spec, "bits": float(codec.bits_per_value(1 << 20)),
                             "native": bool(codec.sums_on_wire), "alpha_s": alpha, "s_per_value": link,
                             "encode_s_per_value": enc, "per_tensor": bool(codec.per_tensor)}
            return out

        out = probe(torch.randn(big, generator=torch.Generator(device="cpu").manual_seed(12345)).to(device))
        if device.type == "cuda":  # hand the probes' buffers back: training's allocations stay as they were
            torch.cuda.synchronize(device)
            torch.cuda.empty_cache()
        return out

    # ------------------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        return {"config": self.config(), "decided_iter": self.decided_iter, "measured": self.measured,
                "decision": None if self.decision is None else self.decision.to_dict()}

    def load_state_dict(self, state: TunedState, d: dict[str, Any]) -> None:
        if not isinstance(d, dict) or d.get("config") != self.config():
            raise ValueError(f"lowbit checkpoint: codec='auto' was saved with {d.get('config') if isinstance(d, dict) else d!r}, "
                             f"this state has {self.config()}")
        if d.get("decision") is None:
            return  # saved while still measuring: measure again
        dec = Decision(**d["decision"])
        unknown = sorted(set(dec.assignment) - set(state.plan))
        bad = sorted({s for s in dec.assignment.values() if s not in self.allow})
        if unknown or bad or set(dec.assignment) != set(state.plan):
            raise ValueError("lowbit checkpoint: the codec='auto' decision does not fit this model/allow list "
                             f"(unknown tensors {unknown[:3]}, codecs not allowed {bad})")
        self.decision, self.measured, self.decided_iter = dec, d.get("measured"), d.get("decided_iter")
        self.phase, self._pending, self._marks, self._steps, self._samples = "done", None, [], [], {}
        self._release(keep_forward=bool(self.remeasure_every))
        state.set_plan(dec.assignment)
        self._maybe_install(state, self.decided_iter or 0)

    def __getstate__(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        for k in ("_handle", "_install", "_state"):
            d[k] = None
        d["_grad_handles"], d["_steps"], d["_samples"], d["_marks"] = [], [], {}, []
        if d.get("phase") == "trial":  # unpickled mid-trial: measure again
            d["phase"], d["_pending"], d["measured"] = "measure", None, None
        return d


# ------------------------------------------------------------------------------------------ helpers
def _timeline_of(d: dict[str, Any], message_mb: Any, ride: bool = False) -> Timeline:
    return Timeline(tuple(TensorTiming(**t) for t in d["tensors"]), d["backward_end_s"], d["step_s"], message_mb,
                    ride)


def _device_of(module: torch.nn.Module) -> torch.device:
    for p in module.parameters():
        return p.device
    return torch.device("cpu")


def _mark(device: torch.device) -> Any:
    """A point on the compute timeline: a CUDA event on the current stream, or the host clock."""
    if device.type == "cuda":
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev
    return time.perf_counter()


def _elapsed(a: Any, b: Any) -> float:
    if isinstance(a, float):
        return b - a
    b.synchronize()
    return a.elapsed_time(b) / 1e3


def _min_time(fn: Callable[[], Any], device: torch.device, reps: int = 5) -> float:
    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    fn()  # warm-up: kernels compiled, buffers allocated
    out = []
    for _ in range(reps):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        out.append(time.perf_counter() - t0)
    return min(out)  # the least disturbed run: other processes share these cores and links


def _errors(x: torch.Tensor, n: int, specs: Sequence[str]) -> dict[str, float]:
    """Each codec's squared error on ``x`` (a prefix of a gradient of ``n`` values), scaled to ``n``."""
    x = x.float().contiguous()
    scale = n / max(x.numel(), 1)
    out = {}
    for spec in specs:
        codec = get_codec(spec)
        if spec == _FP32 or x.numel() == 0:
            out[spec] = 0.0
            continue
        y = codec.decode(codec.encode(x, seed=7), x.numel())
        out[spec] = float(((y - x) ** 2).sum()) * scale
    return out


def _average(per_rank: list[Any]) -> Any:
    """Element-wise mean of the ranks' measurements (same structure on every rank), in rank order."""
    first = per_rank[0]
    if isinstance(first, dict):
        keys = list(first)
        for r in per_rank[1:]:
            if not isinstance(r, dict) or list(r) != keys:
                raise RuntimeError("lowbit codec='auto': the ranks measured different structures "
                                   f"({sorted(first)[:5]} vs {sorted(r)[:5] if isinstance(r, dict) else r!r})")
        return {k: _average([r[k] for r in per_rank]) for k in keys}
    if isinstance(first, list):
        return [_average(list(col)) for col in zip(*per_rank)]
    if isinstance(first, bool) or isinstance(first, str) or first is None:
        return first
    if isinstance(first, (int, float)):
        if isinstance(first, int) and all(r == first for r in per_rank):
            return first
        return sum(float(r) for r in per_rank) / len(per_rank)
    return first
