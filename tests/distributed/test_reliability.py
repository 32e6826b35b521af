"""A bad step, a bad checkpoint or a mixed-up rank must never silently ruin a run (gloo, CPU)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import lowbit
from lowbit.launch import spawn

BIASED = ["onebit:bucket=64", "dettmers:type=dynamic", "topk:ratio=0.1"]


@pytest.mark.parametrize("spec", BIASED + ["qsgd:bits=4,bucket=512"])
def test_one_non_finite_step_does_not_poison_error_feedback(spec: str) -> None:
    ef = lowbit.ErrorFeedback(spec)
    x = torch.randn(256)
    x[5] = float("inf")
    payload = ef.encode("g", x)
    assert not torch.isfinite(ef.codec.decode(payload, 256)).all()  # the bad step still shows
    g = torch.Generator().manual_seed(0)
    finite = sum(bool(torch.isfinite(ef.codec.decode(ef.encode("g", torch.randn(256, generator=g)), 256)).all())
                 for _ in range(50))
    assert finite == 50
    assert torch.isfinite(ef.residuals["g"]).all()


def _body_scaler(rank: int, world: int, spec: str) -> dict:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 4))
    model = DDP(net)
    state = lowbit.ddp.register(model, codec=spec, error_feedback=True, start_iter=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    bad_step = 3
    step = [0]

    def inject(g: torch.Tensor) -> torch.Tensor:
        if rank == 0 and step[0] == bad_step:
            g = g.clone()
            g.view(-1)[7] = float("inf")
        return g

    net[2].weight.register_hook(inject)
    gen = torch.Generator().manual_seed(rank)
    skipped = []
    for i in range(12):
        step[0] = i
        x, y = torch.randn(16, 32, generator=gen), torch.randint(0, 4, (16,), generator=gen)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        scaler.scale(loss.float()).backward()
        before = scaler.get_scale()
        scaler.step(opt)
        scaler.update()
        skipped.append(scaler.get_scale() < before)
    params = [p.detach().clone() for p in model.parameters()]
    return {"skipped": skipped, "params": params,
            "residuals_finite": all(bool(torch.isfinite(r).all()) for r in state.residuals.values()),
            "n_residuals": len(state.residuals)}


@pytest.mark.parametrize("spec", BIASED)
def test_grad_scaler_skips_an_injected_inf_on_every_rank_then_training_goes_on(spec: str) -> None:
    r0, r1 = spawn(_body_scaler, 2, spec, backend="gloo", timeout_s=60)
    for r in (r0, r1):
        assert r["skipped"] == [i == 3 for i in range(12)], (spec, r["skipped"])
        assert r["residuals_finite"] and r["n_residuals"] > 0
        assert all(torch.isfinite(p).all() for p in r["params"])
    for a, b in zip(r0["params"], r1["params"]):
        assert torch.equal(a, b)
