"""lowbit.launch.spawn with $LOWBIT_START_METHOD=forkserver: ranks forked from one server that imported
torch once get the caller's environment as it is now, not as it was when the server started."""

from __future__ import annotations

import os

import pytest

from lowbit.launch import spawn, start_method


def _body(rank: int, world: int, name: str) -> tuple[str | None, int]:
    import torch.distributed as dist

    return os.environ.get(name), dist.get_world_size()


def test_forkserver_children_see_the_callers_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOWBIT_START_METHOD", "forkserver")
    assert start_method() == "forkserver"
    monkeypatch.setenv("LOWBIT_TEST_MARK", "first")
    assert spawn(_body, 2, "LOWBIT_TEST_MARK", backend="gloo", timeout_s=60) == [("first", 2)] * 2
    monkeypatch.setenv("LOWBIT_TEST_MARK", "second")  # the server is running now: its environment is older
    assert spawn(_body, 2, "LOWBIT_TEST_MARK", backend="gloo", timeout_s=60) == [("second", 2)] * 2
    monkeypatch.setenv("LOWBIT_START_METHOD", "threads")
    with pytest.raises(ValueError, match="spawn or forkserver"):
        start_method()
