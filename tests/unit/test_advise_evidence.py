"""The accuracy evidence lowbit advise ships with is the committed CPU study, read the same from an
installed package as from a checkout (issue 13 item 2: no path into the repository).

This test reads benchmarks/results/study_cpu_default/ on purpose: what it checks is that the package data
is that committed study, run for run. Other tests read their copies under tests/fixtures/ (issue 31
item 7)."""

from __future__ import annotations

from pathlib import Path

from lowbit.lab.perfmodel.advise import default_evidence_path
from lowbit.lab.study.store import load_run_records as load_runs

STUDY = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "study_cpu_default"


def test_shipped_evidence_is_package_data_and_matches_the_committed_study() -> None:
    p = default_evidence_path()
    assert p is not None and "benchmarks" not in p.parts and p.parent.name == "data"
    shipped = {r.key: r for r in load_runs(p)}
    full = {r.key: r for r in load_runs(STUDY)}
    assert shipped.keys() == full.keys() and len(shipped) >= 100
    for key, r in full.items():
        s = shipped[key]
        assert (s.network, s.dataset, s.codec, s.seed, s.world, s.final_test_acc) == \
            (r.network, r.dataset, r.codec, r.seed, r.world, r.final_test_acc)
        assert s.step_s == r.step_s and s.bytes_per_step == r.bytes_per_step
