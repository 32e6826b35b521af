"""A bad step, a bad checkpoint or a mixed-up rank must never silently ruin a run (gloo, CPU)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import lowbit
from lowbit.launch import spawn
from tests.distributed.shared_spawn import part, run_parts

BIASED = ["onebit:bucket=64", "dettmers:type=dynamic", "topk:ratio=0.1"]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list:
    tmp = str(tmp_path_factory.mktemp("reliability"))
    parts = (("scaler", _body_scaler_all, ()), ("disagree", _body_disagree, ()), ("checkpoint", _body_checkpoint, ()),
             ("resume", _body_resume_buckets, (tmp,)),
             ("stalled", _body_fault, ("stalled", tmp)))  # last: it leaves its own group broken
    return spawn(run_parts, 2, parts, backend="gloo", timeout_s=120)


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


SCALER_STEPS = 7  # the bad step (3), and three after it (was 12)


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
    for i in range(SCALER_STEPS):
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


def _body_scaler_all(rank: int, world: int) -> dict:
    return {spec: _body_scaler(rank, world, spec) for spec in BIASED}


@pytest.mark.parametrize("spec", BIASED)
def test_grad_scaler_skips_an_injected_inf_on_every_rank_then_training_goes_on(ranks: list, spec: str) -> None:
    r0, r1 = (r[spec] for r in part(ranks, "scaler"))
    for r in (r0, r1):
        assert r["skipped"] == [i == 3 for i in range(SCALER_STEPS)], (spec, r["skipped"])
        assert r["residuals_finite"] and r["n_residuals"] > 0
        assert all(torch.isfinite(p).all() for p in r["params"])
    for a, b in zip(r0["params"], r1["params"]):
        assert torch.equal(a, b)


def _body_disagree(rank: int, world: int) -> list[str]:
    msgs = []
    cases = [
        lambda: lowbit.all_reduce(torch.ones(100), "fp16" if rank == 0 else "bf16", algorithm="allreduce"),
        lambda: lowbit.all_reduce(torch.ones(100 + rank), "qsgd:bits=8"),
        lambda: lowbit.all_reduce(torch.ones(0 if rank == 1 else 50), "qsgd:bits=4", algorithm="allgather"),
    ]
    for case in cases:
        try:
            case()
            msgs.append("no error")
        except lowbit.comm.CollectiveError as exc:
            msgs.append(str(exc))
    t = torch.full((64,), float(rank))
    lowbit.all_reduce(t, "fp32", algorithm="allreduce")  # the ranks are still in step
    msgs.append(str(float(t[0])))
    return msgs


def test_ranks_that_disagree_get_the_same_clear_error(ranks: list) -> None:
    m0, m1 = part(ranks, "disagree")
    assert m0 == m1
    assert "codec fp16" in m0[0] and "codec bf16" in m0[0]
    assert "numel 100" in m0[1] and "numel 101" in m0[1]
    assert "numel 0" in m0[2] and "numel 50" in m0[2]
    assert m0[3] == "1.0"  # 0 + 1: all_reduce sums by default, as torch's does


def _body_checkpoint(rank: int, world: int) -> dict:
    import copy

    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4)))
    state = lowbit.ddp.register(model, codec="onebit:bucket=64", start_iter=0)
    for _ in range(3):
        model(torch.randn(8, 16)).sum().backward()
    good = state.state_dict()
    others = [None] * world
    torch.distributed.all_gather_object(others, good)
    name = next(iter(good["residuals"]))
    bad = {
        "iter str": {**good, "iter": "3"},
        "iter negative": {**good, "iter": -1},
        "nan residual": {**good, "residuals": {**good["residuals"], name: torch.full_like(good["residuals"][name], float("nan"))}},
        "int residual": {**good, "residuals": {**good["residuals"], name: torch.zeros(good["residuals"][name].numel(), dtype=torch.int64)}},
        "wrong size": {**good, "residuals": {**good["residuals"], name: torch.zeros(3)}},
        "unknown name": {**good, "residuals": {**good["residuals"], "nope.weight": torch.zeros(3)}},
        "world size": {**good, "world_size": 3},
        "other rank's": others[1 - rank],
        "not a dict": "checkpoint.pt",
    }
    msgs = {}
    for what, sd in bad.items():
        try:
            state.load_state_dict(copy.deepcopy(sd))
            msgs[what] = "accepted"
        except ValueError as exc:
            msgs[what] = str(exc)
    state.load_state_dict(good)  # the real one still loads
    msgs["good"] = "ok"
    return msgs


def test_checkpoint_load_validates_everything(ranks: list) -> None:
    for m in part(ranks, "checkpoint"):
        assert m["good"] == "ok"
        assert "non-negative int" in m["iter str"] and "non-negative int" in m["iter negative"]
        assert "Inf or NaN" in m["nan residual"]
        assert "float tensor" in m["int residual"]
        assert "has 3 values" in m["wrong size"]
        assert "nope.weight" in m["unknown name"]
        assert "of 3" in m["world size"] and "load each rank's own" in m["world size"]
        assert "saved by rank" in m["other rank's"]
        assert "must be a dict" in m["not a dict"]


@pytest.mark.parametrize("spec", ["fp32", "fp16", "qsgd:bits=4,bucket=64", "onebit:bucket=64", "dettmers:type=dynamic",
                                  "topk:ratio=0.1"])
def test_bad_payloads_and_numels_are_value_errors(spec: str) -> None:
    codec = lowbit.get_codec(spec)
    payload = codec.encode(torch.randn(100), seed=0)
    strided = torch.stack([payload, payload], 1).reshape(-1)[::2]  # same bytes, not contiguous
    assert not strided.is_contiguous() or payload.numel() <= 1
    if not strided.is_contiguous():
        with pytest.raises(ValueError, match="contiguous"):
            codec.decode(strided, 100)
    for numel in (100.0, "100", True):
        with pytest.raises(ValueError, match="numel must be an int"):
            codec.decode(payload, numel)  # type: ignore[arg-type]


#: the fault tests' process-group timeout: a stalled peer is waited out for this long
FAULT_TIMEOUT_S = 2


def _body_fault(rank: int, world: int, fault: str, tmp: str | None = None) -> str:
    """``stalled``: rank 1 sleeps past the group's timeout, until rank 0 has its error (a file in ``tmp``)
    or FAULT_TIMEOUT_S + 3 s at most (it slept those 3 s out in full: the shared spawn waited for it)."""
    import os
    import time
    from datetime import timedelta

    import torch._dynamo  # noqa: F401 — DDP's first build imports it (seconds): before the short timeout starts

    torch.distributed.barrier()  # the ranks in step (on the spawn's group, 60 s), then a group of FAULT_TIMEOUT_S
    group = torch.distributed.new_group(timeout=timedelta(seconds=FAULT_TIMEOUT_S))
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4))
    model = DDP(net, process_group=group)
    lowbit.ddp.register(model, codec="qsgd:bits=8,bucket=512", start_iter=0)
    step = [0]

    def die(g: torch.Tensor) -> torch.Tensor:
        if rank == 1 and step[0] == 3 and fault == "killed":
            os._exit(0)  # the process vanishes inside the backward pass, between two buckets' hooks
        return g

    net[2].weight.register_hook(die)
    try:
        for i in range(8):
            step[0] = i
            t0 = time.monotonic()  # (the error is timed from the start of its step)
            if rank == 1 and i == 3 and fault == "stalled":
                while time.monotonic() - t0 < FAULT_TIMEOUT_S + 3 and not os.path.exists(f"{tmp}/rank0-failed"):
                    time.sleep(0.05)  # past the group's timeout
            model(torch.randn(8, 32)).sum().backward()
    except Exception as exc:  # noqa: BLE001 — DDP re-raises the hook's CollectiveError as a RuntimeError
        if rank == 0 and tmp:
            open(f"{tmp}/rank0-failed", "w").close()
        return f"{time.monotonic() - t0:.1f}|{type(exc).__name__}|{exc}"
    return "no error"


@pytest.mark.parametrize("fault", ["killed", "stalled"])
def test_a_dead_or_stalled_peer_is_a_clear_error_within_the_timeout(fault: str, request) -> None:
    """The peer dies (its own spawn: the process is gone) or stalls past the DDP group's timeout
    (FAULT_TIMEOUT_S, on a group of its own: the last part of the shared spawn; was 6 s of the spawn's
    group, the same check waited out for less)."""
    if fault == "killed":
        res = spawn(_body_fault, 2, fault, backend="gloo", timeout_s=60)
    else:
        res = part(request.getfixturevalue("ranks"), "stalled")
    msg = res[0]
    assert msg != "no error", fault
    elapsed, _, text = msg.split("|", 2)
    # no hang: the error comes within the timeout of its step's start, before the stalled peer wakes
    assert float(elapsed) < FAULT_TIMEOUT_S + 2.5, msg
    if fault == "stalled":
        assert float(elapsed) >= FAULT_TIMEOUT_S - 0.5, msg  # the group's timeout, waited out
    assert "lowbit:" in text and "failed on rank 0 of 2" in text, text


RESUME_CODECS = ["qsgd:bits=8,bucket=512", "qsgd:bits=4,bucket=512", "onebit:bucket=64", "dettmers:type=dynamic",
                 "topk:ratio=0.1"]


def _run(rank: int, spec: str, steps: int, start: int = 0, ckpt_in: str | None = None,
         ckpt_out: str | None = None) -> list[torch.Tensor]:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 128), nn.ReLU(), nn.Linear(128, 10))
    model = DDP(net, bucket_cap_mb=0.05)  # several buckets, and DDP rebuilds them after the first step
    state = lowbit.ddp.register(model, codec=spec, message_mb=0.1)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    if ckpt_in:
        ck = torch.load(f"{ckpt_in}.{rank}", weights_only=False)
        net.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        state.load_state_dict(ck["lowbit"])
    for step in range(start, start + steps):
        g = torch.Generator().manual_seed(100 * step + rank)
        x, y = torch.randn(16, 32, generator=g), torch.randint(0, 10, (16,), generator=g)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    if ckpt_out:
        torch.save({"model": net.state_dict(), "opt": opt.state_dict(), "lowbit": state.state_dict()},
                   f"{ckpt_out}.{rank}")
    return [p.detach().clone() for p in model.parameters()]


def _body_resume_buckets(rank: int, world: int, tmp: str) -> dict:
    out = {}
    for i, spec in enumerate(RESUME_CODECS):
        straight = _run(rank, spec, 6)  # (was 8 = 4 + 4: DDP has rebuilt its buckets by step 3 as by step 4)
        _run(rank, spec, 3, ckpt_out=f"{tmp}/ck{i}")
        resumed = _run(rank, spec, 3, start=3, ckpt_in=f"{tmp}/ck{i}")
        out[spec] = all(torch.equal(a, b) for a, b in zip(straight, resumed))
    return out


def test_resume_is_bit_identical_with_several_ddp_buckets(ranks: list) -> None:
    for res in part(ranks, "resume"):
        assert all(res.values()), res
