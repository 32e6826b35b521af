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


def _collect(rank: int, world: int) -> tuple[int, int, float]:
    import gc
    import time

    import torch._dynamo  # noqa: F401 — preloaded by the server: nothing new to import

    t = time.perf_counter()
    gc.collect()
    return gc.get_freeze_count(), len(gc.get_objects()), time.perf_counter() - t


def test_forkserver_children_collect_only_what_they_made(monkeypatch: pytest.MonkeyPatch) -> None:
    """The server freezes what it preloaded (lowbit._forkserver_freeze): a child's gc.collect() skips
    torch's and dynamo's objects instead of walking them and copying their shared pages (0.3-0.9 s a
    rank on the 2-core machine, at least twice per spawn)."""
    monkeypatch.setenv("LOWBIT_START_METHOD", "forkserver")
    for frozen, tracked, _ in spawn(_collect, 2, backend="gloo", timeout_s=60):
        assert frozen > 100_000, frozen  # torch and dynamo: several hundred thousand objects
        assert tracked < frozen / 4, (tracked, frozen)  # what the child's collections walk
