"""A study's runs: :class:`RunConfig` (one training run), the grid a :class:`lowbit.lab.study.config.StudyConfig`
expands into (:func:`expand_runs`) and the checks across runs (:func:`check_runs`)."""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import itertools
import json
import math
from collections.abc import Iterable, Mapping
from typing import Any

from lowbit.auto.options import default_allow
from lowbit.lab.baselines import get_baseline, is_baseline
from lowbit.codecs.base import Codec, get_codec
from lowbit.localsgd.config import auto_feedback
from lowbit.lab.data import load_dataset
from lowbit.lab.models import build_model
from lowbit.parallel.split import check_splits
from lowbit.lab.study import seed_data
from lowbit.lab.study.config import (DEFAULT_AUTO_LEVEL, LOCALSGD, SCHEMA, StudyConfig, auto_level, is_auto, policy_label,
                                 resolve_batch)

__all__ = ["RunConfig", "expand_runs", "check_runs", "codec_label", "localsgd_label"]


# ------------------------------------------------------------------------------------ runs
@dataclasses.dataclass(frozen=True)
class RunConfig:
    """One point of the grid: everything that determines what a run computes (and so its key)."""

    network: str
    dataset: str
    codec: str              # canonical spec
    algorithm: str          # effective: "allreduce" for native codecs, "none" at world size 1
    error_feedback: bool    # resolved
    world_size: int
    backend: str
    device: str             # cpu | cuda
    batch_size: int         # per worker
    epochs: int
    seed: int
    lr: float
    momentum: float
    weight_decay: float
    lr_schedule: str
    optimizer: str
    threads_per_worker: int
    max_train_samples: int
    max_test_samples: int
    max_steps_per_epoch: int
    start_iter: int
    model_args: Mapping[str, Any]
    dataset_args: Mapping[str, Any]
    batch_preset: str = ""  # how the batch size was chosen ("fig4", ...): a label, not part of the key
    nodes: int = 1          # emulated nodes (world_size / nodes ranks each); in the key only when > 1
    parallelism: str = "data"  # data | model | hybrid; in the key only when not "data"
    sub_batches: int = 1       # hybrid only; in the key only when > 1
    emulate_link: str | None = None  # an emulated link's speed (gloo); in the key only when set
    # localsgd runs only (in the key only then): H, F, the outer SGD's lr and momentum
    local_steps: int = 0
    fragments: int = 1
    overlap: int = 0           # in the key only when > 0 (runs made before it keep theirs)
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    policy: Mapping[str, Any] = dataclasses.field(default_factory=dict)  # per-layer overrides; in the key if any
    # time to accuracy (StudyConfig's keys; each in the key only when set, so older runs keep theirs)
    time_budget_s: float | None = None
    target_loss: float | None = None    # given, or resolved from the run of `target_from` (with_target)
    target_accuracy: float | None = None
    target_from: str | None = None      # a label: the target's value and the schedule are what count
    # the learning-rate schedule step by step (its progress, 0 to 1, at each step), replayed from the run
    # that set the target ((): the schedule runs over the epochs, or over the budget's seconds)
    schedule: tuple[float, ...] = ()
    # "replay": a run that takes its target also takes that run's schedule (above); "own": it follows its
    # own over its budget (StudyConfig.target_schedule); in the key only when "own"
    target_schedule: str = "replay"
    eval_every: int = 0
    eval_every_s: float = 0.0
    eval_samples: int = 0
    warmup: float = 0.0
    autocast: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "schedule", tuple(self.schedule))  # (a list when read back from a row)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["model_args"] = dict(self.model_args)
        d["dataset_args"] = dict(self.dataset_args)
        d["policy"] = {k: dict(v) for k, v in self.policy.items()}
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> RunConfig:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})

    def key(self) -> str:
        """Stable 16-hex-digit hash of what the run computes (the resume key of its result rows)."""
        d = self.to_dict()
        d.pop("batch_preset")
        if d["nodes"] == 1:
            d.pop("nodes")  # the keys of runs made before emulated nodes existed stay the same
        if d["parallelism"] == "data":
            d.pop("parallelism")  # likewise for runs made before model parallelism existed
        if d["sub_batches"] == 1:
            d.pop("sub_batches")
        if d["emulate_link"] is None:
            d.pop("emulate_link")
        if d["target_schedule"] == "replay":
            d.pop("target_schedule")  # the keys of runs made before "own" existed stay the same
        if not d["overlap"]:
            d.pop("overlap")  # synchronous streaming: the keys of runs made before overlap existed
        if d.get("parallelism") != LOCALSGD:  # (popped above for data parallelism)
            for field in _LOCALSGD_FIELDS:
                d.pop(field, None)
        if not d["policy"]:
            d.pop("policy")  # likewise for runs without per-layer overrides
        d.pop("target_from")  # a label: the target's value (resolved) is in target_loss
        for field, unset in _TTA_UNSET.items():  # likewise for runs without time to accuracy
            if d[field] == unset:
                d.pop(field)
        if "schedule" in d:
            d["schedule"] = list(d["schedule"])
        d["schema"] = SCHEMA
        blob = json.dumps(d, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(blob.encode()).hexdigest()[:16]

    @property
    def codec_label(self) -> str:
        return codec_label(self.codec, self.error_feedback) + policy_label(self.policy) + self.localsgd_label

    @property
    def localsgd_label(self) -> str:
        """`` [local SGD H=8]`` (`` [local SGD H=8, F=4]`` streaming) for a local SGD run, else ''."""
        return localsgd_label(self.to_dict())

    @property
    def time_to_accuracy(self) -> bool:
        """Whether the run validates while training and may stop before its epochs end."""
        return any(getattr(self, k) != v for k, v in _TTA_UNSET.items()) or self.target_from is not None

    @property
    def is_target_source(self) -> bool:
        """The run whose final validation loss is the target of its setting's other runs (``target_from``)."""
        return self.target_from is not None and self.codec == self.target_from and self.parallelism != LOCALSGD

    @property
    def awaits_target(self) -> bool:
        """A run whose target comes from its setting's ``target_from`` run, not yet known (:meth:`with_target`)."""
        return self.target_from is not None and not self.is_target_source and self.target_loss is None

    def target_setting(self) -> str:
        """What a run shares with the run its target comes from: everything but the codec (and what goes
        with it: algorithm, error feedback, per-layer policy), the target itself, the budget (which
        ``target_budget_factor`` scales) and the schedule rule; the seed included."""
        d = self.to_dict()
        for field in ("codec", "algorithm", "error_feedback", "policy", "batch_preset", "target_loss",
                      "schedule", "target_schedule", "time_budget_s") + _LOCALSGD_FIELDS:
            d.pop(field)
        if d["parallelism"] == LOCALSGD:  # local SGD takes its target from the data-parallel run's
            d["parallelism"] = "data"
        return json.dumps(d, sort_keys=True)

    def with_target(self, source: Mapping[str, Any]) -> RunConfig:
        """This run with the target of its ``target_from`` run, from that run's row: its final validation
        loss becomes ``target_loss``, and (``target_schedule`` "replay") the learning-rate schedule it
        followed over its budget, step by step (its ``schedule``), becomes this run's: the same learning rate
        at every step, and the schedule's end (that run's number of steps) a stop. With "own" this run keeps
        its own schedule, over its own budget of training seconds."""
        loss = (source.get("summary") or {}).get("final_val_loss")
        schedule = source.get("schedule")
        if not isinstance(loss, (int, float)) or not math.isfinite(loss) or not isinstance(schedule, list) \
                or not schedule:
            raise ValueError(f"the target of {self.describe().strip()} comes from the {self.target_from!r} run, "
                             f"which ended without a finite validation loss and its schedule "
                             f"(final_val_loss={loss!r}, {len(schedule) if isinstance(schedule, list) else 0} steps)")
        if self.target_schedule == "own":
            return dataclasses.replace(self, target_loss=float(loss))
        return dataclasses.replace(self, target_loss=float(loss), schedule=tuple(float(p) for p in schedule))

    def describe(self) -> str:
        return (f"{self.network:<10} {self.dataset:<9} K={self.world_size}"
                + (f" ({self.nodes} nodes)" if self.nodes > 1 else "")
                + (f" {self.parallelism}" + (f"/{self.sub_batches}" if self.sub_batches > 1 else "")
                   + (f" H={self.local_steps}" + (f" F={self.fragments}" if self.fragments > 1 else "")
                      if self.parallelism == LOCALSGD else "")
                   if self.parallelism != "data" else "")
                + (f" link={self.emulate_link}" if self.emulate_link else "") + f" {self.backend:<5} "
                f"b={self.batch_size:<4} {self.codec_label:<22} {self.algorithm:<14} "
                f"seed={self.seed} epochs={self.epochs}" + self._describe_target())

    def _describe_target(self) -> str:
        if not self.time_to_accuracy:
            return ""
        out = f" budget={self.time_budget_s:g}s" if self.time_budget_s is not None else ""
        if self.target_loss is not None:
            out += f" target loss={self.target_loss:.4g}"
        elif self.target_accuracy is not None:
            out += f" target acc={self.target_accuracy:.4g}"
        if self.is_target_source:
            out += " (sets the target)"
        return out


def codec_label(spec: str, error_feedback: bool = False) -> str:
    """Short label in the seed's style: 32bit, 16bit, QSGD 4bit/512, 1bitSGD*/64 +EF, ...; ``auto`` with
    the codecs it chooses among (``auto:bold``: "auto (bold: ...)", with error feedback on its biased ones)."""
    level = auto_level(spec)
    if level is not None:
        labels = "|".join(get_codec(s).label + (" +EF" if error_feedback and get_codec(s).biased else "")
                          for s in default_allow(level))
        return f"auto ({labels})" if level == DEFAULT_AUTO_LEVEL else f"auto ({level}: {labels})"
    if is_baseline(spec):  # PyTorch's hooks: PowerSGD's error feedback is its own, always on
        return get_baseline(spec).label
    return get_codec(spec).label + (" +EF" if error_feedback else "")


#: the study's name for lowbit.ddp.register(codec="auto") (a choice made while training, not a codec);
#: ``"auto:LEVEL"`` names its ``auto_level`` (``"auto:bold"``), and plain ``"auto"`` the default level
_LOCALSGD_FIELDS = ("local_steps", "fragments", "overlap", "outer_lr", "outer_momentum")


def localsgd_label(cfg: Mapping[str, Any]) -> str:
    """What a run's label adds for local SGD (a config dict: a RunConfig's or a result row's), else ''."""
    if cfg.get("parallelism") != LOCALSGD:
        return ""
    f, o = int(cfg.get("fragments") or 1), int(cfg.get("overlap") or 0)
    return (f" [local SGD H={cfg.get('local_steps')}" + (f", F={f}" if f > 1 else "") + (f", overlap {o}" if o else "")
            + "]")


#: RunConfig's time-to-accuracy fields and their values when unset (then left out of the run's key)
_TTA_UNSET = {"time_budget_s": None, "target_loss": None, "target_accuracy": None, "schedule": (),
              "eval_every": 0, "eval_every_s": 0.0, "eval_samples": 0, "warmup": 0.0, "autocast": None}


#: the study's error-feedback settings: ``auto`` is the seeds' practice (``Codec.seeds_feedback``: 1bitSGD
#: and top-k need it; QSGD is unbiased, and Dettmers used none), ``biased`` turns it on for every biased
#: codec (Dettmers too)


def _localsgd_feedback(ef: bool | str, codec: Codec) -> bool:
    """Error feedback of a local SGD run: ``auto`` is lowbit.localsgd's (:func:`lowbit.localsgd.config.
    auto_feedback`)."""
    if ef == "auto":
        return auto_feedback(codec)
    return _feedback(ef, codec)


def _feedback(ef: bool | str, codec: Codec) -> bool:
    if codec.sums_on_wire:
        return False
    if ef == "auto":
        return codec.seeds_feedback
    if ef == "biased":
        return codec.biased
    return bool(ef)


@functools.lru_cache(maxsize=None)
def _splits(network: str, parallelism: str) -> bool:
    """Whether ``network`` runs under ``parallelism`` (built once on the meta device)."""
    if parallelism in ("data", LOCALSGD):
        return True
    import torch


    with torch.device("meta"):
        model = build_model(network)
    try:
        check_splits(model, parallelism)
    except ValueError:
        return False
    return True


def expand_runs(cfg: StudyConfig) -> list[RunConfig]:
    """The grid's runs, ordered so runs of one (backend, world size, nodes) are contiguous (they share
    workers).

    Order: backend, world size, nodes, seed, data set, network, batch, codec, algorithm. Duplicates (e.g.
    fp32 under two algorithms: it always uses the native allreduce) are dropped, and so are world sizes
    that do not split into the number of nodes (one rank is one node).
    """
    runs: list[RunConfig] = []
    seen: set[str] = set()
    efs = cfg.error_feedback if isinstance(cfg.error_feedback, tuple) else (cfg.error_feedback,)
    links = cfg.emulate_link if isinstance(cfg.emulate_link, tuple) else (cfg.emulate_link,)
    for backend, ws, nodes, seed, dataset, network, batch, spec, policy, algorithm, par, ef, link in itertools.product(
        cfg.backends, sorted(cfg.world_sizes), sorted(cfg.nodes), cfg.seeds, cfg.datasets, cfg.networks,
        cfg.batch_sizes, cfg.codecs, cfg.policies, cfg.algorithms, cfg.parallelism, efs, links,
    ):
        if ws % nodes:  # (one rank is one node)
            continue
        local = par == LOCALSGD
        if local and (ws == 1 or nodes > 1 or policy or is_baseline(spec) or is_auto(spec)):
            continue  # local SGD: across workers, one codec for the whole weight change, lowbit's own
        if par != "data" and (ws == 1 or not _splits(network, par) or policy):
            continue  # one worker is data parallelism's baseline; networks that do not split are skipped
        if is_baseline(spec):
            if policy or par != "data" or ws == 1:
                continue  # PyTorch's DDP hooks: whole-model, data-parallel gradients, across workers
            codec = get_codec("fp32")  # (what the grid's rules below see: it sums on the wire, no policy)
        elif is_auto(spec):
            if policy or par != "data" or (ws == 1 and not cfg.compress_at_world_size_1):
                continue  # auto chooses the codecs itself, for data-parallel gradients, across workers
            codec = get_codec("fp32")  # (until it decides; it needs a collective algorithm all the same)
        else:
            codec = get_codec(spec)
        # overrides equal to the run's codec change nothing: drop them (one run, one key)
        policy = {k: {n: c for n, c in t.items() if c != codec.spec} for k, t in policy.items()}
        policy = {k: t for k, t in policy.items() if t}
        quantised = is_auto(spec) or not codec.sums_on_wire or any(
            not get_codec(c).sums_on_wire for t in policy.values() for c in t.values())
        if ws == 1 and not cfg.compress_at_world_size_1 and (codec.name != "fp32" or policy):
            continue
        if ws == 1 and codec.name == "fp32" and not cfg.compress_at_world_size_1:
            eff = "none"
        elif not quantised:
            eff = "allreduce"
        else:
            eff = algorithm
            if algorithm == "allreduce":
                if not any(a != "allreduce" for a in cfg.algorithms):
                    raise ValueError(
                        f"study config: 'algorithms': codec {spec!r} is quantised and 'allreduce' sums on the "
                        "wire, so it needs 'scatter_gather' or 'allgather' in 'algorithms'"
                    )
                continue
        try:
            per_worker = resolve_batch(batch, network, ws)
        except ValueError as exc:
            raise ValueError(f"study config: 'batch_sizes': {exc}") from None
        device = cfg.device if cfg.device != "auto" else ("cuda" if backend == "nccl" else "cpu")
        if par == "model":
            eff = "none"  # no parameter gradient crosses: the codec carries activations and their gradients
        if is_baseline(spec):
            eff = "torch"  # the hook's own collectives
        run_codec = spec if is_baseline(spec) or is_auto(spec) else codec.spec
        run = RunConfig(
            network=network, dataset=dataset, codec=run_codec,
            algorithm=eff,
            error_feedback=(get_baseline(spec).error_feedback if is_baseline(spec)
                            # auto: on when it may choose a biased codec (bold's 1bitSGD*), for those alone
                            # (lowbit.ddp's error_feedback="auto"); the default level's codecs take none
                            else any(get_codec(s).biased for s in default_allow(auto_level(spec)))
                            if is_auto(spec)
                            else _localsgd_feedback(ef, codec) if local
                            else _feedback(ef, codec) if (ws > 1 or cfg.compress_at_world_size_1) and par != "model"
                            else False),  # (activations take no error feedback)
            world_size=ws, backend=backend, device=device, batch_size=per_worker,
            epochs=seed_data.FIG3_RECIPE[network][0] if cfg.recipe == "fig3" else cfg.epochs,
            seed=seed, lr=seed_data.FIG3_RECIPE[network][1] if cfg.recipe == "fig3" else cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay,
            lr_schedule=cfg.lr_schedule, optimizer=cfg.optimizer, threads_per_worker=cfg.threads_per_worker,
            max_train_samples=cfg.max_train_samples, max_test_samples=cfg.max_test_samples,
            max_steps_per_epoch=cfg.max_steps_per_epoch, start_iter=cfg.start_iter,
            model_args=dict(cfg.model_args.get(network, {})),
            dataset_args=dict(cfg.dataset_args.get(dataset, {})),
            batch_preset=batch if isinstance(batch, str) else "",
            nodes=nodes,
            policy=dict(policy) if ws > 1 or cfg.compress_at_world_size_1 else {},
            parallelism=par,
            sub_batches=cfg.sub_batches if par == "hybrid" else 1, emulate_link=link,
            local_steps=cfg.local_steps if local else 0, fragments=cfg.fragments if local else 1,
            overlap=cfg.overlap if local else 0,
            outer_lr=cfg.outer_lr if local else 0.7, outer_momentum=cfg.outer_momentum if local else 0.9,
            time_budget_s=(cfg.time_budget_s * cfg.target_budget_factor
                           if cfg.time_budget_s is not None and cfg.target_from not in (None, run_codec)
                           else cfg.time_budget_s),
            target_loss=cfg.target_loss, target_accuracy=cfg.target_accuracy,
            target_from=cfg.target_from,
            # (the run that sets the target follows its own schedule either way: its key keeps no rule)
            target_schedule=("replay" if cfg.target_from == run_codec and not local else cfg.target_schedule),
            eval_every=cfg.eval_every, eval_every_s=cfg.eval_every_s,
            eval_samples=cfg.eval_samples, warmup=cfg.warmup, autocast=cfg.autocast,
        )
        k = run.key()
        if k not in seen:
            seen.add(k)
            runs.append(run)
    for i in range(len(cfg.also)):
        for run in expand_runs(cfg.also_config(i)):
            if cfg.target_from is not None:  # the main grid's target, and its budget for the runs that take it
                run = dataclasses.replace(run, target_from=cfg.target_from, time_budget_s=(
                    cfg.time_budget_s * cfg.target_budget_factor if cfg.time_budget_s is not None else None))
                if not run.is_target_source:
                    run = dataclasses.replace(run, target_schedule=cfg.target_schedule)
            k = run.key()
            if k not in seen:
                seen.add(k)
                runs.append(run)
    if not runs:
        why = []
        if not any(ws % n == 0 for ws in cfg.world_sizes for n in cfg.nodes):
            why.append(f"no world size in {sorted(cfg.world_sizes)} splits into nodes {sorted(cfg.nodes)}")
        if set(cfg.parallelism) - {"data"} and not any(_splits(n, p) for n in cfg.networks for p in cfg.parallelism):
            why.append(f"no network in {list(cfg.networks)} splits for parallelism {list(cfg.parallelism)} "
                       "(model: mlp; hybrid: alexnet, vgg*, small_cnn)")
        if set(cfg.world_sizes) == {1} and not cfg.compress_at_world_size_1:
            why.append("at world size 1 only fp32 runs (compress_at_world_size_1 is false)")
        raise ValueError("study config: the grid has no runs" + (": " + "; ".join(why) if why else ""))
    return runs


def check_runs(runs: Iterable[RunConfig]) -> None:
    """Build every (network, data set) pair on the meta device and push one batch through it.

    Catches a network that cannot take a data set's samples, or bad ``model_args`` / ``dataset_args``,
    before any run starts. Loads each real data set once (a second or so).
    """
    import torch


    checked: set[str] = set()
    data_cache: dict[str, Any] = {}
    for run in runs:
        dkey = json.dumps([run.dataset, run.dataset_args, run.network if run.dataset == "synthetic" else ""], sort_keys=True)
        pair = json.dumps([dkey, run.network, run.model_args], sort_keys=True)
        if pair in checked:
            continue
        checked.add(pair)
        if dkey not in data_cache:
            args = dict(run.dataset_args)
            if run.dataset == "synthetic":
                args.setdefault("model", run.network)
            try:
                data_cache[dkey] = load_dataset(run.dataset, seed=0, **args)
            except (TypeError, ValueError) as exc:
                raise ValueError(f"study config: 'dataset_args.{run.dataset}': {exc}") from None
        data = data_cache[dkey]
        try:
            with torch.device("meta"):
                model = build_model(run.network, num_classes=data.num_classes, in_shape=data.in_shape, **run.model_args)
            x = data.x_train[:2].to("meta")
            out = model(x)
        except (TypeError, ValueError, RuntimeError) as exc:
            raise ValueError(
                f"study config: network {run.network!r} (model_args {dict(run.model_args)}) cannot train on "
                f"data set {run.dataset!r} (samples {tuple(data.in_shape)}): {exc}"
            ) from None
        want = 3 if data.task == "sequence" else 2
        if out.dim() != want or out.shape[-1] != data.num_classes:
            raise ValueError(
                f"study config: network {run.network!r} gives outputs of shape {tuple(out.shape)} on data set "
                f"{run.dataset!r}, which wants {data.num_classes} classes ({data.task})"
            )
