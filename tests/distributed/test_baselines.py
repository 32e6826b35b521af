"""lowbit.lab.baselines on two gloo ranks: PowerSGD with several buckets runs (torch's hook alone aborts there,
pytorch/pytorch#58467), every baseline leaves the ranks with the same weights, the bytes counted are the
bytes torch's hooks send (checked against the shapes and PowerSGD's own buffers, not the counting code),
and the hooks cross an emulated link."""

from __future__ import annotations

import time

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from lowbit.lab import baselines as B
from lowbit.comm import collectives as C
from lowbit.launch import spawn
from lowbit.lab.models import build_model
from tests.distributed.shared_spawn import part, run_parts

STEPS = 5
RANK = 2


def _gpt() -> nn.Module:
    torch.manual_seed(0)
    return build_model("gpt2_small", num_classes=256, in_shape=(16,), n_layers=2, n_heads=2, d_model=32, context=16)


def _train(rank: int, spec: str | None, link: float | None = None, bucket_mb: float = 0.02,
           latency: float = 0.0) -> dict:
    model = _gpt()
    shapes = [tuple(p.shape) for p in model.parameters()]
    C.emulate_link(link, latency)
    try:
        ddp = DDP(model, bucket_cap_mb=bucket_mb)
        state = B.register(ddp, spec) if spec else None
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        g = torch.Generator().manual_seed(rank)
        t0 = time.perf_counter()
        for _ in range(STEPS):
            x = torch.randint(0, 256, (4, 16), generator=g)
            loss = nn.functional.cross_entropy(ddp(x).reshape(-1, 256), x.reshape(-1))
            opt.zero_grad()
            loss.backward()
            opt.step()
            if state is not None:
                state.count_step()
        elapsed = time.perf_counter() - t0
    finally:
        C.emulate_link(None)
    out = {"params": torch.cat([p.detach().reshape(-1) for p in model.parameters()]), "shapes": shapes,
           "elapsed": elapsed, "bytes": state.stats.bytes_sent if state else None}
    if state is not None and state.baseline.kind == "powersgd":
        hs = state.hook_state
        out["buckets"] = len(hs.p_memory_dict)
        out["p"] = sum(v.numel() for v in hs.p_memory_dict.values())
        out["q"] = sum(v.numel() for v in hs.q_memory_dict.values())
        out["serial"] = state.serial
    return out


def _body(rank: int, world: int) -> dict:
    torch.set_num_threads(1)  # two ranks on two cores: more threads make a step 50x slower under load
    return {
        "plain": _train(rank, None),
        "powersgd": _train(rank, f"torch:powersgd:rank={RANK}"),
        "fp16": _train(rank, "torch:fp16"),
        "fp16_link": _train(rank, "torch:fp16", link=1e6),
        "ddp_link": _train(rank, "torch:ddp", link=1e6),
        # a fast link with a 60 ms latency, one bucket a step: each step's allreduce waits the latency
        "ddp_fast": _train(rank, "torch:ddp", link=1e9, bucket_mb=25),
        "ddp_latency": _train(rank, "torch:ddp", link=1e9, bucket_mb=25, latency=0.06),
    }


@pytest.fixture(scope="module")
def ranks() -> list:
    return spawn(run_parts, 2, (("all", _body, ()),), backend="gloo", timeout_s=120)


def _same_on_both(rs: list, name: str) -> torch.Tensor:
    a, b = rs[0][name]["params"], rs[1][name]["params"]
    assert torch.equal(a, b), f"{name}: the ranks' weights differ"
    return a


def test_powersgd_runs_on_gloo_with_several_buckets_and_counts_what_it_sends(ranks) -> None:
    rs = part(ranks, "all")
    r = rs[0]["powersgd"]
    assert r["serial"] and r["buckets"] > 1  # several buckets: what aborts torch's hook alone on gloo
    _same_on_both(rs, "powersgd")
    # what PowerSGD sends, from the shapes (as its hook decides: shape[0] x rest, compressed when that
    # saves at least 2x): P is n x r, Q is m x r per compressed matrix; the rest goes uncompressed
    p = q = rest = 0
    for shape in r["shapes"]:
        n = shape[0]
        m = 1
        for d in shape[1:]:
            m *= d
        k = min(n, m, RANK)
        if (n + m) * k * 2 < n * m:
            p, q = p + n * k, q + m * k
        else:
            rest += n * m
    assert (r["p"], r["q"]) == (p, q)  # PowerSGD's own buffers: the same matrices compressed
    numel = sum(n for n in (r["params"].numel(),))
    vanilla, compressed = 2, STEPS - 2  # start_iter=2: fp32 allreduce before
    assert r["bytes"] == vanilla * 4 * numel + compressed * 4 * (p + q + rest)  # 2(K-1)/K = 1 at K=2
    assert 4 * (p + q + rest) < numel  # and it compresses: under a quarter of the fp32 bytes


def test_casts_reduce_like_ddp_and_count_two_bytes_a_value(ranks) -> None:
    rs = part(ranks, "all")
    plain = _same_on_both(rs, "plain")
    fp16 = _same_on_both(rs, "fp16")
    assert not torch.equal(plain, fp16)  # the cast did something ...
    assert torch.allclose(plain, fp16, atol=1e-3, rtol=1e-2)  # ... and reduced the same gradients
    numel = plain.numel()
    assert rs[0]["fp16"]["bytes"] == STEPS * 2 * numel
    assert rs[0]["ddp_link"]["bytes"] == STEPS * 4 * numel
    torch.testing.assert_close(_same_on_both(rs, "ddp_link"), plain)  # torch's allreduce hook = DDP's mean


def test_hooks_cross_the_emulated_link(ranks) -> None:
    """At 1 MB/s each step holds the link for the bytes the rank contributes (the tensor it allreduces):
    the run takes at least that long, and longer than without the link."""
    r = part(ranks, "all")[0]
    numel = r["plain"]["params"].numel()
    assert r["fp16_link"]["elapsed"] >= STEPS * 2 * numel / 1e6
    assert r["ddp_link"]["elapsed"] >= STEPS * 4 * numel / 1e6
    assert r["fp16_link"]["elapsed"] > r["fp16"]["elapsed"]
    assert torch.equal(r["fp16_link"]["params"], r["fp16"]["params"])  # the link delays, changes nothing


def test_the_emulated_links_latency_is_paid_per_collective(ranks) -> None:
    """``emulate_link(bytes_per_s, latency_s)``: at 1 GB/s the bytes are nothing; a 60 ms latency per
    collective makes each of the steps (one bucket, one allreduce) wait it, and changes no weight."""
    rs = part(ranks, "all")
    late, fast = rs[0]["ddp_latency"]["elapsed"], rs[0]["ddp_fast"]["elapsed"]
    assert late >= STEPS * 0.06 and late - fast >= 0.5 * STEPS * 0.06, (late, fast)
    assert torch.equal(_same_on_both(rs, "ddp_latency"), _same_on_both(rs, "ddp_fast"))
