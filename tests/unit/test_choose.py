"""lowbit.choose: the replay of a measured step and the decision rule shared by advise and codec="auto"."""

from __future__ import annotations

import dataclasses

import pytest

from lowbit.choose import CodecCost, Timeline, TensorTiming, Tried, choice, decide, pick, simulate, split_choice

Q8 = "qsgd:bits=8"
Q4 = "qsgd:bits=4"
HQ8 = choice(Q8, "hierarchical")


def _costs(bytes_per_s: float, encode_s_per_value: float = 1e-10, alpha: float = 50e-6) -> dict[str, CodecCost]:
    """A link of ``bytes_per_s``; QSGD's payload is its bits plus a scale per 512 values."""
    def c(spec: str, bits: float, native: bool, enc: float = 0.0) -> CodecCost:
        return CodecCost(spec, bits, native, alpha, bits / 8 / bytes_per_s, enc)
    return {"fp32": c("fp32", 32, True), "bf16": c("bf16", 16, True),
            Q8: c(Q8, 8.06, False, encode_s_per_value), Q4: c(Q4, 4.06, False, encode_s_per_value)}


def _timeline(compute_s: float = 0.05) -> Timeline:
    """Two big matrices and their biases, in two DDP buckets, ready in backward order."""
    t = [TensorTiming("fc2.bias", 1_000, 0.6 * compute_s, 0), TensorTiming("fc2.weight", 4_000_000, 0.6 * compute_s, 0),
         TensorTiming("fc1.bias", 1_000, compute_s, 1), TensorTiming("fc1.weight", 8_000_000, compute_s, 1)]
    return Timeline(tuple(t), compute_s, compute_s * 1.1)


def _errors(scale: float = 1.0) -> dict[str, dict[str, float]]:
    e = {}
    for name, n in [("fc2.bias", 1_000), ("fc2.weight", 4_000_000), ("fc1.bias", 1_000), ("fc1.weight", 8_000_000)]:
        e[name] = {"fp32": 0.0, "bf16": 1e-6 * n, Q8: 1e-3 * n * scale, Q4: 2e-2 * n * scale}
    return e


def test_simulate_counts_what_is_not_hidden() -> None:
    tl = _timeline()
    costs = _costs(1e9)  # 1 GB/s
    all32 = {t.name: "fp32" for t in tl.tensors}
    extra = simulate(tl, all32, costs)
    # bucket 0 (16 MB) is sent at 30 ms and takes 16 ms, bucket 1 (32 MB) at 50 ms: 32 ms exposed
    assert extra == pytest.approx(0.032 + 2 * 50e-6 - 0.0, rel=0.05)
    q8 = {t.name: Q8 if t.numel > 10_000 else "fp32" for t in tl.tensors}
    assert simulate(tl, q8, costs) < extra / 2  # both in one message, sent when fc1's gradient is ready


def test_fast_link_keeps_fp32() -> None:
    d = decide(_timeline(), _costs(300e9), _errors(), error_limit=sum(e[Q8] for e in _errors().values()))
    assert d.fp32_is_best and set(d.assignment.values()) == {"fp32"}
    assert d.speedup == pytest.approx(1.0)


def test_slow_link_compresses_the_large_tensors_only() -> None:
    errors = _errors()
    d = decide(_timeline(), _costs(1e9), errors, error_limit=sum(e[Q8] for e in errors.values()))
    assert not d.fp32_is_best and d.speedup > 1.3
    assert d.assignment["fc1.weight"] == Q8
    # fc2's fp32 allreduce (16 ms from 30 ms) ends before the backward pass does: hidden, so fp32 stays
    assert d.assignment["fc2.weight"] == "fp32"
    assert d.assignment["fc1.bias"] == "fp32" and d.assignment["fc2.bias"] == "fp32"
    saving = {r["name"]: r["saving_s"] for r in d.rows}
    assert saving["fc1.weight"] > 0 and saving["fc1.bias"] == 0
    assert "fc1.weight" in d.table()


def test_error_budget_bounds_the_choice() -> None:
    errors = _errors()
    limit = sum(e[Q8] for e in errors.values())
    free = decide(_timeline(), _costs(1e9), errors, error_limit=None)
    assert Q4 in free.assignment.values()  # no budget: the fewest bits
    bounded = decide(_timeline(), _costs(1e9), errors, error_limit=limit)
    assert Q4 not in bounded.assignment.values()  # 4-bit anywhere big exceeds uniform 8-bit's error
    assert bounded.error is not None and bounded.error <= limit * (1 + 1e-9)
    tight = decide(_timeline(), _costs(1e9), errors, error_limit=limit / 100)
    assert Q8 not in tight.assignment.values()


def test_pick_prefers_bits_within_three_percent_and_fp32_below_the_margin() -> None:
    fp32 = Tried({"a": "fp32"}, 1.0, 32.0)
    fast, close = Tried({"a": Q4}, 2.0, 4.0), Tried({"a": Q8}, 1.96, 8.0)
    assert pick([fp32, fast, close], fp32)[0] is close
    assert pick([fp32, fast, Tried({"a": Q8}, 1.9, 8.0)], fp32)[0] is fast
    chosen, is_fp32 = pick([fp32, Tried({"a": Q8}, 1.04, 8.0)], fp32, faster_than_fp32=1.05)
    assert chosen is fp32 and is_fp32


def test_bad_costs_and_timelines_are_named() -> None:
    with pytest.raises(ValueError, match="s_per_value"):
        CodecCost("fp32", 32, True, 0.0, float("nan"))
    with pytest.raises(ValueError, match="at least one tensor"):
        Timeline((), 1.0, 1.0)
    with pytest.raises(ValueError, match="must include 'fp32'"):
        decide(_timeline(), {Q8: _costs(1e9)[Q8]})


def test_choices_name_a_codec_and_an_algorithm() -> None:
    assert choice(Q8) == Q8 and split_choice(Q8) == (Q8, None)
    assert choice(Q8, "hierarchical") == f"{Q8}@hierarchical"
    assert split_choice(choice(Q8, "hierarchical")) == (Q8, "hierarchical")


def _two_algorithms(bytes_per_s: float = 1e9) -> dict[str, CodecCost]:
    """Flat 8-bit QSGD on the slow link, and hierarchically: half its link time per value (the slow link
    carries a 1/G shard; G = 2), 5 ms more a message (three phases)."""
    costs = {k: dataclasses.replace(c, algorithm="allreduce" if c.native else "scatter_gather")
             for k, c in _costs(bytes_per_s).items() if k != Q4}
    flat = costs[Q8]
    costs[HQ8] = dataclasses.replace(flat, spec=HQ8, alpha_s=flat.alpha_s + 5e-3, s_per_value=flat.s_per_value / 2,
                                     algorithm="hierarchical")
    return costs


def test_flat_and_hierarchical_compete_per_tensor_and_the_decision_names_both() -> None:
    errors = {n: {**e, HQ8: e[Q8]} for n, e in _errors().items()}  # the codec's error, whichever algorithm
    limit = sum(e[Q8] for e in errors.values())
    # 100 MB/s: fc1's 8 M values take 80 ms flat, 40 + 5 ms hierarchically
    d = decide(_timeline(), _two_algorithms(1e8), errors, error_limit=limit)
    assert d.assignment["fc1.weight"] == HQ8
    assert {"scatter_gather", "hierarchical"} <= set(d.algorithms.values())
    # every finalist, the chosen one included, is listed with the algorithms its tensors go by
    assert {"scatter_gather", "hierarchical"} <= {x for _, a, _ in d.finalists for x in d.algorithms_of(a)}
    assert "hierarchical" in d.algorithms_of(d.assignment)
    table = d.table()
    assert "hierarchical" in table and "scatter_gather" in table
    assert [r["algorithm"] for r in d.rows if r["name"] == "fc1.weight"] == ["hierarchical"]
    # 1 GB/s: 8 ms flat against 4 + 5 ms: the flat algorithm wins, by the same costs
    d = decide(_timeline(), _two_algorithms(1e9), errors, error_limit=limit)
    assert not d.fp32_is_best and HQ8 not in d.assignment.values()


def test_only_keeps_a_tensor_at_its_floor() -> None:
    errors = _errors()
    d = decide(_timeline(), _costs(1e8), errors, error_limit=None, only={"fc1.weight": ["fp32", "bf16"]})
    assert d.assignment["fc1.weight"] in ("fp32", "bf16")
    assert all(a["fc1.weight"] in ("fp32", "bf16") for _, a, _ in d.finalists)
    assert d.assignment["fc2.weight"] == Q4  # the others are free
