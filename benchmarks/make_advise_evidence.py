"""Write the accuracy evidence ``lowbit advise`` ships with: the finished run rows of a study, slimmed to
what the speed model and advise read (config, labels, env device/links, summary, per-epoch timings).

    python benchmarks/make_advise_evidence.py benchmarks/results/study_cpu_default \
        src/lowbit/lab/perfmodel/data/evidence_cpu_default.jsonl
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from lowbit.lab.study.store import read_runs

SUMMARY = ("params", "compressed_params", "samples_per_s", "final_test_acc", "timed_epochs", "gflop_per_sample")
EPOCH = ("epoch", "steps", "train_s", "compute_s", "exposed_comm_s", "encode_s", "comm_s", "decode_s",
         "bytes_sent_per_rank", "test_acc")


def slim(row: dict) -> dict:
    env = row.get("env") or {}
    return {
        "kind": "run", "key": row["key"], "attempt": row.get("attempt", 1), "schema": row.get("schema", 1),
        "config": row["config"],
        "labels": {k: v for k, v in (row.get("labels") or {}).items() if k in ("codec", "synthetic", "task")},
        "env": {"device_name": env.get("device_name", ""), "links": env.get("links") or {}},
        "summary": {k: (row.get("summary") or {}).get(k) for k in SUMMARY},
        "epochs": [{k: e.get(k) for k in EPOCH} for e in row.get("epochs") or []],
    }


def main(src: str, dst: str) -> int:
    rows, _ = read_runs(src)  # the study's one reader: the rows the report and the speed model see
    with open(dst, "w") as f:
        for row in sorted(rows, key=lambda r: r["key"]):
            f.write(json.dumps(slim(row), sort_keys=True, separators=(",", ":")) + "\n")
    print(f"wrote {len(rows)} runs to {dst} ({Path(dst).stat().st_size:,} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:3]))
