"""codec="auto"'s trials (lowbit.autotune, module doc step 5) in one process, on a clock the test sets:
which finalists are close enough for a second pass, in which order it runs them, and how their two
passes combine into the times lowbit.choose.pick decides on."""

from __future__ import annotations

import math
import pickle
from typing import Any, Optional

import pytest

import lowbit.autotune as A
from lowbit.autotune import AutoTuner, close_finalists, mean_of_passes
from lowbit.choose import CodecCost, Decision
from lowbit.codecs.base import get_codec

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


class _State:
    """What the trials read from the DDP hook's state (lowbit.autotune.TunedState), one process, and
    every plan they set, in order."""

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


def _drive(finalists: list[tuple[str, dict[str, str], float]], fp32_s: float,
           durations: dict[str, list[float]], tuner: Optional[AutoTuner] = None,
           until: Optional[int] = None) -> tuple[AutoTuner, _State, int]:
    """Run the trials of ``finalists`` (as AutoTuner._predict leaves them) at forward passes on a clock:
    each step lasts ``durations[label][p]`` for the finalist whose plan is set, ``p`` its pass (0, 1).
    Returns the tuner, the state and the steps taken (until decided, or ``until`` steps)."""
    tuner = tuner or AutoTuner()
    state = _State()
    tuner._state = state
    tuner.measured = {"tensors": [dict(name="w", numel=NUMELS["w"], ready_s=0.01, bucket=0),
                                  dict(name="b", numel=NUMELS["b"], ready_s=0.01, bucket=0)],
                      "backward_end_s": 0.01, "step_s": fp32_s, "errors": {}, "norms": {}, "noise": {},
                      "node_size": None,
                      "costs": {FP32: _cost(FP32, 32, True), BF16: _cost(BF16, 16, True), Q8: _cost(Q8, 8.06, False)}}
    pred = Decision(dict(finalists[0][1]), False, finalists[0][2], fp32_s, 3, [], finalists=list(finalists),
                    measured_s={"fp32": fp32_s})
    tuner._pending, tuner._trial, tuner._marks, tuner._trial_times = pred, 0, [], []
    tuner._order, tuner._first, tuner.phase = list(range(len(finalists))), None, "trial"
    clock = [100.0]
    label_of = [(label, a) for label, a, _ in finalists]
    seen: dict[str, int] = {}
    step = 10
    old_mark = A._mark
    A._mark = lambda device: clock[0]
    try:
        while tuner.phase == "trial" and (until is None or step - 10 < until):
            n = len(state.sets)
            tuner._trial_mark(state, step)
            for a in state.sets[n:]:  # a finalist's plan set at this forward pass: its pass begins
                label = next(lb for lb, plan in label_of if plan == a)
                seen[label] = seen.get(label, -1) + 1
            if tuner.phase == "trial":
                current = next(lb for lb, plan in label_of if plan == state.sets[-1])
                clock[0] += durations[current][seen[current]]
                step += 1
    finally:
        A._mark = old_mark
    return tuner, state, step - 10


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
    plans = [a for a in state.sets]
    assert plans[:5] == [fin[0][1], fin[1][1], fin[2][1], fin[1][1], fin[0][1]]  # then the decision's
    assert steps == 5 * (1 + tuner.trial_steps)  # each pass: a warm-up and trial_steps timed steps
    d = tuner.decision
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


def test_pickled_during_the_second_pass_measures_again() -> None:
    fin = _plans()
    tuner, _, steps = _drive(fin, 0.060, {"predicted best": [0.040, 0.040], fin[1][0]: [0.041, 0.041],
                                          "slow": [0.060]}, until=3 * (1 + 2) + 2)
    assert tuner.phase == "trial" and tuner._first is not None  # inside the second pass
    again = pickle.loads(pickle.dumps(tuner))
    assert again.phase == "measure" and again._pending is None and again.measured is None
    assert again._first is None and again._order == [] and again._trial == 0


def test_a_decision_pickled_before_retried_existed_reads_none_retried() -> None:
    d = Decision({"w": Q8}, False, 0.04, 0.06, 3, [], finalists=[("predicted best", {"w": Q8}, 0.04)],
                 measured_s={"fp32": 0.06, "predicted best": 0.04})
    del d.__dict__["retried"]  # as an older lowbit pickled it
    old = pickle.loads(pickle.dumps(d))
    assert old.retried == () and "(2 passes)" not in old.table()
    # ... and a checkpoint's decision dict saved without the field
    fields = d.__dict__
    assert Decision(**fields).retried == ()
