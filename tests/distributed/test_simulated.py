"""algorithm="simulated" (Grubic et al.'s simulated low-precision NCCL, Figs 7, 9, 11): a native fp32
allreduce of a buffer of the codec's wire size, the tensor left unreduced; in lowbit.all_reduce, the DDP
hook, `lowbit bench` (labelled) and the study (labelled, out of the accuracy tables)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import lowbit
from lowbit.lab.cli import main
from lowbit.codecs.base import get_codec
from lowbit.comm.allreduce import CommStats, bytes_sent_per_rank, simulated_numel
from lowbit.launch import spawn
from lowbit.lab.study.store import ResultStore


def _body(rank: int, world: int) -> dict:
    out = {}
    for spec in ["fp32", "qsgd:bits=4,bucket=512", "onebit:bucket=64", "dettmers:type=dynamic,bucket=0"]:
        x = torch.randn(5000, generator=torch.Generator().manual_seed(rank))
        t = x.clone()
        st = CommStats()
        lowbit.all_reduce(t, spec, algorithm="simulated", op="mean", stats=st)
        out[spec] = (torch.equal(t, x), st.bytes_sent, st.calls)
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10)))
    state = lowbit.ddp.register(model, codec="qsgd:bits=4,bucket=512", algorithm="simulated", start_iter=0)
    g = torch.Generator().manual_seed(rank)
    for _ in range(3):
        x = torch.randn(16, 64, generator=g)
        model.zero_grad()
        nn.functional.cross_entropy(model(x), torch.randint(0, 10, (16,), generator=g)).backward()
    out["ddp"] = (state.stats.bytes_sent, [p.grad.clone() for p in model.parameters()])
    return out


def test_simulated_sends_the_wire_size_and_leaves_the_tensor() -> None:
    for world in (2, 3):
        res = spawn(_body, world, backend="gloo")
        for rank, r in enumerate(res):
            for spec in ["fp32", "qsgd:bits=4,bucket=512", "onebit:bucket=64", "dettmers:type=dynamic,bucket=0"]:
                same, sent, calls = r[spec]
                codec = get_codec(spec)
                m = simulated_numel(codec, 5000)
                assert m == -(-codec.nbytes(5000, codec.flat_shape(5000)) // 4)
                assert same and calls == 1  # the tensor keeps this rank's values: speed only
                assert sent == bytes_sent_per_rank(codec, 5000, world, "simulated", rank) == 2 * (world - 1) * m * 4 // world
            assert r["ddp"][0] > 0
        # the hook does not average: the ranks' gradients differ (each its own)
        assert not torch.equal(res[0]["ddp"][1][0], res[1]["ddp"][1][0])
    # 4-bit QSGD: about an eighth of fp32's buffer (scales included)
    assert simulated_numel(get_codec("qsgd:bits=4,bucket=512"), 1 << 20) < 0.14 * (1 << 20)


def test_simulated_in_bench_and_study(tmp_path: Path, capsys) -> None:
    path = tmp_path / "b.json"
    assert main(["bench", "allreduce", "--world-size", "2", "--backend", "gloo", "--sizes", "4K", "--codecs",
                 "qsgd:bits=4,bucket=512", "--algorithms", "simulated", "--reps", "2", "--quiet",
                 "--json", str(path)]) == 0
    out = capsys.readouterr().out
    assert "simulated (sim.)" in out and "the tensor is not reduced" in out
    rows = json.loads(path.read_text())["rows"]
    assert [r["algorithm"] for r in rows] == ["torch.distributed.all_reduce", "allreduce", "simulated"]  # torch's own row first
    # the study: a simulated run beside the real one, labelled, out of the accuracy tables
    res = tmp_path / "res"
    assert main(["study", "--preset", "smoke", "--no-progress", "--out", str(res),
                 "--algorithms", "scatter_gather", "simulated"]) == 0
    runs = [r for r in ResultStore(res).rows() if r["kind"] == "run"]
    assert sorted(r["config"]["algorithm"] for r in runs) == ["allreduce", "scatter_gather", "simulated"]
    html = (res / "report" / "index.html").read_text()
    assert "NCCL simulated" in html and "leave the gradients unreduced" in html
    from lowbit.lab.study.report import accuracy_matches, load_runs

    matched = accuracy_matches(load_runs(res)[0])
    assert matched and not any("simulated" in m["label"] for m in matched)
