"""Streaming local SGD with overlapping communication (LocalSGD(overlap=τ, mix=α)) on gloo, 2 ranks.

A fragment's exchange is issued at its step and lands τ inner steps later: the anchors stay
bit-identical on every rank after every step; with mix=0 the parameters are the anchor when a fragment
lands; with fp32, outer lr 1 and no momentum the anchor becomes the mean of the ranks' parameters at the
issuing step (the delay applied as Streaming DiLoCo does); the bytes are those of the synchronous
schedule; a checkpoint taken with an exchange in flight resumes bit-identically; bad options are named.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

from lowbit.launch import spawn
from lowbit.localsgd import LocalSGD
from tests.distributed.shared_spawn import part, run_parts
from tests.distributed.test_localsgd import _batch, _flat, _model, _train


def _anchors(opt: LocalSGD) -> torch.Tensor:
    return torch.cat([fr.anchor.detach().clone() for fr in opt._frags])


def _body(rank: int, world: int) -> dict:
    out: dict = {}
    for spec, mix in (("qsgd:bits=4,bucket=512", 0.0), ("qsgd:bits=4,bucket=512", 0.5), ("fp32", 0.0)):
        model = _model(seed=rank)
        opt = LocalSGD(model, torch.optim.AdamW(model.parameters(), lr=1e-2), local_steps=8, fragments=2,
                       codec=spec, overlap=2, mix=mix)
        anchors, weights, landed_equal = [], [], []
        for s in range(24):
            _train(model, opt, rank, range(s, s + 1))
            anchors.append(_anchors(opt))
            weights.append(_flat(model))
            # fragments land at steps 6 and 10 (issued at 4 and 8, mod 8): then, with mix=0, params = anchor
            step = opt.inner_steps
            for f, fr in enumerate(opt._frags):
                if (step - 2) % 8 == fr.offset and step > 2:
                    flat = torch.cat([p.detach().reshape(-1) for p in fr.params])
                    landed_equal.append(torch.equal(flat, fr.anchor) if mix == 0.0 else None)
        out[(spec, mix)] = {"anchors": anchors, "weights": weights, "landed_equal": landed_equal,
                            "bytes": opt.stats.bytes_sent}
    # the same schedule synchronously: the same bytes
    model = _model(seed=rank)
    sync = LocalSGD(model, torch.optim.AdamW(model.parameters(), lr=1e-2), local_steps=8, fragments=2,
                    codec="qsgd:bits=4,bucket=512")
    _train(model, sync, rank, range(24))
    out["sync_bytes"] = sync.stats.bytes_sent
    return out


def _body_mean(rank: int, world: int) -> dict:
    """fp32, outer lr 1, no momentum, mix 0: the landed anchor is the ranks' mean at the issuing step."""
    model = _model(seed=0)
    opt = LocalSGD(model, torch.optim.SGD(model.parameters(), lr=0.05), local_steps=4, codec="fp32",
                   outer_lr=1.0, outer_momentum=0.0, overlap=2, mix=0.0)
    _train(model, opt, rank, range(4))  # step 4: issued (offset 0)
    at_issue = _flat(model)
    mean = [torch.empty_like(at_issue) for _ in range(world)]
    dist.all_gather(mean, at_issue)
    _train(model, opt, rank, range(4, 6))  # step 6: landed
    return {"anchor": _anchors(opt), "mean": torch.stack(mean).mean(0), "params": _flat(model)}


def _build(rank: int) -> tuple[nn.Module, LocalSGD]:
    model = _model(seed=rank)
    return model, LocalSGD(model, torch.optim.AdamW(model.parameters(), lr=1e-2), local_steps=8, fragments=2,
                           codec="qsgd:bits=2,bucket=128", overlap=3, mix=0.5)


def _body_resume(rank: int, world: int) -> dict:
    model, opt = _build(rank)
    _train(model, opt, rank, range(5))  # fragment 0 issued at step 4, lands at 7: in flight now
    in_flight = sorted(opt._pending)
    saved = copy.deepcopy({"model": model.state_dict(), "inner": opt.optimizer.state_dict(),
                           "localsgd": opt.state_dict()})
    _train(model, opt, rank, range(5, 20))
    model2, opt2 = _build(rank + 5)
    model2.load_state_dict(saved["model"])
    opt2.optimizer.load_state_dict(saved["inner"])
    opt2.load_state_dict(saved["localsgd"])
    _train(model2, opt2, rank, range(5, 20))
    return {"in_flight": in_flight, "straight": _flat(model), "resumed": _flat(model2),
            "anchors": (_anchors(opt), _anchors(opt2))}


@pytest.fixture(scope="module")
def ranks() -> list:
    return spawn(run_parts, 2, (("overlap", _body, ()), ("mean", _body_mean, ()), ("resume", _body_resume, ())),
                 backend="gloo", timeout_s=180)


def test_anchors_stay_identical_and_params_are_the_anchor_when_a_fragment_lands(ranks: list) -> None:
    r0, r1 = part(ranks, "overlap")
    for key in (("qsgd:bits=4,bucket=512", 0.0), ("qsgd:bits=4,bucket=512", 0.5), ("fp32", 0.0)):
        a0, a1 = r0[key]["anchors"], r1[key]["anchors"]
        assert all(torch.equal(x, y) for x, y in zip(a0, a1)), key
        assert not torch.equal(a0[0], a0[-1]), key  # the anchors moved
        if key[1] == 0.0:
            assert r0[key]["landed_equal"] and all(r0[key]["landed_equal"]), key
        else:  # mixed: each rank keeps its share of the local steps
            assert not torch.equal(r0[key]["weights"][-1], r1[key]["weights"][-1])
    assert r0[("qsgd:bits=4,bucket=512", 0.0)]["bytes"] == r0["sync_bytes"] > 0


def test_the_delay_applies_the_pseudo_gradient_of_the_issuing_step(ranks: list) -> None:
    for r in part(ranks, "mean"):
        assert torch.allclose(r["anchor"], r["mean"], atol=1e-6)
        assert torch.equal(r["params"], r["anchor"])  # mix 0: the parameters take the anchor


def test_a_checkpoint_with_an_exchange_in_flight_resumes_bit_identically(ranks: list) -> None:
    for r in part(ranks, "resume"):
        assert r["in_flight"] == [0]
        assert torch.equal(r["straight"], r["resumed"])
        assert torch.equal(*r["anchors"])


def test_overlap_options_are_checked() -> None:
    model = _model(0)
    with pytest.raises(ValueError, match=r"overlap must be an int in \[0, 4\)"):
        LocalSGD(model, None, local_steps=8, fragments=2, overlap=4)
    with pytest.raises(ValueError, match="mix goes with overlap"):
        LocalSGD(model, None, local_steps=8, mix=0.5)
    with pytest.raises(ValueError, match=r"mix must be a number in \[0, 1\)"):
        LocalSGD(model, None, local_steps=8, overlap=1, mix=1.0)
