"""lowbit's own process groups (lowbit.comm.groups, issue 44 items 1 and 5), gloo on CPU:

* every group lowbit makes (lowbit.fsdp's communicators, the hierarchical topology, the DDP hook
  thread's) has its parent's timeout and backend, so a stalled peer is an error after the job's
  timeout, as with plain FSDP2, not after gloo's default 30 minutes;
* the hierarchical algorithm still works after ``destroy_process_group()`` and a new
  ``init_process_group()`` (its cached groups belonged to the old default group).
"""

from __future__ import annotations

import os
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch import nn

import lowbit
from lowbit.comm.groups import group_timeout
from lowbit.launch import spawn
from tests.distributed.shared_spawn import part, run_parts

#: the default group's timeout in the shared spawn, and the shorter one of a group made there
SPAWN_TIMEOUT_S = 47
SHORT_S = 7


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list:
    tmp = str(tmp_path_factory.mktemp("groups"))
    parts = (("timeouts", _body_timeouts, ()),
             ("reinit", _body_reinit, (tmp,)))  # last: it replaces the default group
    return spawn(run_parts, 2, parts, backend="gloo", timeout_s=SPAWN_TIMEOUT_S)


def _seconds(group: dist.ProcessGroup | None) -> float | None:
    t = group_timeout(group)
    return None if t is None else t.total_seconds()


def _body_timeouts(rank: int, world: int) -> dict:
    from lowbit.comm.hierarchical import topology
    from lowbit.fsdp import _make_groups

    short = dist.new_group(timeout=timedelta(seconds=SHORT_S))
    out = {"world": _seconds(None), "short": _seconds(short)}
    # the hierarchical algorithm's groups, of the default group and of the short one
    out["hier_cross"] = _seconds(topology(None, 1).cross)  # 2 nodes of 1: one cross-node group
    out["hier_intra"] = _seconds(topology(None, 2).intra)  # 1 node of 2: one node group
    out["hier_short_cross"] = _seconds(topology(short, 1).cross)
    # lowbit.fsdp's communicators over FSDP's group (one node; and 2 nodes of 1 rank)
    one = _make_groups(short, None)
    two = _make_groups(short, 1)
    out["fsdp_one_node"] = _seconds(one.cross)
    out["fsdp_cross"], out["fsdp_intra"] = _seconds(two.cross), _seconds(two.intra)
    # the DDP hook thread's group (hook_thread=True makes it on CPU too)
    state = lowbit.ddp.make_state(nn.Linear(4, 4), codec="qsgd:bits=8", process_group=short, hook_thread=True)
    out["ddp_thread"] = _seconds(state._thread_group)
    out["backends"] = {dist.get_backend(g) for g in (short, topology(None, 1).cross, one.cross, state._thread_group)}
    return out


def test_lowbit_groups_take_their_parent_groups_timeout(ranks: list) -> None:
    for r in part(ranks, "timeouts"):
        assert r["world"] == SPAWN_TIMEOUT_S and r["short"] == SHORT_S, r  # torch shows them (2.6+)
        assert r["hier_cross"] == r["hier_intra"] == SPAWN_TIMEOUT_S, r
        for key in ("hier_short_cross", "fsdp_one_node", "fsdp_cross", "ddp_thread"):
            assert r[key] == SHORT_S, (key, r)
        assert r["fsdp_intra"] is None or r["fsdp_intra"] == SHORT_S, r  # (a group of one rank: None)
        assert r["backends"] == {"gloo"}, r


def _body_reinit(rank: int, world: int, tmp: str) -> dict:
    import gc

    from lowbit.comm.hierarchical import _TOPOLOGIES

    x = torch.arange(8, dtype=torch.float32) + rank
    out: dict = {"results": []}
    for i in range(2):
        if i:  # a new default group, as a job that restarts its process group does
            dist.destroy_process_group()
            gc.collect()
            out["cached_after_destroy"] = len(_TOPOLOGIES)  # the old groups' topologies went with them
            dist.init_process_group("gloo", init_method=f"file://{tmp}/rendezvous2", rank=rank, world_size=world,
                                    timeout=timedelta(seconds=SPAWN_TIMEOUT_S))
        t = x.clone()
        lowbit.all_reduce(t, "qsgd:bits=8,bucket=512", algorithm="hierarchical", op="mean", node_size=1)
        out["results"].append(t)
    return out


def test_hierarchical_works_after_the_process_group_is_made_again(ranks: list) -> None:
    """It raised torch's "Group ... is not registered" after the re-init: the topology cache kept the old
    default group's sub-groups."""
    r0, r1 = part(ranks, "reinit")
    exact = torch.arange(8, dtype=torch.float32) + 0.5
    for t in r0["results"] + r1["results"]:
        assert float((t - exact).norm() / exact.norm()) < 0.02
    assert torch.equal(r0["results"][1], r1["results"][1])
    assert r0["cached_after_destroy"] == r1["cached_after_destroy"] == 0


# ------------------------------------------------------------------------ a stalled peer under FSDP
#: the FSDP group's timeout in the stalled-peer test
FAULT_TIMEOUT_S = 2
#: how long the stalled rank sleeps at most (it wakes as soon as rank 0 has its error)
STALL_S = FAULT_TIMEOUT_S + 10


def _body_fsdp_stalled(rank: int, world: int, tmp: str) -> str:
    """Rank 1 stalls before its backward at step 2; rank 0's backward (lowbit's reduce-scatters only:
    the blocks keep their parameters unsharded after the forward, so no all-gather on FSDP's group)
    must fail after FSDP's group's timeout, not when rank 1 wakes."""
    import torch._dynamo  # noqa: F401 — FSDP's first use imports it (seconds): before the short timeout starts
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    dist.barrier()  # in step on the spawn's group, then FSDP on a group of FAULT_TIMEOUT_S
    group = dist.new_group(timeout=timedelta(seconds=FAULT_TIMEOUT_S))
    mesh = DeviceMesh.from_group(group, "cpu")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 4))
    for m in (model[0], model[2], model[4]):
        fully_shard(m, mesh=mesh, reshard_after_forward=False)
    fully_shard(model, mesh=mesh, reshard_after_forward=False)
    lowbit.fsdp.register(model, codec="qsgd:bits=8,bucket=512")
    t0 = time.monotonic()
    longest = 0.0
    try:
        for i in range(4):
            loss = model(torch.randn(8, 16)).sum()
            if rank == 1 and i == 2:
                while time.monotonic() - t0 < STALL_S and not os.path.exists(f"{tmp}/rank0-failed"):
                    time.sleep(0.05)
            t0 = time.monotonic()  # the error is timed from the start of the backward
            loss.backward()
            longest = max(longest, time.monotonic() - t0)
    except Exception as exc:  # noqa: BLE001 — the collective's error, from the backward
        if rank == 0:
            open(f"{tmp}/rank0-failed", "w").close()
        return f"{time.monotonic() - t0:.1f}|{type(exc).__name__}|{exc}"
    return f"{longest:.1f}|no error|"  # (the longest backward)


def test_a_stalled_peer_under_lowbit_fsdp_is_an_error_within_the_groups_timeout(tmp_path) -> None:
    """lowbit's gradient communicators had gloo's 30-minute default: rank 0 waited for the stalled peer
    (here until it woke, STALL_S) where plain FSDP2 raises after the group's timeout."""
    res = spawn(_body_fsdp_stalled, 2, str(tmp_path), backend="gloo", timeout_s=60)
    elapsed, kind, text = res[0].split("|", 2)
    assert kind != "no error", res
    assert FAULT_TIMEOUT_S - 0.5 <= float(elapsed) < FAULT_TIMEOUT_S + 3, res
    assert "lowbit:" in text and "failed on rank 0 of 2" in text, text
