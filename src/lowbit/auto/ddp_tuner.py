"""``codec="auto"`` for the DDP hook: the adapter that measures this job, then chooses per parameter
tensor a codec that pays. The options, the clock, the estimates, the trials, the decision rules and the
guard are :mod:`lowbit.auto`'s, shared with FSDP; what is DDP's own is here: the backward timeline, the
link probes and the replay that predicts the finalists.

    state = lowbit.ddp.register(model, codec="auto")                       # fp32, bf16, 8-bit QSGD
    state = lowbit.ddp.register(model, codec="auto", auto_level="bold")    # ... and 4-bit QSGD, 1bitSGD*
    state = lowbit.ddp.register(model, codec="auto", allow=["fp32", "bf16", "qsgd:bits=8", "qsgd:bits=4"])

How (on the job's own first steps, nothing extra for the user to run):

1. **Measure** (``measure_steps`` steps, default 3, after DDP's bucket rebuild and two warm-up steps,
   with DDP's own fp32 allreduce: :func:`lowbit.ddp.register` installs no hook yet): when each parameter's gradient became
   ready (post-accumulate-grad hooks), counted from the forward pass's start (CUDA events on the compute
   stream on a GPU, the host clock on a CPU), when the backward pass ended (the autograd engine's
   callback: later than the last gradient where an input's gradient or a slow last node follows), and
   the whole step; on the last of them a sample of every
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

   *How far it may go* is ``auto_level``: ``"conservative"`` (the default) is the rule above;
   ``"bold"`` adds 4-bit QSGD and 1bitSGD* (error feedback on, as ``error_feedback="auto"`` gives every
   biased codec) to the allowed codecs and lets the summed error reach ``error_budget`` times the larger
   of uniform 8-bit QSGD's error and the gradients' own *sampling noise*: how much the ranks' gradients
   of a tensor differ from their mean (one sum of the gradient samples over the group), E|g_r - mean|^2
   K/(K-1), the noise a rank's batch already carries. At budget 1.0 compression adds at most as much
   noise as the batch has, as training at half the batch would; ranks that see the same data have no
   noise, and bold is then as strict as the default. That allowance is for unbiased codecs, whose error
   is noise; a biased codec (1bitSGD*, top-k: error feedback repays their distortion late) is held to
   the default limit, its error weighed by bold's limit over 8-bit QSGD's (:func:`lowbit.auto.decide.
   biased_weight`).
   Which codecs pass is decided by those measured errors, tensor by tensor, then by the trials' speed:
   not by codec names.

   *Several nodes* (``node_size=``, ``$LOWBIT_NODE_SIZE`` or torchrun's ``LOCAL_WORLD_SIZE`` smaller than
   the group, ``algorithm="auto"``): each quantised codec is also probed through the hierarchical
   algorithm and becomes a choice of its own (``"qsgd:bits=8,bucket=512@hierarchical"``, :func:`lowbit.
   choose.choice`), priced from its own measured costs (three phases a message, a 1/G shard encoded and
   sent between nodes) and given the codec's measured error; the search takes flat or hierarchical per
   tensor, and the finalists include each codec both ways. The decision names the algorithm of every
   tensor and finalist (``Decision.algorithms``, the table's algorithm column).
5. **Try**: otherwise lowbit's hook is registered and the finalists (the predicted best, each allowed
   codec as a fixed codec would apply it) are tried by :class:`lowbit.auto.trials.Trials`, FSDP's rule
   too: one warm-up and ``trial_steps`` timed steps each, one after another, the median per rank,
   averaged over the ranks; those within ``retry_within`` (10 %) of the fastest (fp32 counts only where
   it is a finalist, as when re-measuring) run a second pass in reverse order and count with the mean
   of both passes (``Decision.retried`` names them). :func:`measured_decision` then chooses on the
   measured step times against the measured fp32 step (:func:`lowbit.auto.decide.choose_measured`, the
   rule ``lowbit advise`` uses). :meth:`AutoTuner.last_decision_step` bounds the step of the decision.

The decision is logged once (rank 0, ``logging.INFO``, a table: tensor, numel, codec, predicted saving,
the finalists predicted and measured; a ``WARNING`` with the reason when it keeps fp32 everywhere), kept
on ``state.auto.decision``, saved in ``state.state_dict()`` (a resumed run uses it without measuring
again) and, with ``remeasure_every=N``, probed and tried again every N steps, fp32 and the current plan
among the finalists, in case the link changed (the backward timeline and the errors are kept); a tensor
whose codec changes then starts with an empty error-feedback residual. A hook registered by a framework
(:func:`lowbit.ddp.make_state`) reduces in fp32 until the decision.

6. **Guard** (``guard_every``, default 50; 0: off): while something is compressed, every ``guard_every``
   steps one step's gradients are sampled and the chosen codecs checked: non-finite gradients or
   residuals, the codec's error against its value at the decision, error-feedback residual growth, and
   the loss the user may report (``state.auto.report_loss(loss)``). Every rank's numbers are gathered
   and summed in rank order, so every rank takes the same step-ups (:mod:`lowbit.auto.guard` has the rule);
   each is logged once (rank 0, ``WARNING``), kept in ``state.auto.changes`` and ``state.auto.assignment``
   and saved in checkpoints, and re-measuring keeps a stepped-up tensor at its new precision or above.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist

from lowbit.auto.clock import Clock, DeviceClock
from lowbit.auto.ddp_measure import (TunedState, by_choice, hierarchical_ok, measure_timeline, nodes_of, probe_costs,
                                     rides, timeline_of)
from lowbit.auto.decide import Measured, choose_measured, error_limit, weighed_errors
from lowbit.auto.estimates import agree, codec_errors, prefix_sample, sampling_noise, squared_norm
from lowbit.auto.guard import Guard, ReportedLoss, combine, local_entry
from lowbit.auto.options import BASELINE, check_auto_options, default_allow
from lowbit.auto.trials import TRIAL_STEPS, RETRY_WITHIN, Trials, most_steps
from lowbit.choose import (AUTO_FASTER_THAN_FP32, WITHIN_BEST, CodecCost, Decision, Timeline, compute_time, decide,
                           explain, simulate, split_choice, weighted_bits)
from lowbit.codecs.base import get_codec
from lowbit.comm import collectives as C
from lowbit.comm.allreduce import get_algorithm

__all__ = ["AutoTuner", "TunedState", "measured_decision"]

log = logging.getLogger("lowbit.ddp")

_FP32 = get_codec("fp32").spec


class AutoTuner:
    """The measurements and the decision of ``codec="auto"`` (module doc); lives on ``state.auto``.
    Its options come validated (:class:`lowbit.ddp.DDPConfig`); ``allow`` is kept as canonical specs,
    fp32 first unless listed. ``clock``: where every time is read (default: the module's device,
    :class:`lowbit.auto.clock.DeviceClock`); ``trials``: the trials running (None otherwise)."""

    #: finalists whose first-pass trial times are within this share of the fastest run a second pass
    #: (module doc, step 5)
    retry_within = RETRY_WITHIN

    def __init__(self, allow: Optional[Sequence[str]] = None, error_budget: Optional[float] = 1.0,
                 measure_steps: int = 3, remeasure_every: int = 0,
                 faster_than_fp32: float = AUTO_FASTER_THAN_FP32, *, level: str = "conservative",
                 guard_every: int = 50, clock: Optional[Clock] = None) -> None:
        check_auto_options(allow, error_budget, level, guard_every)
        self.level = level
        self.guard_every = guard_every
        canon = [get_codec(s).spec for s in (default_allow(level) if allow is None else allow)]
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
        self.trial_steps = TRIAL_STEPS  # timed steps per finalist (after one warm-up step); 0: trust the prediction
        self.max_trials = 6 if level == "bold" else 4  # finalists tried at most (bold: more codecs to try)
        self.phase = "measure"  # -> "trial" -> "done"
        self._pending: Optional[Decision] = None  # the prediction whose finalists are being tried
        self.trials: Optional[Trials] = None
        self.clock = clock
        self.decision: Optional[Decision] = None
        self.decided_iter: Optional[int] = None
        self.measured: Optional[dict[str, Any]] = None  # the agreed measurements the decision came from
        self.node_size: Optional[int] = None  # ranks per node when auto weighed the hierarchical algorithm
        self.assignment: dict[str, str] = {}  # what runs now: the decision, with the guard's step-ups
        self.guard = Guard(guard_every, [(s, float(get_codec(s).bits_per_value(1 << 20))) for s in self.allow],
                           [s for s in self.allow if hierarchical_ok(get_codec(s))], fp32=_FP32)
        self._watch: Optional[int] = None  # the step whose gradients the guard samples
        self._guard_samples: dict[str, tuple[torch.Tensor, int]] = {}
        self._losses = ReportedLoss()  # reported since the last check (on their device: no host sync)
        self._steps: list[dict[str, Any]] = []  # per measured step: forward mark and gradient marks
        self._samples: dict[str, tuple[torch.Tensor, int]] = {}
        self.forwards = 0  # training forward passes seen (= the step about to run)
        self._handle: Any = None
        self._grad_handles: list[Any] = []
        self._install: Optional[Callable[[], None]] = None
        self._state: Optional[TunedState] = None
        self._module: Optional[torch.nn.Module] = None
        self._device = torch.device("cpu")

    def _clock(self) -> Clock:
        if self.clock is None:
            self.clock = DeviceClock(self._device)
        return self.clock

    # ------------------------------------------------------------------------------ configuration
    def config(self) -> dict[str, Any]:
        out = {"allow": self.allow, "error_budget": self.error_budget, "measure_steps": self.measure_steps,
               "remeasure_every": self.remeasure_every}
        # (only where not the default: checkpoints saved before these options existed still load)
        if getattr(self, "level", "conservative") != "conservative":
            out["level"] = self.level
        if getattr(self, "guard_every", 50) != 50:
            out["guard_every"] = self.guard_every
        return out

    @property
    def changes(self) -> list[dict[str, Any]]:
        """The guard's step-ups so far: each a dict of step, tensor, from, to and reason."""
        return self.guard.changes

    def report_loss(self, loss: Any) -> None:
        """Report this step's training loss (a float or a tensor: added on its device, no host sync), for
        the guard's loss rule (:mod:`lowbit.auto.guard`); optional. Call it once a step, on every rank."""
        self._losses.add(loss)

    def attach(self, module: torch.nn.Module, state: TunedState,
               install: Optional[Callable[[], None]] = None) -> None:
        """Watch ``module`` (the model DDP wraps): count its training forward passes, mark when each one
        starts and when each parameter's gradient is ready (post-accumulate-grad hooks), and decide at the
        forward pass after the measured ones. ``install``: registers lowbit's hook on the DDP model, called
        only once compression pays (until then DDP's own allreduce runs untouched); None: the hook is
        already installed and reduces in fp32 until the decision. DDP's bucket caps are the state's."""
        self.detach()
        self._state, self._install, self._module = state, install, module
        self._device = _device_of(module)
        self._handle = module.register_forward_pre_hook(self._on_forward)
        self._grad_handles = [p.register_post_accumulate_grad_hook(self._on_grad(name))
                              for name, p in module.named_parameters() if p.requires_grad and name in state.plan]

    def last_decision_step(self, start_iter: int) -> int:
        """The step whose forward pass takes the first decision at the latest: ``start_iter``, the warm-up
        and measured steps, then every finalist's warm-up and timed steps, twice when all of them measured
        close (the second pass, module doc step 5; fewer finalists, or fewer close ones, decide earlier)."""
        return start_iter + self.warmup_steps + self.measure_steps + most_steps(self.max_trials, self.trial_steps)

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
                rec = self._steps[-1]
                rec["grads"].append((name, self._clock().mark()))
                if "end" not in rec:
                    # the backward pass ends when the autograd engine has run every node, which may be
                    # well after the last gradient is ready (an input's gradient, a slow last node):
                    # the engine's callbacks run then, and this one is queued before DDP's reducer
                    # queues its own (at the last bucket), so it marks the end before DDP waits for
                    # the allreduces
                    rec["end"] = None
                    self._queue_end_mark(rec, p.device)
            if step == first + self.measure_steps - 1 and p.grad is not None:
                self._samples[name] = prefix_sample(p.grad)
        return hook

    def _queue_end_mark(self, rec: dict[str, Any], device: torch.device) -> None:
        """Mark ``rec["end"]`` when the autograd engine has run the whole backward pass, on the stream
        the gradient hooks ran on (the engine runs its callbacks on the default stream)."""
        stream = torch.cuda.current_stream(device) if device.type == "cuda" else None

        def mark() -> None:
            if stream is None:
                rec["end"] = self._clock().mark()
            else:
                with torch.cuda.stream(stream):
                    rec["end"] = self._clock().mark()
        torch.autograd.Variable._execution_engine.queue_callback(mark)

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
                self._steps.append({"forward": self._clock().mark(), "grads": []})
            if step >= first + self.measure_steps:
                self._predict(st, step)
        elif self.phase == "trial":
            self._trial_mark(st, step)
        elif self.remeasure_every and self.decided_iter is not None and \
                step - self.decided_iter >= self.remeasure_every:
            self._predict(st, step)
        elif self._guarding():
            self._guard_step(st, step)

    # ------------------------------------------------------------------------------ steps 2-5
    def _predict(self, state: TunedState, step: int) -> None:
        """Probe, agree and predict (module doc); fp32 when nothing pays, else try the finalists."""
        group = state.process_group
        device = self._device
        rank, world = C.world(group)
        if self.measured is None:
            timeline = measure_timeline(self._steps, state, self._clock(), rides(self.allow, state))
            specs = self.allow + [get_codec(BASELINE).spec]
            errors = {name: codec_errors(x, n, specs) for name, (x, n) in self._samples.items()}
            norms = {name: squared_norm(x, n) for name, (x, n) in self._samples.items()}
            # bold: how much the ranks' gradients differ (a collective: every rank, the same tensors)
            noise = self._noise(state, group, world) if self.level == "bold" else {}
            self._samples = {}
        else:  # re-measuring: the link only
            timeline = timeline_of(self.measured, state.message_mb, rides(self.allow, state))
            errors = self.measured["errors"]
            norms, noise = self.measured.get("norms", {}), self.measured.get("noise", {})
        nodes = nodes_of(state, world)  # ranks per node when several nodes are known, else None
        mine = {"tensors": [dict(name=t.name, numel=t.numel, ready_s=t.ready_s, bucket=t.bucket)
                            for t in timeline.tensors],
                "backward_end_s": timeline.backward_end_s, "step_s": timeline.step_s,
                "costs": probe_costs(self.allow, state, group, device, timeline, world, self._clock(), nodes),
                "errors": errors, "norms": norms, "noise": noise, "node_size": nodes}
        agreed = agree(mine, group)  # the same numbers on every rank
        self.node_size = agreed["node_size"]
        costs = {s: CodecCost(**c) for s, c in agreed["costs"].items()}
        timeline = timeline_of(agreed, state.message_mb, rides(self.allow, state))
        weighed = weighed_errors(by_choice(agreed["errors"], costs), self.level, self.error_budget,
                                 *_summed_refs(agreed))
        pred = decide(timeline, costs, weighed,
                      error_limit=self._error_limit(agreed),
                      fp32=_FP32, within_best=WITHIN_BEST, faster_than_fp32=self.faster_than_fp32,
                      max_finalists=self.max_trials,
                      only={n: self.guard.allowed(n, costs) for n in self.guard.floors} or None)
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
        self.run_trials(state, step, pred, agreed)

    def run_trials(self, state: TunedState, step: int, prediction: Decision, measured: dict[str, Any]) -> None:
        """Try ``prediction``'s finalists from this step (a training forward pass) on, on every rank
        (module doc, step 5); the decision comes at the forward pass after the last trial step.

        Args:
            state: the hook's state, whose plan each finalist sets in turn.
            step: the step starting now.
            prediction: its ``finalists`` (label, assignment, predicted seconds) are tried; ``measured_s``
                holds fp32's measured step (``"fp32"``).
            measured: the agreed measurements the prediction came from (``tensors``, ``costs``, ...)."""
        self.measured = measured
        self._pending = prediction
        self.trials = Trials(len(prediction.finalists), self._clock(), steps=self.trial_steps,
                             retry_within=self.retry_within)
        self.phase = "trial"
        self._maybe_install(state, step)
        self._trial_mark(state, step)

    def _trial_mark(self, state: TunedState, step: int) -> None:
        """At a forward pass during the trials: the plan of the finalist whose trial begins; after the
        last, the decision (:func:`measured_decision`)."""
        pred, trials = self._pending, self.trials
        got = trials.step(state.process_group)
        if got is not None:
            if got.begins:
                state.set_plan(pred.finalists[got.finalist][1])
            return
        timeline = timeline_of(self.measured, state.message_mb, rides(self.allow, state))
        costs = {s: CodecCost(**c) for s, c in self.measured["costs"].items()}
        measured_decision(pred, trials.times, trials.retried, timeline, costs, list(state.plan), self.faster_than_fp32)
        self._pending, self.trials = None, None
        self._finish(state, step, pred)

    def _finish(self, state: TunedState, step: int, decision: Decision) -> None:
        rank, world = C.world(state.process_group)
        self.decision, self.decided_iter, self.phase = decision, step, "done"
        self.assignment = dict(decision.assignment)
        self._watch, self._guard_samples = None, {}
        self.guard.start(step, self._losses.take())  # the loss reported so far: the fp32 steps' reference
        self._release(keep_forward=bool(self.remeasure_every) or self._guarding())
        state.set_plan(decision.assignment)
        if rank == 0 and decision.fp32_is_best and not self._said_fp32:
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

    def _error_limit(self, agreed: dict[str, Any]) -> Optional[float]:
        """The most error an assignment may add, over the tensors (:func:`lowbit.auto.decide.error_limit`
        on the summed references; None: no limit)."""
        if self.error_budget is None or not agreed["errors"]:
            return None
        return error_limit(self.level, self.error_budget, *_summed_refs(agreed))

    def _noise(self, state: TunedState, group: Optional[dist.ProcessGroup], k: int) -> dict[str, float]:
        """Per tensor, the sampling noise of one rank's gradient (:func:`sampling_noise`), over the model's
        tensors in order (every rank: the same layout)."""
        numels = {n: state.numels[n] for n in state.plan if n in state.numels}
        return sampling_noise(self._samples, numels, group, k, self._device)

    # ------------------------------------------------------------------------------ the guard
    def _guarding(self) -> bool:
        """Whether the guard watches: it is on and something is compressed."""
        return bool(getattr(self, "guard_every", 0)) and self.phase == "done" and \
            any(k != _FP32 for k in self.assignment.values())

    def _guard_step(self, state: TunedState, step: int) -> None:
        """At a forward pass after the decision: check the watched step once its backward pass has run,
        and watch the step the guard asks for (lowbit.auto.guard)."""
        if self._watch is not None and step > self._watch:
            self._check(state, step)
        nxt = self.guard.next_check
        if self._guarding() and self._watch is None and nxt is not None and step >= nxt:
            self._watch = step
            self._guard_samples = {}
            names = {n for n, k in self.assignment.items() if k != _FP32}
            self._grad_handles = [p.register_post_accumulate_grad_hook(self._on_guard_grad(name))
                                  for name, p in self._params() if name in names]

    def _on_guard_grad(self, name: str) -> Callable[[torch.Tensor], None]:
        def hook(p: torch.Tensor) -> None:
            if p.grad is not None and self.forwards - 1 == self._watch:
                self._guard_samples[name] = prefix_sample(p.grad)
        return hook

    def _check(self, state: TunedState, step: int) -> None:
        """The guard's check of the watched step, from what every rank saw (lowbit.auto.guard.combine), and the
        step-ups it decides, the same on every rank; each logged once (rank 0)."""
        self._release(keep_forward=True)
        samples, self._guard_samples, watched, self._watch = self._guard_samples, {}, self._watch, None
        if self._device.type == "cuda":
            torch.cuda.synchronize(self._device)  # (the hook thread's residual updates included)
        tensors = {}
        for name, key in sorted(self.assignment.items()):
            if key == _FP32:
                continue
            spec = split_choice(key)[0]
            x, n = samples.get(name, (torch.zeros(0), state.numels.get(name, 0)))
            res = state.residuals.get(name)
            tensors[name] = local_entry(x, n, spec, bool(torch.isfinite(x).all()),
                                        None if res is None else float((res.double() ** 2).sum()))
        mine = {"tensors": tensors, **ReportedLoss.entry(self._losses.take())}
        stats = combine(C.all_gather_object(mine, state.process_group))
        measured = self.measured or {}
        reference = {}
        for name, key in self.assignment.items():
            e, norm = measured.get("errors", {}).get(name), measured.get("norms", {}).get(name)
            spec = split_choice(key)[0]
            reference[name] = e[spec] / norm if e is not None and norm and spec in e else None
        changes = self.guard.check(step, self.assignment, stats, reference)
        if not changes:
            return
        rank, _ = C.world(state.process_group)
        if rank == 0:  # one message a check: the tensors that made the same change for the same reason together
            same: dict[tuple[str, str, str], list[str]] = {}
            for name, (to, reason) in changes.items():
                same.setdefault((self.assignment[name], to, reason), []).append(name)
            log.warning("lowbit.ddp codec='auto' guard, step %d: %d tensor(s) step up\n%s", watched, len(changes),
                        "\n".join(f"  {frm} -> {to} ({len(names)}: {', '.join(names[:8])}"
                                  f"{', ...' if len(names) > 8 else ''}): {reason}"
                                  for (frm, to, reason), names in same.items()))
        for name, (to, _) in changes.items():
            self.assignment[name] = to
        state.set_plan(dict(self.assignment))
        if not self._guarding():
            self._release(keep_forward=bool(self.remeasure_every))

    def _params(self) -> list[tuple[str, torch.Tensor]]:
        module = self._module
        return [] if module is None else [(n, p) for n, p in module.named_parameters() if p.requires_grad]

    # ------------------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        return {"config": self.config(), "decided_iter": self.decided_iter, "measured": self.measured,
                "decision": None if self.decision is None else self.decision.to_dict(),
                "assignment": dict(self.assignment), "node_size": self.node_size, "guard": self.guard.state_dict()}

    def load_state_dict(self, state: TunedState, d: dict[str, Any]) -> None:
        if not isinstance(d, dict) or d.get("config") != self.config():
            raise ValueError(f"lowbit checkpoint: codec='auto' was saved with {d.get('config') if isinstance(d, dict) else d!r}, "
                             f"this state has {self.config()}")
        if d.get("decision") is None:
            return  # saved while still measuring: measure again
        dec = Decision(**d["decision"])
        assignment = d.get("assignment") or dec.assignment  # (saved before the guard: the decision's)
        for a in (dec.assignment, assignment):
            unknown = sorted(set(a) - set(state.plan))
            bad = sorted({s for s in a.values() if not self._known_choice(s)})
            if unknown or bad or set(a) != set(state.plan):
                raise ValueError("lowbit checkpoint: the codec='auto' decision does not fit this model/allow list "
                                 f"(unknown tensors {unknown[:3]}, codecs not allowed {bad})")
        self.decision, self.measured, self.decided_iter = dec, d.get("measured"), d.get("decided_iter")
        self.node_size = d.get("node_size")
        self.assignment = dict(assignment)
        self.guard.start(self.decided_iter or 0)
        if d.get("guard") is not None:
            self.guard.load_state_dict(d["guard"])
        self.phase, self._pending, self.trials, self._steps, self._samples = "done", None, None, [], {}
        self._watch, self._guard_samples = None, {}
        self._release(keep_forward=bool(self.remeasure_every) or self._guarding())
        state.set_plan(dict(self.assignment))
        self._maybe_install(state, self.decided_iter or 0)

    def _known_choice(self, key: str) -> bool:
        """Whether ``key`` names an allowed codec (and a registered algorithm, where it names one)."""
        spec, algorithm = split_choice(key)
        if spec not in self.allow:
            return False
        if algorithm is not None:
            try:
                get_algorithm(algorithm)
            except ValueError:
                return False
        return True

    def __getstate__(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        for k in ("_handle", "_install", "_state", "_module", "_watch"):
            d[k] = None
        d["_grad_handles"], d["_steps"], d["_samples"], d["_marks"] = [], [], {}, []
        d["_guard_samples"], d["_losses"] = {}, ReportedLoss()
        if d.get("phase") == "trial":  # unpickled mid-trial (either pass): measure again
            d["phase"], d["_pending"], d["measured"], d["trials"] = "measure", None, None, None
        return d


def _device_of(module: torch.nn.Module) -> torch.device:
    for p in module.parameters():
        return p.device
    return torch.device("cpu")


def _summed_refs(agreed: Mapping[str, Any]) -> tuple[float, float]:
    """Uniform 8-bit QSGD's summed error over the tensors, and their summed sampling noise (0 unmeasured):
    the two references of the error limit."""
    base = get_codec(BASELINE).spec
    return (sum(e.get(base, 0.0) for e in agreed["errors"].values()),
            float(sum(agreed.get("noise", {}).values())))


def measured_decision(prediction: Decision, times: Sequence[float], retried: Sequence[int], timeline: Timeline,
                      costs: Mapping[str, CodecCost], names: Sequence[str],
                      faster_than_fp32: float = AUTO_FASTER_THAN_FP32) -> Decision:
    """``prediction`` made the decision measured by its trials (module doc, step 5), in place.

    Args:
        prediction: its ``finalists`` were tried; ``measured_s["fp32"]`` is fp32's measured step, replaced
            where fp32 is a finalist (re-measuring).
        times: every finalist's agreed step time (:attr:`lowbit.auto.trials.Trials.times`).
        retried: the finalists that ran a second pass (indices).
        timeline, costs: the measured step and codec costs, to weigh bits and describe a winner the
            prediction did not put first.
        names: every tensor of the plan (fp32's assignment, when nothing pays).
        faster_than_fp32: the least speed-up over fp32 that pays.

    Returns:
        ``prediction``, with ``measured_s``, ``retried``, ``chosen`` and, where the predicted best lost,
        the winner's ``assignment``, ``rows`` and ``step_s``."""
    pred = prediction
    if retried:
        pred.retried = tuple(pred.finalists[i][0] for i in sorted(retried))
    for (label, _, _), t in zip(pred.finalists, times, strict=True):
        pred.measured_s[label] = t  # (a re-measured "fp32" replaces the first measurement)
    fp32 = Measured("fp32", {n: _FP32 for n in names}, 32.0, pred.measured_s["fp32"])
    tried = [Measured(label, assignment, weighted_bits(timeline, assignment, costs), t)
             for (label, assignment, _), t in zip(pred.finalists, times) if label != "fp32"]
    best, none_pays = choose_measured(tried, fp32, faster_than_fp32)
    pred.chosen = f"{best.label} (measured)" if not none_pays else "fp32 (measured: nothing paid)"
    if best.label != pred.finalists[0][0] or none_pays:  # the predicted best lost: describe the winner
        compute = compute_time(timeline, costs, _FP32)
        pred.assignment = dict(best.assignment)
        pred.rows = explain(timeline, costs, pred.assignment, compute, _FP32)
        pred.step_s = compute + simulate(timeline, pred.assignment, costs)
        pred.fp32_is_best = none_pays
    return pred
