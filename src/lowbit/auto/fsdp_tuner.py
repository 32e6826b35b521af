"""``codec="auto"`` for :mod:`lowbit.fsdp`: the adapter that chooses each FSDP module's gradient exchange
by measurement. The options, the clock, the estimates, the trials, the decision rules and the guard are
:mod:`lowbit.auto`'s, shared with DDP; what is FSDP's own is here: steps counted on reduce-scatters, the
samples of their inputs, admission per module and the finalists.

    state = lowbit.fsdp.register(model, codec="auto")                      # native, bf16, 8-bit QSGD
    state = lowbit.fsdp.register(model, codec="auto", auto_level="bold")   # ... 4-bit QSGD, 1bitSGD*
    state = lowbit.fsdp.register(model, codec="auto", allow=["bf16"])      # native or bf16
    state.auto.report_loss(loss)                                           # optional, each step: the guard

The rules of DDP's ``codec="auto"`` (:mod:`lowbit.auto.ddp_tuner`) on FSDP's unit of communication, one
reduce-scatter per ``fully_shard`` module. The candidates: FSDP's own reduce-scatter in its reduce dtype
(``"native"``, always allowed), and the codecs of ``allow``, by default those of the level
(:func:`lowbit.auto.options.default_allow`): ``"conservative"`` (the default) bf16 on the wire and 8-bit QSGD,
``"bold"`` also 4-bit QSGD and 1bitSGD* (error feedback on for the biased codecs). Measured on the job's
own first steps, nothing extra to run. A step is the training forward passes up to one whose modules
reduce-scatter (with gradient accumulation, the micro-batches run under ``set_requires_gradient_sync(False)``
belong to the step whose last pass reduce-scatters): samples, trials and the guard's checks are taken on
steps, so on gradients that crossed the wire.

1. **Warm up** (``warmup_steps``, 2): every module reduce-scatters natively. On the last of them each
   module's reduce-scatter input (this rank's unsharded gradient) is sampled (:func:`lowbit.auto.estimates.
   spread_sample`; the
   values the policy keeps exact read as zeros: they cross exactly) and each codec's squared error on
   the sample measured. A module without a sample, or with a non-finite one (inf/NaN gradients), on any
   rank puts admission off one step; not finite again, it is admitted nothing (native; nan in the table).
2. **Agree and admit**: the ranks' errors are averaged in rank order, so every rank holds the same
   numbers. A codec is admitted for a module when its error there is at most ``error_budget`` (default 1)
   times 8-bit QSGD's (conservative), or times the larger of that and the gradients' sampling noise
   between the ranks (bold, :func:`lowbit.auto.estimates.sampling_noise`): by measured error, not by codec
   name. Bold's noise allowance is for unbiased codecs: a biased one (1bitSGD*, top-k) is held to the
   default limit (:func:`lowbit.auto.decide.module_limit`). DDP's budget bounds the error summed over the tensors, this
   one each module's (``None``: no limit, every allowed codec admitted).
3. **Finalists**: native everywhere, and for each codec, every module of at least 10,000 values taking it
   where it is admitted (else the next admitted one up the ladder, more bits; native at the top), the
   smaller modules native.
4. **Try**, by DDP's rule (:class:`lowbit.auto.trials.Trials`): each finalist runs one warm-up step and
   ``trial_steps`` (2) timed steps, forward start to forward start (the whole step), one finalist after
   another; a rank's time of a finalist is the median of its timed steps, and the ranks' times are
   averaged; finalists within 10 % of the fastest run a second pass, in reverse order, and count with
   the mean of both (``retried``). :func:`lowbit.auto.decide.choose_measured` chooses, as for DDP:
   native unless a finalist is at least 2 % faster; of the finalists within 3 % of the fastest, the one
   with the most bits (the more precise).

Measuring takes ``warmup_steps + (1 + trial_steps) x (finalists + retried)`` steps (11 at the
conservative level without a second pass, 17 at the bold one; at most twice the trials), some of them
under a slower candidate: a few steps' time, once a job. The decision is
logged once (rank 0, INFO, :meth:`FSDPAuto.table`; WARNING, with the reason, when it keeps FSDP's own
reduce-scatter everywhere), kept on ``state.auto`` and saved in
``state.state_dict()``: a resumed job does not measure again.

5. **Guard** (``guard_every`` steps apart, default 50; 0: off) while a module is compressed: one step's
   reduce-scatter inputs are sampled, and :class:`lowbit.auto.guard.Guard`'s rule, on the ranks' numbers
   summed in rank order (so every rank alike), steps a module up the ladder (native at the top): a
   gradient not finite at two checks in a row or a non-finite residual (straight to native), the codec's
   error grown past 4x its value at the decision, an error-feedback residual growing; and the loss the
   user may report (:meth:`FSDPAuto.report_loss`), averaged over the ranks: not finite on any rank, every
   compressed module to native; 1.5x its lowest mean so far (the steps before the decision included) and
   not coming down, every compressed module one step up. Each change is logged once (rank 0, WARNING),
   kept in ``state.auto.changes`` and ``state.auto.assignment`` and in checkpoints.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from typing import Any, Optional, Protocol

import torch
import torch.distributed as dist

from lowbit.auto.clock import Clock, DeviceClock
from lowbit.auto.decide import Measured, choose_measured, module_limit
from lowbit.auto.estimates import agree, codec_errors, sampling_noise, squared_norm
from lowbit.auto.guard import Guard, ReportedLoss, combine, local_entry
from lowbit.auto.options import BASELINE, FSDP_WORDS, check_auto_options, default_allow
from lowbit.auto.trials import TRIAL_STEPS, Trials
from lowbit.choose import AUTO_FASTER_THAN_FP32, UNIFORM_MIN_NUMEL
from lowbit.codecs.base import get_codec
from lowbit.comm import collectives as C

__all__ = ["FSDPAuto", "NATIVE", "check_options"]

log = logging.getLogger("lowbit.fsdp")

#: the choice of FSDP's own reduce-scatter (in its reduce dtype): the top of the ladder
NATIVE = "native"
_FP32 = get_codec("fp32").spec


class Exchange(Protocol):
    """What the tuner asks of a module's reduce-scatter (:class:`lowbit.fsdp.LowbitReduceScatter`, a layer
    that imports this one, so named here by its shape)."""

    name: str
    choice: str  # NATIVE or a codec spec

    def set_choice(self, key: str) -> None: ...
    def sample(self, rows: torch.Tensor) -> tuple[torch.Tensor, int]: ...
    def residual_sq(self) -> Optional[torch.Tensor]: ...


def check_options(allow: Any, error_budget: Any, level: Any, guard_every: Any) -> None:
    """codec="auto"'s shared options (:func:`lowbit.auto.options.check_auto_options`), in FSDP's words
    (:data:`lowbit.auto.options.FSDP_WORDS`): native is always allowed, and the error budget multiplies
    each module's 8-bit QSGD error."""
    check_auto_options(allow, error_budget, level, guard_every, **FSDP_WORDS)


def _specs(codecs: Sequence[Any]) -> list[str]:
    """``allow``'s codecs as canonical specs, in order, once each; ``"native"`` and ``"fp32"`` dropped
    (native is always allowed, and is what fp32 means here: FSDP's own reduce-scatter)."""
    out = [NATIVE if c == NATIVE else get_codec(c).spec for c in codecs]
    return [s for s in dict.fromkeys(out) if s not in (NATIVE, _FP32)]


def _ratio(err: float, limit: float) -> float:
    """An error over its limit for the table: NaN where either is unknown or not finite (not admitted)."""
    if math.isnan(err) or math.isnan(limit) or math.isinf(err):
        return math.nan
    return err / limit if limit > 0 else (0.0 if err == 0 else math.inf)


def _short(key: str) -> str:
    """A choice's short label (``qsgd8/512``, ``native``)."""
    return key if key in (NATIVE, "") else get_codec(key).short_label


class FSDPAuto:
    """The measurements, decision and guard of ``lowbit.fsdp.register(..., codec="auto")`` (module doc), on
    ``state.auto``: ``finalists`` (label -> per-module choice) with their ``measured_s`` (seconds a step,
    averaged over the ranks; ``retried``: those that ran a second pass), the agreed ``errors`` (module ->
    codec -> squared error), ``norms``, ``noise`` and ``limits``, ``decision`` (module -> choice, at
    ``decided_iter``), ``assignment`` (what runs now: the decision with the guard's step-ups, listed in
    ``changes``). ``allow``: the codecs to choose among besides native (default: the level's; ``"native"``
    and ``"fp32"`` name native, always allowed), kept as canonical specs; ``error_budget``: the admission
    limit's factor (None: no limit); ``clock``: where the trials read time (default: the device's,
    :class:`lowbit.auto.clock.DeviceClock`). The options come checked by :func:`lowbit.fsdp.register`."""

    def __init__(self, level: str = "conservative", guard_every: int = 50, allow: Optional[Sequence[Any]] = None,
                 error_budget: Optional[float] = 1.0, *, clock: Optional[Clock] = None) -> None:
        check_options(allow, error_budget, level, guard_every)
        self.level, self.guard_every = level, guard_every
        self.allow = _specs(default_allow(level) if allow is None else allow)
        self._default_allow = self.allow == _specs(default_allow(level))
        self.error_budget = None if error_budget is None else float(error_budget)
        self.bits = {s: float(get_codec(s).bits_per_value(1 << 20)) for s in self.allow}
        self.guard = Guard(guard_every, list(self.bits.items()), fp32=NATIVE)
        self.warmup_steps, self.trial_steps = 2, TRIAL_STEPS
        self.clock = clock
        self.phase = "measure"  # -> "trial" -> "done"
        # steps: a step is the training forward passes up to one whose modules reduce-scatter (gradient
        # accumulation's micro-batches under set_requires_gradient_sync(False) belong to the step they end in)
        self.steps = 0  # steps completed (= the step running or about to run)
        self._scattered = False  # reduce-scatters ran since the last training forward pass (it ended a step)
        self._starting = True  # the next training forward pass starts step `steps` (the first; after a load)
        self._deferred = False  # admission put off once: a module had no sample or a non-finite one
        self.exchanges: dict[str, Exchange] = {}
        self.numels: dict[str, int] = {}  # module -> values of its reduce-scatter (all ranks' rows)
        self.errors: dict[str, dict[str, float]] = {}
        self.norms: dict[str, float] = {}
        self.noise: dict[str, float] = {}
        self.limits: dict[str, float] = {}
        self.finalists: list[tuple[str, dict[str, str]]] = []
        self.measured_s: dict[str, float] = {}
        self.retried: list[str] = []  # the finalists (labels) that ran a second pass
        self.chosen = ""
        self.decision: Optional[dict[str, str]] = None
        self.decided_iter: Optional[int] = None
        self.assignment: dict[str, str] = {}
        self._group: Optional[dist.ProcessGroup] = None
        self._device = torch.device("cpu")
        self._samples: dict[str, tuple[torch.Tensor, int]] = {}
        self._seen: dict[str, tuple[torch.Tensor, int, torch.Tensor, Optional[torch.Tensor]]] = {}
        self._watch: Optional[int] = None  # the step whose gradients the guard samples
        self.trials: Optional[Trials] = None  # the trials running
        self._losses = ReportedLoss()  # reported since the last check (not saved: the guard's references are)

    def config(self) -> dict[str, Any]:
        out: dict[str, Any] = {"level": self.level, "guard_every": self.guard_every}
        # (allow and error_budget only where not the defaults: checkpoints saved before they existed still load)
        if not self._default_allow:
            out["allow"] = list(self.allow)
        if self.error_budget != 1.0:
            out["error_budget"] = self.error_budget
        return out

    def report_loss(self, loss: Any) -> None:
        """Report this step's training loss (a float or a tensor: added on its device, no host sync), for
        the guard's loss rule (:mod:`lowbit.auto.guard`); optional. Call it once a step, on every rank."""
        self._losses.add(loss)

    @property
    def changes(self) -> list[dict[str, Any]]:
        """The guard's step-ups so far: each a dict of step, tensor (the module), from, to and reason."""
        return self.guard.changes

    def attach(self, model: torch.nn.Module, group: dist.ProcessGroup, device: torch.device,
               exchanges: Sequence[tuple[str, int, Exchange]]) -> None:
        """Tune ``exchanges`` ((module, values, its reduce-scatter)), counting ``model``'s training forward
        passes; every module starts native."""
        self._group, self._device = group, device
        if self.clock is None:
            self.clock = DeviceClock(device)
        for name, numel, ex in exchanges:
            if numel == 0:  # a module without parameters of its own (a root over sharded blocks): it never
                ex.set_choice(NATIVE)  # reduce-scatters, so there is nothing to sample or decide
                continue
            self.exchanges[name], self.numels[name] = ex, numel
        self._apply({n: NATIVE for n in self.exchanges})
        model.register_forward_pre_hook(self._on_forward)

    # ------------------------------------------------------------------------------ the steps
    def _on_forward(self, module: torch.nn.Module, _inp: Any) -> None:
        if not (module.training and torch.is_grad_enabled()):
            return  # evaluation passes are not steps
        if self._scattered:
            self._scattered, self._starting = False, True
            self.steps += 1
        if not self._starting:
            return  # no reduce-scatter since the last pass (a micro-batch without sync): the same step goes on
        self._starting = False
        step = self.steps  # (every rank runs the same reduce-scatters: the same step, the same collectives)
        if self.phase == "measure" and step >= self.warmup_steps:
            if self._admit():
                self._trial_mark(step)
        elif self.phase == "trial":
            self._trial_mark(step)
        elif self._guarding():
            self._guard_step(step)

    def observe(self, ex: Exchange, rows: torch.Tensor) -> None:
        """Called by each reduce-scatter with this rank's gradient rows ((K, S)): the step it belongs to has
        reduce-scattered (it ends at the next training forward pass). Sampled on the last warm-up step (and
        the one after, when admission was put off), and for the guard on its watched step (the sample, a
        finiteness flag and the residual stay on the device until the check)."""
        self._scattered = True
        step = self.steps
        if self.phase == "measure" and step >= self.warmup_steps - 1:
            self._samples[ex.name] = ex.sample(rows)
        elif step == self._watch and ex.choice != NATIVE:
            x, n = ex.sample(rows)
            self._seen[ex.name] = (x, n, torch.isfinite(rows).all(), ex.residual_sq())

    def _admit(self) -> bool:
        """Steps 2-3: agree on the errors (and bold's sampling noise), the limits, the finalists. A module
        without a sample, or with a non-finite error, norm or noise (on any rank), puts admission off to the
        next step, once; then such a module is admitted nothing (native). False when put off."""
        specs = list(dict.fromkeys([*self.allow, get_codec(BASELINE).spec]))
        mine: dict[str, Any] = {"errors": {}, "norms": {}, "noise": {}}
        for name in self.numels:
            got = self._samples.get(name)
            mine["errors"][name] = codec_errors(got[0], got[1], specs) if got else dict.fromkeys(specs, math.nan)
            mine["norms"][name] = squared_norm(got[0], got[1]) if got else math.nan
        if self.level == "bold":  # a collective: every rank, the same modules in the same order
            # scaled, as the errors are, by the values each call carried (frozen or unused parameters left
            # out), which every rank's call shares; a module without a sample keeps its parameters' count
            carried = {n: self._samples[n][1] if n in self._samples else v for n, v in self.numels.items()}
            noise = sampling_noise(self._samples, carried, self._group, C.world(self._group)[1], self._device)
            mine["noise"] = {n: noise.get(n, 0.0) for n in self.numels}
        agreed = agree(mine, self._group)
        bad = [n for n in self.numels if not self._finite(agreed, n)]  # the same on every rank (agreed numbers)
        if bad and not self._deferred:
            self._deferred, self._samples = True, {}
            return False
        if bad and C.world(self._group)[0] == 0:
            log.warning("lowbit.fsdp codec='auto': no finite gradient sample of %s on two steps: left native",
                        ", ".join(bad[:4]) + (" ..." if len(bad) > 4 else ""))
        self.errors, self.norms, self.noise = agreed["errors"], agreed["norms"], agreed["noise"]
        base = get_codec(BASELINE).spec
        self.limits = {n: module_limit(self.level, self.error_budget, e[base], self.noise.get(n, 0.0), False)
                       for n, e in self.errors.items()}
        self._samples = {}
        self.finalists = [(NATIVE, {n: NATIVE for n in self.numels})]
        for spec in sorted(self.allow, key=lambda s: -self.bits[s]):
            a = {n: self._fit(n, spec) if v >= UNIFORM_MIN_NUMEL else NATIVE for n, v in self.numels.items()}
            if all(a != b for _, b in self.finalists):
                self.finalists.append((spec, a))
        if len(self.finalists) > 1:
            self.trials = Trials(len(self.finalists), self.clock, steps=self.trial_steps)
        self.phase = "trial"
        return True

    @staticmethod
    def _finite(agreed: dict[str, Any], name: str) -> bool:
        vals = [*agreed["errors"][name].values(), agreed["norms"][name], agreed["noise"].get(name, 0.0)]
        return all(math.isfinite(v) for v in vals)

    def _fit(self, name: str, spec: str) -> str:
        """``spec`` for module ``name`` if admitted there, else the next admitted choice up the ladder (none
        where its error is not finite)."""
        key = spec
        while key != NATIVE and not (math.isfinite(e := self.errors[name].get(key, math.nan))
                                     and e <= self._limit(name, key) * (1 + 1e-9)):
            key = self.guard.up(key)
        return key

    def _limit(self, name: str, key: str) -> float:
        """Module ``name``'s admission limit for codec ``key`` (:func:`lowbit.auto.decide.module_limit`: a
        biased codec held to the conservative limit). NaN for a module not admitted yet."""
        if name not in self.limits or name not in self.errors:
            return math.nan
        ref = self.errors[name].get(get_codec(BASELINE).spec, 0.0)
        return module_limit(self.level, self.error_budget, ref, self.noise.get(name, 0.0),
                            self.level == "bold" and get_codec(key).biased)

    def _trial_mark(self, step: int) -> None:
        """At a forward pass during the trials (:class:`lowbit.auto.trials.Trials`): the finalist whose trial
        begins takes over; after the last, choose on the agreed times."""
        if self.trials is not None:
            got = self.trials.step(self._group)
            if got is not None:
                if got.begins:
                    self._apply(self.finalists[got.finalist][1])
                return
            self.measured_s = {label: t for (label, _), t in zip(self.finalists, self.trials.times)}
            self.retried = [self.finalists[i][0] for i in self.trials.retried]
            self.trials = None
        native_s = self.measured_s.get(NATIVE, 1.0)
        tried = [Measured(label, a, self._bits_of(a), self.measured_s[label]) for label, a in self.finalists[1:]]
        best, _ = choose_measured(tried, Measured(NATIVE, self.finalists[0][1], 32.0, native_s), AUTO_FASTER_THAN_FP32)
        self.chosen, self.decision, self.decided_iter, self.phase = best.label, dict(best.assignment), step, "done"
        self.assignment = dict(self.decision)
        self._apply(self.assignment)
        self.guard.start(step, self._losses.take())  # the losses reported so far: the loss rule's first reference
        rank, world = C.world(self._group)
        if rank == 0 and all(k == NATIVE for k in self.decision.values()):
            # the one outcome where auto compresses nothing: said as a warning, with the reason (as DDP's)
            if len(self.finalists) == 1:
                why = (f"no module of at least {UNIFORM_MIN_NUMEL:,} values admitted an allowed codec "
                       f"({', '.join(self.allow)}) within its error limit, so none was tried")
            else:
                why = (f"no allowed codec ({', '.join(self.allow)}) was measured to make the step at least "
                       f"{(AUTO_FASTER_THAN_FP32 - 1) * 100:.0f} % faster than native ({native_s * 1e3:.2f} ms)")
            log.warning("lowbit.fsdp codec='auto' at step %d (%d ranks, %s) keeps FSDP's own reduce-scatter "
                        "everywhere, so gradients are not compressed: %s\n%s", step, world, self.level, why,
                        self.table())
        elif rank == 0:
            log.info("lowbit.fsdp codec='auto' at step %d (%d ranks, %s):\n%s", step, world, self.level, self.table())

    def _bits_of(self, assignment: dict[str, str]) -> float:
        total = sum(self.numels.values()) or 1
        return sum(v * self.bits.get(assignment[n], 32.0) for n, v in self.numels.items()) / total

    def _apply(self, assignment: dict[str, str]) -> None:
        for name, key in assignment.items():
            if self.exchanges[name].choice != key:
                self.exchanges[name].set_choice(key)

    def table(self) -> str:
        """The decision: per module its values, choice, and each codec's error over the module's limit
        (at most 1: admitted); the finalists' measured steps; the guard's changes."""
        specs = sorted(self.allow, key=lambda s: -self.bits[s])
        lines = [f"{'module':<28} {'values':>11}  {'choice':<12} error / limit (<= 1: admitted):",
                 f"{'':<54}" + "".join(f"{_short(s):>11}" for s in specs)]
        for name, numel in self.numels.items():
            errs = [_ratio(self.errors.get(name, {}).get(s, math.nan), self._limit(name, s)) for s in specs]
            lines.append(f"{name[:28]:<28} {numel:>11,}  {_short(self.assignment.get(name, NATIVE)):<12}"
                         + "".join(f"{e:>11.3g}" for e in errs))
        if self.measured_s:
            lines.append("measured step (mean over the ranks): "
                         + ", ".join(f"{_short(label)} {s * 1e3:.2f} ms"
                                     + (" (2 passes)" if label in self.retried else "")
                                     for label, s in self.measured_s.items()))
        lines.append(f"chosen: {_short(self.chosen)}" + (" (native everywhere: compression did not pay)"
                                                         if self.chosen == NATIVE else ""))
        lines += [f"guard, step {c['step']}: {c['tensor']} {_short(c['from'])} -> {_short(c['to'])}: {c['reason']}"
                  for c in self.changes]
        return "\n".join(lines)

    # ------------------------------------------------------------------------------ the guard
    def _guarding(self) -> bool:
        return bool(self.guard_every) and self.phase == "done" and any(k != NATIVE for k in self.assignment.values())

    def _guard_step(self, step: int) -> None:
        if self._watch is not None and step > self._watch:
            self._check(step)
        nxt = self.guard.next_check
        if self._guarding() and self._watch is None and nxt is not None and step >= nxt:
            self._watch, self._seen = step, {}

    def _check(self, step: int) -> None:
        """The guard's check of the watched step from every rank's numbers (lowbit.auto.guard.combine); the
        step-ups it decides, the same on every rank, logged once (rank 0)."""
        seen, self._seen, watched, self._watch = self._seen, {}, self._watch, None
        if self._device.type == "cuda":
            torch.cuda.synchronize(self._device)  # (the samples were taken on FSDP's reduce-scatter stream)
        tensors = {}
        for name, key in self.assignment.items():
            if key == NATIVE:
                continue
            x, n, finite, res = seen.get(name, (torch.zeros(0), 0, torch.tensor(True), None))
            tensors[name] = local_entry(x, n, key, bool(finite), None if res is None else float(res))
        mine = {"tensors": tensors, **ReportedLoss.entry(self._losses.take())}
        stats = combine(C.all_gather_object(mine, self._group))
        reference = {n: self.errors[n][k] / self.norms[n] if self.norms.get(n) and k in self.errors.get(n, {}) else None
                     for n, k in self.assignment.items()}
        changes = self.guard.check(step, self.assignment, stats, reference)
        if not changes:
            return
        if C.world(self._group)[0] == 0:
            log.warning("lowbit.fsdp codec='auto' guard, step %d: %d module(s) step up\n%s", watched, len(changes),
                        "\n".join(f"  {n}: {_short(self.assignment[n])} -> {_short(to)}: {why}"
                                  for n, (to, why) in changes.items()))
        for name, (to, _) in changes.items():
            self.assignment[name] = to
        self._apply(self.assignment)

    # ------------------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        # (the steps whose reduce-scatters ran; saved as "forwards", its name when a step was a forward pass)
        return {"forwards": self.steps + int(self._scattered), "decided_iter": self.decided_iter, "decision": self.decision,
                "assignment": dict(self.assignment), "chosen": self.chosen,
                "finalists": [[label, dict(a)] for label, a in self.finalists], "measured_s": dict(self.measured_s),
                "retried": list(self.retried),
                "errors": self.errors, "norms": self.norms, "noise": self.noise, "limits": self.limits,
                "guard": self.guard.state_dict()}

    def load_state_dict(self, d: Any) -> None:
        """Resume a decision (nothing is measured again); one saved while measuring: measure again. Nothing
        changes unless all of ``d`` fits."""
        self.loader(d)()

    def loader(self, d: Any) -> Callable[[], None]:
        """Check checkpoint entry ``d`` whole (a ``ValueError`` for anything that does not fit) and return
        what loads it, which does not fail (:meth:`lowbit.fsdp.FSDPState.load_state_dict` checks every
        entry before it loads any)."""
        if not isinstance(d, dict) or "decision" not in d:
            raise ValueError(f"lowbit.fsdp checkpoint: its codec='auto' entry is not FSDPAuto.state_dict()'s: {d!r:.200}")
        if d["decision"] is None:
            return lambda: None
        missing = [k for k in ("assignment", "forwards", "decided_iter", "chosen", "finalists", "measured_s",
                               "retried", "errors", "norms", "noise", "limits", "guard") if k not in d]
        if missing:
            raise ValueError(f"lowbit.fsdp checkpoint: its codec='auto' entry has no {missing} (not made by "
                             "FSDPAuto.state_dict())")
        for a in (d["decision"], d["assignment"]):
            if (not isinstance(a, dict) or set(a) != set(self.exchanges)
                    or any(k != NATIVE and k not in self.allow for k in a.values())):
                raise ValueError("lowbit.fsdp checkpoint: the codec='auto' decision does not fit this model "
                                 f"(modules {sorted(a)[:4]} against {sorted(self.exchanges)[:4]}, choices "
                                 f"{sorted(set(a.values()))}, allowed {[NATIVE, *self.allow]})")
        steps = d["forwards"]
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
            raise ValueError(f"lowbit.fsdp checkpoint: codec='auto''s step count must be an int >= 0, got {steps!r}")
        try:
            finalists = [(str(label), dict(a)) for label, a in d["finalists"]]
        except (TypeError, ValueError) as e:
            raise ValueError(f"lowbit.fsdp checkpoint: codec='auto''s finalists are not (label, choices) pairs: {e}")
        guard = Guard(self.guard_every, list(self.bits.items()), fp32=NATIVE)
        guard.load_state_dict(d["guard"])

        def load() -> None:
            self.decision, self.assignment = dict(d["decision"]), dict(d["assignment"])
            self.steps, self.decided_iter, self.chosen = steps, d["decided_iter"], d["chosen"]
            self.finalists, self.retried = finalists, list(d["retried"])
            self.measured_s, self.errors, self.norms = d["measured_s"], d["errors"], d["norms"]
            self.noise, self.limits, self.guard = d["noise"], d["limits"], guard
            self.phase, self._samples, self._seen, self._watch = "done", {}, {}, None
            self._scattered, self._starting, self._deferred = False, True, False
            self.trials = None
            self._apply(self.assignment)
        return load
