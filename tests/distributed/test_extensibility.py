"""A new codec is one file: ``tests/plugins/toy_codec.py`` (8-bit absmax per tensor), registered through
``LOWBIT_PLUGINS``, runs through ``lowbit.all_reduce``, the DDP hook, the study (in spawned workers) and
the speed model without a line of lowbit changed (issue 13 item 6, the codec half)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import lowbit
from lowbit.cli import main
from lowbit.launch import spawn
from lowbit.study.store import ResultStore

PLUGIN = "tests.plugins.toy_codec"


def _body(rank: int, world: int) -> dict:
    codec = lowbit.get_codec("toy8")
    x = torch.randn(3000, generator=torch.Generator().manual_seed(rank))
    exact = x.clone()
    dist.all_reduce(exact)
    exact /= world
    out = {}
    for algo in ("scatter_gather", "allgather"):
        t = x.clone()
        lowbit.all_reduce(t, codec, algorithm=algo, op="mean")
        out[algo] = (t, float((t - exact).norm() / exact.norm()))
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)))
    state = lowbit.ddp.register(model, codec="toy8", start_iter=0)
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(rank))
    nn.functional.cross_entropy(model(x), torch.randint(0, 4, (8,))).backward()
    out["ddp"] = ([p.grad.clone() for p in model.parameters()], state.stats.bytes_sent, state.uses_feedback(codec))
    return out


def test_a_codec_from_its_own_file(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("LOWBIT_PLUGINS", PLUGIN)
    assert lowbit.get_codec("toy8").nbytes(10) == 14
    r0, r1 = spawn(_body, 2, backend="gloo")
    for algo in ("scatter_gather", "allgather"):
        assert torch.equal(r0[algo][0], r1[algo][0]) and r0[algo][1] < 0.02, (algo, r0[algo][1])
    assert all(torch.equal(a, b) for a, b in zip(r0["ddp"][0], r1["ddp"][0]))
    assert r0["ddp"][1] > 0 and r0["ddp"][2]  # bytes counted; biased: error feedback under "auto"
    # the study, in its own spawned workers, and the report
    out = tmp_path / "res"
    assert main(["study", "--preset", "smoke", "--no-progress", "--out", str(out), "--codecs", "fp32", "toy8"]) == 0
    runs = {r["config"]["codec"]: r for r in ResultStore(out).rows() if r["kind"] == "run"}
    assert runs["toy8"]["summary"]["bytes_per_step_per_rank"] > 0 and 0 <= runs["toy8"]["summary"]["final_test_acc"]
    # the speed model asks the codec for its bits per value
    from lowbit.perfmodel.codecbits import bits_per_value

    assert abs(bits_per_value("toy8") - 8.0) < 1e-3
    # a plugin that does not import is a clear error
    monkeypatch.setenv("LOWBIT_PLUGINS", "tests.plugins.no_such_module")
    with pytest.raises(ValueError, match="LOWBIT_PLUGINS"):
        lowbit.get_codec("toy8:")
