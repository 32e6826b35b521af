"""`lowbit bench allreduce`: a 2-rank gloo smoke run and argument validation (no processes for bad input)."""

from __future__ import annotations

import json

import pytest

from lowbit.lab.cli import main
from lowbit.codecs.base import get_codec
from lowbit.comm.allreduce import bytes_sent_per_rank
from lowbit.lab.cli.bench import parse_codecs, parse_sizes


def test_bench_allreduce_smoke(tmp_path, capsys):
    path = tmp_path / "b.json"
    rc = main(["bench", "allreduce", "--world-size", "2", "--backend", "gloo", "--sizes", "4K",
               "--codecs", "fp32", "--codecs", "qsgd:bits=8", "--algorithms", "scatter_gather,allreduce",
               "--reps", "2", "--quiet", "--json", str(path)])
    assert rc == 0
    out = capsys.readouterr().out
    assert out.rstrip().splitlines()[-1].startswith("4K")  # the table comes last

    doc = json.loads(path.read_text())
    meta, rows = doc["meta"], doc["rows"]
    assert meta["backend"] == "gloo" and meta["world_size"] == 2
    assert meta["torch_version"] and meta["hostname"] and meta["device_name"] and meta["kernel_backend"]
    assert "synthetic" in meta["tensors"]
    assert meta["skipped"] == [{"codec": "qsgd:bits=8", "algorithm": "allreduce",
                                "reason": "allreduce sums on the wire: fp32/fp16/bf16 only"}]
    # torch's own allreduce (the baseline of the ratios, first), lowbit's fp32 allreduce as a row of its
    # own, then the grid
    assert [(r["codec"], r["algorithm"]) for r in rows] == [
        ("fp32", "torch.distributed.all_reduce"), ("fp32", "allreduce"), ("fp32", "scatter_gather"),
        ("qsgd:bits=8", "scatter_gather")]
    torch_row, lowbit_fp32 = rows[0], rows[1]
    assert torch_row["torch"] and torch_row["baseline"] and not any(r["torch"] or r["baseline"] for r in rows[1:])
    assert torch_row["ratio_vs_torch_allreduce"] == 1.0 and lowbit_fp32["ratio_vs_fp32_allreduce"] == 1.0
    assert torch_row["rel_error"] < 1e-6  # its sum over 2 is the mean lowbit's fp32 path computes
    for r in rows:
        assert r["ratio_vs_torch_allreduce"] == torch_row["time_s"] / r["time_s"]
        assert r["ratio_vs_fp32_allreduce"] == lowbit_fp32["time_s"] / r["time_s"]
        assert r["raw_dist_all_reduce_s"] == torch_row["time_s"]  # the old field, kept for old readers
        assert r["numel"] == 4096 and r["size"] == "4K" and r["fp32_bytes"] == 4 * 4096
        algo = "allreduce" if r["torch"] else r["algorithm"]  # torch's ring moves what lowbit's fp32 path does
        assert r["bytes_sent_per_rank"] == bytes_sent_per_rank(get_codec(r["codec"]), 4096, 2, algo)
        assert r["time_s"] > 0 and r["ratio_vs_fp32_allreduce"] > 0 and r["algbw_GBps"] > 0
        assert r["time_s"] == max(p["time_s"] for p in r["per_rank"]) and len(r["per_rank"]) == 2
        assert min(r["t_encode_s"], r["t_comm_s"], r["t_decode_s"]) >= 0 and r["t_comm_s"] > 0
    assert rows[3]["bytes_sent_per_rank"] < rows[2]["bytes_sent_per_rank"]  # 8 bits + scales < 32 bits
    # The table's ratio column is against torch's allreduce, and both fp32 paths have rows of their own.
    table = out[out.index("size  "):].splitlines()
    assert "vs torch AR" in table[0]
    assert [line.split()[2:4] for line in table[2:4]] == [["torch", "allreduce"], ["lowbit", "allreduce"]]
    assert table[2].split()[5] == "1.00x"


@pytest.mark.parametrize("argv, needle", [
    (["--codecs", "nosuchcodec"], "unknown codec 'nosuchcodec'"),
    (["--codecs", "qsgd:bits=9"], "bits"),
    (["--world-size", "0"], "--world-size must be >= 1"),
    (["--sizes", "4X"], "bad size '4X'"),
    (["--sizes", "1M,0"], "at least 1 element"),
    (["--algorithms", "ring"], "unknown algorithm 'ring'"),
    (["--reps", "0"], "--reps"),
    (["--backend", "mpi"], "--backend must be gloo or nccl"),
    (["--algorithms", "hierarchical"], "needs the number of ranks per node"),
])
def test_bench_bad_input(argv, needle, capsys, monkeypatch):
    monkeypatch.delenv("LOWBIT_NODE_SIZE", raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert main(["bench", "allreduce", "--quiet", *argv]) == 2
    err = capsys.readouterr().err
    assert needle in err, err


def test_parse_helpers():
    assert parse_sizes("1K,4M,1G,7") == [1024, 4 << 20, 1 << 30, 7]
    assert parse_codecs(["fp32,qsgd:bits=4,bucket=512;onebit:bucket=64", "fp16", "fp32"]) == [
        "fp32", "qsgd:bits=4,bucket=512", "onebit:bucket=64", "fp16"]
