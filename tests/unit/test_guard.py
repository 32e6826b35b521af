"""lowbit.auto.guard: codec="auto"'s guard rule on made-up checks (no processes): each signal steps a tensor up,
the healthy case changes nothing, and every rank's numbers combine to one decision."""

from __future__ import annotations

import math

import pytest

import torch

from lowbit.auto.guard import ERROR_DRIFT, LOSS_RISE, RESIDUAL_GROWTH, Guard, ReportedLoss, combine

Q1, Q4, Q8, ONE = "qsgd:bits=1", "qsgd:bits=4", "qsgd:bits=8", "onebit:bucket=64"
LADDER = [("fp32", 32.0), ("bf16", 16.0), (Q8, 8.06), (Q4, 4.06), (ONE, 2.0)]


def _guard(every: int = 10) -> Guard:
    g = Guard(every, LADDER, hierarchical=[Q8, Q4, ONE])
    g.start(100, loss=2.0)
    return g


def _t(err: float = 0.01, norm: float = 1.0, residual: float | None = None, finite: bool = True,
       values: int = 65536, residual_finite: bool = True) -> dict:
    return {"err": err, "norm": norm, "residual": residual, "finite": finite, "values": values,
            "residual_finite": residual_finite}


def _stats(loss: float | None = None, **tensors: dict) -> dict:
    return {"tensors": tensors, "loss": loss, "loss_finite": loss is None or math.isfinite(loss)}


def test_the_ladder_goes_up_by_bits_and_keeps_the_algorithm_where_it_can() -> None:
    g = _guard()
    assert g.up(ONE) == Q4 and g.up(Q4) == Q8 and g.up(Q8) == "bf16" and g.up("bf16") == "fp32"
    assert g.up("fp32") == "fp32"
    assert g.up(f"{ONE}@hierarchical") == f"{Q4}@hierarchical"
    assert g.up(f"{Q8}@hierarchical") == "bf16"  # summed on the wire: no algorithm of its own


def test_a_healthy_check_changes_nothing_and_schedules_the_next() -> None:
    g = _guard(every=10)
    assert g.next_check == 110
    a = {"w": Q4, "b": "fp32"}
    assert g.check(111, a, _stats(1.0, w=_t(0.011, 1.0, residual=None)), {"w": 0.01}) == {}
    assert g.next_check == 120 and g.changes == [] and g.loss_best == 1.0


def test_error_drift_steps_up_one_level_and_sets_a_floor() -> None:
    g = _guard()
    a = {"w": Q4, "v": Q4}
    out = g.check(111, a, _stats(w=_t(err=ERROR_DRIFT * 0.011), v=_t(err=ERROR_DRIFT * 0.009)), {"w": 0.01, "v": 0.01})
    assert list(out) == ["w"] and out["w"][0] == Q8 and "error grew" in out["w"][1]
    assert g.floors == {"w": 8.06} and g.changes[0]["step"] == 110 and g.changes[0]["from"] == Q4
    assert g.allowed("w", ["fp32", Q8, Q4, ONE]) == ["fp32", Q8]
    # a small tensor's sample is too noisy to judge
    assert g.check(121, a, _stats(v=_t(err=1.0, values=100)), {"v": 0.01}) == {}
    # not measured at decision time: the first check's value is the reference
    assert g.check(131, a, _stats(v=_t(err=0.01)), {"v": None}) == {}
    assert "v" in g.check(141, a, _stats(v=_t(err=0.05)), {"v": None})


def test_residual_growth_between_checks_steps_up() -> None:
    g = _guard()
    a = {"w": ONE}
    assert g.check(111, a, _stats(w=_t(residual=2.0)), {"w": 0.01}) == {}
    assert g.check(121, a, _stats(w=_t(residual=2.0 * RESIDUAL_GROWTH * 0.9)), {"w": 0.01}) == {}
    out = g.check(131, a, _stats(w=_t(residual=2.0 * RESIDUAL_GROWTH ** 2)), {"w": 0.01})
    assert out["w"][0] == Q4 and "residual grew" in out["w"][1]
    g2 = _guard()  # below the gradient's own norm, growth alone is not a signal
    g2.check(111, a, _stats(w=_t(residual=0.01)), {"w": 0.01})
    assert g2.check(121, a, _stats(w=_t(residual=0.5)), {"w": 0.01}) == {}


def test_non_finite_residual_goes_to_fp32_and_a_gradient_is_confirmed_at_the_next_step() -> None:
    g = _guard()
    a = {"w": ONE, "v": Q4}
    out = g.check(111, a, _stats(w=_t(residual_finite=False), v=_t(finite=False, err=math.nan)), {})
    assert out == {"w": ("fp32", "its error-feedback residual is not finite")}
    assert g.strikes == {"v"} and g.next_check == 111  # the step now starting is watched at once
    assert g.check(112, {**a, "w": "fp32"}, _stats(v=_t()), {"v": 0.01}) == {}  # one overflow: forgiven
    assert g.strikes == set() and g.next_check == 121
    g.check(122, a, _stats(v=_t(finite=False)), {})
    out = g.check(123, a, _stats(v=_t(finite=False)), {})
    assert out["v"][0] == "fp32" and "two checks" in out["v"][1]


def test_loss_rule_steps_every_compressed_tensor_while_the_loss_is_not_coming_down() -> None:
    g = _guard()
    a = {"w": ONE, "v": Q8, "b": "fp32"}
    assert g.check(111, a, _stats(1.0), {}) == {} and g.loss_best == 1.0
    out = g.check(121, a, _stats(LOSS_RISE * 1.1), {})
    assert {n: to for n, (to, _) in out.items()} == {"w": Q4, "v": "bf16"} and "loss" in out["w"][1]
    a = {"w": Q4, "v": "bf16", "b": "fp32"}
    assert g.check(131, a, _stats(LOSS_RISE * 1.05), {}) == {}  # above the best, but coming down
    assert set(g.check(141, a, _stats(LOSS_RISE * 1.2), {})) == {"w", "v"}  # rising again
    out = g.check(151, a, _stats(float("nan")), {})
    assert {to for to, _ in out.values()} == {"fp32"}


def test_combine_sums_in_rank_order_and_any_rank_makes_it_non_finite() -> None:
    r0 = {"tensors": {"w": _t(0.1, 1.0, 0.5, values=10)}, "loss": 1.0, "loss_finite": True}
    r1 = {"tensors": {"w": _t(0.3, 3.0, 1.5, values=20)}, "loss": 3.0, "loss_finite": True}
    c = combine([r0, r1])
    assert c["tensors"]["w"]["err"] == pytest.approx(0.4) and c["tensors"]["w"]["norm"] == pytest.approx(4.0)
    assert c["tensors"]["w"]["residual"] == pytest.approx(2.0) and c["tensors"]["w"]["values"] == 10
    assert c["loss"] == pytest.approx(2.0) and c["loss_finite"]
    bad = {"tensors": {"w": _t(finite=False, residual=math.inf)}, "loss": None, "loss_finite": False}
    c = combine([r0, bad])
    assert not c["tensors"]["w"]["finite"] and not c["tensors"]["w"]["residual_finite"] and not c["loss_finite"]


def test_the_state_round_trips() -> None:
    g = _guard()
    g.check(111, {"w": Q4}, _stats(1.0, w=_t(err=1.0)), {"w": 0.01})
    h = Guard(10, LADDER)
    h.load_state_dict(g.state_dict())
    assert h.state_dict() == g.state_dict() and h.floors == {"w": 8.06} and len(h.changes) == 1
    with pytest.raises(ValueError, match="guard state must be a dict"):
        h.load_state_dict([])  # type: ignore[arg-type]


def test_reported_losses_are_averaged_between_takes_and_a_non_finite_mean_is_flagged() -> None:
    r = ReportedLoss()
    assert r.take() is None and ReportedLoss.entry(None) == {"loss": None, "loss_finite": True}
    r.add(torch.tensor(1.0, requires_grad=True) * 2)  # a tensor (detached), then floats
    r.add(4.0)
    r.add(6)
    assert r.take() == 4.0 and r.take() is None  # the mean since the last take; then a new sum
    r.add(1.0)
    r.add(float("nan"))
    loss = r.take()
    assert math.isnan(loss) and ReportedLoss.entry(loss) == {"loss": None, "loss_finite": False}
    assert ReportedLoss.entry(2.5) == {"loss": 2.5, "loss_finite": True}
