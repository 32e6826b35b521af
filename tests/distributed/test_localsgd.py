"""lowbit.localsgd on gloo, 2 ranks: bit-identical weights after every outer step (fp32, 4- and 2-bit QSGD
with error feedback, streaming fragments), plain model averaging at outer lr 1, bytes per outer step
(4-bit and 2-bit against fp32, counted from the buffers sent), disagreeing ranks, a bit-identical
resume, a non-finite round skipped on every rank."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

from lowbit.localsgd import ConfigMismatchError, LocalSGD
from lowbit.localsgd.fragments import _split
from lowbit.launch import spawn
from tests.distributed.shared_spawn import part, run_parts


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 4))


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * rank + step)
    x = torch.randn(32, 16, generator=g)
    return x, x[:, :4].sin() + 0.1 * torch.randn(32, 4, generator=g)


def _train(model: nn.Module, opt: LocalSGD, rank: int, steps: range) -> list[bool]:
    """Inner steps on this rank's own data; after each, whether a fragment was synchronised."""
    out = []
    for s in steps:
        x, y = _batch(rank, s)
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        out.append(bool(opt.synced))
    return out


def _flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone()


def _body_identical(rank: int, world: int) -> dict:
    """Weights after every step, per configuration: the test compares them across ranks."""
    out: dict = {}
    for spec, fragments in (("fp32", 1), ("qsgd:bits=4,bucket=512", 1), ("qsgd:bits=2,bucket=128,rounding=nearest", 1),
                            ("qsgd:bits=4,bucket=512", 3), ("onebit:bucket=64", 1)):
        model = _model(seed=rank)  # different inits: the constructor broadcasts rank 0's
        inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
        opt = LocalSGD(model, inner, local_steps=6, codec=spec, fragments=fragments)
        first = _flat(model)
        weights, synced = [], []
        for s in range(24):
            synced += _train(model, opt, rank, range(s, s + 1))
            weights.append(_flat(model))
        out[(spec, fragments)] = (first, weights, synced, opt.feedback is not None, opt.outer_steps,
                                  opt.feedback.residual_norm() if opt.feedback is not None else 0.0)
    return out


def _body_average(rank: int, world: int) -> dict:
    """Outer SGD at lr 1 without momentum is model averaging: the weights become the ranks' mean."""
    model = _model(0)
    opt = LocalSGD(model, torch.optim.SGD(model.parameters(), lr=0.05), local_steps=3, codec="fp32",
                   outer_lr=1.0, outer_momentum=0.0)
    _train(model, opt, rank, range(2))
    x, y = _batch(rank, 2)
    nn.functional.mse_loss(model(x), y).backward()
    opt.optimizer.step()
    before = _flat(model)  # this rank's weights just before the synchronisation
    mean = before.double().clone()
    dist.all_reduce(mean)
    mean /= world
    opt.zero_grad()
    opt.after_step()
    return {"synced": opt.synced, "after": _flat(model), "mean": mean.float()}


def _body_bytes(rank: int, world: int) -> dict:
    """Bytes per outer step of each codec, from the collectives' own count (CommStats)."""
    out = {}
    for spec in ("fp32", "qsgd:bits=4,bucket=512", "qsgd:bits=2,bucket=512,rounding=nearest"):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(256, 256), nn.Linear(256, 64))  # 82,240 values
        opt = LocalSGD(model, torch.optim.SGD(model.parameters(), lr=1e-3), local_steps=2, codec=spec)
        for s in range(6):
            x = torch.randn(8, 256, generator=torch.Generator().manual_seed(10 * rank + s))
            model(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
        out[spec] = (opt.bytes_per_outer_step(), opt.stats.bytes_inter, opt.stats.bytes_sent, opt.outer_steps,
                     opt.feedback is not None, sum(p.numel() for p in model.parameters()))
    return out


def _body_mismatch(rank: int, world: int) -> dict:
    """Ranks that disagree get the same error on every rank, never a hang."""
    out = {}
    cases = {
        "local_steps": dict(local_steps=4 + 4 * rank),
        "fragments": dict(local_steps=4, fragments=1 + rank),
        "codec": dict(local_steps=4, codec="qsgd:bits=4,bucket=512" if rank else "qsgd:bits=2,bucket=512"),
        "outer": dict(local_steps=4, outer_momentum=0.9 if rank else 0.5),
        "invalid": dict(local_steps=4 if rank else 0),
        "same mistake": dict(local_steps=4, fragments=9),
    }
    for name, kw in cases.items():
        model = _model(0)
        try:
            LocalSGD(model, torch.optim.SGD(model.parameters(), lr=0.1), **kw)
            out[name] = ("built", "")
        except ConfigMismatchError as exc:
            out[name] = ("mismatch", str(exc))
        except ValueError as exc:
            out[name] = ("value", str(exc))
    # and the ranks still work together afterwards
    t = torch.ones(3)
    dist.all_reduce(t)
    out["after"] = t
    return out


def _build_resumable(rank: int) -> tuple[nn.Module, LocalSGD]:
    model = _model(rank)
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, LocalSGD(model, inner, local_steps=4, fragments=2, codec="qsgd:bits=4,bucket=512")


def _body_resume(rank: int, world: int) -> dict:
    """Save mid-period, continue; a fresh model and LocalSGD loaded from the save continue bit-identically."""
    model, opt = _build_resumable(rank)
    _train(model, opt, rank, range(0, 7))  # 7: mid-period, fragment 0 synchronised at 6, fragment 1 due at 8
    saved = {"model": {k: v.clone() for k, v in model.state_dict().items()},
             "inner": opt.optimizer.state_dict(), "localsgd": opt.state_dict()}
    saved = copy.deepcopy(saved)
    _train(model, opt, rank, range(7, 15))
    straight = _flat(model)
    model2, opt2 = _build_resumable(rank + 7)
    model2.load_state_dict(saved["model"])
    opt2.optimizer.load_state_dict(saved["inner"])
    opt2.load_state_dict(saved["localsgd"])
    _train(model2, opt2, rank, range(7, 15))
    # a checkpoint of other settings is refused, naming the difference
    model3 = _model(0)
    opt3 = LocalSGD(model3, torch.optim.SGD(model3.parameters(), lr=0.1), local_steps=5, fragments=2,
                    codec="qsgd:bits=4,bucket=512")
    try:
        opt3.load_state_dict(saved["localsgd"])
        refused = ""
    except ValueError as exc:
        refused = str(exc)
    return {"straight": straight, "resumed": _flat(model2), "steps": (opt.inner_steps, opt2.inner_steps),
            "refused": refused}


def _body_nonfinite(rank: int, world: int) -> dict:
    """An Inf on one rank makes the mean non-finite on every rank: the round is skipped everywhere, the
    weights go back to the anchor, and training goes on."""
    model = _model(0)
    opt = LocalSGD(model, torch.optim.SGD(model.parameters(), lr=0.05), local_steps=2, codec="qsgd:bits=4,bucket=512")
    anchor = _flat(model)
    _train(model, opt, rank, range(1))
    if rank == 1:
        with torch.no_grad():
            next(model.parameters())[0, 0] = float("inf")
    opt.after_step()
    reset = _flat(model)
    _train(model, opt, rank, range(2, 4))
    return {"skipped": opt.skipped, "reset": torch.equal(reset, anchor), "after": _flat(model)}


@pytest.fixture(scope="module")
def ranks() -> list:
    parts = (("identical", _body_identical, ()), ("average", _body_average, ()), ("bytes", _body_bytes, ()),
             ("mismatch", _body_mismatch, ()), ("resume", _body_resume, ()), ("nonfinite", _body_nonfinite, ()))
    return spawn(run_parts, 2, parts, backend="gloo", timeout_s=120)


def test_weights_bit_identical_after_every_outer_step(ranks: list) -> None:
    r0, r1 = part(ranks, "identical")
    for key in r0:
        first0, w0, synced, fb, outer_steps, res = r0[key]
        first1, w1, _, _, _, _ = r1[key]
        assert torch.equal(first0, first1), key  # the constructor broadcast rank 0's weights
        spec, fragments = key
        assert outer_steps == 4
        assert fb == (spec != "fp32"), key  # error feedback on by default for 4-bit, nearest 2-bit, 1-bit codecs
        if fb:
            assert res > 0, key
        period_ends = [i for i in range(24) if (i + 1) % 6 == 0]
        for i in range(24):
            if fragments == 1:
                assert synced[i] == (i in period_ends), (key, i)
            if i in period_ends:  # every fragment has just been synchronised at a period's end... (F=1),
                # and with F fragments the last one: compare the whole model only where all are fresh
                if fragments == 1:
                    assert torch.equal(w0[i], w1[i]), (key, i)
            elif fragments == 1:
                assert not torch.equal(w0[i], w1[i]), (key, i)  # between syncs the ranks drift apart
        if fragments == 3:
            assert synced == [(i + 1) % 2 == 0 for i in range(24)], synced  # fragments at steps 2, 4, 6
            assert torch.isfinite(w0[-1]).all()


def test_streaming_fragments_identical_where_synchronised(ranks: list) -> None:
    r0, r1 = part(ranks, "identical")
    # fragment f of 3 (whole tensors in model order, about equal size) is synchronised after inner step
    # 2(f+1) of each period of 6: compare that fragment's values right after it
    model = _model(0)
    frags = _split([p for p in model.parameters()], 3)
    bounds, pos = [], 0
    for members in frags:
        n = sum(p.numel() for p in members)
        bounds.append((pos, pos + n))
        pos += n
    _, w0, _, _, _, _ = r0[("qsgd:bits=4,bucket=512", 3)]
    _, w1, _, _, _, _ = r1[("qsgd:bits=4,bucket=512", 3)]
    for i in range(24):
        step = i + 1
        if step % 2 == 0:
            f = (step % 6) // 2 - 1 if step % 6 else 2
            lo, hi = bounds[f]
            assert torch.equal(w0[i][lo:hi], w1[i][lo:hi]), (i, f)
            other = bounds[(f + 1) % 3]
            if step > 2:  # the other fragments drifted since their own synchronisation
                assert not torch.equal(w0[i][other[0]:other[1]], w1[i][other[0]:other[1]]), (i, f)


def test_outer_lr_one_without_momentum_is_model_averaging(ranks: list) -> None:
    for r in part(ranks, "average"):
        assert r["synced"] == [0]
        torch.testing.assert_close(r["after"], r["mean"], rtol=0, atol=1e-6)


def test_bytes_per_outer_step_low_bit_against_fp32(ranks: list) -> None:
    for r in part(ranks, "bytes"):
        fp32, _, _, steps, fb, n = r["fp32"]
        assert steps == 3 and not fb
        assert fp32 == 4 * n  # two ranks, ring allreduce: each sends (K-1)/K of the tensor twice
        for spec, frac in (("qsgd:bits=4,bucket=512", 1 / 8), ("qsgd:bits=2,bucket=512,rounding=nearest", 1 / 16)):
            b, inter, sent, steps, fb, _ = r[spec]
            assert fb and steps == 3
            assert inter == sent  # one rank a group: everything crosses between groups
            # framing: one float32 scale per 512 values (32/512 bits a value) and 16-byte message slots
            assert frac <= b / fp32 <= frac * (1 + (32 / 512) / (32 * frac)) * 1.002, (spec, b / fp32)


def test_disagreeing_ranks_get_one_clear_error(ranks: list) -> None:
    r0, r1 = part(ranks, "mismatch")
    for name, field in (("local_steps", "local_steps=4"), ("fragments", "fragments=1"),
                        ("codec", "bits=2"), ("outer", "momentum")):
        assert r0[name][0] == r1[name][0] == "mismatch", (name, r0[name], r1[name])
        assert r0[name][1] == r1[name][1] and field in r0[name][1], (name, r0[name][1])
        assert "rank 0" in r0[name][1] and "rank 1" in r0[name][1]
    assert r0["invalid"][0] == r1["invalid"][0] == "mismatch"
    assert "invalid: local_steps must be a positive int, got 0" in r0["invalid"][1]
    # one script's mistake on every rank is the ValueError itself
    assert r0["same mistake"] == r1["same mistake"]
    assert r0["same mistake"][0] == "value" and "fragments (9) must be at most local_steps (4)" in r0["same mistake"][1]
    assert torch.equal(r0["after"], torch.full((3,), 2.0))


def test_resume_is_bit_identical(ranks: list) -> None:
    for r in part(ranks, "resume"):
        assert r["steps"] == (15, 15)
        assert torch.equal(r["straight"], r["resumed"])
        assert "local_steps saved 4, now 5" in r["refused"]


def test_non_finite_round_is_skipped_on_every_rank(ranks: list) -> None:
    r0, r1 = part(ranks, "nonfinite")
    assert r0["skipped"] == r1["skipped"] == 1
    assert r0["reset"] and r1["reset"]
    assert torch.isfinite(r0["after"]).all() and torch.equal(r0["after"], r1["after"])
