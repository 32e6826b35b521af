"""lowbit.launch.spawn starts the processes again when they fail before the rendezvous completes (gloo's
full-mesh connect between local processes on a loaded 2-core machine: "Connection closed by peer"), and
never once any of them is past it (the function may have had effects)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from lowbit.launch import WorkerError, spawn


def _rank_times_ten(rank: int, world: int) -> int:
    return rank * 10


def _fail_after_the_rendezvous(rank: int, world: int, log: str) -> None:
    with open(log, "a") as f:
        f.write(f"{rank}\n")
    raise ValueError("the function itself failed")


def test_a_failed_rendezvous_is_retried_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                              capfd: pytest.CaptureFixture[str]) -> None:
    flag = tmp_path / "failed-once"
    monkeypatch.setenv("LOWBIT_FAULT_INIT_ONCE", str(flag))
    assert spawn(_rank_times_ten, 2, backend="gloo", timeout_s=60) == [0, 10]
    assert flag.exists()  # the first attempt did fail
    assert "starting them again" in capfd.readouterr().err


def _destroy_at_once(rank: int, world: int) -> int:
    import torch.distributed as dist

    dist.destroy_process_group()  # what a fast rank 0 did in CI while its peer was still connecting
    return rank


def test_a_peer_failing_after_rank_0_is_through_its_init_is_still_retried(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]) -> None:
    # no rank counts as started (and so rules a retry out) before every rank is past the rendezvous
    flag = tmp_path / "late-failed-once"
    monkeypatch.setenv("LOWBIT_FAULT_LATE_INIT_ONCE", str(flag))
    assert spawn(_destroy_at_once, 2, backend="gloo", timeout_s=60) == [0, 1]
    assert flag.exists()
    assert "starting them again" in capfd.readouterr().err


def test_a_failure_past_the_rendezvous_is_not_retried(tmp_path: Path) -> None:
    log = tmp_path / "calls"
    with pytest.raises(WorkerError, match="the function itself failed"):
        spawn(_fail_after_the_rendezvous, 2, str(log), backend="gloo", timeout_s=60)
    assert sorted(log.read_text().split()) == ["0", "1"]  # each rank ran the function once
    assert "LOWBIT_FAULT_INIT_ONCE" not in os.environ
