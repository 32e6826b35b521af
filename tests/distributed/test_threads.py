"""lowbit's background threads at teardown (lowbit.comm.threads; issue 44, the abort at exit), gloo on CPU.

The DDP hook thread (``hook_thread=True`` runs it on CPU too) must keep nothing of a finished step (the
state, its buffers and process group are freed by the caller's ``gc.collect()`` before the group is
destroyed), and ``lowbit.launch.shutdown()`` stops and joins it before it destroys the group.
"""

from __future__ import annotations

import gc
import threading
import time
import weakref
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import lowbit
from lowbit.launch import shutdown, spawn


def _lowbit_threads() -> list[str]:
    return sorted(t.name for t in threading.enumerate() if t.name.startswith("lowbit-") and t.is_alive())


def _train(rank: int, spec: str, steps: int) -> tuple[DDP, object]:
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 10)), bucket_cap_mb=0.05)
    state = lowbit.ddp.register(model, codec=spec, error_feedback=True, start_iter=0, hook_thread=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(rank)
    for _ in range(steps):
        opt.zero_grad()
        nn.functional.cross_entropy(model(torch.randn(16, 32, generator=g)), torch.randint(0, 10, (16,), generator=g)).backward()
        opt.step()
    return model, state


def _body_teardown(rank: int, world: int) -> dict:
    model, state = _train(rank, "onebit:bucket=64", 3)
    out = {"during": _lowbit_threads()}
    ref = weakref.ref(state)
    del model, state
    # The hook thread held the last job (the state, its buffers, its group) until the next one; now it
    # drops it before the step's last bucket returns. (A message's done-callback, run on gloo's thread,
    # can hold the state for a moment after the step: hence a short wait, not one collection.)
    t0 = time.monotonic()
    while gc.collect() is not None and ref() is not None and time.monotonic() - t0 < 2:
        time.sleep(0.01)
    out["state_freed"] = ref() is None
    shutdown()  # lowbit's teardown: stops lowbit's threads, then destroys the group
    out["after_shutdown"] = _lowbit_threads()
    return out


def test_the_hook_thread_keeps_nothing_and_stops_before_the_group_is_destroyed() -> None:
    for r in spawn(_body_teardown, 2, backend="gloo", timeout_s=120):
        assert r["during"] == ["lowbit-ddp-hook"], r
        assert r["state_freed"], r
        assert r["after_shutdown"] == [], r

