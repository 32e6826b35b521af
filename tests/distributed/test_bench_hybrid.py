"""benchmarks/bench_hybrid.py under torchrun on gloo: 2 ranks, the small CNN as a hybrid (features
data-parallel, classifier model-parallel), and Dettmers' model measured and set beside the runs."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
D8 = "dettmers:type=dynamic,bucket=0"


CONFIGS = f"dp:ddp;hybrid[s=1]:fp32;hybrid[s=1]:{D8};hybrid[s=2]:{D8};hybrid[s=1,pair=1]:{D8}"


def _args(tmp_path: Path) -> list[str]:
    return ["--device", "cpu", "--models", "small_cnn", "--configs", CONFIGS, "--batch", "8", "--warmup", "1",
            "--steps", "2", "--rounds", "1", "--out", str(tmp_path / "hybrid.json"),
            "--profile", str(tmp_path / "prof"), "--profile-config", f"hybrid[s=1,pair=1]:{D8}"]


def test_bench_hybrid_in_spawned_ranks(tmp_path: Path, monkeypatch) -> None:
    """Fast equivalent of test_bench_hybrid_with_dettmers_model_cpu (slow): the same arguments and checks,
    with bench_hybrid's main() run in 2 spawned ranks that carry torchrun's environment (no torchrun, no
    fresh interpreters) on the reference kernels."""
    from tests.distributed.test_bench_ddp import run_bench_in_spawned_ranks

    run_bench_in_spawned_ranks("bench_hybrid", _args(tmp_path), monkeypatch)
    _check_doc(tmp_path)


@pytest.mark.slow
def test_bench_hybrid_with_dettmers_model_cpu(tmp_path: Path) -> None:
    """Fast equivalent: test_bench_hybrid_in_spawned_ranks."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1", "--nproc-per-node", "2",
           str(ROOT / "benchmarks" / "bench_hybrid.py"), *_args(tmp_path)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    _check_doc(tmp_path)


def _check_doc(tmp_path: Path) -> None:
    configs = CONFIGS
    doc = json.loads((tmp_path / "hybrid.json").read_text())
    assert doc["errors"] == []
    res = doc["results"]["small_cnn"]
    cfgs = res["configs"]
    assert set(cfgs) == set(configs.split(";"))
    assert all(c["samples_per_s"] > 0 for c in cfgs.values())
    # 8-bit activations cross in fewer bytes than fp32 ones (counted from the buffers sent)
    assert 0 < cfgs[f"hybrid[s=1]:{D8}"]["activation_bytes_per_step"] < cfgs["hybrid[s=1]:fp32"]["activation_bytes_per_step"]
    ph = res["dettmers"]
    assert sorted(ph["p_fc_ms"]) == sorted(["fp32", D8])
    for spec in ("fp32", D8):
        t = ph["transfers_ms"][spec]
        assert {"labels", "features", "fc1_gather", "features_grad"} <= set(t) and all(v > 0 for v in t.values())
        assert math.isclose(ph["p_fc_ms"][spec], sum(t.values()))
        step = ph["t_total_ms"] - ph["t_fc_ms"] + ph["p_conv_ms"] + ph["k_t_fc_par_ms"] + ph["p_fc_ms"][spec]
        assert math.isclose(ph["predicted"][spec]["step_ms"], step)
        assert math.isclose(ph["predicted"][spec]["samples_per_s"], 2 * 8 / step * 1e3)
    # the prediction sits beside the one-sub-batch hybrids only, with its error
    for cfg in ("hybrid[s=1]:fp32", f"hybrid[s=1]:{D8}"):
        c = cfgs[cfg]
        assert math.isclose(c["dettmers_error"], c["samples_per_s"] / c["dettmers_predicted_samples_per_s"] - 1)
    assert "dettmers_predicted_samples_per_s" not in cfgs[f"hybrid[s=2]:{D8}"]
    # pair=1 reaches the hybrid (small_cnn's classifier is one Linear: nothing to pair, the same bytes; the
    # saving on a chain of layers is tested in test_parallel.py) and gets no Dettmers prediction (his
    # model is the unpaired split)
    paired = cfgs[f"hybrid[s=1,pair=1]:{D8}"]
    assert paired["activation_bytes_per_step"] == cfgs[f"hybrid[s=1]:{D8}"]["activation_bytes_per_step"]
    assert "dettmers_predicted_samples_per_s" not in paired
    # --profile: rank 0's trace and table of the one config asked for (the 5th of --configs)
    assert sorted(f.name for f in (tmp_path / "prof").iterdir()) == ["key_averages_small_cnn_4_rank0.txt",
                                                                      "trace_small_cnn_4_rank0.json"]


def test_parse_hybrid_takes_a_conv_hook_with_options() -> None:
    """``conv=`` may hold a lowbit hook with its own ``[...]`` options (the features' message size)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import bench_hybrid as H
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    cfg = f"hybrid[s=2,pair=1,graph=1,cap=1,conv=lowbit[mb=1]:qsgd:bits=8,bucket=512]:{D8}"
    assert H.parse_hybrid(cfg) == (2, "lowbit[mb=1]:qsgd:bits=8,bucket=512", D8, True, 1.0, True)
    assert H.parse_hybrid("hybrid:fp32") == (1, "ddp", "fp32", False, None, False)
    assert H.parse_hybrid("hybrid[s=1]fp32") is None
