"""The study: run a grid of training runs and report accuracy, speed and scalability in the seed's style.

    from lowbit.lab.study import load_config, run_study, write_report
    cfg = load_config(preset="default", overrides={"epochs": 2})
    result = run_study(cfg, "study-results/")          # resumes: finished runs are skipped
    html = write_report("study-results/")              # study-results/report/index.html + PNGs

Modules: ``config`` (TOML / presets -> validated grid -> runs with stable keys), ``runner`` (runs onto
worker groups: local spawn or torchrun), ``train`` (one run on a rank: DDP + lowbit, the timed loop), ``metrics`` (what is measured and how), ``store``
(append-only JSON Lines), ``report`` (HTML + matplotlib PNGs), ``seed_data`` (the seed's Figure 4,
10 and 11 numbers). The commands (``lowbit study``, ``report``, ``export``) are :mod:`lowbit.lab.cli.study`. See docs/study.md.
"""

from __future__ import annotations

from lowbit.lab.study.config import StudyConfig
from lowbit.lab.study.loading import load_config

from lowbit.lab.study.runs import RunConfig, expand_runs
from lowbit.lab.study.report import write_report
from lowbit.lab.study.runner import run_study
from lowbit.lab.study.store import ResultStore

__all__ = ["RunConfig", "StudyConfig", "ResultStore", "expand_runs", "load_config", "run_study", "write_report"]

