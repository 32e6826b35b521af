"""lowbit.localsgd in one process (no process group: a world of one): options refused with a clear
ValueError, error feedback's default, the fragments and their schedule, the outer optimizer, state
checks. The exchange between ranks is tested in tests/distributed/test_localsgd.py."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lowbit.localsgd import LocalSGD, default_outer_optimizer
from lowbit.localsgd.fragments import _split


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 2))


def _opt(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.1)


def _steps(model: nn.Module, opt: LocalSGD, n: int) -> list[list[int]]:
    synced = []
    for s in range(n):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(s))
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        synced.append(list(opt.synced))
    return synced


@pytest.mark.parametrize("kw, message", [
    (dict(local_steps=0), "local_steps must be a positive int, got 0"),
    (dict(local_steps=2.5), "local_steps must be a positive int"),
    (dict(local_steps=True), "local_steps must be a positive int"),
    (dict(local_steps=4, fragments=0), "fragments must be a positive int"),
    (dict(local_steps=4, fragments=5), "fragments (5) must be at most local_steps (4)"),
    (dict(local_steps=8, fragments=7), "fragments=7: the model has only 6 trainable parameter tensors"),
    (dict(local_steps=4, codec="qsgd:bits=9"), "bits"),
    (dict(local_steps=4, codec="nope"), "unknown codec"),
    (dict(local_steps=4, codec=4), "codec must be a codec spec"),
    (dict(local_steps=4, codec="fp32", error_feedback=True), "takes no error feedback"),
    (dict(local_steps=4, error_feedback="yes"), "error_feedback must be 'auto', True or False"),
    (dict(local_steps=4, outer_lr=0), "outer_lr must be a number > 0"),
    (dict(local_steps=4, outer_momentum=1.0), "outer_momentum must be a number in [0, 1)"),
    (dict(local_steps=4, outer_optimizer=lambda p: torch.optim.Adam(p), outer_lr=0.5), "outer_lr / outer_momentum"),
    (dict(local_steps=4, outer_optimizer="sgd"), "outer_optimizer must be a callable"),
    (dict(local_steps=4, outer_optimizer=lambda p: p), "outer_optimizer must return a torch.optim.Optimizer"),
    (dict(local_steps=4, algorithm="ring"), "unknown algorithm 'ring'"),
    (dict(local_steps=4, algorithm="simulated"), "unreduced"),
    (dict(local_steps=4, algorithm="allreduce", codec="qsgd:bits=4"), "only takes fp32/fp16/bf16"),
    (dict(local_steps=4, node_size=0), "node_size must be a positive int"),
    (dict(local_steps=4, node_size=2), "do not split into groups of 2"),
])
def test_bad_options_are_refused_by_name(kw: dict, message: str) -> None:
    model = _model()
    with pytest.raises(ValueError) as info:
        LocalSGD(model, _opt(model), **kw)
    assert message in str(info.value)


def test_bad_model_and_optimizer_are_refused() -> None:
    with pytest.raises(ValueError, match="model must be a torch.nn.Module"):
        LocalSGD("model", None, local_steps=2)  # type: ignore[arg-type]
    model = _model()
    with pytest.raises(ValueError, match="optimizer must be a torch.optim.Optimizer"):
        LocalSGD(model, "adam", local_steps=2)  # type: ignore[arg-type]
    for p in model.parameters():
        p.requires_grad_(False)
    with pytest.raises(ValueError, match="no trainable parameters"):
        LocalSGD(model, None, local_steps=2)
    opt = LocalSGD(nn.Linear(2, 2), None, local_steps=2)
    with pytest.raises(ValueError, match="without an inner optimizer"):
        opt.step()


@pytest.mark.parametrize("spec, on", [("fp32", False), ("bf16", False), ("qsgd:bits=8,bucket=512", False),
                                      ("qsgd:bits=4,bucket=512", True), ("qsgd:bits=2,bucket=512", False),
                                      ("qsgd:bits=2,bucket=512,rounding=nearest", True),
                                      ("onebit:bucket=64", True), ("topk:ratio=0.01", True),
                                      ("dettmers:type=dynamic,bucket=512", True)])
def test_error_feedback_default(spec: str, on: bool) -> None:
    """'auto': on for biased codecs and for 4 bits or fewer (unbiased QSGD-8 goes without)."""
    model = _model()
    opt = LocalSGD(model, _opt(model), local_steps=2, codec=spec)
    assert opt.config.error_feedback is on
    assert (opt.feedback is not None) is on


def test_split_keeps_order_whole_tensors_and_no_empty_fragment() -> None:
    sizes = [1000, 1, 1, 1, 1000, 5, 7, 1000]
    params = [nn.Parameter(torch.zeros(n)) for n in sizes]
    for f in range(1, len(sizes) + 1):
        frags = _split(params, f)
        assert len(frags) == f and all(frags)
        assert [p for fr in frags for p in fr] == params
    assert [sum(p.numel() for p in fr) for fr in _split(params, 3)] == [1003, 1005, 1007]


def test_schedule_fragment_f_after_step_f_plus_one_times_h_over_f() -> None:
    model = _model()
    opt = LocalSGD(model, _opt(model), local_steps=6, fragments=3)
    synced = _steps(model, opt, 12)
    assert synced == [[], [0], [], [1], [], [2]] * 2
    assert opt.outer_steps == 2 and opt.inner_steps == 12
    model = _model()
    opt = LocalSGD(model, _opt(model), local_steps=5, fragments=2)
    assert _steps(model, opt, 10) == [[], [0], [], [], [1]] * 2


def test_one_rank_outer_step_moves_the_anchor_with_nesterov_momentum() -> None:
    """A world of one: the mean is this rank's delta; the outer SGD (lr 0.7, Nesterov 0.9) steps the anchor
    by exactly what torch's SGD computes from it."""
    model = _model()
    anchor = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone()
    opt = LocalSGD(model, _opt(model), local_steps=3, codec="fp32")
    _steps(model, opt, 2)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(2))
    model(x).pow(2).mean().backward()
    opt.optimizer.step()
    current = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone()
    opt.after_step()
    ref = anchor.clone()
    ref.grad = anchor - current
    sgd = torch.optim.SGD([ref], lr=0.7, momentum=0.9, nesterov=True)
    sgd.step()
    after = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    assert torch.equal(after, ref.detach())
    assert opt.stats.bytes_sent == 0  # nothing crosses in a world of one


def test_custom_outer_optimizer_factory() -> None:
    model = _model()
    opt = LocalSGD(model, _opt(model), local_steps=2, outer_optimizer=lambda p: torch.optim.Adam(p, lr=1e-3))
    _steps(model, opt, 4)
    assert isinstance(opt.outer, torch.optim.Adam) and len(opt.outer.state) == 1
    with pytest.raises(ValueError, match="outer_momentum"):
        default_outer_optimizer(0.7, -0.1)


def test_state_dict_round_trip_and_refusals() -> None:
    model = _model()
    opt = LocalSGD(model, _opt(model), local_steps=3, fragments=2, codec="qsgd:bits=4,bucket=64")
    _steps(model, opt, 4)
    sd = opt.state_dict()
    assert sd["step"] == 4 and len(sd["anchors"]) == 2 and sd["feedback"] is not None
    model2 = _model()
    opt2 = LocalSGD(model2, _opt(model2), local_steps=3, fragments=2, codec="qsgd:bits=4,bucket=64")
    opt2.load_state_dict(sd)
    assert opt2.inner_steps == 4
    for a, b in zip(opt._frags, opt2._frags):
        assert torch.equal(a.anchor, b.anchor)
    assert opt2.feedback.residual_norm() == opt.feedback.residual_norm() > 0
    with pytest.raises(ValueError, match="not a lowbit.localsgd checkpoint"):
        opt2.load_state_dict({"step": 1})
    bad = dict(sd, anchors=[sd["anchors"][0][:-1], sd["anchors"][1]])
    with pytest.raises(ValueError, match="anchor 0 must be a float32 tensor"):
        opt2.load_state_dict(bad)
    bad = dict(sd, feedback=dict(sd["feedback"], residuals={0: torch.full((3,), float("nan"))}))
    with pytest.raises(ValueError):
        opt2.load_state_dict(bad)
    assert opt2.inner_steps == 4  # nothing applied from a refused checkpoint
    other = LocalSGD(_model(), None, local_steps=3, fragments=2, codec="qsgd:bits=2,bucket=64")
    with pytest.raises(ValueError, match="codec saved"):
        other.load_state_dict(sd)


def test_memory_cost_anchor_scratch_momentum_residual() -> None:
    """Beyond the model: the anchor, a scratch buffer, SGD's momentum and the residual, 4 bytes a value each."""
    model = _model()
    n = sum(p.numel() for p in model.parameters())
    opt = LocalSGD(model, _opt(model), local_steps=2, codec="qsgd:bits=4,bucket=64")
    _steps(model, opt, 2)
    assert opt.memory_bytes() == 4 * 4 * n
    opt = LocalSGD(model, _opt(model), local_steps=2, codec="fp32")
    _steps(model, opt, 2)
    assert opt.memory_bytes() == 3 * 4 * n


def test_anchor_weights_swaps_in_the_agreed_weights_and_back() -> None:
    model = _model()
    opt = LocalSGD(model, _opt(model), local_steps=4, codec="fp32")
    anchor = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone()
    _steps(model, opt, 2)  # mid-period: the weights moved, the anchor did not
    own = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone()
    assert not torch.equal(own, anchor)
    with opt.anchor_weights():
        assert torch.equal(torch.cat([p.detach().reshape(-1) for p in model.parameters()]), anchor)
    assert torch.equal(torch.cat([p.detach().reshape(-1) for p in model.parameters()]), own)
