"""A new codec is one file: ``tests/plugins/toy_codec.py`` (8-bit absmax per tensor), registered through
``LOWBIT_PLUGINS``, runs through ``lowbit.all_reduce``, the DDP hook, the study (in spawned workers) and
the speed model without a line of lowbit changed (issue 13 item 6, the codec half)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import lowbit
from lowbit.lab.cli import main
from lowbit.launch import spawn
from lowbit.lab.study.store import ResultStore

PLUGIN = "tests.plugins.toy_codec"


@pytest.fixture(autouse=True)
def _registries_restored():
    """Plugins registered here (toy8, toy_ring) leave the process's registries as they found them, so
    tests that run later in the same process see the built-ins only."""
    from lowbit.codecs import base as codec_base
    from lowbit.comm import allreduce as allreduce_mod

    saved = (dict(codec_base._REGISTRY), set(codec_base._PLUGINS_LOADED), dict(allreduce_mod._PLUGINS))
    yield
    for live, old in zip((codec_base._REGISTRY, codec_base._PLUGINS_LOADED, allreduce_mod._PLUGINS), saved):
        live.clear()
        live.update(old)
    for name in [m for m in sys.modules if m.startswith("tests.plugins.")]:
        del sys.modules[name]  # (imported again, a plugin registers again)


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
    from lowbit.lab.perfmodel.model import bits_per_value

    assert abs(bits_per_value("toy8") - 8.0) < 1e-3
    # a plugin that does not import is a clear error
    monkeypatch.setenv("LOWBIT_PLUGINS", "tests.plugins.no_such_module")
    with pytest.raises(ValueError, match="LOWBIT_PLUGINS"):
        lowbit.get_codec("toy8:")


# ------------------------------------------------------------------------------ the algorithm half
ALGORITHM_PLUGINS = "tests.plugins.toy_codec,tests.plugins.toy_algorithm"


def _algorithm_body(rank: int, world: int) -> dict:
    from tests.plugins import toy_algorithm

    codec = lowbit.get_codec("toy8")
    x = torch.randn(3000, generator=torch.Generator().manual_seed(rank))
    exact = x.clone()
    dist.all_reduce(exact)
    exact /= world
    out: dict = {}
    t, stats = x.clone(), lowbit.comm.CommStats()
    lowbit.all_reduce(t, codec, algorithm="toy_ring", op="mean", stats=stats)
    out["all_reduce"] = (t, float((t - exact).norm() / exact.norm()), stats.bytes_sent,
                         lowbit.comm.bytes_sent_per_rank(codec, 3000, world, "toy_ring", rank), toy_algorithm.CALLS)
    # with error feedback, through the async handle
    fb, t2 = lowbit.ErrorFeedback(codec), x.clone()
    lowbit.all_reduce(t2, codec, algorithm="toy_ring", op="mean", feedback=fb, async_op=True).wait()
    out["feedback"] = (t2, float((t2 - exact).norm() / exact.norm()), float(fb.residual("tensor", 3000, x.device).norm()))
    # the DDP hook, against plain DDP on the same model and data
    grads = {}
    for name in ("plain", "toy_ring"):
        torch.manual_seed(0)
        model = DDP(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)))
        if name == "toy_ring":
            calls = toy_algorithm.CALLS
            state = lowbit.ddp.register(model, codec="toy8", algorithm="toy_ring", start_iter=0)
        xb = torch.randn(8, 16, generator=torch.Generator().manual_seed(rank))
        yb = torch.randint(0, 4, (8,), generator=torch.Generator().manual_seed(rank))
        nn.functional.cross_entropy(model(xb), yb).backward()
        grads[name] = [p.grad.clone() for p in model.parameters()]
    out["ddp"] = (grads, state.stats.bytes_sent, toy_algorithm.CALLS - calls)
    return out


def test_an_algorithm_from_its_own_file(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A new algorithm is one registry entry, in tests/plugins/toy_algorithm.py (named in LOWBIT_PLUGINS):
    lowbit.all_reduce, the DDP hook, the study (spawned workers) and the speed model run it, and every
    layer lists it (issue 13 item 6, the algorithm half)."""
    from lowbit.comm.allreduce import algorithm_choices, get_algorithm
    from lowbit.lab.perfmodel import Cluster, predict_network
    from lowbit.lab.perfmodel.collectives import modeled_algorithms
    from lowbit.lab.study.config import StudyConfig

    monkeypatch.setenv("LOWBIT_PLUGINS", ALGORITHM_PLUGINS)
    assert "toy_ring" in algorithm_choices() and "toy_ring" in modeled_algorithms(quantised=True)
    assert get_algorithm("toy_ring").cost is not None
    # an unregistered name is a clear error that names the known algorithms, at every layer
    for call in (lambda: lowbit.all_reduce(torch.ones(4), "toy8", algorithm="no_such_ring"),
                 lambda: get_algorithm("no_such_ring"),
                 lambda: StudyConfig(algorithms=("no_such_ring",)),
                 lambda: predict_network("resnet50", Cluster(4, 4), batch_per_gpu=8, device_tflops=50,
                                         codec="toy8", algorithm="no_such_ring")):
        with pytest.raises(ValueError, match=r"no_such_ring.*(scatter_gather.*toy_ring|toy_ring.*scatter_gather)"):
            call()
    r0, r1 = spawn(_algorithm_body, 2, backend="gloo")
    # lowbit.all_reduce: the same bits on every rank, within toy8's error of the exact mean, the bytes of
    # its own formula (not allgather's: those pad to 16-byte slots), and the plugin's start ran
    t, err, sent, want, calls = r0["all_reduce"]
    assert torch.equal(t, r1["all_reduce"][0]) and err < 0.02, err
    assert sent == want == (2 - 1) * (4 + 3000) and calls == 1, (sent, want, calls)
    assert torch.equal(r0["feedback"][0], r1["feedback"][0]) and r0["feedback"][1] < 0.02
    assert r0["feedback"][2] > 0  # the residual holds what toy8 did not send
    # the DDP hook: gradients agree across ranks and stay near plain DDP's; the plugin carried them
    for r in (r0, r1):
        grads, sent, calls = r["ddp"]
        assert calls >= 1 and sent > 0, (calls, sent)
        for g, ref in zip(grads["toy_ring"], grads["plain"]):
            assert float((g - ref).norm() / ref.norm().clamp_min(1e-12)) < 0.05
    assert all(torch.equal(a, b) for a, b in zip(r0["ddp"][0]["toy_ring"], r1["ddp"][0]["toy_ring"]))
    # the study, in its own spawned workers
    out = tmp_path / "res"
    assert main(["study", "--preset", "smoke", "--no-progress", "--out", str(out), "--codecs", "toy8",
                 "--algorithms", "toy_ring"]) == 0
    runs = [r for r in ResultStore(out).rows() if r["kind"] == "run"]
    assert [r["config"]["algorithm"] for r in runs] == ["toy_ring"], [r["config"] for r in runs]
    assert runs[0]["summary"]["bytes_per_step_per_rank"] > 0 and 0 <= runs[0]["summary"]["final_test_acc"]
    # the speed model: the plugin's cost (a ring all-gather, as allgather's) and work (one encode, K decodes)
    cluster = Cluster(4, 4, "nvlink")
    kw = dict(batch_per_gpu=32, device_tflops=50, codec="toy8", encode_Bps=2e10, decode_Bps=2e10)
    toy = predict_network("resnet50", cluster, algorithm="toy_ring", **kw)
    ag = predict_network("resnet50", cluster, algorithm="allgather", **kw)
    sg = predict_network("resnet50", cluster, algorithm="scatter_gather", **kw)
    assert toy.algorithm == "toy_ring" and toy.step_s == ag.step_s and toy.bytes_per_rank == ag.bytes_per_rank
    assert toy.bytes_per_rank > sg.bytes_per_rank  # (K-1) payloads against ~2
    assert main(["predict", "--network", "resnet50", "--gpus", "4", "--gpus-per-node", "4", "--codec", "toy8",
                 "--algorithm", "toy_ring", "--json"]) == 0
