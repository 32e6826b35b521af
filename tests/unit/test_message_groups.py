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
    assert D.message_limit("auto", 10) == 64 * MiB  # small models: at least 64 MiB
    assert D.message_limit("auto", 3 * 1024 * MiB) == pytest.approx(1024 * MiB)  # big ones: a third


def _groups(model: nn.Module, message_mb) -> list:
    state = D.make_state(model, "qsgd:bits=8,bucket=512", message_mb=message_mb)
    for name, p in model.named_parameters():
        state._numels[name] = p.numel()
    plan = D._plan_groups(state, 2, torch.device("cpu"))
    return sorted({id(g): g for g in plan.values()}.values(), key=lambda g: g.index)


@pytest.mark.parametrize("mb,count", [("auto", 3), (0, 12), (float("inf"), 1)])
def test_auto_sends_about_three_messages(monkeypatch: pytest.MonkeyPatch, mb, count: int) -> None:
    monkeypatch.setattr(choose, "AUTO_MESSAGE_MIN", 0)  # as if the model were large
    model = nn.Sequential(*[nn.Linear(64, 64, bias=False) for _ in range(12)])
    groups = _groups(model, mb)
    assert len(groups) == count
    assert sum(g.n for g in groups) == 12 * 64 * 64


def test_auto_keeps_a_small_model_in_one_message() -> None:
    model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(12)])
    assert len(_groups(model, "auto")) == 1


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
