"""lowbit.localsgd across groups, gloo, 4 ranks as 2 groups of 2: DDP inside each group every step, the
outer exchange only between groups (each local rank its chunk); bit-identical weights on all four
ranks after every outer step, the groups' mean at outer lr 1, half the bytes between groups of a
rank that sends its whole weight change (replicate_group)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from lowbit.launch import spawn
from lowbit.localsgd import LocalSGD, node_groups
from tests.distributed.shared_spawn import part, run_parts


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 3))  # 1,283 values: odd, chunks uneven


def _flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone()


def _run(rank: int, spec: str, steps: int, **kw: object) -> dict:
    inner_group, outer_group = node_groups(2)
    model = DDP(_model(), process_group=inner_group)
    if "replicate" in kw:
        kw.pop("replicate")
        opt = LocalSGD(model, torch.optim.SGD(model.parameters(), lr=0.05), local_steps=3, codec=spec,
                       replicate_group=outer_group, **kw)
    else:
        opt = LocalSGD(model, torch.optim.SGD(model.parameters(), lr=0.05), local_steps=3, codec=spec, node_size=2,
                       **kw)
    weights = []
    for s in range(steps):
        g = torch.Generator().manual_seed(100 * rank + s)
        x = torch.randn(8, 16, generator=g)
        nn.functional.mse_loss(model(x), x[:, :3].cos()).backward()
        if s == steps - 1 and kw.get("outer_lr") == 1.0:
            opt.optimizer.step()
            mean = _flat(model).double()
            dist.all_reduce(mean)
            weights.append(mean / 4)  # the mean over the 4 ranks = over the 2 groups (equal inside)
            opt.after_step()
        else:
            opt.step()
        opt.zero_grad()
        weights.append(_flat(model))
    return {"weights": weights, "inter": opt.stats.bytes_inter, "sent": opt.stats.bytes_sent,
            "outer_steps": opt.outer_steps}


def _body(rank: int, world: int) -> dict:
    return {
        "qsgd4": _run(rank, "qsgd:bits=4,bucket=64", 9),
        "fp32-average": _run(rank, "fp32", 3, outer_lr=1.0, outer_momentum=0.0),
        "fp32-chunks": _run(rank, "fp32", 3),
        "fp32-whole": _run(rank, "fp32", 3, replicate=True),
    }


@pytest.fixture(scope="module")
def ranks() -> list:
    return spawn(run_parts, 4, (("groups", _body, ()),), backend="gloo", timeout_s=120)


def test_four_ranks_two_groups_identical_after_every_outer_step(ranks: list) -> None:
    rs = part(ranks, "groups")
    w = [r["qsgd4"]["weights"] for r in rs]
    for i in range(9):
        assert torch.equal(w[0][i], w[1][i]) and torch.equal(w[2][i], w[3][i]), i  # DDP inside each group
        if (i + 1) % 3 == 0:
            assert all(torch.equal(w[0][i], w[r][i]) for r in range(4)), i
        else:
            assert not torch.equal(w[0][i], w[2][i]), i  # the groups drift apart between syncs
    assert all(r["qsgd4"]["outer_steps"] == 3 for r in rs)


def test_outer_lr_one_is_the_mean_of_the_groups(ranks: list) -> None:
    for r in part(ranks, "groups"):
        *_, mean, after = r["fp32-average"]["weights"]
        torch.testing.assert_close(after, mean.float(), rtol=0, atol=1e-6)


def test_each_local_rank_sends_its_chunk_between_groups(ranks: list) -> None:
    rs = part(ranks, "groups")
    n = sum(p.numel() for p in _model().parameters())
    for r in rs:
        # fp32 between 2 groups (ring allreduce over 2 ranks: the chunk once each way), 1 outer step:
        # a chunk of ceil(n / 2) values, where a rank sending its whole change sends n
        assert r["fp32-chunks"]["inter"] == 4 * -(-n // 2)
        assert r["fp32-whole"]["inter"] == r["fp32-whole"]["sent"] == 4 * n
        # the chunk gather inside the group: one chunk to the other local rank
        assert r["fp32-chunks"]["sent"] - r["fp32-chunks"]["inter"] == 4 * -(-n // 2)
    # the whole-change variant ends identical as well
    ws = [r["fp32-whole"]["weights"][-1] for r in rs]
    assert all(torch.equal(ws[0], x) for x in ws)
