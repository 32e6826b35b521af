"""The speed model of local SGD against per-step compression (lowbit.lab.perfmodel.localsgd, issue 45):
amortisation over H, streaming, groups, the cross-over bandwidth and ``lowbit predict --localsgd``."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from lowbit.lab.cli import main as lowbit_main
from lowbit.lab.perfmodel.links import Link
from lowbit.lab.perfmodel.localsgd import (crossover, crossover_bandwidth, ddp_step, emulated_cost, localsgd_step,
                                       model_layers)
from lowbit.lab.perfmodel.model import Cluster, bits_per_value
from lowbit.lab.study.crossover import _interp_crossing, check, format_check
from lowbit.lab.study.tta import time_to_target

Q4 = "qsgd:bits=4,bucket=512"
Q2 = "qsgd:bits=2,bucket=512"
N = 136_960          # the localsgd preset's tiny GPT
C = 0.040            # 40 ms of compute a step


def _two(bw: float = 12.5e6, lat: float = 0.0) -> Cluster:
    return Cluster(2, 2, Link(lat, bw))


@pytest.mark.parametrize("rule", ["ring", "emulated"])
@pytest.mark.parametrize("codec", ["fp32", Q4, Q2])
def test_local_step_amortises_one_ddp_exchange_over_h(rule: str, codec: str) -> None:
    layers, cl = model_layers(N, C), _two()
    d = ddp_step(layers, cl, codec, link_rule=rule)
    for h in (1, 4, 16):
        lo = localsgd_step(layers, cl, codec, h, link_rule=rule)
        assert lo.compute_s == pytest.approx(C)
        assert lo.comm_s == pytest.approx(d.comm_s / h, rel=1e-3)
        assert lo.bytes_per_step == pytest.approx(d.bytes_per_step / h, rel=1e-3)
        assert lo.step_s == pytest.approx(C + d.comm_s / h, rel=1e-4)


def test_local_step_falls_with_h_towards_compute() -> None:
    layers, cl = model_layers(N, C), _two(lat=1e-3)
    steps = [localsgd_step(layers, cl, Q4, h, encode_Bps=1e9, decode_Bps=1e9).step_s for h in (1, 2, 4, 8, 16, 64)]
    assert all(a > b for a, b in zip(steps, steps[1:]))
    assert steps[-1] > C and steps[-1] - C < (steps[0] - C) / 32


def test_crossover_closed_form() -> None:
    # zero latency, free codecs, one message after the backward: B* = (W_d - rho W_l / H) / ((rho - 1) c)
    layers, cl, h, rho = model_layers(N, C), _two(), 16, 2.0
    x = crossover(layers, cl, ddp_codec="fp32", local_codec="fp32", local_steps=h, steps_ratio=rho)
    w = 4 * N
    assert x.bandwidth_Bps == pytest.approx((w - rho * w / h) / ((rho - 1) * C), rel=2e-3)


def test_crossover_moves_by_the_codecs_bytes_ratio() -> None:
    layers, cl = model_layers(N, C), _two()
    fp = crossover(layers, cl, ddp_codec="fp32", local_codec="fp32", local_steps=16, steps_ratio=1.5).bandwidth_Bps
    for codec in (Q4, Q2):
        q = crossover(layers, cl, ddp_codec=codec, local_codec=codec, local_steps=16, steps_ratio=1.5).bandwidth_Bps
        assert q / fp == pytest.approx(bits_per_value(codec, N) / 32, rel=3e-3)


def test_crossover_rises_with_h() -> None:
    layers, cl = model_layers(N, C), _two(lat=2e-4)
    xs = [crossover(layers, cl, ddp_codec=Q4, local_codec=Q4, local_steps=h, steps_ratio=1.3).bandwidth_Bps
          for h in (2, 4, 8, 16, 64)]
    assert all(0 < a < b < math.inf for a, b in zip(xs, xs[1:]))


def test_crossover_ends() -> None:
    layers, cl = model_layers(N, C), _two()
    # as many steps as DDP: its steps are never dearer, so it pays on every link
    assert crossover(layers, cl, local_steps=16, steps_ratio=1.0).bandwidth_Bps == math.inf
    # 16x the steps at H=16 saves no bytes and costs compute: it pays on none
    assert crossover(layers, cl, local_steps=16, steps_ratio=16.0).bandwidth_Bps == 0.0
    with pytest.raises(ValueError, match="steps ratio"):
        crossover_bandwidth(lambda b: 1.0, lambda b: 1.0, 0.0)
    with pytest.raises(ValueError, match="search range"):
        crossover_bandwidth(lambda b: 1.0, lambda b: 1.0, 1.0, search=(10.0, 1.0))


def test_streaming_spreads_the_same_bytes_and_pays_the_latency_f_times() -> None:
    layers, lat = model_layers(N, C), 5e-3
    one = localsgd_step(layers, _two(lat=lat), Q4, 16)
    four = localsgd_step(layers, _two(lat=lat), Q4, 16, fragments=4)
    assert four.bytes_per_step == pytest.approx(one.bytes_per_step, rel=1e-3)
    assert four.step_s - one.step_s == pytest.approx(3 * lat / 16, rel=1e-2)   # allgather of 2: one latency
    assert localsgd_step(layers, _two(), Q4, 16, fragments=4).step_s == pytest.approx(
        localsgd_step(layers, _two(), Q4, 16).step_s, rel=1e-3)


def test_groups_send_their_chunk_between_nodes() -> None:
    # 2 nodes x 4 GPUs: DDP fp32 inside every step, each rank sends n/4 values among the 2 nodes
    layers = model_layers(8_000_000, 0.1)
    cl = Cluster(8, 4, "nvlink", Link(0.0, 1.25e9), nics_per_node=1)
    lo = localsgd_step(layers, cl, Q4, 10)
    assert lo.algorithm == "allgather"
    assert lo.bytes_per_exchange == pytest.approx(2e6 * bits_per_value(Q4, 2_000_000) / 8, rel=1e-6)
    assert lo.compute_s > 0.1  # DDP inside the node
    assert lo.comm_s > lo.bytes_per_exchange / (1.25e9 / 4) / 10 * 0.99  # 4 exchanges share the node's NIC


def test_emulated_rule_prices_what_a_rank_contributes() -> None:
    link = Link(0.0, 1e6)
    assert emulated_cost("allgather", 1e6, 4, link).time_s == pytest.approx(1.0)
    assert emulated_cost("allreduce", 1e6, 4, link).time_s == pytest.approx(1.0)
    assert emulated_cost("scatter_gather", 1e6, 4, link).time_s == pytest.approx(1.25)
    with pytest.raises(ValueError, match="emulated link rule"):
        emulated_cost("hierarchical", 1e6, 4, link)


def test_emulated_rule_pays_the_latency_of_every_collective_measured() -> None:
    """A step of 4 collectives (messages, per-call checks) pays 4 latencies and its bytes once."""
    link = Link(0.025, 12.5e6)
    assert emulated_cost("allgather", 1e6, 2, link).time_s == pytest.approx(0.025 + 0.08)
    assert emulated_cost("allgather", 1e6, 2, link, collectives=4).time_s == pytest.approx(4 * 0.025 + 0.08)
    layers = model_layers(N, C)
    one = ddp_step(layers, Cluster(2, 2, link), Q4, link_rule="emulated")
    four = ddp_step(layers, Cluster(2, 2, link), Q4, link_rule="emulated", collectives=4)
    assert four.step_s - one.step_s == pytest.approx(3 * 0.025) and four.bytes_per_step == one.bytes_per_step
    lo = localsgd_step(layers, Cluster(2, 2, link), Q4, 16, link_rule="emulated", collectives=2)
    assert lo.comm_s == pytest.approx(localsgd_step(layers, Cluster(2, 2, link), Q4, 16, link_rule="emulated").comm_s
                                      + 0.025 / 16)
    with pytest.raises(ValueError, match="collectives"):
        emulated_cost("allgather", 1e6, 2, link, collectives=-1)


def test_bad_inputs_are_named() -> None:
    layers = model_layers(N, C)
    with pytest.raises(ValueError, match="local steps"):
        localsgd_step(layers, _two(), Q4, 0)
    with pytest.raises(ValueError, match="fragments"):
        localsgd_step(layers, _two(), Q4, 4, fragments=0)
    with pytest.raises(ValueError, match="link rule"):
        ddp_step(layers, _two(), Q4, link_rule="wire")
    with pytest.raises(ValueError, match="compute per step"):
        model_layers(N, 0.0)


def test_measured_crossing_is_interpolated_or_said_extrapolated() -> None:
    b, how = _interp_crossing([(12.5e6, 0.5), (125e6, 2.0)])
    assert b == pytest.approx(math.sqrt(12.5e6 * 125e6)) and how.startswith("interpolated")
    b, how = _interp_crossing([(12.5e6, 0.25), (125e6, 0.5)])
    assert b == pytest.approx(1250e6) and how.startswith("extrapolated")
    assert _interp_crossing([(12.5e6, 0.5)])[0] is None


def test_predict_localsgd_command(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["predict", "--localsgd", "16", "--params", str(N), "--compute-ms", "40", "--gpus", "2",
            "--gpus-per-node", "2", "--intra", "bw=100Mbit/s,lat=0", "--codec", Q4, "--steps-ratio", "2",
            "--encode-gbps", "0", "--decode-gbps", "0"]
    assert lowbit_main(argv) == 0
    out = capsys.readouterr().out
    assert "local SGD qsgd4/512 H=16 vs DDP fp32: below 108 Mbit/s" in out
    assert "local SGD fp32 H=16 vs DDP fp32: below 95.9 Mbit/s" in out
    assert lowbit_main(argv + ["--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert {s["scheme"] for s in doc["schemes"]} == {"ddp", "localsgd"} and len(doc["crossovers"]) == 4


def test_predict_localsgd_refuses_half_a_model(capsys: pytest.CaptureFixture[str]) -> None:
    assert lowbit_main(["predict", "--localsgd", "16", "--params", "1000"]) == 2
    assert "--params and --compute-ms go together" in capsys.readouterr().err
    assert lowbit_main(["predict", "--localsgd", "0", "--params", "1000", "--compute-ms", "1"]) == 2
    assert "--localsgd must be a positive" in capsys.readouterr().err


# ------------------------------------------------------------------ the check against a localsgd study
FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
LOCALSGD = FIXTURES / "study_cpu_localsgd"      # seed 0, K=2 of the committed CPU study


def _k2(rep: dict) -> dict:
    return next(s for s in rep["settings"] if s["world_size"] == 2)


def test_check_says_plainly_when_local_sgd_never_reached_the_target() -> None:
    st = _k2(check(str(LOCALSGD)))
    assert st["params"] == N
    q4 = next(c for c in st["comparisons"] if c["local"] == "QSGD 4bit/512 +EF [local SGD H=16]")
    assert q4["measured_crossover_Bps"] is None and q4["predicted_crossover_Bps"] is None
    assert q4["verdict"] == "no verdict: no measured cross-over"
    # the model's answer instead: the most steps local SGD may take and still be sooner (> 1: its step is cheaper)
    assert all(1.0 < v["break_even_steps_ratio"] < 1.5 for v in q4["links"].values())
    ratios = st["targets"]["bytes_per_outer_step_vs_fp32"]
    assert ratios["100mbit QSGD 4bit/512 +EF [local SGD H=16]"]["ratio"] == pytest.approx(4.0626 / 32, rel=1e-3)
    assert ratios["100mbit QSGD 2bit/512 +EF [local SGD H=16]"]["ratio"] == pytest.approx(2.0626 / 32, rel=1e-3)
    assert all(v["met"] and v["as_modelled"] and v["algorithm"] == "allgather" for v in ratios.values())
    assert "no measured cross-over" in format_check(check(str(LOCALSGD)))


def test_check_interpolates_a_crossing_and_predicts_from_the_steps_ratio(tmp_path: Path) -> None:
    # the same rows, the 4-bit local SGD run's curve shifted to reach the target at 100 Mbit/s sooner than
    # the per-step runs (0.5x their time) and at 1 Gbit/s later (2x): the ratio crosses 1 between them
    rows = [json.loads(line) for line in (LOCALSGD / "results.jsonl").read_text().splitlines()]
    runs = {(r["config"]["emulate_link"], r["config"]["parallelism"], r["config"]["codec"], r["config"]["fragments"]): r
            for r in rows if r.get("kind") == "run"}
    for link, factor in (("100mbit", 0.5), ("1gbit", 2.0)):
        ddp = [r for k, r in runs.items() if k[0] == link and k[1] == "data"]
        best = min((time_to_target_of(r), r) for r in ddp if time_to_target_of(r) is not None)[0]
        loc = next(r for k, r in runs.items() if k[0] == link and k[1] == "localsgd"
                   and k[2].startswith("qsgd:bits=4") and k[3] == 1)
        target = loc["summary"]["target_loss"]
        loc["curve"] = [{**p, "val_loss": (target if abs(p["train_s"] - best * factor) == min(
            abs(q["train_s"] - best * factor) for q in loc["curve"]) else 9.0)} for p in loc["curve"]]
    (tmp_path / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    q4 = next(c for c in _k2(check(str(tmp_path)))["comparisons"] if c["local"] == "QSGD 4bit/512 +EF [local SGD H=16]")
    assert q4["measured_how"] == "interpolated between the links"
    assert 12.5e6 < q4["measured_crossover_Bps"] < 125e6
    assert q4["steps_ratio_used"] is not None and q4["predicted_crossover_Bps"] is not None
    assert q4["verdict"].startswith(("within", "NOT within", "no verdict: the model"))


def time_to_target_of(r: dict) -> float | None:
    """A stored row's time to target, read as the report reads it (config fields at the top)."""
    return time_to_target({**r, **r["config"]})


def test_check_refuses_results_without_local_sgd() -> None:
    with pytest.raises(ValueError, match="no time-to-accuracy runs of both local SGD and DDP"):
        check(str(FIXTURES / "study_cpu_default"))


def test_check_prices_each_links_stated_latency(tmp_path: Path) -> None:
    """Links stated with a latency (``"100mbit@25ms"``): the model's steps pay it once per collective, DDP's
    every step and local SGD's once per period of H steps; the latency between the links is interpolated."""
    from lowbit.lab.study.crossover import _latency_along

    rows = [json.loads(line) for line in (LOCALSGD / "results.jsonl").read_text().splitlines()]
    lat = {"100mbit": "100mbit@25ms", "1gbit": "1gbit@5ms"}
    for r in rows:
        if r.get("kind") == "run":
            r["config"]["emulate_link"] = lat[r["config"]["emulate_link"]]
    (tmp_path / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    plain, late = _k2(check(str(LOCALSGD))), _k2(check(str(tmp_path)))
    assert sorted(late["links"]) == ["100mbit@25ms", "1gbit@5ms"]
    for c0, c1 in zip(plain["comparisons"], late["comparisons"]):
        assert c0["local"] == c1["local"]
        for link, extra in (("100mbit", 0.025), ("1gbit", 0.005)):
            a, b = c0["links"][link], c1["links"][lat[link]]
            assert b["predicted_ddp_step_s"] - a["predicted_ddp_step_s"] == pytest.approx(extra)
            h, f = (16, 4) if "F=4" in c0["local"] else (16, 1)
            assert b["predicted_local_step_s"] - a["predicted_local_step_s"] == pytest.approx(extra * f / h)
    assert late["targets"]["sooner_at_slowest"]["link"] == "100mbit@25ms"
    at = _latency_along({"a": 12.5e6, "b": 125e6}, {"a": 0.025, "b": 0.005})
    assert at(1e6) == 0.025 and at(1e9) == 0.005 and at(12.5e6) == pytest.approx(0.025)
    assert at(math.sqrt(12.5e6 * 125e6)) == pytest.approx(0.015)


def test_a_window_where_local_sgd_pays_is_found_and_its_top_returned() -> None:
    """With a latency per collective the gain can change sign twice: local SGD loses on the slowest links
    (more bytes per step than the per-step codec), wins in between (the codec's latencies), and loses on
    fast ones (its extra steps; the latency falls with the link, as the check interpolates it between
    100mbit@25ms and 1gbit@5ms). Checking the two ends only found no crossing ("no link")."""
    def lat(b: float) -> float:  # 25 ms at 100 Mbit/s, 5 ms at 1 Gbit/s, on log b between, held beyond
        x = min(max(math.log(b / 12.5e6) / math.log(10), 0.0), 1.0)
        return 0.025 + (0.005 - 0.025) * x

    def ddp(b: float) -> float:
        return 0.03 + 2 * lat(b) + 240e3 / b  # compute, 2 latencies, 240 kB

    def local(b: float) -> float:
        return 0.03 + 2 * lat(b) / 16 + 117e3 / b  # fp32 deltas of 1.9 MB every 16 steps

    b = crossover_bandwidth(ddp, local, 2.11)
    assert ddp(b) == pytest.approx(2.11 * local(b), rel=1e-2)
    assert ddp(b / 2) > 2.11 * local(b / 2) and ddp(b * 2) < 2.11 * local(b * 2)  # the window's top
    assert ddp(1e3) < 2.11 * local(1e3)  # it loses on the slowest link searched


def test_the_measured_cross_over_is_bracketed_by_a_run_that_never_got_there() -> None:
    from lowbit.lab.study.crossover import _bracket

    # sooner at 12.5 MB/s (ratio 0.5); at 125 MB/s it never reached the target in 12 s against 8 s
    lo, hi = _bracket([(12.5e6, 0.5)], [(125e6, 12 / 8)])
    assert lo == 12.5e6 and hi == pytest.approx(_cross_at(12.5e6, 0.5, 125e6, 1.5))
    assert _bracket([(12.5e6, 1.2)], [(125e6, 1.5)]) is None  # never sooner: nothing bracketed
    assert _bracket([(12.5e6, 0.5)], []) is None


def _cross_at(b1: float, r1: float, b2: float, r2: float) -> float:
    return math.exp(math.log(b1) + (0 - math.log(r1)) * (math.log(b2) - math.log(b1)) / (math.log(r2) - math.log(r1)))
