"""codec="auto" in the DDP hook on real gloo process groups: what it chooses on a slow and on a fast
link, the same on every rank, and kept in checkpoints; its guard stepping a diverging codec up.

The 2-rank checks on a slow link run in one shared spawn (tests/distributed/shared_spawn.py), each part
setting its own emulated link; the slow tests spawn their own. Those that judge a fast link (compute-bound,
re-measuring) are in test_auto_fastlink.py, which runs alone under `make test`'s two workers."""

from __future__ import annotations

import math
import time

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import lowbit
import lowbit.comm.collectives as C
from lowbit.launch import spawn
from tests.distributed.shared_spawn import part, run_parts

Q8 = lowbit.get_codec("qsgd:bits=8,bucket=512").spec
Q1 = lowbit.get_codec("qsgd:bits=1,bucket=512").spec


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list:
    path = str(tmp_path_factory.mktemp("auto") / "auto.pt")
    parts = (("slow_link", _body, (60e6, 64)), ("register", _body, (60e6, 64, False)),
             ("close", _body, (60e6, 64, True, 0.0, False, 10.0)),
             ("ckpt", _body_ckpt, (path,)), ("guard", _body_guard, (100, 0.2, 5, 20e6)),
             ("bold", _body_bold, (32, 20e6)))
    return spawn(run_parts, 2, parts, backend="gloo", timeout_s=240)


def _slow_link(bytes_per_s: float | None) -> None:
    """This process's lowbit collectives cross an emulated slow link (lowbit.comm.collectives.emulate_link:
    one FIFO link thread holds the link for bytes / bytes_per_s after each collective; the caller goes on)."""
    C.emulate_link(bytes_per_s)


class _SlowBackward(torch.autograd.Function):
    """Identity whose backward sleeps: a long backward pass (compute that hides the allreduces) without
    burning the 2-core machine's CPU, so what auto measures depends little on the machine's load."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, seconds: float) -> torch.Tensor:
        ctx.seconds = seconds
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        time.sleep(ctx.seconds)
        return grad, None


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10))


def _train(model: nn.Module, steps: int, batch: int = 64, start: int = 0, sleep_s: float = 0.0) -> None:
    """``sleep_s``: the backward pass ends with a sleep of that long (:class:`_SlowBackward` on the input,
    whose gradient comes after every parameter's)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(start, start + steps):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(batch, 256, generator=g), torch.randint(0, 10, (batch,), generator=g)
        if sleep_s:
            x = _SlowBackward.apply(x.requires_grad_(), sleep_s)
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()


def _undecided(state, step: int) -> bool:
    """Whether auto has not decided by ``step`` and may still (its bound: AutoTuner.last_decision_step)."""
    return state.auto.decision is None and step <= state.auto.last_decision_step(state.start_iter)


def _body(rank: int, world: int, bytes_per_s: float | None, batch: int, framework: bool = True,
          sleep_s: float = 0.0, until_decided: bool = False, retry_within: float | None = None) -> dict:
    """22 steps and until auto decides, or (``until_decided``) as many as it takes auto to decide.
    ``retry_within``: the share of the fastest trial within which finalists run a second pass."""
    if bytes_per_s:
        # ranks measure differently (rank 1 holds the link longer), yet must decide the same
        _slow_link(bytes_per_s / (1 + rank))
    model = DDP(_net())
    if framework:
        # the hook registered up front, as Lightning's DDPStrategy does: the fp32 steps it measures cross
        # the slowed link too (DDP's own allreduce, which register() keeps until compression pays, would
        # not: the slow link is lowbit's collective wrapper)
        state = lowbit.ddp.make_state(model.module, codec="auto")
        model.register_comm_hook(state, lowbit.ddp.hook)
    else:
        state = lowbit.ddp.register(model, codec="auto")
    if retry_within is not None:
        state.auto.retry_within = retry_within
    step = 0
    while (not until_decided and step < 22) or _undecided(state, step):
        _train(model, 1, batch, start=step, sleep_s=sleep_s)
        step += 1
    d = state.auto.decision
    return {"plan": d.assignment, "fp32": d.fp32_is_best, "rows": d.rows, "iter": state.auto.decided_iter,
            "finalists": len(d.finalists), "measured": d.measured_s, "chosen": d.chosen, "table": d.table(),
            "labels": [label for label, _, _ in d.finalists], "retried": d.retried,
            "costs": state.auto.measured["costs"], "sent": state.stats.bytes_sent,
            "params": [p.detach().clone() for p in model.parameters()], "hooks": len(model._comm_hooks),
            "backward_end": state.auto.measured["backward_end_s"]}


def test_slow_link_compresses_large_tensors_fp32_for_small_and_all_ranks_agree(ranks: list) -> None:
    # 60 MB/s for rank 0, 30 MB/s for rank 1: ~5 MB of fp32 gradients take 0.09-0.17 s a step
    res = part(ranks, "slow_link")
    plan = res[0]["plan"]
    assert res[1]["plan"] == plan and res[0]["rows"] == res[1]["rows"]
    # start_iter 2 + 2 warm-up + 3 measured steps, then each finalist 1 warm-up + 2 timed steps, and
    # those measured within 10 % of the fastest 1 + 2 steps again
    assert res[1]["retried"] == res[0]["retried"] and res[1]["measured"] == res[0]["measured"]
    assert res[0]["finalists"] >= 2 and res[0]["iter"] == 7 + 3 * (res[0]["finalists"] + len(res[0]["retried"]))
    assert res[0]["measured"]["fp32"] > 0 and len(res[0]["measured"]) == 1 + res[0]["finalists"]
    assert plan["2.weight"] == Q8 and plan["0.weight"] == Q8, res[0]["table"]
    assert all(plan[n] == "fp32" for n in ("0.bias", "2.bias", "4.bias"))
    for a, b in zip(res[0]["params"], res[1]["params"]):
        assert torch.equal(a, b)  # replicas stay identical under the chosen plan


def test_register_installs_the_hook_for_the_trials_only_when_compression_is_predicted_to_pay(ranks: list) -> None:
    res = part(ranks, "register")
    assert res[0]["plan"] == res[1]["plan"] and res[0]["chosen"] == res[1]["chosen"]
    assert res[0]["hooks"] == 1 and res[0]["finalists"] >= 2  # predicted to pay: tried, with lowbit's hook
    assert "(measured" in res[0]["chosen"]


def test_close_finalists_take_a_second_pass_and_every_rank_decides_alike(ranks: list) -> None:
    """With ``retry_within`` at 10 (every finalist within 1,000 % of the fastest), every finalist runs
    twice: the second pass in reverse order, each timed by the mean of its passes, the same on both
    ranks (rank 1's link is half as fast: they measure differently, yet agree)."""
    res = part(ranks, "close")
    r0 = res[0]
    assert r0["finalists"] >= 2 and tuple(r0["retried"]) == tuple(r0["labels"]), r0["table"]
    assert r0["iter"] == 7 + 2 * 3 * r0["finalists"]  # two passes of 1 + 2 steps each
    assert r0["iter"] <= 31  # AutoTuner.last_decision_step(2) at the default level
    for key in ("plan", "chosen", "measured", "retried", "table"):
        assert res[1][key] == r0[key], key
    assert r0["table"].count("(2 passes)") == r0["finalists"], r0["table"]
    assert len(r0["measured"]) == 1 + r0["finalists"] and "(measured" in r0["chosen"]
    for a, b in zip(r0["params"], res[1]["params"]):
        assert torch.equal(a, b)


def _body_ckpt(rank: int, world: int, path: str) -> dict:
    _slow_link(60e6)
    model = DDP(_net())
    state = lowbit.ddp.register(model, codec="auto")
    step = 0
    while step < 22 or _undecided(state, step):
        _train(model, 1, start=step)
        step += 1
    torch.save(state.state_dict(), f"{path}.{rank}")
    # a new job: the decision comes back from the checkpoint; nothing is measured again
    model2 = DDP(_net())
    state2 = lowbit.ddp.register(model2, codec="auto")
    state2.load_state_dict(torch.load(f"{path}.{rank}", weights_only=False))
    _train(model2, 2, start=step)
    other = lowbit.ddp.make_state(_net(), codec="auto", allow=["fp32", "qsgd:bits=4"])
    try:
        other.load_state_dict(torch.load(f"{path}.{rank}", weights_only=False))
        mismatch = ""
    except ValueError as exc:
        mismatch = str(exc)
    return {"plan": state.auto.decision.assignment, "plan2": state2.auto.decision.assignment,
            "plan2_used": {n: c.spec for n, c in state2.plan.items()}, "decided2": state2.auto.decided_iter,
            "decided": state.auto.decided_iter,
            "mismatch": mismatch}


def test_decision_survives_save_and_load(ranks: list) -> None:
    for r in part(ranks, "ckpt"):
        assert r["plan2"] == r["plan"] == r["plan2_used"]
        assert r["decided2"] == r["decided"]  # from the checkpoint, not re-measured at step 22
        assert "different codec/policy/algorithm configuration" in r["mismatch"]


def _body_guard(rank: int, world: int, steps: int, lr: float, guard_every: int | None, link: float | None) -> dict:
    """A two-layer MLP on the digits data set (each rank its own batches of 32; SGD with momentum 0.9; no
    biases: each of its two tensors holds at least 10,000 values, so every assignment auto tries compresses
    both and the forced codec is the same whatever the trials measure). With ``link``
    (every lowbit collective crosses an emulated link of that many bytes/s): codec="auto" forced to a
    codec too aggressive for this learning rate, 1-bit QSGD without an error budget (it diverges), the
    loss reported each step and the guard checking every ``guard_every`` steps (0: no guard). Without:
    plain DDP in fp32, the reference."""
    from lowbit.lab.data import load_dataset

    _slow_link(link)
    ds = load_dataset("digits", seed=0)
    x_tr, x_te = ds.x_train.reshape(len(ds.x_train), -1), ds.x_test.reshape(len(ds.x_test), -1)
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(64, 1024, bias=False), nn.ReLU(), nn.Linear(1024, 10, bias=False)))
    state = None
    if link:
        state = lowbit.ddp.make_state(model.module, codec="auto", allow=["fp32", Q1], error_budget=None,
                                      guard_every=guard_every)
        model.register_comm_hook(state, lowbit.ddp.hook)  # the fp32 steps cross the slow link too
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    losses = []
    for step in range(steps):
        idx = torch.randint(0, len(x_tr), (32,), generator=torch.Generator().manual_seed(1000 * step + rank))
        loss = nn.functional.cross_entropy(model(x_tr[idx]), ds.y_train[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
        if state is not None:
            state.auto.report_loss(loss)
        losses.append(loss.item())
    _slow_link(None)
    with torch.no_grad():
        acc = float((model.module(x_te).argmax(1) == ds.y_test).float().mean())
    out = {"acc": acc, "losses": losses, "params": [p.detach().clone() for p in model.parameters()]}
    if state is not None:
        out.update(decided=state.auto.decided_iter, decision=state.auto.decision.assignment,
                   changes=state.auto.changes, now=dict(state.auto.assignment),
                   plan={n: c.spec for n, c in state.plan.items()})
        # the step-ups are kept in checkpoints: a new state resumes with them
        again = lowbit.ddp.make_state(model.module, codec="auto", allow=["fp32", Q1], error_budget=None,
                                      guard_every=guard_every)
        again.load_state_dict(state.state_dict())
        out.update(resumed={n: c.spec for n, c in again.plan.items()}, resumed_changes=again.auto.changes)
    return out


def _window(losses: list, i: int, n: int = 10) -> float:
    return sum(losses[i:i + n]) / n


def test_guard_steps_a_diverging_codec_up_and_the_run_recovers_fast(ranks: list) -> None:
    """Fast equivalent of test_guard_recovers_from_a_diverging_codec_within_a_point_of_fp32: 100 steps at a
    learning rate (0.2) where 1-bit QSGD diverges within ~40 steps of its start (unguarded, its loss
    passes 10^6 by step 100); the guard checks every 5 steps."""
    res = part(ranks, "guard")
    r0 = res[0]
    assert all(r["changes"] == r0["changes"] and r["now"] == r0["now"] for r in res)  # every rank alike
    assert set(r0["decision"].values()) == {Q1}  # forced: the aggressive codec was chosen ...
    assert r0["changes"] and all("loss" in c["reason"] for c in r0["changes"])  # ... and stepped up on the loss
    assert set(r0["now"].values()) == {"fp32"} and set(r0["plan"].values()) == {"fp32"}
    assert r0["resumed"] == r0["plan"] and r0["resumed_changes"] == r0["changes"]
    losses = r0["losses"]
    assert r0["changes"][0]["step"] > r0["decided"]
    peak = max(_window(losses, i) for i in range(r0["decided"], len(losses) - 10))
    assert all(math.isfinite(v) for v in losses) and _window(losses, len(losses) - 10) < 0.5 * peak, peak
    assert r0["acc"] > 0.85
    for a, b in zip(r0["params"], res[1]["params"]):
        assert torch.equal(a, b)


@pytest.mark.slow
@pytest.mark.xfail(strict=False, reason=(
    "on 2026-12-01's VM this ends 1.1 points under fp32 (0.967 vs 0.978, the guard stepping up at step 50) "
    "at the base commit f64bf22 as well as after that day's changes; it passed in earlier CI runs: cause open"))
def test_guard_recovers_from_a_diverging_codec_within_a_point_of_fp32() -> None:
    """The guard's target (issue 29): a run that diverges under a forced too-aggressive codec (1-bit QSGD at
    learning rate 0.1: unguarded, its loss climbs from ~0.15 after ~100 steps and keeps climbing) recovers
    by itself and ends within 1 point of fp32's test accuracy (CPU, gloo, 2 ranks, 300 steps). Fast
    equivalent: test_guard_steps_a_diverging_codec_up_and_the_run_recovers_fast."""
    parts = (("fp32", _body_guard, (300, 0.1, None, None)), ("unguarded", _body_guard, (300, 0.1, 0, 20e6)),
             ("guarded", _body_guard, (300, 0.1, 10, 20e6)))
    ranks = spawn(run_parts, 2, parts, backend="gloo", timeout_s=600)
    fp32, unguarded, guarded = (part(ranks, name)[0] for name in ("fp32", "unguarded", "guarded"))
    # without the guard the run diverges: its last losses are NaN or far above fp32's
    end = _window(unguarded["losses"], 280, 20)
    assert not math.isfinite(end) or end > 1.0 > 10 * _window(fp32["losses"], 280, 20), end
    assert unguarded["changes"] == []
    assert guarded["changes"] and set(guarded["now"].values()) == {"fp32"}
    assert guarded["acc"] >= fp32["acc"] - 0.01, (guarded["acc"], fp32["acc"], guarded["changes"])


def _body_bold(rank: int, world: int, steps: int, link: float) -> dict:
    """auto_level="bold" on a two-layer MLP and the digits data set, each rank its own batches (their
    gradients differ: sampling noise), every lowbit collective over an emulated link (rank 1's half as fast)."""
    from lowbit.lab.data import load_dataset

    _slow_link(link / (1 + rank))
    ds = load_dataset("digits", seed=0)
    x_tr = ds.x_train.reshape(len(ds.x_train), -1)
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(64, 1024), nn.ReLU(), nn.Linear(1024, 10)))
    state = lowbit.ddp.make_state(model.module, codec="auto", auto_level="bold")
    model.register_comm_hook(state, lowbit.ddp.hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    step = 0
    while step < steps or _undecided(state, step):
        idx = torch.randint(0, len(x_tr), (32,), generator=torch.Generator().manual_seed(1000 * step + rank))
        loss = nn.functional.cross_entropy(model(x_tr[idx]), ds.y_train[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
        step += 1
    _slow_link(None)
    d, m = state.auto.decision, state.auto.measured
    return {"assignment": d.assignment, "error": d.error, "limit": d.error_limit, "noise": m["noise"],
            "errors": m["errors"], "costs": sorted(m["costs"]), "measured": d.measured_s, "table": d.table(),
            "tried": [(label, set(a.values())) for label, a, _ in d.finalists]}


def test_bold_weighs_4_bit_and_1bitsgd_up_to_the_gradients_sampling_noise(ranks: list) -> None:
    res = part(ranks, "bold")
    r0 = res[0]
    assert res[1]["assignment"] == r0["assignment"] and res[1]["limit"] == r0["limit"]
    q4, one = (lowbit.get_codec(s).spec for s in ("qsgd:bits=4,bucket=512", "onebit:bucket=64"))
    assert q4 in r0["costs"] and one in r0["costs"]  # probed beside the default set
    assert r0["noise"] and all(v > 0 for v in r0["noise"].values())  # the ranks' gradients differ
    # the error limit: the larger of uniform 8-bit QSGD's error and the summed sampling noise (budget 1.0)
    q8_sum = sum(e[Q8] for e in r0["errors"].values())
    assert r0["limit"] == pytest.approx(max(q8_sum, sum(r0["noise"].values())))
    assert r0["limit"] > 100 * q8_sum, r0["table"]  # here far above the conservative setting's
    assert r0["error"] <= r0["limit"] * (1 + 1e-9)
    # codecs below 8 bits were tried on the job (measured), as any within the limit would be
    low = [label for label, used in r0["tried"] if used & {q4, one}]
    assert low and all(label in r0["measured"] for label in low), r0["table"]


def test_bad_arguments_are_named() -> None:
    net = _net()
    with pytest.raises(ValueError, match="unknown codec"):
        lowbit.ddp.make_state(net, codec="auto", allow=["fp32", "nope"])
    with pytest.raises(ValueError, match="list of codec specs"):
        lowbit.ddp.make_state(net, codec="auto", allow="qsgd")
    with pytest.raises(ValueError, match="go with codec='auto'"):
        lowbit.ddp.make_state(net, codec="qsgd:bits=8", allow=["fp32"])
    with pytest.raises(ValueError, match="error_budget"):
        lowbit.ddp.make_state(net, codec="auto", error_budget=0)
    with pytest.raises(ValueError, match="algorithm 'allreduce'"):
        lowbit.ddp.make_state(net, codec="auto", algorithm="allreduce")
    st = lowbit.ddp.make_state(net, codec="auto", algorithm="allreduce", allow=["fp32", "bf16"])
    assert st.auto.allow == ["fp32", "bf16"]


def _body_link(rank: int, world: int) -> tuple[float, float]:
    x = torch.ones(250_000)  # 1 MB
    times = []
    for bps in (None, 10e6):
        C.emulate_link(bps)
        t0 = time.perf_counter()
        C.wait(C.all_reduce_async(x, None), "all_reduce", None)
        times.append(time.perf_counter() - t0)
    C.emulate_link(None)
    return times[0], times[1]


def test_emulated_link_holds_the_link_for_bytes_over_speed() -> None:
    for fast, slow in spawn(_body_link, 2, backend="gloo"):
        assert slow >= 0.1 > fast  # 1 MB at 10 MB/s
    with pytest.raises(ValueError, match="bytes/s > 0"):
        C.emulate_link(0)
