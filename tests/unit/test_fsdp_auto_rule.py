"""lowbit.fsdp's codec="auto" rule alone, in one process, on a clock the test sets: module exchanges that
cost a known time per choice (a link and codecs of known speed; the clock the tuner reads, injected
through ``clock=``, advances by it) and show the tuner random gradient rows; what it admits, tries and chooses, its
ties, allow= and error_budget=, the guard's loss rule, a non-finite sample. Nothing sleeps, so a busy
second worker cannot move a close call (a tie within 3 %: bf16 53.0 ms against 8-bit QSGD 52.9 ms a
step). The 2-rank FSDP2 checks are in tests/distributed/test_fsdp_auto.py."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import lowbit

fsdp_api = pytest.importorskip("torch.distributed.fsdp")
if not hasattr(fsdp_api.FSDPModule, "set_custom_reduce_scatter"):  # pragma: no cover
    pytest.skip("this torch's FSDP2 has no custom reduce-scatter", allow_module_level=True)

import lowbit.fsdp as lf  # noqa: E402
from lowbit.auto.estimates import spread_sample  # noqa: E402
from lowbit.auto.fsdp_tuner import FSDPAuto  # noqa: E402
from tests.unit.manual_clock import ManualClock  # noqa: E402

CLOCK = ManualClock()  # the tuners' clock in this file (seconds)


@pytest.fixture(autouse=True)
def _set_clock() -> None:
    CLOCK.now = 1000.0

Q8 = lowbit.get_codec("qsgd:bits=8,bucket=512").spec
Q4 = lowbit.get_codec("qsgd:bits=4,bucket=512").spec
BF16 = lowbit.get_codec("bf16").spec


class _Exchange:
    """A module's reduce-scatter as the tuner sees it, in one process: a call costs ``costs[choice]``
    seconds on the clock (a link and codecs of known speed) and shows the tuner random gradient rows."""

    def __init__(self, name: str, numel: int, costs: dict[str, float]) -> None:
        self.name, self.choice, self.costs = name, lf.NATIVE, costs
        self.rows = torch.randn(2, numel // 2, generator=torch.Generator().manual_seed(numel))

    def set_choice(self, key: str) -> None:
        self.choice = key

    def sample(self, rows: torch.Tensor) -> tuple[torch.Tensor, int]:
        return spread_sample(rows.reshape(-1)), rows.numel()

    def residual_sq(self) -> None:
        return None


def _tune(costs: dict[str, float], base_s: float, level: str = "conservative", **kw) -> FSDPAuto:
    """Run steps of a big module (40,000 values) and a small one (4,000) until the tuner decides; a step
    also computes for ``base_s``. ``kw``: FSDPAuto's other options (guard_every 0 unless given)."""
    tuner = FSDPAuto(level, **{"guard_every": 0, **kw}, clock=CLOCK)
    model = nn.Linear(2, 2)
    exchanges = [_Exchange("big", 40_000, costs), _Exchange("small", 4_000, costs)]
    tuner.attach(model, None, torch.device("cpu"), [(ex.name, ex.rows.numel(), ex) for ex in exchanges])
    tuner.model = model  # (for _step)
    while tuner.decision is None and tuner.steps < 30:
        _step(tuner, base_s)
    return tuner


def _step(tuner: FSDPAuto, base_s: float = 0.0, loss: float | None = None) -> None:
    """One step of _tune's model: its forward, each module's reduce-scatter, ``loss`` reported."""
    tuner.model(torch.zeros(1, 2))
    for ex in tuner.exchanges.values():
        tuner.observe(ex, ex.rows)
        CLOCK.now += ex.costs[ex.choice]
    CLOCK.now += base_s
    if loss is not None:
        tuner.report_loss(loss)




def test_native_when_the_codecs_cost_more_than_they_save() -> None:
    """A fast link: FSDP's reduce-scatter 1 ms a call, lowbit's 6-8 ms (its host time)."""
    t = _tune({lf.NATIVE: 0.001, BF16: 0.006, Q8: 0.008}, base_s=0.01)
    assert [label for label, _ in t.finalists] == [lf.NATIVE, BF16, Q8]  # tried ...
    assert t.chosen == lf.NATIVE and set(t.decision.values()) == {lf.NATIVE}, t.table()  # ... and lost
    assert t.measured_s[lf.NATIVE] < min(t.measured_s[BF16], t.measured_s[Q8])
    assert t.measured_s == pytest.approx({lf.NATIVE: 0.012, BF16: 0.017, Q8: 0.019}) and t.retried == []
    assert t.decided_iter == 2 + 3 * 3  # 2 warm-up steps, then 1 + 2 steps a finalist: none close to another


def test_compresses_the_big_module_and_a_tie_goes_to_the_more_precise() -> None:
    # a slow link: 8-bit QSGD clearly fastest
    t = _tune({lf.NATIVE: 0.02, BF16: 0.015, Q8: 0.004}, base_s=0.01)
    assert t.decision == {"big": Q8, "small": lf.NATIVE} == {n: ex.choice for n, ex in t.exchanges.items()}, t.table()
    # bf16 and 8-bit QSGD within 3 % of each other (53.0 and 52.9 ms a step): bf16, the more precise; within
    # 10 % of each other, both ran a second pass (in reverse order), native (60 ms) did not
    t = _tune({lf.NATIVE: 0.01, BF16: 0.003, Q8: 0.0029}, base_s=0.04)
    assert t.decision == {"big": BF16, "small": lf.NATIVE}, t.table()
    assert t.retried == [BF16, Q8] and t.decided_iter == 2 + 3 * 3 + 3 * 2, t.table()
    assert t.measured_s == pytest.approx({lf.NATIVE: 0.060, BF16: 0.053, Q8: 0.0529})
    assert "bf16 53.00 ms (2 passes)" in t.table() and "native 60.00 ms," in t.table()


def test_bold_admits_no_codec_whose_error_exceeds_the_limit() -> None:
    """One rank: no sampling noise, so bold's limit is 8-bit QSGD's error, which 4-bit QSGD and 1bitSGD*
    exceed: however fast they would be, they are not tried."""
    q4, one = (lowbit.get_codec(s).spec for s in ("qsgd:bits=4,bucket=512", "onebit:bucket=64"))
    t = _tune({lf.NATIVE: 0.02, BF16: 0.015, Q8: 0.01, q4: 0.001, one: 0.001}, base_s=0.005, level="bold")
    assert t.errors["big"][q4] > t.limits["big"] == t.errors["big"][Q8]
    assert [label for label, _ in t.finalists] == [lf.NATIVE, BF16, Q8]
    assert t.decision["big"] == Q8, t.table()


def test_allow_limits_the_candidates_to_native_and_its_codecs() -> None:
    """8-bit QSGD would be fastest, but allow=["bf16"]: native and bf16 only, tried and chosen among."""
    costs = {lf.NATIVE: 0.02, BF16: 0.01, Q8: 0.002}
    t = _tune(costs, base_s=0.005, allow=["bf16"])
    assert t.allow == [BF16] and [label for label, _ in t.finalists] == [lf.NATIVE, BF16]
    assert set(t.measured_s) == {lf.NATIVE, BF16}
    assert t.decision == {"big": BF16, "small": lf.NATIVE}, t.table()
    assert t.guard.up(BF16) == lf.NATIVE  # the guard's ladder: the allowed codecs only


def test_error_budget_scales_each_module_s_limit_and_none_admits_every_allowed_codec() -> None:
    """allow=[4-bit QSGD] at the conservative level: over 8-bit QSGD's error, so not admitted (native
    alone, nothing tried) unless the budget makes room: 1000x (4-bit QSGD's error is ~330x 8-bit's), or
    None (no limit)."""
    costs = {lf.NATIVE: 0.02, Q4: 0.002}
    t = _tune(costs, base_s=0.002, allow=[Q4])
    assert t.errors["big"][Q4] > t.limits["big"] == t.errors["big"][Q8]
    assert [label for label, _ in t.finalists] == [lf.NATIVE] and set(t.decision.values()) == {lf.NATIVE}
    for eb in (None, 1000.0):
        t = _tune(costs, base_s=0.002, allow=[Q4], error_budget=eb)
        assert t.limits["big"] == (math.inf if eb is None else 1000.0 * t.errors["big"][Q8])
        assert [label for label, _ in t.finalists] == [lf.NATIVE, Q4], t.table()
        assert t.decision == {"big": Q4, "small": lf.NATIVE}, t.table()


def test_report_loss_feeds_the_guard_s_loss_rule() -> None:
    """One process: the losses reported while measuring are the rule's first reference; a loss 3x that
    and not coming down steps the compressed module one up (8-bit QSGD -> bf16), a NaN loss to native."""
    costs = {lf.NATIVE: 0.02, BF16: 0.015, Q8: 0.004}
    t = FSDPAuto(guard_every=2, clock=CLOCK)
    t.model = nn.Linear(2, 2)
    exchanges = [_Exchange("big", 40_000, costs), _Exchange("small", 4_000, costs)]
    t.attach(t.model, None, torch.device("cpu"), [(ex.name, ex.rows.numel(), ex) for ex in exchanges])
    while t.decision is None:
        _step(t, 0.002, loss=torch.tensor(2.0))  # (a tensor)
    assert t.decision == {"big": Q8, "small": lf.NATIVE} and t.guard.loss_best == 2.0, t.table()
    # checks at the 3rd, 5th, 7th, 9th step's forward from here, each on the losses reported since the last
    for loss in (2.0, 2.0, 1.9, 1.9, 6.0, 6.0):
        _step(t, loss=loss)
    assert not t.changes and t.guard.loss_best == 1.9
    _step(t)  # the check of the two 6.0s
    assert [(c["tensor"], c["from"], c["to"]) for c in t.changes] == [("big", Q8, BF16)], t.table()
    assert "reported loss 6 is 3.16x its lowest mean 1.9" in t.changes[0]["reason"]
    assert t.exchanges["big"].choice == BF16
    _step(t, loss=float("nan"))
    _step(t)  # its check
    assert [(c["from"], c["to"], c["reason"]) for c in t.changes[1:]] == \
        [(BF16, lf.NATIVE, "the reported loss is not finite")]
    assert t.exchanges["big"].choice == lf.NATIVE


def test_a_module_without_a_finite_sample_waits_a_step_then_stays_native() -> None:
    """The warm-up sample of the big module NaN: admission waits one step and takes that step's sample;
    NaN again, the module is admitted nothing (native) and the table says nan, not 0 (admitted)."""
    costs = {lf.NATIVE: 0.02, BF16: 0.015, Q8: 0.004}
    for recovers in (True, False):
        t = FSDPAuto(guard_every=0, clock=CLOCK)
        t.model = nn.Linear(2, 2)
        exchanges = [_Exchange("big", 40_000, costs), _Exchange("small", 4_000, costs)]
        t.attach(t.model, None, torch.device("cpu"), [(ex.name, ex.rows.numel(), ex) for ex in exchanges])
        big, good = exchanges[0], exchanges[0].rows
        big.rows = good.clone().index_fill_(1, torch.tensor([7]), math.nan)
        _step(t)
        _step(t)  # the last warm-up step: its sample is NaN
        if recovers:
            big.rows = good
        _step(t)  # its forward: admission put off to this step's sample
        _step(t)  # its forward: admitted
        assert t.phase == ("trial" if recovers else "done") and t.steps == 3
        while t.decision is None and t.steps < 30:
            _step(t, 0.005)
        if recovers:
            assert math.isfinite(t.errors["big"][Q8]) and t.decided_iter == 3 + 3 * 3, t.table()
            assert t.decision == {"big": Q8, "small": lf.NATIVE}, t.table()
        else:
            assert t.decided_iter == 3 and t.decision == {"big": lf.NATIVE, "small": lf.NATIVE}, t.table()
            row = next(line for line in t.table().splitlines() if line.startswith("big"))
            assert row.split()[-2:] == ["nan", "nan"], t.table()


def test_each_finalist_runs_its_trial_steps_in_one_block_after_a_warm_up() -> None:
    """DDP's trial rule (lowbit.auto.trials): a finalist's warm-up step and its two timed steps run back to
    back, so a module switches once a finalist (an error-feedback codec keeps its residual over its timed
    steps), not at every step as in rounds."""
    costs = {lf.NATIVE: 0.001, BF16: 0.006, Q8: 0.008}
    t = FSDPAuto(guard_every=0, clock=CLOCK)
    t.model = nn.Linear(2, 2)
    exchanges = [_Exchange("big", 40_000, costs), _Exchange("small", 4_000, costs)]
    switches = []
    exchanges[0].set_choice = lambda key: (switches.append(key), setattr(exchanges[0], "choice", key))
    t.attach(t.model, None, torch.device("cpu"), [(ex.name, ex.rows.numel(), ex) for ex in exchanges])
    ran = []
    while t.decision is None:
        _step(t, 0.01)
        ran.append(exchanges[0].choice)  # what this step ran (set at its forward pass)
    assert ran[:2] == [lf.NATIVE] * 2  # the warm-up steps
    assert ran[2:11] == [lf.NATIVE] * 3 + [BF16] * 3 + [Q8] * 3, ran
    assert switches == [BF16, Q8, lf.NATIVE], switches  # into each trial once, then the decision (native)
