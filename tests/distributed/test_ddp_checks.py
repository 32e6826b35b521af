"""DDP: configurations that differ across ranks, errors DDP would disguise, checkpoints that do not fit
(issue 32 items 3, 4 and 11; gloo, CPU)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import lowbit
from lowbit.launch import spawn


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4))


def _body_config(rank: int, world: int) -> list[str]:
    msgs = []
    cases = [
        lambda: lowbit.ddp.register(DDP(_net(), bucket_cap_mb=25 if rank == 0 else 0.001), codec="qsgd:bits=8"),
        lambda: lowbit.ddp.register(DDP(_net()), codec="qsgd:bits=8", hook_thread=rank == 0),
    ]
    for case in cases:
        try:
            case()
            msgs.append("no error")
        except lowbit.ddp.ConfigMismatchError as exc:
            msgs.append(str(exc))
    return msgs


def test_bucket_cap_and_hook_thread_that_differ_are_a_config_mismatch_on_every_rank() -> None:
    """bucket_cap_mb crashed a rank in gloo ("Received data size doesn't match"); hook_thread hung register."""
    m0, m1 = spawn(_body_config, 2, backend="gloo", timeout_s=15)
    assert m0 == m1
    assert "bucket caps" in m0[0] and "rank 1:" in m0[0], m0[0]
    assert "hook thread group True" in m0[1] and "hook thread group False" in m0[1], m0[1]


def test_a_collective_error_in_ddp_is_raised_with_its_own_type(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    """DDP turns a failed hook future into RuntimeError("Unable to cast ... CollectiveError"): lowbit keeps
    the original and raises it from state.check() and at the next step's hook (issue 32 item 4)."""
    import torch.distributed as dist

    from lowbit.comm import flat as A  # (where the flat algorithms' completion callbacks look _keep up)

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model = DDP(_net())
        state = lowbit.ddp.register(model, codec="qsgd:bits=8", start_iter=0)

        def broken(t: torch.Tensor) -> None:
            raise lowbit.comm.CollectiveError("lowbit: all_gather_into_tensor failed on rank 0 of 1 (planted)")

        monkeypatch.setattr(A, "_keep", broken)
        with pytest.raises(RuntimeError) as first:
            model(torch.randn(4, 16)).sum().backward()
        assert not isinstance(first.value, lowbit.comm.CollectiveError)  # DDP's disguise, as documented
        with pytest.raises(lowbit.comm.CollectiveError, match="planted"):
            state.check()
        with pytest.raises(lowbit.comm.CollectiveError, match="planted"):
            model(torch.randn(4, 16)).sum().backward()
    finally:
        dist.destroy_process_group()


def test_checkpoints_without_their_rank_residuals_or_a_plausible_iter_are_refused() -> None:
    """Issue 32 item 11: each of these loaded silently before."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model = DDP(_net())
        state = lowbit.ddp.register(model, codec="onebit:bucket=64", start_iter=0)
        for _ in range(3):
            model(torch.randn(8, 16)).sum().backward()
        good = state.state_dict()
        assert good["residuals"]
        bad = {
            "no rank": ({k: v for k, v in good.items() if k != "rank"}, "'rank'"),
            "no world_size": ({k: v for k, v in good.items() if k != "world_size"}, "'world_size'"),
            "no residuals": ({**good, "residuals": {}}, "no error-feedback residuals"),
            "iter 2**70": ({**good, "iter": 2**70}, "2\\*\\*53"),
        }
        for what, (sd, match) in bad.items():
            with pytest.raises(ValueError, match=match):
                state.load_state_dict(sd)
        state.load_state_dict(good)  # the real one still loads
        fresh = lowbit.ddp.make_state(_net(), codec="onebit:bucket=64")  # before any compressed step: no residuals
        fresh.load_state_dict(fresh.state_dict())
    finally:
        dist.destroy_process_group()


def test_a_checkpoint_that_does_not_fit_changes_nothing_not_even_the_auto_decision() -> None:
    """Issue 44 item 2: lowbit.feedback's one check of residuals runs before anything loads. Before, a
    float64 residual loaded (cast), and codec='auto' applied the checkpoint's decision (its plan) and only
    then refused a residual of the wrong size."""
    import torch.distributed as dist

    from lowbit.choose import Decision

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model = DDP(_net())
        state = lowbit.ddp.register(model, codec="onebit:bucket=64", start_iter=0)
        for _ in range(2):
            model(torch.randn(8, 16)).sum().backward()
        good = state.state_dict()
        name = sorted(good["residuals"])[0]
        before = {k: v.clone() for k, v in state.residuals.items()}
        wide = {**good, "residuals": {**good["residuals"], name: good["residuals"][name].double()}}
        with pytest.raises(ValueError, match=f"{name} must be a float tensor of dtype float32.*float64"):
            state.load_state_dict(wide)
        assert set(state.residuals) == set(before) and all(torch.equal(state.residuals[k], v) for k, v in before.items())

        tuned = lowbit.ddp.make_state(_net(), codec="auto")
        sd = tuned.state_dict()
        spec = next(s for s in tuned.auto.allow if s != "fp32")
        assignment = {n: spec for n in tuned.plan}
        sd["auto"]["decision"] = Decision(assignment=assignment, fp32_is_best=False, step_s=1.0, fp32_step_s=2.0,
                                          tried=1, rows=[]).to_dict()
        sd["auto"]["assignment"] = assignment
        plan = {n: c.spec for n, c in tuned.plan.items()}
        with pytest.raises(ValueError, match="0.weight has 3 values"):
            tuned.load_state_dict({**sd, "residuals": {"0.weight": torch.zeros(3)}})
        assert tuned.auto.decision is None and {n: c.spec for n, c in tuned.plan.items()} == plan
        tuned.load_state_dict(sd)  # the decision with fitting residuals loads
        assert {c.spec for c in tuned.plan.values()} == {spec}
    finally:
        dist.destroy_process_group()
