"""How far off is the speed model on runs we measured? (``lowbit predict --validate``; docs/perfmodel.md, section 8)

Every finished run of a study is predicted (:func:`lowbit.lab.perfmodel.fit.model_step` plus the per-step overhead)
and set against its measured step. A model fitted on the very run it predicts is not validated: parameters
come from a saved calibration (its study-derived parts only for runs they were not fitted on), bench files,
and the study itself *refitted for every prediction without the predicted run's configuration*
(leave-one-config-out; 1-worker runs, whose compute only their own configuration gives, leave-one-run-out).
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Sequence
from typing import Any

from lowbit.lab.perfmodel.calibrate import STUDY_TABLES, Calibration, Run, fit_comm_in_situ, fit_study
from lowbit.lab.perfmodel.fit import fit_overhead, model_step
from lowbit.lab.perfmodel.model import short_codec

__all__ = ["RunPrediction", "ValidationReport", "predict_run", "validate", "TARGET_MEDIAN_ABS_ERROR"]

#: The project's target for the median absolute relative error of the predicted step time.
TARGET_MEDIAN_ABS_ERROR = 0.15


@dataclasses.dataclass(frozen=True)
class RunPrediction:
    """The model's step time for one measured run, its parts, and where each input came from."""

    run: Run
    step_s: float
    compute_s: float
    encode_s: float
    comm_s: float
    decode_s: float
    overhead_s: float
    compute_source: str
    comm_source: str
    holdout: str

    @property
    def error(self) -> float:
        """Relative error of the step time: (predicted - measured) / measured."""
        return (self.step_s - self.run.step_s) / self.run.step_s

    @property
    def samples_per_s(self) -> float:
        return self.run.world * self.run.batch / self.step_s

    @property
    def measured_samples_per_s(self) -> float:
        return self.run.world * self.run.batch / self.run.step_s


def predict_run(run: Run, cal: Calibration, holdout: str = "") -> RunPrediction | str:
    """The model's step for ``run`` under ``cal`` (overhead included), or why it cannot predict it."""
    m = model_step(run, cal)
    if isinstance(m, str):
        return m
    step, br, compute_src, comm_src = m
    overhead = 0.0
    if run.world > 1:
        o = cal.step_overhead_s.get(run.overhead_key) or cal.step_overhead_s.get(run.scale_key)
        if o:
            overhead = float(o["seconds"])
        else:
            comm_src += " (no overhead calibrated)"
    # The overhead is a fitted bias and may be negative, but no step is shorter than its compute.
    return RunPrediction(run, max(step + overhead, br.compute_s, 1e-12), br.compute_s, br.encode_s, br.exposed_comm_s,
                         br.decode_s, overhead, compute_src, comm_src, holdout)


# ------------------------------------------------------------------------------------------ validation
@dataclasses.dataclass
class ValidationReport:
    predictions: list[RunPrediction]
    skipped: list[tuple[Run, str]]
    results_path: str
    holdout: str             # "config" (leave-one-config-out) or "run"
    parameters: Calibration  # the links and codec costs given (saved calibration, bench files)
    in_situ: list[str]       # backends whose links and codec costs came from the held-out runs themselves
    served: tuple[int, int] | None  # a saved calibration's study-derived parts: (runs served, runs refitted)

    def summary(self) -> dict[str, Any]:
        def stats(errs: list[float]) -> dict[str, Any]:
            return ({"runs": len(errs), "median_abs_error": statistics.median(errs),
                     "mean_abs_error": statistics.fmean(errs), "within_15pct": sum(e <= 0.15 for e in errs) / len(errs),
                     "max_abs_error": max(errs)} if errs else {"runs": 0})
        signed = [p.error for p in self.predictions]
        # (|error|, multi-worker) per run; per configuration, the model against the mean over its seeds; and
        # for context, how far each run is from the mean of the other seeds of its configuration
        runs = [(abs(p.error), p.run.world > 1) for p in self.predictions]
        by_config: dict[str, list[RunPrediction]] = {}
        for p in self.predictions:
            by_config.setdefault(p.run.config_id, []).append(p)
        cfg, oracle = [], []
        for ps in by_config.values():
            meas = statistics.fmean(p.run.step_s for p in ps)
            cfg.append((abs(statistics.fmean(p.step_s for p in ps) - meas) / meas, ps[0].run.world > 1))
            for p in ps if len(ps) > 1 else ():
                others = statistics.fmean(q.run.step_s for q in ps if q is not p)
                oracle.append((abs(others - p.run.step_s) / p.run.step_s, p.run.world > 1))

        def only(pairs: list[tuple[float, bool]], multi: bool | None = None) -> list[float]:
            return [e for e, m in pairs if multi in (None, m)]
        by_codec: dict[str, list[float]] = {}
        for p in self.predictions:
            if p.run.world > 1:
                by_codec.setdefault(short_codec(p.run.codec), []).append(abs(p.error))
        return {"all": stats(only(runs)), "multi_worker": stats(only(runs, True)),
                "single_worker": stats(only(runs, False)),
                "median_signed_error": statistics.median(signed) if signed else math.nan,
                "config_mean": stats(only(cfg)), "config_mean_multi_worker": stats(only(cfg, True)),
                "seed_scatter": stats(only(oracle)), "seed_scatter_multi_worker": stats(only(oracle, True)),
                "median_abs_error_by_codec_multi_worker": {k: statistics.median(v)
                                                           for k, v in sorted(by_codec.items())},
                "target_median_abs_error": TARGET_MEDIAN_ABS_ERROR}


def _split(cal: Calibration) -> tuple[Calibration, Calibration]:
    """(bench-derived part, study-derived part) of a calibration."""
    bench = Calibration(sources=dict(cal.sources))
    study = Calibration(**{name: dict(getattr(cal, name)) for name in STUDY_TABLES},
                        run_keys=list(cal.run_keys), config_keys=list(cal.config_keys))
    for t, by in cal.links.items():
        for a, f in by.items():
            target = study if f.source.startswith("in situ") else bench
            target.links.setdefault(t, {})[a] = f
    for t, by in cal.codecs.items():
        for a, by_c in by.items():
            for c, f in by_c.items():
                target = study if f.source.startswith("in situ") else bench
                target.codecs.setdefault(t, {}).setdefault(a, {})[c] = f
    return bench, study


def validate(runs: Sequence[Run], *, calibration: Calibration | None = None, bench: Calibration | None = None,
             holdout: str = "config", results_path: str = "") -> ValidationReport:
    """Predict every run with parameters it was not fitted on (module doc); ``holdout`` = ``config``
    (leave-one-config-out; default) or ``run`` (leave-one-run-out)."""
    if holdout not in ("config", "run"):
        raise ValueError(f"holdout must be 'config' or 'run', got {holdout!r}")
    if not runs:
        raise ValueError("no runs to validate")
    given_bench, given_study = _split(calibration) if calibration is not None else (None, None)
    fixed = Calibration()
    for part in (p for p in (given_bench, bench) if p is not None):
        fixed = fixed.merged(part)
    leak_keys = set(given_study.run_keys) if given_study else set()
    leak_configs = set(given_study.config_keys) if given_study else set()
    # Study rows name the backend, not the transport (NCCL's environment is not recorded): a bench file of
    # the same backend (e.g. nccl/socket) serves them; say so.
    need_in_situ = {r.backend for r in runs if not any(t.split("/")[0] == r.backend for t in fixed.links)}

    folds: dict[str, list[Run]] = {}
    for r in runs:
        unit = r.key if (holdout == "run" or r.world == 1) else r.config_id
        folds.setdefault(unit, []).append(r)
    preds: list[RunPrediction] = []
    skipped: list[tuple[Run, str]] = []
    used_given = refit = 0
    overhead_cache: dict[tuple[str, str], dict[str, Any]] = {}
    for unit, fold in folds.items():
        held = {r.key for r in fold}
        train = [r for r in runs if r.key not in held]
        refit_cal = fit_study(train)
        in_situ = [r for r in train if r.backend in need_in_situ]
        if in_situ:
            refit_cal = refit_cal.merged(fit_comm_in_situ(in_situ))
        for r in fold:
            use_given = given_study is not None and r.key not in leak_keys and r.config_id not in leak_configs
            cal = (fixed.merged(given_study) if use_given else fixed).merged(refit_cal)
            used_given += use_given
            refit += not use_given
            if r.world > 1 and r.overhead_key not in cal.step_overhead_s and r.scale_key not in cal.step_overhead_s:
                key = (unit, r.scale_key)
                if key not in overhead_cache:
                    overhead_cache[key] = fit_overhead([t for t in train if t.scale_key == r.scale_key], cal)
                cal.step_overhead_s.update(overhead_cache[key])
            scheme = ("calibration (disjoint runs)" if use_given else
                      "leave-one-run-out" if unit == r.key else "leave-one-config-out")
            p = predict_run(r, cal, scheme)
            if isinstance(p, str):
                skipped.append((r, p))
            else:
                preds.append(p)
    preds.sort(key=lambda p: (p.run.network, p.run.dataset, p.run.batch, p.run.backend, p.run.world,
                              p.run.codec_name != "fp32", p.run.codec, p.run.seed))
    return ValidationReport(preds, skipped, results_path, holdout, fixed, sorted(need_in_situ),
                            (used_given, refit) if calibration is not None else None)
