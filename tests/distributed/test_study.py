"""`lowbit study` / `lowbit report` end to end on gloo: rows, report, resume after a crash, bad configs.

Cost (issue 31 item 7): a study group's workers fork from the test forkserver, which has not imported
scikit-learn (the digits data) or numba (the CPU kernels): each costs ~2 s of CPU per rank. The default
run keeps one real end-to-end study (digits, numba, report, TensorBoard: the crash/resume test) and runs
every other feature as a fast equivalent on FAST data: synthetic inputs of the network's shape, the
reference kernels, one run or two, no report where the report is not what is tested. The full versions,
on digits with numba and the report, are marked slow (``make test-slow``).
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lowbit.lab.cli import main
from lowbit.lab.study.report import accuracy_matches, load_runs
from lowbit.lab.study.runner import CRASH_ENV
from lowbit.lab.study.store import ResultStore

SMOKE = ["study", "--preset", "smoke", "--no-progress"]
# fast equivalents: synthetic inputs shaped for the network (no scikit-learn in the workers): 64 samples,
# in batches of 8 so that a 2-rank epoch has 4 steps (the first 2 are fp32: start_iter)
FAST = ["--datasets", "synthetic", "--batch-sizes", "8"]


@pytest.fixture
def reference_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    """The torch reference kernels in the workers (no numba import and cache load: ~2 s a rank)."""
    monkeypatch.setenv("LOWBIT_KERNELS", "reference")


def _rows(path: Path, kind: str) -> list[dict]:
    return [r for r in ResultStore(path).rows() if r["kind"] == kind]


def test_study_crash_resume_and_report_fast(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys,
                                           reference_kernels) -> None:
    """Fast equivalent of test_study_crash_resume_and_report (slow): the same crash, resume, rerun, dry
    run, TensorBoard log and report, with the same checks, on the smoke preset pointed at CIFAR-10 files
    written here (real data without scikit-learn in the workers; batches of 16) with the reference kernels."""
    from tests.unit.test_ondisk_data import write_cifar

    write_cifar(tmp_path / "cifar-10-batches-py", per_batch=40, n_test=40)
    cfg = tmp_path / "smoke_cifar.toml"
    cfg.write_text(f"""extends = "smoke"
datasets = ["cifar10"]
batch_sizes = [16]
[dataset_args.cifar10]
data_dir = "{tmp_path}"
""")
    _crash_resume_and_report(tmp_path, monkeypatch, capsys, ["study", "--config", str(cfg)], "cifar10", 16)


@pytest.mark.slow
def test_study_crash_resume_and_report(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    """The smoke preset as a user runs it: digits, numba's kernels. Fast equivalent:
    test_study_crash_resume_and_report_fast."""
    _crash_resume_and_report(tmp_path, monkeypatch, capsys, ["study", "--preset", "smoke"], "digits", 16)


def _crash_resume_and_report(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys, study: list[str],
                             dataset: str, batch: int) -> None:
    out = tmp_path / "res"
    # 1. A crash injected after the first finished run: the study stops, the run is saved.
    monkeypatch.setenv(CRASH_ENV, "1")
    assert main([*study, "--no-progress", "--out", str(out)]) == 1
    assert "rerun the same command to resume" in capsys.readouterr().err
    first = _rows(out, "run")
    assert len(first) == 1
    assert len(_rows(out, "epoch")) == 1

    # 2. Rerun (no crash): only the missing run runs; the finished one is kept, not repeated.
    monkeypatch.delenv(CRASH_ENV)
    tb = tmp_path / "tb"
    assert main([*study, "--out", str(out), "--tensorboard", str(tb)]) == 0  # progress bar
    # the run that ran now logged its epoch to TensorBoard, live (one directory per run, named readably)
    logged = [d for d in tb.iterdir() if any(d.glob("events.out.tfevents.*"))]
    assert len(logged) == 1 and logged[0].name.startswith(f"small_cnn_{dataset}_QSGD"), logged
    text = capsys.readouterr().out
    assert "1 run(s) done, 1 already there" in text and "report:" in text
    runs = _rows(out, "run")
    assert len(runs) == 2 and runs[0] == first[0]
    assert {r["config"]["codec"].split(":")[0] for r in runs} == {"fp32", "qsgd"}
    for r in runs:
        s, ep = r["summary"], r["epochs"][0]
        assert r["config"]["world_size"] == 2 and len(r["epochs"]) == 1
        assert s["samples_per_s"] > 0 and 0.0 <= s["final_test_acc"] <= 1.0 and s["final_train_loss"] > 0
        if dataset == "digits":  # a first try learns: well above chance (10 %) in one epoch
            assert s["final_test_acc"] > 0.5, s["final_test_acc"]
        assert ep["bytes_sent_per_rank"] > 0 and ep["train_s"] > 0
        assert abs(ep["compute_s"] + ep["exposed_comm_s"] - ep["train_s"]) < 1e-9
        assert ep["comm_s"] > 0 and ep["samples"] == ep["steps"] * batch * 2
    by = {r["config"]["codec"].split(":")[0]: r for r in runs}
    # 4-bit QSGD puts far fewer bytes on the wire than fp32
    assert by["qsgd"]["summary"]["bytes_per_step_per_rank"] < 0.5 * by["fp32"]["summary"]["bytes_per_step_per_rank"]
    assert by["qsgd"]["summary"]["compressed_fraction"] > 0.9

    # 3. Rerun again: nothing left to do, nothing appended.
    size = (out / "results.jsonl").stat().st_size
    assert main([*study, "--no-progress", "--out", str(out), "--no-report"]) == 0
    assert "0 run(s) done, 2 already there" in capsys.readouterr().out
    assert (out / "results.jsonl").stat().st_size == size
    # ... and the dry run lists both as done
    assert main([*study, "--no-progress", "--out", str(out), "--dry-run"]) == 0
    listing = capsys.readouterr().out
    assert listing.count("  done  ") == 2 and "todo" not in listing

    # 4. The report: HTML with PNGs beside it, every referenced image present.
    index = out / "report" / "index.html"
    html = index.read_text()
    pngs = sorted(p.name for p in index.parent.glob("*.png"))
    assert "fig5_accuracy.png" in pngs and "fig6_9_time_breakdown.png" in pngs
    for name in pngs:
        assert f"src='{name}'" in html
        assert (index.parent / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "Which codecs match fp32" in html
    # ... and the same runs as CSV tables beside it
    import csv

    with open(index.parent / "runs.csv", newline="") as f:
        table = list(csv.DictReader(f))
    assert sorted(r["key"] for r in table) == sorted(r["key"] for r in runs)
    assert all(float(r["samples_per_s"]) > 0 and r["world_size"] == "2" for r in table)
    with open(index.parent / "epochs.csv", newline="") as f:
        assert len(list(csv.DictReader(f))) == 2


def _check_links(r: dict) -> None:
    links = r["env"]["links"]
    assert links["nodes"] == r["config"]["nodes"] and links["world_GBps"] > 0
    if r["config"]["nodes"] == 2:
        assert links["intra_GBps"] > 0 and links["inter_GBps"] > 0
        assert links["env"]["LOWBIT_NODE_SIZE"] == "2" and links["env"]["NCCL_HOSTID"] == "node0"
    assert 0 <= r["summary"]["final_test_acc"] <= 1


def test_study_with_emulated_nodes_fast(tmp_path: Path, capsys, reference_kernels) -> None:
    """Fast equivalent of test_study_with_emulated_nodes (slow): the same dry-run listing of the 4-run
    grid, then one run of it, hierarchical on 2 emulated nodes of 2 (synthetic data, reference kernels):
    the row records the links inside and between the nodes, and the node layout in its config."""
    out = tmp_path / "res"
    grid = ["study", "--preset", "smoke", "--no-progress", "--no-report", "--out", str(out), "--world-sizes", "4",
            "--codecs", "qsgd:bits=4,bucket=512"]
    assert main([*grid, "--emulate-nodes", "1", "2", "--algorithms", "scatter_gather", "hierarchical",
                 "--dry-run"]) == 0
    listing = capsys.readouterr().out
    assert listing.count("(2 nodes)") == 2 and listing.count("todo") == 4
    assert main([*grid, *FAST, "--emulate-nodes", "2", "--algorithms", "hierarchical"]) == 0
    (run,) = _rows(out, "run")
    assert (run["config"]["nodes"], run["config"]["algorithm"]) == (2, "hierarchical")
    _check_links(run)
    assert run["summary"]["bytes_per_step_per_rank"] > 0


@pytest.mark.slow
def test_study_with_emulated_nodes(tmp_path: Path, capsys) -> None:
    """--emulate-nodes 1 2 at 4 workers: each run as one node and as 2 emulated nodes of 2, with the
    hierarchical algorithm beside the flat one; every row records the links its group measured.
    Fast equivalent in the default run: test_study_with_emulated_nodes_fast (one 2-node run)."""
    out = tmp_path / "res"
    args = ["study", "--preset", "smoke", "--no-progress", "--no-report", "--out", str(out), "--world-sizes", "4",
            "--emulate-nodes", "1", "2", "--codecs", "qsgd:bits=4,bucket=512",
            "--algorithms", "scatter_gather", "hierarchical"]
    assert main([*args, "--dry-run"]) == 0
    listing = capsys.readouterr().out
    assert listing.count("(2 nodes)") == 2 and listing.count("todo") == 4
    assert main(args) == 0
    runs = _rows(out, "run")
    assert sorted((r["config"]["nodes"], r["config"]["algorithm"]) for r in runs) == [
        (1, "hierarchical"), (1, "scatter_gather"), (2, "hierarchical"), (2, "scatter_gather")]
    for r in runs:
        _check_links(r)
    # one node: the "hierarchical" run compresses nothing, so it sends more than the flat 4-bit run
    by = {(r["config"]["nodes"], r["config"]["algorithm"]): r["summary"]["bytes_per_step_per_rank"] for r in runs}
    assert by[(1, "hierarchical")] > by[(1, "scatter_gather")]
    # a run as one node keeps the key it had before nodes existed
    from lowbit.lab.study.runs import RunConfig

    one = next(r for r in runs if r["config"]["nodes"] == 1)
    cfg = dict(one["config"])
    cfg.pop("nodes")
    assert RunConfig.from_dict(cfg).key() == one["key"]


def _cifar_study(tmp_path: Path, codecs: list[str]) -> Path:
    from tests.unit.test_ondisk_data import write_cifar

    write_cifar(tmp_path / "cifar-10-batches-py", per_batch=40, n_test=40)
    cfg = tmp_path / "c.toml"
    cfg.write_text(f"""networks = ["small_cnn"]
datasets = ["cifar10"]
codecs = {codecs!r}
world_sizes = [2]
batch_sizes = [16]
epochs = 1
[dataset_args.cifar10]
data_dir = "{tmp_path}"
""".replace("'", '"'))
    return cfg


def test_study_on_cifar10_files_fast(tmp_path: Path, reference_kernels) -> None:
    """Fast equivalent of test_study_on_cifar10_files (slow): the same CIFAR-10 files and config with one
    codec (8-bit QSGD, reference kernels) and no report; the row names the data and its sizes."""
    out = tmp_path / "res"
    cfg = _cifar_study(tmp_path, ["qsgd:bits=8,bucket=512"])
    assert main(["study", "--config", str(cfg), "--no-progress", "--no-report", "--out", str(out)]) == 0
    (run,) = _rows(out, "run")
    assert "CIFAR-10" in run["labels"]["data"]
    assert run["summary"]["n_train"] == 200 and run["summary"]["n_test"] == 40


@pytest.mark.slow
def test_study_on_cifar10_files(tmp_path: Path) -> None:
    """The study pointed at CIFAR-10 python batches on disk (written here in that format): small_cnn,
    fp32 vs 8-bit QSGD, 2 workers; rows name the data. Fast equivalent: test_study_on_cifar10_files_fast."""
    cfg = _cifar_study(tmp_path, ["fp32", "qsgd:bits=8,bucket=512"])
    out = tmp_path / "res"
    assert main(["study", "--config", str(cfg), "--no-progress", "--out", str(out)]) == 0
    runs = _rows(out, "run")
    assert len(runs) == 2 and all("CIFAR-10" in r["labels"]["data"] for r in runs)
    assert all(r["summary"]["n_train"] == 200 and r["summary"]["n_test"] == 40 for r in runs)
    assert (out / "report" / "index.html").exists()


@pytest.mark.parametrize("optimizer", [pytest.param("rmsprop", marks=pytest.mark.slow), "adam"])
def test_study_optimizers_and_top5_fast(tmp_path: Path, optimizer: str, reference_kernels) -> None:
    """Fast equivalent of test_study_optimizers_and_top5 (slow): the same optimizer and checks on
    synthetic inputs (64 samples; the training loss still falls) with the reference kernels; adam in the
    default run, rmsprop (the same path through make_optimizer) with the slow tests."""
    _optimizer_study(tmp_path, optimizer, FAST)


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", ["rmsprop", "adam"])
def test_study_optimizers_and_top5(tmp_path: Path, optimizer: str) -> None:
    """On digits with numba. Fast equivalent: test_study_optimizers_and_top5_fast."""
    _optimizer_study(tmp_path, optimizer, [])


def _optimizer_study(tmp_path: Path, optimizer: str, extra: list[str]) -> None:
    out = tmp_path / "res"
    assert main([*SMOKE, "--out", str(out), "--no-report", "--codecs", "qsgd:bits=8,bucket=512",
                 "--optimizer", optimizer, "--lr", "0.003", "--epochs", "3", *extra]) == 0
    (run,) = _rows(out, "run")
    assert run["config"]["optimizer"] == optimizer
    s = run["summary"]
    assert 0 <= s["final_test_acc"] <= s["final_test_top5"] <= 1  # 10 classes: top-5 is measured
    losses = [e["train_loss"] for e in run["epochs"]]
    assert losses[-1] < losses[0]  # it trains


def test_study_layer_type_sensitivity_fast(tmp_path: Path, reference_kernels) -> None:
    """Fast equivalent of test_study_layer_type_sensitivity (slow): the same config and checks on
    synthetic inputs with the reference kernels and no report."""
    _layer_type_study(tmp_path, "synthetic", FAST[2:] + ["--no-report"])


@pytest.mark.slow
def test_study_layer_type_sensitivity(tmp_path: Path) -> None:
    """The seed's conv-vs-fc experiment from a config: 2-bit QSGD everywhere, and with the conv layers
    kept at fp32; the policy reaches the hook (fewer bytes compressed), the label and the key.
    Fast equivalent: test_study_layer_type_sensitivity_fast."""
    _layer_type_study(tmp_path, "digits", [])


def _layer_type_study(tmp_path: Path, dataset: str, extra: list[str]) -> None:
    cfg = tmp_path / "s.toml"
    cfg.write_text(f"""networks = ["small_cnn"]
datasets = ["{dataset}"]
codecs = ["qsgd:bits=2,bucket=128"]
policies = [{{}}, {{by_type = {{Conv2d = "fp32"}}}}]
world_sizes = [2]
epochs = 1
max_train_samples = 200
max_test_samples = 100
""")
    out = tmp_path / "res"
    assert main(["study", "--config", str(cfg), "--no-progress", "--out", str(out), *extra]) == 0
    runs = {bool(r["config"]["policy"]): r for r in _rows(out, "run")}
    assert set(runs) == {False, True}
    mixed, plain = runs[True], runs[False]
    assert mixed["config"]["policy"] == {"by_type": {"Conv2d": "fp32"}}
    assert mixed["summary"]["compressed_fraction"] < plain["summary"]["compressed_fraction"]
    assert mixed["summary"]["bytes_per_step_per_rank"] > plain["summary"]["bytes_per_step_per_rank"]
    from lowbit.lab.study.report import load_runs

    labels = sorted(r["label"] for r in load_runs(out)[0])
    assert labels == ["QSGD 2bit/128", "QSGD 2bit/128 [Conv2d 32bit]"]
    bad = tmp_path / "bad.toml"
    bad.write_text('policies = [{by_kind = {Conv2d = "fp32"}}]\n')
    assert main(["study", "--config", str(bad), "--out", str(out)]) == 2


def test_bad_config_fails_before_any_run(tmp_path: Path, capsys) -> None:
    out = tmp_path / "res"
    bad = tmp_path / "bad.toml"
    bad.write_text('networks = ["small_cnn"]\ncodecs = ["fp32", "qsgd:bits=99"]\n')
    assert main(["study", "--config", str(bad), "--out", str(out)]) == 2
    assert "codecs" in capsys.readouterr().err
    bad.write_text('networks = ["lstm"]\ndatasets = ["digits"]\n')   # cannot take 8x8 images
    assert main(["study", "--config", str(bad), "--out", str(out)]) == 2
    assert "lstm" in capsys.readouterr().err
    assert main(["study", "--preset", "smoke", "--codecs", "fp32", "nonsense", "--out", str(out)]) == 2
    assert "nonsense" in capsys.readouterr().err
    assert main(["study", "--preset", "smoke", "--world-sizes", "4", "--emulate-nodes", "3", "--out", str(out)]) == 2
    assert "no world size in [4] splits into nodes [3]" in capsys.readouterr().err
    assert not out.exists()
    assert main(["report", str(tmp_path / "nothing")]) == 2


def _as_torchrun_rank(rank: int, world: int, port: int, argv: list[str]) -> int:
    """A spawned rank that drops the group spawn made and runs `lowbit study` as a torchrun rank would:
    RANK / WORLD_SIZE / MASTER_* in the environment, the group made from them by the study."""
    import torch.distributed as dist

    dist.destroy_process_group()  # (lowbit.launch's shutdown then finds none to tear down)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    return main(argv)


def test_torchrun_launch_fast(tmp_path: Path, reference_kernels) -> None:
    """Fast equivalent of test_torchrun_launch (slow): the same `lowbit study --launcher torchrun` path in
    2 spawned ranks that carry torchrun's environment (no torchrun and no fresh interpreters), on
    synthetic data: rank 0 writes the one row, marked as launched by torchrun."""
    import socket

    from lowbit.launch import spawn

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "res"
    argv = ["study", "--preset", "smoke", "--codecs", "fp32", *FAST, "--out", str(out), "--no-progress",
            "--no-report", "--launcher", "torchrun"]
    assert spawn(_as_torchrun_rank, 2, port, argv, backend="gloo", timeout_s=120) == [0, 0]
    runs = _rows(out, "run")
    assert len(runs) == 1 and runs[0]["env"]["launcher"] == "torchrun"


@pytest.mark.slow
def test_torchrun_launch(tmp_path: Path) -> None:
    """The same study under torchrun (2 local ranks): rank 0 writes the rows and the report.
    Fast equivalent: test_torchrun_launch_fast (spawned ranks with torchrun's environment)."""
    out = tmp_path / "res"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[2] / "src"), os.environ.get("PYTHONPATH", "")])}
    env.pop(CRASH_ENV, None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1", "--nproc-per-node", "2",
           "-m", "lowbit", "study", "--preset", "smoke", "--codecs", "fp32",
           "--out", str(out), "--no-progress", "--no-report"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    runs = _rows(out, "run")
    assert len(runs) == 1 and runs[0]["env"]["launcher"] == "torchrun"


# ------------------------------------------------------------------------------------ report logic
def _fake_rows(tmp_path: Path) -> Path:
    """Rows of a 3-seed study at 1 and 2 workers (numbers made up), built from one real-looking row."""
    template = {
        "kind": "run", "schema": 1, "attempt": "x", "study": "fake",
        "config": {"network": "small_cnn", "dataset": "digits", "codec": "fp32", "algorithm": "allreduce",
                   "error_feedback": False, "world_size": 2, "backend": "gloo", "device": "cpu", "batch_size": 32,
                   "epochs": 2, "seed": 0, "lr": 0.1, "momentum": 0.9, "weight_decay": 0.0, "lr_schedule": "cosine",
                   "optimizer": "sgd", "threads_per_worker": 1, "max_train_samples": 0, "max_test_samples": 0,
                   "max_steps_per_epoch": 0, "start_iter": 2, "model_args": {}, "dataset_args": {}, "batch_preset": ""},
        "labels": {"synthetic": False, "data": "digits", "task": "classify"},
        "env": {"cpu": "test", "loadavg_at_start": [1.0, 1.0, 1.0]},
        "summary": {"samples_per_s": 1000.0, "final_test_acc": 0.95, "comm_comp_ratio": 1.3, "train_s": 2.0,
                    "epoch_exposed_comm_s": 0.2, "epoch_compute_s": 0.8, "epoch_encode_s": 0.01, "epoch_comm_s": 0.1,
                    "epoch_decode_s": 0.01, "epoch_train_s": 1.0, "bytes_per_step_per_rank": 1e5,
                    "compressed_fraction": 0.99},
        "epochs": [{"epoch": 1, "test_acc": 0.9, "train_loss": 0.5}, {"epoch": 2, "test_acc": 0.95, "train_loss": 0.2}],
    }
    store = ResultStore(tmp_path)
    # accuracy by codec and seed: 8-bit within 0.5 points, 2-bit about 1 point lower
    acc = {"fp32": [0.950, 0.955, 0.945], "qsgd:bits=8,bucket=512": [0.952, 0.953, 0.946],
           "qsgd:bits=2,bucket=128": [0.940, 0.944, 0.936]}
    i = 0
    for codec, accs in acc.items():
        for seed, a in enumerate(accs):
            row = copy.deepcopy(template)
            row["config"].update(codec=codec, seed=seed, algorithm="allreduce" if codec == "fp32" else "scatter_gather")
            row["summary"].update(final_test_acc=a, samples_per_s=1000.0 if codec == "fp32" else 1200.0)
            row["key"] = f"k{i}"
            i += 1
            store.append(row)
    for seed in range(3):  # the 1-worker baseline
        row = copy.deepcopy(template)
        row["config"].update(world_size=1, algorithm="none", seed=seed)
        row["summary"].update(samples_per_s=600.0)
        row["key"] = f"k{i}"
        i += 1
        store.append(row)
    # a synthetic throughput row of a seed network: reported for speed, never for accuracy
    row = copy.deepcopy(template)
    row["config"].update(network="resnet110", dataset="synthetic")
    row["labels"]["synthetic"] = True
    row["key"] = "syn"
    store.append(row)
    return store.path


def test_report_verdicts_on_made_up_rows(tmp_path: Path) -> None:
    """Fast equivalent of test_report_logic_on_made_up_rows (slow): the same verdicts from the same rows,
    without drawing the report (~3 s of matplotlib; the crash/resume test draws one)."""
    _check_verdicts(_fake_rows(tmp_path))


@pytest.mark.slow
def test_report_logic_on_made_up_rows(tmp_path: Path) -> None:
    """Verdicts and the drawn report. Fast equivalent: test_report_verdicts_on_made_up_rows."""
    path = _fake_rows(tmp_path)
    _check_verdicts(path)
    assert main(["report", str(path), "--out", str(tmp_path / "rep"), "--price-per-gpu-hour", "1"]) == 0
    index = tmp_path / "rep" / "index.html"
    html = index.read_text()
    names = {p.name for p in index.parent.glob("*.png")}
    assert {"fig12_15_scalability.png", "fig16_speedup_ratio.png", "fig16_price_accuracy.png"} <= names
    assert "SYNTHETIC" in html and "[seed 555.0]" in html   # ResNet-110, 32bit, 2 GPUs, Figure 10


def _check_verdicts(path: Path) -> None:
    runs, _ = load_runs(path)
    rows = {r["label"]: r for r in accuracy_matches(runs)}
    assert all(r["dataset"] != "synthetic" for r in rows.values())
    assert rows["32bit"]["verdict"] == "baseline"
    assert rows["QSGD 8bit/512"]["verdict"] == "matches" and rows["QSGD 8bit/512"]["n_pairs"] == 3
    assert rows["QSGD 2bit/128"]["verdict"] == "does not match"
    assert abs(rows["QSGD 2bit/128"]["diff_mean"] * 100 - (-1.0)) < 1e-6


def _parallel_args(out: Path, parallelism: list[str], epochs: str) -> list[str]:
    return ["study", "--preset", "smoke", "--no-progress", "--out", str(out), "--networks", "mlp", "small_cnn",
            "--codecs", "fp32", "dettmers:type=dynamic,bucket=0", "--parallelism", *parallelism,
            "--sub-batches", "2", "--epochs", epochs]


def _check_parallel_runs(runs: dict) -> None:
    for (net, codec, par), r in runs.items():
        s = r["summary"]
        assert 0 <= s["final_test_acc"] <= 1 and not s["diverged"], (net, codec, par)
        assert s["bytes_per_step_per_rank"] > 0, (net, codec, par)
        assert r["config"]["sub_batches"] == (2 if par == "hybrid" else 1)
    # the activations' codec shrinks what crosses in model parallelism (8 bits vs fp32)
    m32 = runs[("mlp", "fp32", "model")]["summary"]["bytes_per_step_per_rank"]
    m8 = runs[("mlp", "dettmers:type=dynamic", "model")]["summary"]["bytes_per_step_per_rank"]
    assert m8 < 0.3 * m32


def _parallel_rows(out: Path) -> dict:
    return {(r["config"]["network"], r["config"]["codec"].split(",")[0], r["config"]["parallelism"]): r
            for r in _rows(out, "run")}


def test_study_with_model_and_hybrid_parallelism_fast(tmp_path: Path, capsys, reference_kernels) -> None:
    """Fast equivalent of test_study_with_model_and_hybrid_parallelism (slow): the same dry-run listing of
    the grid, then its model and hybrid runs only (mlp model-parallel, small_cnn hybrid with 2
    sub-batches; fp32 and Dettmers' 8 bits) for 1 epoch on synthetic data with the reference kernels, no
    report: the rows say which parallelism, and 8-bit activations cross in fewer bytes."""
    out = tmp_path / "res"
    assert main([*_parallel_args(out, ["data", "model", "hybrid"], "2"), "--dry-run"]) == 0
    listing = capsys.readouterr().out
    assert listing.count(" model ") == 2 and listing.count(" hybrid/2 ") == 2  # mlp: model; small_cnn: hybrid
    assert main([*_parallel_args(out, ["model", "hybrid"], "1"), *FAST, "--no-report"]) == 0
    runs = _parallel_rows(out)
    assert sorted(runs) == [("mlp", "dettmers:type=dynamic", "model"), ("mlp", "fp32", "model"),
                            ("small_cnn", "dettmers:type=dynamic", "hybrid"), ("small_cnn", "fp32", "hybrid")]
    _check_parallel_runs(runs)


@pytest.mark.slow
def test_study_with_model_and_hybrid_parallelism(tmp_path: Path, capsys) -> None:
    """--parallelism data model hybrid: mlp splits model-parallel, small_cnn hybrid (2 sub-batches); rows
    say which, count the activations' bytes, and the report labels them.
    Fast equivalent: test_study_with_model_and_hybrid_parallelism_fast (the model and hybrid runs)."""
    out = tmp_path / "res"
    args = _parallel_args(out, ["data", "model", "hybrid"], "2")
    assert main([*args, "--dry-run"]) == 0
    listing = capsys.readouterr().out
    assert listing.count(" model ") == 2 and listing.count(" hybrid/2 ") == 2  # mlp: model; small_cnn: hybrid
    assert main(args) == 0
    runs = _parallel_rows(out)
    assert len(runs) == 8
    _check_parallel_runs(runs)
    # model parallelism trains as well as data parallelism here (same global batch, same recipe)
    assert abs(runs[("mlp", "fp32", "model")]["summary"]["final_test_acc"]
               - runs[("mlp", "fp32", "data")]["summary"]["final_test_acc"]) < 0.1
    html = (out / "report" / "index.html").read_text()
    assert "[model]" in html and "[hybrid, 2 sub-batches]" in html
    # a data-parallel run keeps the key it had before parallelism existed
    from lowbit.lab.study.runs import RunConfig

    one = runs[("mlp", "fp32", "data")]
    cfg = dict(one["config"])
    cfg.pop("parallelism"), cfg.pop("sub_batches")
    assert RunConfig.from_dict(cfg).key() == one["key"]
