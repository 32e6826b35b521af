"""FSDP's codec="auto" decision table on CPU, written to a results file (docs/results.md cites it).

    python benchmarks/fsdp_auto_table_cpu.py --out benchmarks/results/fsdp_auto_table_cpu.txt

Two gloo ranks, the model of tests/distributed/test_fsdp_auto.py (two blocks of 66,304 values, each its own
fully_shard, and a root of 9,476 that auto keeps native), lowbit.fsdp.register(codec="auto") at its
conservative level, an emulated link of ``--link`` bytes/s (rank 1 at half of it, so the ranks measure
differently), trained until auto has decided. Writes rank 0's ``state.auto.table()`` with the machine and
the commit. The step times vary from run to run on a shared 2-core machine: a log of one run, not a
benchmark."""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # (the test's model and loop)


def _body(rank: int, world: int, link: float) -> str:
    import lowbit.comm.collectives as C
    from tests.distributed.test_fsdp_auto import _model, _train_to_decision

    C.emulate_link(link / (1 + rank))
    m, st = _model()
    _train_to_decision(m, rank, st, 12)
    C.emulate_link(None)
    return st.auto.table()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--link", type=float, default=20e6, help="emulated link of rank 0, bytes/s (rank 1: half)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    from lowbit.launch import spawn

    table = spawn(_body, 2, args.link, backend="gloo", timeout_s=300)[0]
    here = Path(__file__).resolve().parent
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=here, capture_output=True, text=True).stdout.strip()
    cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), platform.machine())
    head = (f"# FSDP codec='auto' decision table, rank 0 of 2 gloo ranks, emulated link {args.link / 1e6:g} MB/s "
            f"(rank 1: {args.link / 2e6:g} MB/s)\n# machine: {cpu}, {os.cpu_count()} cores; commit {commit}; "
            f"python {platform.python_version()}\n")
    Path(args.out).write_text(head + table + "\n")
    print(head + table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
