"""The study's result rows as the speed model reads them: :func:`run_record` turns a finished run's ``run``
row into a :class:`lowbit.perfmodel.calibrate.RunRecord` (times per training step, averaged over ranks and
over the timed epochs). The study owns its rows' schema; the speed model only reads records.
"""

from __future__ import annotations

import json
import math
from typing import Any

from lowbit.baselines import is_baseline
from lowbit.perfmodel.calibrate import RunRecord
from lowbit.perfmodel.model import codec_fact

__all__ = ["run_record"]


def run_record(row: dict[str, Any]) -> RunRecord | None:
    """A study result row (a finished run's ``run`` row) as the model reads it; None for runs it does
    not describe (model / hybrid parallelism, the simulated NCCL, ``codec="auto"``, no timed steps). The study's reader
    (:func:`lowbit.study.store.load_run_records`) applies it to a results file."""
    c, s = row.get("config") or {}, row.get("summary") or {}
    epochs = row.get("epochs") or []
    timed = set(s.get("timed_epochs") or [e.get("epoch") for e in epochs[1:]] or [e.get("epoch") for e in epochs])
    use = [e for e in epochs if e.get("epoch") in timed] or epochs
    steps = sum(float(e.get("steps") or 0) for e in use)
    if steps <= 0:
        return None

    def per_step(field: str) -> float:
        return sum(float(e.get(field) or 0.0) for e in use) / steps

    if c.get("parallelism", "data") != "data" or c.get("algorithm") == "simulated":
        return None  # model / hybrid parallelism and the simulated NCCL are not what this model describes
    world = int(c.get("world_size", 1))
    codec = str(c.get("codec", "fp32"))
    if codec == "auto":
        return None  # lowbit.ddp's codec="auto" chooses per tensor while training; the row holds no codec
    if is_baseline(codec):
        return None  # PyTorch's own hooks: not lowbit's collectives, which the model prices
    algo = "allreduce" if codec_fact(codec, "sums_on_wire", False) else str(c.get("algorithm") or "scatter_gather")
    if algo == "none":
        algo = "scatter_gather"
    rest = {k: v for k, v in c.items() if k not in (
        "network", "dataset", "batch_size", "world_size", "backend", "device", "codec", "algorithm",
        "error_feedback", "seed", "batch_preset")}
    labels = row.get("labels") or {}
    env = row.get("env") or {}
    links = env.get("links") if isinstance(env.get("links"), dict) else {}

    def link_Bps(field: str) -> float:
        v = links.get(field)
        return float(v) * 1e9 if isinstance(v, (int, float)) and v > 0 else math.nan

    return RunRecord(
        key=str(row["key"]), network=str(c.get("network")), dataset=str(c.get("dataset")),
        batch=int(c.get("batch_size", 0)), world=world, backend=str(c.get("backend", "gloo")),
        device=str(c.get("device", "cpu")), codec=codec, algorithm=algo,
        error_feedback=bool(c.get("error_feedback", False)), seed=int(c.get("seed", 0)),
        synthetic=bool(labels.get("synthetic", False)), params=int(s.get("params") or 0),
        compressed_params=int(s.get("compressed_params") or 0),
        step_s=per_step("train_s"), compute_s=per_step("compute_s"), exposed_s=per_step("exposed_comm_s"),
        encode_s=per_step("encode_s"), comm_s=per_step("comm_s"), decode_s=per_step("decode_s"),
        bytes_per_step=per_step("bytes_sent_per_rank"), samples_per_s=float(s.get("samples_per_s") or math.nan),
        final_test_acc=float(s.get("final_test_acc") if s.get("final_test_acc") is not None else math.nan),
        epochs=int(c.get("epochs", len(epochs))), lr=float(c.get("lr", math.nan)),
        device_name=str(env.get("device_name", "")), config_rest=json.dumps(rest, sort_keys=True),
        gflop_per_sample=float(s.get("gflop_per_sample") or math.nan),
        nodes=int(c.get("nodes", 1) or 1), intra_Bps=link_Bps("intra_GBps"), inter_Bps=link_Bps("inter_GBps"),
    )
