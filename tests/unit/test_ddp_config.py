"""lowbit.ddp.DDPConfig: the one object that holds the DDP hook's options (issue 31 item 2), without a
process group."""

from __future__ import annotations

import dataclasses
import pickle

import pytest
import torch
from torch import nn

import lowbit
import lowbit.ddp as D


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(200, 200), nn.ReLU(), nn.Linear(200, 4))


def test_keyword_only_and_frozen() -> None:
    with pytest.raises(TypeError):
        D.DDPConfig("qsgd:bits=8")  # type: ignore[misc]
    cfg = D.DDPConfig(codec="qsgd:bits=8")
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.codec = "fp16"  # type: ignore[misc]
    assert D.DDPConfig(codec="auto", allow=["fp32", "bf16"]).allow == ("fp32", "bf16")  # a list is kept as a tuple


@pytest.mark.parametrize("options,match", [
    (dict(codec="qsgd:bits=8", policy="fp16"), "not both"),
    (dict(codec="nope"), "unknown codec"),
    (dict(codec=3), "codec must be"),
    (dict(algorithm="nope"), "nope"),
    (dict(error_feedback=1), "error_feedback"),
    (dict(error_feedback="yes"), "error_feedback"),
    (dict(hook_thread="on"), "hook_thread"),
    (dict(start_iter=-1), "start_iter"),
    (dict(start_iter=2.0), "start_iter"),
    (dict(seed=0.5), "seed"),
    (dict(message_mb=-1), "message_mb"),
    (dict(message_mb=True), "message_mb"),
    (dict(node_size=0), "node_size"),
    (dict(one_node_native="no"), "one_node_native"),
    (dict(codec="qsgd:bits=8", allow=["fp32"]), "go with codec='auto'"),
    (dict(codec="qsgd:bits=8", measure_steps=5), "go with codec='auto'"),
    (dict(codec="auto", allow="qsgd"), "list of codec specs"),
    (dict(codec="auto", allow=[]), "at least one codec"),
    (dict(codec="auto", allow=["fp32", "nope"]), "unknown codec"),
    (dict(codec="auto", error_budget=0), "error_budget"),
    (dict(codec="auto", measure_steps=0), "measure_steps"),
    (dict(codec="auto", remeasure_every=-1), "remeasure_every"),
    (dict(codec="auto", algorithm="allreduce"), "algorithm 'allreduce'"),
    (dict(codec="auto", auto_level="wild"), "auto_level must be one of 'conservative', 'bold'"),
    (dict(codec="auto", auto_level=None), "auto_level"),
    (dict(codec="qsgd:bits=8", auto_level="bold"), "go with codec='auto'"),
    (dict(codec="auto", guard_every=-1), "guard_every"),
    (dict(codec="auto", guard_every=True), "guard_every"),
    (dict(codec="fp16", guard_every=0), "go with codec='auto'"),
    (dict(codec="auto", algorithm="allreduce", auto_level="bold"), "algorithm 'allreduce'"),
])
def test_each_bad_option_is_named(options: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        D.DDPConfig(**options)
    if "one_node_native" not in options:  # (a register option)
        with pytest.raises(ValueError, match=match):  # make_state validates through the same object
            D.make_state(_net(), **options)


def test_good_options_pass() -> None:
    D.DDPConfig(codec="auto", algorithm="allreduce", allow=["fp32", "bf16"], error_budget=None, remeasure_every=4)
    D.DDPConfig(codec="auto", auto_level="bold", guard_every=0)
    bold = D.make_state(_net(), codec="auto", auto_level="bold")
    assert "onebit:bucket=64" in " ".join(bold.auto.allow) and "qsgd:bits=4" in " ".join(bold.auto.allow)
    assert bold.auto.config()["level"] == "bold"
    assert "level" not in D.make_state(_net(), codec="auto").auto.config()  # older checkpoints still load
    D.DDPConfig(policy=lowbit.Policy("qsgd:bits=4"), error_feedback=True, message_mb=float("inf"), node_size=2,
                hook_thread=False, seed=-3)


def test_the_plan_check_names_the_algorithm() -> None:
    """algorithm='allreduce' sums on the wire: a plan that quantises is refused (it needs the model)."""
    with pytest.raises(ValueError, match="sums on the wire"):
        D.make_state(_net(), codec="qsgd:bits=4", algorithm="allreduce")
    D.make_state(_net(), codec="fp16", algorithm="allreduce")


def test_make_state_with_options_or_a_config_is_the_same_state() -> None:
    cfg = D.DDPConfig(codec="onebit:bucket=64", error_feedback=True, start_iter=0, seed=5, message_mb=1)
    a = D.make_state(_net(), codec="onebit:bucket=64", error_feedback=True, start_iter=0, seed=5, message_mb=1)
    b = D.make_state(_net(), config=cfg)
    assert a.options == b.options == cfg
    assert a.config() == b.config() and a.fingerprint() == b.fingerprint()
    assert (b.algorithm, b.error_feedback, b.start_iter, b.seed, b.message_mb) == ("auto", True, 0, 5, 1)
    with pytest.raises(ValueError, match="not both"):
        D.make_state(_net(), codec="fp16", config=cfg)
    with pytest.raises(ValueError, match="DDPConfig"):
        D.make_state(_net(), config={"codec": "fp16"})  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="no option 'codecs'"):
        D.DDPConfig.of(cfg, codecs="fp16")


def test_the_state_changes_its_options_by_replacing_them_validated() -> None:
    state = D.make_state(_net(), codec="qsgd:bits=8", message_mb=2)
    before = state.options
    state.message_mb = 64
    assert state.options.message_mb == 64 and before.message_mb == 2  # a new frozen object
    with pytest.raises(ValueError, match="message_mb"):
        state.message_mb = -1
    with pytest.raises(ValueError, match="sums on the wire"):
        state.reconfigure(algorithm="allreduce")
    assert state.message_mb == 64 and state.algorithm == "auto"


def test_set_plan_keeps_residuals_only_where_the_codec_stays() -> None:
    state = D.make_state(_net(), codec="onebit:bucket=64")
    q = state.plan["0.weight"].spec
    state.residuals = {"0.weight": torch.ones(200 * 200), "2.weight": torch.ones(800)}
    state.set_plan({"0.weight": q, "2.weight": "fp32"})
    assert set(state.residuals) == {"0.weight"}
    assert state.plan["2.weight"].spec == "fp32" and state.plan["0.bias"].spec == "fp32"


def test_auto_builds_its_tuner_from_the_config() -> None:
    state = D.make_state(_net(), codec="auto", allow=["bf16", "qsgd:bits=4"], measure_steps=2)
    assert state.auto is not None and state.auto.allow[0] == "fp32" and state.auto.measure_steps == 2
    assert state.config()["auto"]["allow"] == state.auto.allow


def test_a_state_pickles_with_its_options() -> None:
    state = D.make_state(_net(), codec="qsgd:bits=4", seed=3)
    back = pickle.loads(pickle.dumps(state))
    assert back.options == state.options and back.config() == state.config()


def test_the_bold_error_limit_is_the_larger_of_8_bit_qsgd_error_and_the_sampling_noise() -> None:
    # the tensors' summed references: 8-bit QSGD's error 2.0 + 0.0, the sampling noise 40 + 10
    from lowbit.auto.decide import error_limit

    assert error_limit("conservative", 1.0, 2.0, 50.0) == 2.0  # conservative: the noise plays no part
    assert error_limit("bold", 1.0, 2.0, 50.0) == 50.0
    assert error_limit("bold", 0.1, 2.0, 50.0) == pytest.approx(5.0)
    assert error_limit("bold", 1.0, 2.0, 0.5) == 2.0  # ranks that see (nearly) the same gradients: never below 8-bit's
    assert error_limit("bold", None, 2.0, 50.0) is None


def test_bold_holds_a_biased_codec_to_the_default_limit() -> None:
    """Bold's noise allowance is for unbiased codecs: a biased one's error (1bitSGD*, top-k) is weighed by
    bold's limit over 8-bit QSGD's, so that alone it must fit 8-bit QSGD's error, as at the default level.
    The decision then prices it so: 1bitSGD* at 1.5x 8-bit's error passes the noise (50) but not 2.0. Per
    module (FSDP) the same rule is a lower limit for the biased codec."""
    from lowbit.auto.decide import error_limit, module_limit, weighed_errors
    from lowbit.auto.options import BASELINE
    from lowbit.choose import choice

    q8, q4, one = (lowbit.get_codec(s).spec for s in (BASELINE, "qsgd:bits=4,bucket=512", "onebit:bucket=64"))
    ref, noise = 2.0, 50.0  # summed over the tensors w (8-bit: 2.0, noise 40) and b (0.0, 10)
    errors = {"w": {"fp32": 0.0, q8: 2.0, q4: 20.0, one: 3.0, choice(one, "hierarchical"): 3.0}}
    w = weighed_errors(errors, "bold", 1.0, ref, noise)["w"]
    assert w[q8] == 2.0 and w[q4] == 20.0 and w["fp32"] == 0.0  # unbiased: as measured, within the noise
    assert w[one] == w[choice(one, "hierarchical")] == pytest.approx(3.0 * 50.0 / 2.0)  # 75 > the limit, 50
    assert w[q4] <= error_limit("bold", 1.0, ref, noise) < w[one]
    assert weighed_errors(errors, "conservative", 1.0, ref, noise) == errors  # no allowance to hold back
    assert weighed_errors(errors, "bold", None, ref, noise) == errors  # no limit at all
    assert weighed_errors(errors, "bold", 1.0, ref, 0.5) == errors  # the limit is 8-bit's already: nothing to weigh
    # per module: 1bitSGD* (biased) held to 8-bit's error, 4-bit QSGD (unbiased) to the noise
    assert module_limit("bold", 1.0, 2.0, 40.0, biased=True) == 2.0 < 3.0
    assert module_limit("bold", 1.0, 2.0, 40.0, biased=False) == 40.0 >= 20.0
    assert module_limit("conservative", 1.0, 2.0, 40.0, biased=False) == 2.0
    assert module_limit("bold", None, 2.0, 40.0, biased=True) == float("inf")
