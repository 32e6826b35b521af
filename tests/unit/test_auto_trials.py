"""codec="auto"'s trials (lowbit.auto.trials), one procedure for DDP and FSDP, in one process on a clock
the test sets (injected through ``clock=``): which finalists are close enough for a second pass, in which
order it runs them, how a finalist's timed steps and its two passes combine into the times the decision
reads; then DDP's tuner driven through its public interface (attach, run_trials, forward passes) to the
decision lowbit.choose.pick takes on them. FSDP's tuner on the same clock: tests/unit/test_fsdp_auto_rule.py."""

from __future__ import annotations

import math
import pickle
from typing import Any, Callable, Optional

import pytest
import torch
from torch import nn

from lowbit.auto.ddp_tuner import AutoTuner
from lowbit.auto.trials import Trials, close_finalists, mean_of_passes, most_steps
from lowbit.choose import CodecCost, Decision
from lowbit.codecs.base import get_codec
from tests.unit.manual_clock import ManualClock

FP32, BF16 = get_codec("fp32").spec, get_codec("bf16").spec
Q8 = get_codec("qsgd:bits=8,bucket=512").spec
NUMELS = {"w": 1_000_000, "b": 10}


def test_close_finalists_are_those_within_the_share_of_the_fastest_and_only_two_or_more() -> None:
    # the bench's ResNet-50 trials over sockets (ms): 8-bit QSGD and bf16, 7 % apart
    assert close_finalists([39.8, 42.6], 0.10) == [0, 1]
    assert close_finalists([42.9, 39.1, 60.0], 0.10) == [0, 1]
    assert close_finalists([40.0, 44.0, 44.01], 0.10) == [0, 1]   # the limit itself is close, beyond it not
    assert close_finalists([40.0, 45.0], 0.10) == []              # one alone is not retried
    assert close_finalists([40.0], 0.10) == []
    assert close_finalists([], 0.10) == []
    assert close_finalists([math.nan, 40.0, 41.0], 0.10) == [1, 2]  # non-finite: never close, never the best
    assert close_finalists([math.inf, math.nan], 0.10) == []


def test_mean_of_passes_pairs_the_second_pass_by_the_order_it_ran() -> None:
    first = [40.0, 42.0, 60.0]
    # the second pass ran finalist 1 then 0 (reverse order): its times come in that order
    assert mean_of_passes(first, [1, 0], [41.0, 46.0]) == [43.0, 41.5, 60.0]
    assert mean_of_passes(first, [], []) == first
    with pytest.raises(ValueError):
        mean_of_passes(first, [1, 0], [41.0])


def _run(trials: Trials, clock: ManualClock, step_s: Callable[[int, int, int], float]) -> list[tuple[int, bool]]:
    """Drive ``trials`` to the end: each step lasts ``step_s(finalist, pass, step of that pass)``. Returns
    what each step ran: (finalist, begins)."""
    ran: list[tuple[int, bool]] = []
    passes: dict[int, int] = {}
    at = 0
    while (got := trials.step(None)) is not None:
        ran.append(tuple(got))
        if got.begins:
            passes[got.finalist] = passes.get(got.finalist, -1) + 1
            at = 0
        clock.now += step_s(got.finalist, passes[got.finalist], at)
        at += 1
    return ran


def test_trials_time_a_finalist_by_the_median_of_its_timed_steps_after_one_warm_up() -> None:
    """Blocks: each finalist a warm-up step (its slow first step, a switch's cost, not counted) and three
    timed steps, whose median counts (one disturbed step does not move it); far apart, no second pass."""
    clock = ManualClock()
    warm = {0: 1.0, 1: 2.0}
    timed = {0: [0.040, 0.090, 0.041], 1: [0.060, 0.061, 0.059]}
    trials = Trials(2, clock, steps=3)
    ran = _run(trials, clock, lambda f, p, i: warm[f] if i == 0 else timed[f][i - 1])
    assert ran == [(0, True), (0, False), (0, False), (0, False), (1, True), (1, False), (1, False), (1, False)]
    assert trials.done and not trials.second_pass and trials.retried == ()
    assert trials.times == pytest.approx([0.041, 0.060])
    assert len(ran) == 2 * (1 + 3) <= most_steps(2, 3)


def test_trials_run_the_close_finalists_again_in_reverse_order_and_count_both_passes_mean() -> None:
    clock = ManualClock()
    per_pass = {0: [0.040, 0.046], 1: [0.042, 0.041], 2: [0.060]}
    trials = Trials(3, clock)
    ran = _run(trials, clock, lambda f, p, i: per_pass[f][p])
    assert [f for f, begins in ran if begins] == [0, 1, 2, 1, 0]
    assert len(ran) == 5 * (1 + 2)
    assert trials.first == pytest.approx([0.040, 0.042, 0.060]) and trials.retried == (0, 1)
    assert trials.times == pytest.approx([0.043, 0.0415, 0.060])
    assert trials.step(None) is None  # over: stays over


def test_trials_need_a_finalist_and_a_timed_step() -> None:
    with pytest.raises(ValueError, match="at least one finalist and one timed step"):
        Trials(0, ManualClock())
    with pytest.raises(ValueError, match="steps=0"):
        Trials(2, ManualClock(), steps=0)


# ---------------------------------------------------------------------------------------- DDP's tuner
class _State:
    """What the trials read from the DDP hook's state (lowbit.auto.ddp_tuner.TunedState), one process,
    and every plan they set, in order."""

    process_group = None
    algorithm = "auto"
    message_mb = "auto"
    node_size = None
    start_iter = 2

    def __init__(self) -> None:
        self.plan = {n: get_codec("fp32") for n in NUMELS}
        self.numels, self.order = dict(NUMELS), {n: i for i, n in enumerate(NUMELS)}
        self.residuals: dict[str, Any] = {}
        self.sets: list[dict[str, str]] = []

    def world(self) -> tuple[int, int]:
        return 0, 1

    def set_plan(self, assignment: dict[str, str]) -> None:
        self.sets.append(dict(assignment))


def _cost(spec: str, bits: float, native: bool) -> dict[str, Any]:
    return vars(CodecCost(spec, bits, native, 1e-4, bits / 8 / 1e9, 0.0 if native else 1e-10))


def _measured(fp32_s: float) -> dict[str, Any]:
    """The agreed measurements the finalists were predicted from (AutoTuner.measured's layout)."""
    return {"tensors": [dict(name="w", numel=NUMELS["w"], ready_s=0.01, bucket=0),
                        dict(name="b", numel=NUMELS["b"], ready_s=0.01, bucket=0)],
            "backward_end_s": 0.01, "step_s": fp32_s, "errors": {}, "norms": {}, "noise": {}, "node_size": None,
            "costs": {FP32: _cost(FP32, 32, True), BF16: _cost(BF16, 16, True), Q8: _cost(Q8, 8.06, False)}}


def _drive(finalists: list[tuple[str, dict[str, str], float]], fp32_s: float, durations: dict[str, list[float]],
           until: Optional[int] = None) -> tuple[AutoTuner, _State, int]:
    """Try ``finalists`` (as the tuner's prediction leaves them) with DDP's tuner watching a module, one
    forward pass a step on a manual clock: each step lasts ``durations[label][p]`` for the finalist whose
    plan is set, ``p`` its pass (0, 1). Returns the tuner, the state and the steps taken (until decided,
    or ``until`` steps)."""
    clock = ManualClock()
    tuner, state, module = AutoTuner(clock=clock), _State(), nn.Linear(1, 1)
    tuner.attach(module, state)
    pred = Decision(dict(finalists[0][1]), False, finalists[0][2], fp32_s, 3, [], finalists=list(finalists),
                    measured_s={"fp32": fp32_s})
    label_of = [(label, a) for label, a, _ in finalists]
    seen: dict[str, int] = {}
    done = 0
    module(torch.zeros(1, 1))  # step 0's forward pass (before start_iter: nothing measured) ...
    tuner.run_trials(state, tuner.forwards - 1, pred, _measured(fp32_s))  # ... starts the trials
    steps = 0
    while tuner.phase == "trial" and (until is None or steps < until):
        for a in state.sets[done:]:  # a finalist's plan set at this forward pass: its pass begins
            label = next(lb for lb, plan in label_of if plan == a)
            seen[label] = seen.get(label, -1) + 1
        done = len(state.sets)
        current = next(lb for lb, plan in label_of if plan == state.sets[-1])
        clock.now += durations[current][seen[current]]
        module(torch.zeros(1, 1))  # the next step's forward pass
        steps += 1
    return tuner, state, steps


def _plans() -> list[tuple[str, dict[str, str], float]]:
    return [("predicted best", {"w": Q8, "b": FP32}, 0.040), (f"{BF16} (uniform)", {"w": BF16, "b": FP32}, 0.041),
            ("slow", {"w": Q8, "b": Q8}, 0.050)]


def test_close_finalists_run_a_second_pass_in_reverse_order_and_count_with_both_passes_mean() -> None:
    """8-bit measures 40 ms and bf16 42 ms in the first pass (within 10 %: both run again, bf16 first), 46
    and 41 ms in the second: their means, 43 and 41.5 ms, make bf16 the faster by more than the 3 % tie
    rule. The first pass alone would choose 8-bit; a third finalist at 60 ms runs once."""
    fin = _plans()
    tuner, state, steps = _drive(fin, 0.060, {"predicted best": [0.040, 0.046], fin[1][0]: [0.042, 0.041],
                                              "slow": [0.060]})
    plans = list(state.sets)
    assert plans[:5] == [fin[0][1], fin[1][1], fin[2][1], fin[1][1], fin[0][1]]  # then the decision's
    assert steps == 5 * (1 + tuner.trial_steps)  # each pass: a warm-up and trial_steps timed steps
    d = tuner.decision
    assert tuner.phase == "done" and tuner.decided_iter == steps and tuner.trials is None
    assert d.retried == ("predicted best", fin[1][0])
    assert d.measured_s == pytest.approx({"fp32": 0.060, "predicted best": 0.043, fin[1][0]: 0.0415, "slow": 0.060})
    assert d.assignment == fin[1][1] and plans[-1] == fin[1][1], d.table()
    lines = {ln.split()[1]: ln for ln in d.table().splitlines() if ln.startswith("tried ")}
    assert lines["predicted"].endswith("(2 passes)") and lines[BF16].endswith("(2 passes)")
    assert "(2 passes)" not in lines["slow"]
    assert steps <= tuner.last_decision_step(0) - tuner.warmup_steps - tuner.measure_steps


def test_finalists_far_apart_run_once() -> None:
    fin = _plans()
    tuner, state, steps = _drive(fin, 0.060, {"predicted best": [0.040], fin[1][0]: [0.045], "slow": [0.060]})
    assert state.sets[:3] == [a for _, a, _ in fin] and steps == 3 * (1 + tuner.trial_steps)
    d = tuner.decision
    assert d.retried == () and d.assignment == fin[0][1]
    assert d.measured_s == pytest.approx({"fp32": 0.060, "predicted best": 0.040, fin[1][0]: 0.045, "slow": 0.060})
    assert "(2 passes)" not in d.table()


def test_re_measuring_counts_fp32_as_a_finalist_that_can_be_retried() -> None:
    """Re-measuring tries fp32 (and the current plan) among the finalists: when its trial is close to the
    fastest it runs again like any other, and its mean replaces the first fp32 measurement."""
    fin = _plans()[:2] + [("fp32", {"w": FP32, "b": FP32}, 0.050)]
    tuner, state, steps = _drive(fin, 0.070, {"predicted best": [0.040, 0.044], fin[1][0]: [0.050],
                                              "fp32": [0.041, 0.043]})
    assert state.sets[:5] == [fin[0][1], fin[1][1], fin[2][1], fin[2][1], fin[0][1]]
    d = tuner.decision
    assert d.retried == ("predicted best", "fp32")
    assert d.measured_s["fp32"] == pytest.approx(0.042) and d.measured_s["predicted best"] == pytest.approx(0.042)
    assert d.fp32_is_best and set(d.assignment.values()) == {FP32}  # not 2 % faster than fp32's mean
    assert set(d.assignment) == set(NUMELS)  # every tensor of the plan (a checkpoint's decision must fit it)


def test_pickled_during_the_second_pass_measures_again() -> None:
    fin = _plans()
    tuner, _, steps = _drive(fin, 0.060, {"predicted best": [0.040, 0.040], fin[1][0]: [0.041, 0.041],
                                          "slow": [0.060]}, until=3 * (1 + 2) + 2)
    assert tuner.phase == "trial" and tuner.trials.second_pass  # inside the second pass
    again = pickle.loads(pickle.dumps(tuner))
    assert again.phase == "measure" and again.trials is None and again.measured is None and again.decision is None


def test_a_decision_pickled_before_retried_existed_reads_none_retried() -> None:
    d = Decision({"w": Q8}, False, 0.04, 0.06, 3, [], finalists=[("predicted best", {"w": Q8}, 0.04)],
                 measured_s={"fp32": 0.06, "predicted best": 0.04})
    del d.__dict__["retried"]  # as an older lowbit pickled it
    old = pickle.loads(pickle.dumps(d))
    assert old.retried == () and "(2 passes)" not in old.table()
    # ... and a checkpoint's decision dict saved without the field
    fields = d.__dict__
    assert Decision(**fields).retried == ()
