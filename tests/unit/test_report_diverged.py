"""A run that diverged, in the report's plots (issue 43): 1bitSGD* on small_cnn/MNIST-1D in the committed CPU
study (a copy in tests/fixtures/) ended at 8.9 % with its training loss flat at 2.30. Figure 5's panel stays
zoomed on the runs that learned, the diverged curve is marked at the edge and named under the panel, and
the price plot marks its point as the table does, instead of drawing it as an ordinary one."""

from __future__ import annotations

import copy
import math
from pathlib import Path

import pytest

import lowbit.lab.study.figures as figures
import lowbit.lab.study.report as report

pytest.importorskip("matplotlib")

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
DIVERGED = FIXTURES / "study_cpu_default_small_cnn_mnist1d" / "results.jsonl"
LEARNED = FIXTURES / "study_cpu_default" / "results.jsonl"


def _figures(monkeypatch, tmp_path, plot, *args) -> list:
    figs: list = []
    monkeypatch.setattr(figures, "_save", lambda fig, out, name: figs.append(fig) or name)
    assert plot(*args[:1], tmp_path, *args[1:]) is not None
    return figs


def _panel(monkeypatch, tmp_path, runs, field):
    return _figures(monkeypatch, tmp_path, report._plot_accuracy, runs, field, field, "f.png")[0].axes[0]


def test_the_committed_diverged_run_does_not_unzoom_its_panel(monkeypatch, tmp_path) -> None:
    runs, _ = report.load_runs(DIVERGED)
    assert {r["codec"] for r in runs if report.diverged(r)} == {"onebit:bucket=64"}
    for field in ("test_acc", "train_loss"):
        ax = _panel(monkeypatch, tmp_path, runs, field)
        lo, hi = ax.get_ylim()
        gone = [ln for ln in ax.lines if ln.get_label() == "1bitSGD*/64 +EF (diverged)"]
        assert len(gone) == 1 and gone[0].get_linestyle() == ":", [ln.get_label() for ln in ax.lines]
        if field == "test_acc":
            assert lo > 70, (lo, hi)  # the others end at 91.7-96.4 %; the diverged run is at 8.9 %
            assert all(y < lo for y in gone[0].get_ydata())
        else:
            assert hi < 2.1, (lo, hi)  # the others start at 1.9 and fall to 0.03; it stays at 2.30
            assert all(y > hi for y in gone[0].get_ydata())
        # marked on the edge at every epoch, and named under the panel
        edge = [ln for ln in ax.lines if ln.get_gid() in ("off-axis below: 1bitSGD*/64 +EF (diverged)",
                                                          "off-axis above: 1bitSGD*/64 +EF (diverged)")]
        assert len(edge) == 1 and list(edge[0].get_xdata()) == list(range(1, 11))
        notes = [t.get_text().replace("\n", " ") for t in ax.texts
                 if t.get_gid() == "off-axis note: 1bitSGD*/64 +EF (diverged)"]
        assert notes and "the axis at epoch 1–10" in notes[0], notes


def test_a_loss_that_went_non_finite_is_named_and_kept_out_of_the_limits(monkeypatch, tmp_path) -> None:
    runs, _ = report.load_runs(LEARNED)
    bad = []
    for r in runs:
        if r["codec"].startswith("qsgd:bits=4"):
            r = copy.deepcopy(r)
            r["epoch_rows"] = [{**e, "train_loss": (math.nan if e["epoch"] >= 4 else 50.0)} for e in r["epoch_rows"]]
            r["summary"] = {**r["summary"], "final_train_loss": math.nan}
        bad.append(r)
    assert [report.diverged(r) for r in bad if r["codec"].startswith("qsgd:bits=4")] == [True] * 3
    ax = _panel(monkeypatch, tmp_path, bad, "train_loss")
    lo, hi = ax.get_ylim()
    assert hi < 2, (lo, hi)  # the others' range (their loss starts at 1.5), not up to 50
    notes = [t.get_text().replace("\n", " ") for t in ax.texts if str(t.get_gid()).endswith("(diverged)")]
    assert len(notes) == 1, [t.get_text() for t in ax.texts]
    assert "▲ above the axis at epoch 1–3 (max 50.0)" in notes[0] and "not finite at epoch 4–10" in notes[0], notes


def _price_points(ax) -> dict[str, list]:
    """The price plot's drawn points: gid -> offsets for the diverged ones (asserted hollow); "" -> the others
    (the × drawn on a diverged one among them)."""
    out: dict[str, list] = {"": []}
    for c in ax.collections:
        pts = [tuple(p) for p in c.get_offsets()]
        if not pts:
            continue  # a legend key
        gid = str(c.get_gid() or "")
        if gid.startswith("diverged: "):
            assert len(c.get_facecolor()) == 0 or c.get_facecolor()[0][3] == 0, gid  # hollow
            out[gid] = pts
        else:
            out[""] += pts
    return out


def test_the_price_plot_marks_a_diverged_run_as_the_table_does(monkeypatch, tmp_path) -> None:
    runs, _ = report.load_runs(DIVERGED)
    fig = _figures(monkeypatch, tmp_path, report._plot_price, runs, 0.9)[0]
    ax = fig.axes[0]
    pts = _price_points(ax)
    gone = {g: p for g, p in pts.items() if g}
    assert list(gone) == ["diverged: 1bitSGD*/64 +EF, small_cnn, mnist1d, gloo/cpu, K=2"], list(gone)
    (x, y), = gone[next(iter(gone))]
    assert y == pytest.approx(8.9)
    # crossed: an × of its colour on the hollow marker, and no ordinary point of it but that ×
    crosses = [c for c in ax.collections if [tuple(p) for p in c.get_offsets()] == [(x, y)] and c.get_gid() is None]
    assert len(crosses) == 1
    assert min(p[1] for p in pts[""] if p != (x, y)) > 80  # every other point is a run that learned
    labels = [t.get_text() for leg in fig.legends for t in leg.get_texts()]
    assert "hollow, crossed: diverged (ended at chance, or a non-finite loss)" in labels, labels
    # runs that learned: no key for it
    fig = _figures(monkeypatch, tmp_path, report._plot_price, report.load_runs(LEARNED)[0], 0.9)[0]
    assert not any("diverged" in t.get_text() for leg in fig.legends for t in leg.get_texts())
    assert not any(str(c.get_gid() or "").startswith("diverged") for c in fig.axes[0].collections)


def test_a_seed_that_diverged_is_not_averaged_with_those_that_learned(monkeypatch, tmp_path) -> None:
    runs, _ = report.load_runs(LEARNED)
    one = []
    for r in runs:
        if r["codec"].startswith("onebit") and r["seed"] == 0:
            r = copy.deepcopy(r)
            r["summary"] = {**r["summary"], "final_test_acc": 0.089, "final_train_loss": 2.302}
        one.append(r)
    assert sum(report.diverged(r) for r in one) == 1
    ax = _figures(monkeypatch, tmp_path, report._plot_price, one, 0.9)[0].axes[0]
    gone = {g: p for g, p in _price_points(ax).items() if g}
    assert [p[1] for p in gone["diverged: 1bitSGD*/64 +EF, mlp, digits, gloo/cpu, K=2"]] == [pytest.approx(8.9)]
    learned = [r["summary"]["final_test_acc"] * 100 for r in one
               if r["codec"].startswith("onebit") and r["seed"] != 0 and r["world_size"] == 2]
    ys = [p[1] for p in _price_points(ax)[""]]
    assert any(y == pytest.approx(sum(learned) / 2) for y in ys), ys  # the two seeds that learned, averaged
