"""The study's local SGD (parallelism = "localsgd", issue 45): its keys refused by name, the `also` grids
and a list of emulated links as grid dimensions, error feedback's default for local SGD, run keys and
labels, and the localsgd preset's rows. A real run: tests/distributed/test_study_localsgd.py."""

from __future__ import annotations

import pytest

from lowbit.lab.study.config import StudyConfig
from lowbit.lab.study.loading import load_config

from lowbit.lab.study.runs import expand_runs


def _cfg(**kw: object) -> StudyConfig:
    base = dict(networks=["mlp"], datasets=["digits"], world_sizes=[2], codecs=["fp32"])
    return StudyConfig(**{**base, **kw})


@pytest.mark.parametrize("kw, message", [
    (dict(parallelism=["localsgd"]), "needs 'local_steps'"),
    (dict(parallelism=["localsgd"], local_steps=2, fragments=3), "'fragments' (3) must be at most 'local_steps' (2)"),
    (dict(local_steps=-1), "'local_steps' must be an integer >= 0"),
    (dict(outer_lr=0), "'outer_lr' must be a number > 0"),
    (dict(outer_momentum=1.0), "'outer_momentum' must be a number in [0, 1)"),
    (dict(also={"codecs": ["fp32"]}), "'also' is a list of tables"),
    (dict(also=[{"target_from": "fp32"}]), "key 'target_from' cannot be set there"),
    (dict(also=[{"nope": 1}]), "key 'nope' cannot be set there"),
    (dict(also=[{"parallelism": ["localsgd"]}]), "'also' entry 0: study config: parallelism \"localsgd\" needs"),
    (dict(emulate_link=["100mbit", "100mbit"]), "without repeats"),
    (dict(emulate_link=["fast"]), "'emulate_link'"),
    (dict(emulate_link=["100mbit@"]), "'emulate_link': emulated link '100mbit@': a latency after '@'"),
    (dict(emulate_link="100mbit@soon"), "'emulate_link': cannot parse latency 'soon'"),
    (dict(target_schedule="later"), "'target_schedule' must be one of 'replay', 'own'"),
    (dict(target_schedule="own", time_budget_s=5), "'target_schedule' \"own\""),
    (dict(target_schedule="own", target_from="fp32"), "needs both 'target_from' and 'time_budget_s'"),
    (dict(target_from="fp32", time_budget_s=5, eval_every=2, also=[{"target_schedule": "own"}]),
     "key 'target_schedule' cannot be set there"),
])
def test_bad_keys_are_refused_by_name(kw: dict, message: str) -> None:
    with pytest.raises(ValueError) as info:
        _cfg(**kw)
    assert message in str(info.value)


def test_localsgd_runs_keys_labels_and_feedback() -> None:
    cfg = _cfg(codecs=["fp32", "qsgd:bits=4,bucket=512", "qsgd:bits=8,bucket=512", "torch:ddp"],
               parallelism=["data", "localsgd"], local_steps=8, algorithms=["allgather"])
    runs = expand_runs(cfg)
    local = [r for r in runs if r.parallelism == "localsgd"]
    data = [r for r in runs if r.parallelism == "data"]
    assert len(data) == 4 and len(local) == 3  # PyTorch's hooks are DDP's alone
    by = {r.codec.split(",")[0]: r for r in local}
    assert by["qsgd:bits=4"].error_feedback and not by["qsgd:bits=8"].error_feedback and not by["fp32"].error_feedback
    assert by["qsgd:bits=4"].codec_label == "QSGD 4bit/512 +EF [local SGD H=8]"
    assert all(r.local_steps == 0 for r in data) and all(r.local_steps == 8 for r in local)
    # the same codec under DDP and local SGD are two runs, two keys; changing H changes local SGD's key only
    assert len({r.key() for r in runs}) == len(runs)
    runs16 = expand_runs(cfg.replace(local_steps=16))
    assert {r.key() for r in runs16 if r.parallelism == "data"} == {r.key() for r in data}
    assert not {r.key() for r in runs16 if r.parallelism == "localsgd"} & {r.key() for r in local}


def test_also_grids_share_the_main_grids_target_and_links() -> None:
    cfg = _cfg(codecs=["fp32"], target_from="fp32", time_budget_s=10, target_budget_factor=2, eval_every_s=1.0,
               emulate_link=["100mbit", "1gbit"],
               also=[{"parallelism": ["localsgd"], "local_steps": 4, "codecs": ["qsgd:bits=4,bucket=512"]},
                     {"parallelism": ["localsgd"], "local_steps": 4, "fragments": 2, "codecs": ["qsgd:bits=4,bucket=512"]}])
    runs = expand_runs(cfg)
    assert sorted({r.emulate_link for r in runs}) == ["100mbit", "1gbit"]
    src = [r for r in runs if r.is_target_source]
    assert len(src) == 2 and all(r.time_budget_s == 10 for r in src)
    local = [r for r in runs if r.parallelism == "localsgd"]
    assert len(local) == 4 and {r.fragments for r in local} == {1, 2}
    for r in local:  # each takes the data-parallel fp32 run's target at its link, with the scaled budget
        assert r.awaits_target and r.time_budget_s == 20
        assert [s.target_setting() for s in src if s.emulate_link == r.emulate_link] == [r.target_setting()]


def test_a_link_with_latency_is_a_grid_value() -> None:
    runs = expand_runs(_cfg(emulate_link=["100mbit@25ms", "100mbit"]))
    assert sorted(r.emulate_link for r in runs) == ["100mbit", "100mbit@25ms"]
    assert len({r.key() for r in runs}) == 2  # the latency is part of the run's key


def test_own_schedule_for_every_row_that_takes_the_target() -> None:
    """``target_schedule = "own"``: every run that takes the target (DDP's and local SGD's alike) keeps its
    own schedule (none replayed) over its own budget, and only the target comes from the baseline's row;
    "replay" (the default) takes the schedule too, and its runs' keys are what they were before the key
    existed (the fixture test above)."""
    base = dict(codecs=["fp32", "qsgd:bits=4,bucket=512"], algorithms=["allgather"], target_from="fp32",
                time_budget_s=10, target_budget_factor=1.5, eval_every_s=1.0,
                also=[{"parallelism": ["localsgd"], "local_steps": 4, "codecs": ["qsgd:bits=4,bucket=512"]}])
    own, replay = expand_runs(_cfg(**base, target_schedule="own")), expand_runs(_cfg(**base))
    assert {r.target_schedule for r in replay} == {"replay"}
    src = next(r for r in own if r.is_target_source)
    takers = [r for r in own if r.awaits_target]
    assert {r.target_schedule for r in takers} == {"own"}
    assert {r.target_setting() for r in takers} == {src.target_setting()}  # (the runner finds their target)
    # the run that sets the target is the same run under either rule (one key: a study of each rule shares it)
    assert src.target_schedule == "replay" and src.key() == next(r for r in replay if r.is_target_source).key()
    assert not {r.key() for r in takers} & {r.key() for r in replay}
    assert len(takers) == 2 and {r.parallelism for r in takers} == {"data", "localsgd"}
    assert src.time_budget_s == 10 and all(r.time_budget_s == 15 for r in takers)
    row = {"summary": {"final_val_loss": 2.5}, "schedule": [0.0, 0.1, 0.2]}
    for r in takers:
        got = r.with_target(row)
        assert got.target_loss == 2.5 and got.schedule == ()
    rep = next(r for r in replay if r.awaits_target).with_target(row)
    assert rep.target_loss == 2.5 and rep.schedule == (0.0, 0.1, 0.2)


def test_localsgd_preset_rows() -> None:
    runs = expand_runs(load_config(preset="localsgd"))
    assert {r.world_size for r in runs} == {2, 4}
    assert {r.emulate_link for r in runs} == {"100mbit@25ms", "1gbit@5ms"}
    # one rule for every row: its own schedule over the same budget, to the target
    assert {r.target_schedule for r in runs if not r.is_target_source} == {"own"}
    assert {r.time_budget_s for r in runs} == {12}
    assert {r.seed for r in runs} == {0, 1, 2}
    labels = sorted({r.codec_label for r in runs})
    assert labels == sorted(["DDP fp32 (torch)", "QSGD 4bit/512", "32bit [local SGD H=16]",
                             "8bit dynamic (Dettmers) [local SGD H=16]", "QSGD 4bit/512 +EF [local SGD H=16]",
                             "QSGD 2bit/512 rounding=nearest +EF [local SGD H=16]", "QSGD 4bit/512 +EF [local SGD H=16, F=4]"]), labels
    assert len(runs) == 7 * 2 * 2 * 3


def test_overlap_is_a_study_key_and_leaves_older_keys_alone() -> None:
    """``overlap`` (Streaming DiLoCo's overlapping communication, lowbit.localsgd's ``overlap=``): checked
    against local_steps // fragments, carried into the runs and their labels, and in a run's key only
    when set: the committed local SGD rows (a fixture copy) keep the keys they were written with."""
    import json
    from pathlib import Path

    from lowbit.lab.study.runs import RunConfig

    with pytest.raises(ValueError, match=r"'overlap' \(4\) must be less than local_steps // fragments \(4\)"):
        _cfg(parallelism=["localsgd"], local_steps=8, fragments=2, overlap=4)
    with pytest.raises(ValueError, match="'overlap' must be an integer >= 0"):
        _cfg(overlap=-1)
    sync, over = (expand_runs(_cfg(parallelism=["localsgd"], local_steps=8, fragments=2, overlap=o,
                                   codecs=["qsgd:bits=4,bucket=512"]))[0] for o in (0, 2))
    assert (sync.overlap, over.overlap) == (0, 2)
    assert "overlap 2" in over.codec_label and "overlap" not in sync.codec_label
    assert sync.key() != over.key()
    rows = Path(__file__).parents[1] / "fixtures" / "study_cpu_localsgd" / "results.jsonl"
    runs = [r for r in map(json.loads, rows.read_text().splitlines()) if r.get("kind") == "run"]
    assert runs and all(RunConfig.from_dict(r["config"]).key() == r["key"] for r in runs)
