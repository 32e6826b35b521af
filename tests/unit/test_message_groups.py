"""How the DDP hook cuts a model's gradients into messages (message_mb), without a process group."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import lowbit.ddp as D
from lowbit import choose

MiB = 2**20


def test_message_limit() -> None:
    assert D.message_limit(0.5, 10**12) == 0.5 * MiB
    assert D.message_limit(0, 10**12) == 0
    assert D.message_limit("auto", 10) == 16 * MiB  # small models: at least 16 MiB
    assert D.message_limit("auto", 8 * 1024 * MiB) == pytest.approx(1024 * MiB)  # big ones: an eighth


def _groups(model: nn.Module, message_mb, bucket_mb: float = 25) -> list:
    state = D.make_state(model, "qsgd:bits=8,bucket=512", message_mb=message_mb)
    state.bucket_bytes = bucket_mb * MiB
    for name, p in model.named_parameters():
        state._numels[name] = p.numel()
    plan = D._plan_groups(state, 2, torch.device("cpu"))
    return sorted({id(g): g for g in plan.values()}.values(), key=lambda g: g.index)


def test_ddp_buckets_are_cut_as_torch_cuts_them() -> None:
    import torch.distributed as dist

    torch.manual_seed(0)
    sizes = [int(n) for n in torch.randint(1, 3_000_000, (60,))]
    tensors = [torch.empty(n) for n in sizes]
    for cap_mb in (25, 4, 0.5):
        want, _ = dist._compute_bucket_assignment_by_size(tensors, [choose.DDP_FIRST_BUCKET_BYTES, int(cap_mb * MiB)],
                                                         [False] * len(tensors))
        got = choose.ddp_buckets(sizes, cap_mb * MiB)
        assert [[i for i, b in enumerate(got) if b == k] for k in range(max(got) + 1)] == want


def test_auto_groups_end_where_ddp_buckets_end_and_the_last_bucket_goes_alone() -> None:
    # 24 tensors of 1 MiB fp32, DDP buckets of 4 MiB (the first 1 MiB): buckets [1], [4] x 5, [3].
    # With the 16 MiB minimum, groups close at the first bucket end holding >= 16 MiB (1+4+4+4+4 = 17
    # tensors), then at the end of the next bucket, which comes before the last: [17], [4], [3].
    model = nn.Sequential(*[nn.Linear(512, 512, bias=False) for _ in range(24)])
    groups = _groups(model, "auto", bucket_mb=4)
    sizes = [g.n // (512 * 512) for g in groups]
    assert sizes == [17, 4, 3], sizes
    assert sum(sizes) == 24
    # DDP's first bucket (1 MiB) and one bucket for the rest: the first alone, as the rest is the last
    assert [g.n // (512 * 512) for g in _groups(model, "auto", bucket_mb=1000)] == [1, 23]


def test_auto_keeps_a_small_model_in_one_message() -> None:
    model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(12)])
    assert len(_groups(model, "auto")) == 1


def test_replay_cuts_messages_as_the_hook_does() -> None:
    """choose.simulate, which codec='auto' decides with, sends the groups the hook sends: with a link that
    costs alpha per message, the replayed link time counts one alpha per group."""
    model = nn.Sequential(*[nn.Linear(512, 512, bias=False) for _ in range(24)])
    names = [n for n, _ in reversed(list(model.named_parameters()))]
    buckets = choose.ddp_buckets([512 * 512] * 24, 4 * MiB)
    tl = choose.Timeline(tuple(choose.TensorTiming(n, 512 * 512, 0.0, b) for n, b in zip(names, buckets)),
                         backward_end_s=0.0, step_s=1.0)
    q = "qsgd:bits=8,bucket=512"
    costs = {q: choose.CodecCost(q, 8, False, alpha_s=1.0, s_per_value=0.0)}
    assert choose.simulate(tl, {n: q for n in names}, costs) == pytest.approx(len(_groups(model, "auto", 4)))


@pytest.mark.parametrize("mb,count", [(0, 12), (0.05, 3), (64, 1), (float("inf"), 1)])
def test_message_mb_sets_the_number_of_messages(mb, count: int) -> None:
    # 12 tensors of 16 KiB fp32; a group closes once it holds >= message_mb MiB: 0.05 MiB (51.2 KiB)
    # closes after the 4th tensor (64 KiB), so 3 groups of 4.
    model = nn.Sequential(*[nn.Linear(64, 64, bias=False) for _ in range(12)])
    groups = _groups(model, mb)
    assert len(groups) == count
    assert sum(g.n for g in groups) == 12 * 64 * 64


@pytest.mark.parametrize("bad", [-1, True, "big", None])
def test_bad_message_mb_is_refused(bad) -> None:
    with pytest.raises(ValueError, match="message_mb"):
        D.make_state(nn.Linear(4, 4), "qsgd:bits=8", message_mb=bad)


def test_auto_leaves_trailing_fp32_tensors_to_their_own_buckets() -> None:
    """fp32 tensors after the last quantised one (auto keeping the first layers in fp32) are reduced
    natively with their buckets, not appended to the last message, which may have closed at an earlier
    bucket end and would then wait for DDP's last bucket (found in review)."""
    from lowbit.codecs.base import get_codec

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(784, 4096), nn.ReLU(), nn.Linear(4096, 4096), nn.ReLU(), nn.Linear(4096, 10))
    state = D.make_state(model, "qsgd:bits=8,bucket=512", message_mb="auto")
    state.plan = {**state.plan, "0.weight": get_codec("fp32"), "0.bias": get_codec("fp32")}
    plan = D._plan_groups(state, 2, torch.device("cpu"))
    assert "0.weight" not in plan and "0.bias" not in plan
    assert "2.weight" in plan
    state.message_mb = 64  # an explicit size: they ride in the last message, as documented
    plan = D._plan_groups(state, 2, torch.device("cpu"))
    assert "0.weight" in plan and plan["0.weight"] is plan["2.weight"]
