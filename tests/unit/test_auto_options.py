"""codec="auto"'s shared options (auto_level, guard_every, allow, error_budget) have one check,
lowbit.auto.options.check_auto_options, which DDP's configuration, both tuners and lowbit.fsdp.register call:
the same rule everywhere, each in its own words (what is always allowed, what the budget multiplies)."""

from __future__ import annotations

import pytest
from torch import nn

import lowbit.ddp as D
import lowbit.fsdp as lf
from lowbit.auto.ddp_tuner import AutoTuner
from lowbit.auto.fsdp_tuner import FSDPAuto

BAD = [(dict(level="wild"), "auto_level must be one of 'conservative', 'bold'"),
       (dict(level=None), "auto_level must be one of"),
       (dict(guard_every=-1), "guard_every must be an int >= 0"),
       (dict(guard_every=True), "guard_every must be an int >= 0"),
       (dict(allow="bf16"), "allow must be a list of codec specs, got the string 'bf16'"),
       (dict(allow={"bf16"}), "allow must be a list of codec specs"),
       (dict(allow=[]), "allow must name at least one codec"),
       (dict(error_budget=0), "error_budget must be a number > 0"),
       (dict(error_budget=float("nan")), "error_budget must be a number > 0"),
       (dict(error_budget="1"), "error_budget must be a number > 0")]


@pytest.mark.parametrize("bad,match", BAD)
def test_each_tuner_and_each_register_refuse_the_same_options(bad: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        AutoTuner(**bad)
    with pytest.raises(ValueError, match=match):
        FSDPAuto(**bad)
    # as the users pass them (auto_level=; FSDP reads auto_level=None as the default level)
    opts = {("auto_level" if k == "level" else k): v for k, v in bad.items()}
    with pytest.raises(ValueError, match=match):
        D.DDPConfig(codec="auto", **opts)
    if opts != {"auto_level": None}:
        with pytest.raises(ValueError, match=f"lowbit.fsdp.register: {match}"):
            lf.register(nn.Linear(4, 4), codec="auto", **opts)


def test_the_wording_says_what_each_allows_always_and_what_the_budget_multiplies() -> None:
    with pytest.raises(ValueError, match=r"\(fp32 is always allowed\)"):
        AutoTuner(allow=[])
    with pytest.raises(ValueError, match=r"\(native, FSDP's own reduce-scatter, is always allowed\)"):
        FSDPAuto(allow=[])
    with pytest.raises(ValueError, match=r"times uniform 8-bit QSGD's error;"):
        D.DDPConfig(codec="auto", error_budget=-1)
    with pytest.raises(ValueError, match=r"times 8-bit QSGD's error on each module;"):
        FSDPAuto(error_budget=-1)


def test_good_options_pass_everywhere() -> None:
    for opts in (dict(), dict(level="bold", guard_every=0, error_budget=None), dict(allow=["bf16"], error_budget=2)):
        AutoTuner(**opts)
        FSDPAuto(**opts)
