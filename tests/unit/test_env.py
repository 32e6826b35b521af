"""lowbit.env: the one place that records where a measurement ran and decides how the process was launched."""

from __future__ import annotations

import pytest
import torch

from lowbit import env


def test_host_and_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    h = env.host(torch.device("cpu"), "spawn")
    for k in ("lowbit", "torch", "python", "hostname", "cpu", "cpu_count", "device_name", "launcher", "nccl_env"):
        assert k in h, k
    monkeypatch.setenv("NCCL_P2P_DISABLE", "1")
    monkeypatch.setenv("LOWBIT_GIT_COMMIT", "abc1234")
    h = env.host(torch.device("cpu"), "torchrun")
    assert h["nccl_env"] == {"NCCL_P2P_DISABLE": "1"} and h["lowbit_git_commit"] == "abc1234"
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE"):
        monkeypatch.delenv(var, raising=False)
    assert not env.under_torchrun()
    with pytest.raises(ValueError, match="RANK/WORLD_SIZE"):
        env.launched_rank_and_size()
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert not env.under_torchrun()  # torchrun always sets MASTER_ADDR too
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    assert env.under_torchrun() and env.launched_rank_and_size() == (1, 4)
