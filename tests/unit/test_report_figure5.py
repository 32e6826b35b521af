"""The report's Figure 5 and first table on the committed CPU study's mlp/digits runs (a copy in
tests/fixtures/; issue 33, item 6): curves that leave the zoomed accuracy axis are marked at its edge, and
one seed gets the difference without a ✓/✗ mark."""

from __future__ import annotations

from pathlib import Path

import pytest

import lowbit.study.report as report

pytest.importorskip("matplotlib")

REAL = Path(__file__).resolve().parents[1] / "fixtures" / "study_cpu_default" / "results.jsonl"


def _figure5(runs, monkeypatch, tmp_path):
    figs = []
    monkeypatch.setattr(report, "_save", lambda fig, out, name: figs.append(fig) or name)
    assert report._plot_accuracy(runs, tmp_path, "test_acc", "test accuracy (%)", "fig5.png") == "fig5.png"
    return figs[0]


def test_points_below_the_accuracy_axis_are_marked_at_its_edge(monkeypatch, tmp_path) -> None:
    runs, _ = report.load_runs(REAL)
    fig = _figure5(runs, monkeypatch, tmp_path)
    off_axis = 0
    for ax in fig.axes:
        if not ax.get_visible() or not ax.lines:
            continue
        lo, hi = ax.get_ylim()
        markers = [ln for ln in ax.lines if str(ln.get_gid() or "").startswith("off-axis")]
        curves = [ln for ln in ax.lines if ln not in markers and not ln.get_label().startswith("_")]
        for curve in curves:
            outside = [(x, y) for x, y in zip(curve.get_xdata(), curve.get_ydata()) if y < lo or y > hi]
            if not outside:
                continue
            off_axis += len(outside)
            # every such epoch has a marker of the curve's colour on the edge it left by
            for x, y in outside:
                edge = lo if y < lo else hi
                assert any(m.get_color() == curve.get_color() and (x, edge) in zip(m.get_xdata(), m.get_ydata())
                           for m in markers), (ax.get_title(), curve.get_label(), x, y)
            # the panel says which curve left the plot, and where
            assert any(t.get_text().startswith(f"{curve.get_label()}: ▼ below the axis at epoch")
                       or t.get_text().startswith(f"{curve.get_label()}: ▲ above") for t in ax.texts), curve.get_label()
            assert all(m.get_clip_on() is False for m in markers)
    # the committed study has such curves (2-bit QSGD and 1bitSGD* start far below the others)
    assert off_axis > 0


def test_one_seed_shows_the_difference_without_a_verdict_mark() -> None:
    runs, _ = report.load_runs(REAL)
    one = [r for r in runs if r["seed"] == 0]
    html = report._match_section(one)
    assert "✓" not in html.split("<p class='note'>")[0] and "✗" not in html.split("<p class='note'>")[0]
    assert "seed, no verdict)" in html and "fewer than 3 seeds" in html and "Too few seeds" in html
    assert "does not match</td>" not in html and "matches</td>" not in html  # the detail table neither
    # with the study's 3 seeds the marks are there
    html3 = report._match_section(runs)
    assert "✓" in html3 and "✗" in html3 and "Too few seeds" not in html3
