"""lowbit.lab.perfmodel.overhead: the bandwidth below which a configuration pays, from bench_overhead.py rows."""

from __future__ import annotations

import json
import math

import pytest

from lowbit.lab.cli import main
from lowbit.lab.perfmodel.overhead import breakeven, format_breakeven


def _doc(rows):
    return {"meta": {"mode": "fsdp", "model": "m", "batch": 4, "card": "c", "wire": "w", "baseline": "base"},
            "rows": [{"config": "base", "ms_per_step": 100.0, "ratio": 1.0, "wire_bytes_per_step": 3_000_000_000},
                     *rows]}


def test_breakeven_is_the_saved_bytes_over_the_added_time():
    doc = _doc([{"config": "half", "ms_per_step": 125.0, "ratio": 0.8, "wire_bytes_per_step": 1_000_000_000},
                {"config": "free", "ms_per_step": 99.0, "ratio": 1.01, "wire_bytes_per_step": 1_000_000_000},
                {"config": "more", "ms_per_step": 110.0, "ratio": 0.9, "wire_bytes_per_step": 4_000_000_000}])
    by = {b.config: b for b in breakeven(doc)}
    assert by["half"].added_ms == pytest.approx(25.0)
    assert by["half"].gbps == pytest.approx(2e9 / 0.025 / 1e9)  # 80 GB/s: 2 GB saved for 25 ms
    assert math.isinf(by["free"].gbps)  # costs nothing measurable: pays on any link that takes time
    assert by["more"].gbps == 0.0  # sends more than the baseline: never
    text = format_breakeven(doc)
    assert "80 GB/s" in text and "any link" in text and "never" in text


def test_predict_overhead_prints_and_refuses_bad_files(tmp_path, capsys):
    good = tmp_path / "o.json"
    good.write_text(json.dumps(_doc([{"config": "half", "ms_per_step": 125.0, "ratio": 0.8,
                                      "wire_bytes_per_step": 1_000_000_000}])))
    assert main(["predict", "--overhead", str(good)]) == 0
    assert "80 GB/s" in capsys.readouterr().out
    assert main(["predict", "--overhead", str(good), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)[0]["rows"][0]["gbps"] == pytest.approx(80.0)
    bad = tmp_path / "b.json"
    bad.write_text("[1, 2]")
    assert main(["predict", "--overhead", str(bad)]) == 2
    assert "not a bench_overhead.py result" in capsys.readouterr().err
    no_base = tmp_path / "n.json"
    no_base.write_text(json.dumps({"meta": {"baseline": "x"}, "rows": []}))
    assert main(["predict", "--overhead", str(no_base)]) == 2
    assert "baseline" in capsys.readouterr().err
