"""Study configuration: a TOML file (or a named preset) plus command-line overrides -> runs.

A study is the grid networks x datasets x codecs x algorithms x world sizes x backends x batch sizes x
seeds, every point trained for ``epochs`` epochs. Example (every key is optional; the rest comes from
:class:`StudyConfig`'s defaults, or from the preset named by ``extends``)::

    extends = "default"                 # start from a preset (default, seeds, throughput, smoke)
    networks = ["mlp", "small_cnn"]     # lowbit.lab.models names
    datasets = ["digits", "mnist1d"]    # lowbit.lab.data names ("synthetic" = random inputs, throughput only)
    codecs = ["fp32", "qsgd:bits=4,bucket=512", "onebit:bucket=64"]   # lowbit.get_codec specs; "auto" is
                                        # lowbit.ddp's codec="auto", "auto:bold" its auto_level="bold"
    algorithms = ["scatter_gather"]     # for quantised codecs; fp32/fp16/bf16 always use the native allreduce
    world_sizes = [1, 2]
    nodes = [1]                         # [1, 2]: each world size also as 2 emulated nodes (docs/multinode.md)
    parallelism = ["data"]              # data | model | hybrid (Dettmers: docs/parallel.md); sub_batches = 1;
                                        # localsgd: local steps, the weight change exchanged in the codec every
                                        # local_steps steps (docs/localsgd.md; fragments, outer_lr, outer_momentum)
    backends = ["gloo"]                 # gloo | nccl | mpi
    batch_sizes = [32]                  # PER WORKER; or "fig4", "fig4:resnet110", "global:256" (see below)
    epochs = 4
    seeds = [0, 1, 2]
    error_feedback = "auto"             # auto: on for 1bitSGD and top-k, off for QSGD and Dettmers (as the seeds
                                        # ran them); "biased": on for every biased codec; true / false; or a
                                        # list of these (a grid dimension: ["auto", "biased"] adds Dettmers +EF)
    optimizer = "sgd"                   # sgd | rmsprop | adam (lr, momentum, weight_decay apply)
    policies = [{}, {by_type = {Conv2d = "fp32"}}]  # per-layer overrides of each codec: conv vs fc precision
    [model_args.mlp]                    # keyword arguments for build_model, per network
    hidden = [256, 256]

Batch sizes are per worker (per GPU). Named presets resolve per run:

* ``"fig4"`` — the seed's Figure 4 batch for the run's network and number of workers. Figure 4 lists
  the *global* minibatch (CNTK's), so the per-worker batch is that divided by the number of workers
  (VGG19 on 8 GPUs: 128 / 8 = 16 images per GPU, as the seed says).
* ``"fig4:NET"`` — Figure 4's row of network NET (e.g. ResNet-110's 128 for a small CIFAR-sized net).
* ``"global:N"`` — a fixed global batch of N, split over the workers.

At world size 1 only fp32 runs (the single-worker baseline of the scalability plots; compressing
nothing is meaningless there) unless ``compress_at_world_size_1 = true``.

Every error names the key (and value) at fault and is raised before any run starts. Reading a file or
a preset (``extends``, the overrides): :func:`lowbit.lab.study.loading.load_config`.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Iterable, Mapping
from typing import Any

from lowbit.auto.options import AUTO_LEVELS
from lowbit.lab.baselines import get_baseline, is_baseline
from lowbit.codecs.base import get_codec
from lowbit.comm.allreduce import algorithms as registered_algorithms
from lowbit.lab.data import available_datasets
from lowbit.lab.models import available_models
from lowbit.parallel.split import PARALLELISMS
from lowbit.lab.perfmodel.links import parse_emulated_link
from lowbit.lab.study import seed_data

__all__ = ["StudyConfig", "PRESETS", "policy_label", "auto_level", "is_auto", "SCHEMA",
           "MAX_WORLD_SIZE", "LOCALSGD", "STUDY_PARALLELISMS"]

#: Version of the run-key recipe and the result rows; bump when either changes meaning.
SCHEMA = 1

#: The largest world size (and number of emulated nodes) a study accepts: 65536 ranks, beyond the
#: largest jobs run (docs/study.md); a larger number is a typo, and would only fail when workers start.
MAX_WORLD_SIZE = 65536

BACKENDS = ("gloo", "nccl", "mpi")
SCHEDULES = ("cosine", "constant", "warmup_cosine")
AUTOCASTS = ("bf16",)
DEVICES = ("auto", "cpu", "cuda")
OPTIMIZERS = ("sgd", "rmsprop", "adam")

PRESETS = ("default", "seeds", "throughput", "smoke", "fig3", "tta", "tta_cpu", "localsgd")

#: the study's parallelisms: lowbit.parallel's (data, model, hybrid) and local SGD (lowbit.localsgd)
LOCALSGD = "localsgd"
STUDY_PARALLELISMS = PARALLELISMS + (LOCALSGD,)
#: the keys of a table of ``also`` (every key but these): a grid of its own, unioned with the main one
_NOT_IN_ALSO = ("name", "description", "also", "target_from", "target_budget_factor", "target_schedule")

#: How the runs that take a target follow a learning-rate schedule (StudyConfig.target_schedule)
TARGET_SCHEDULES = ("replay", "own")

_LIST_KEYS = ("networks", "datasets", "codecs", "algorithms", "world_sizes", "backends", "batch_sizes", "seeds",
              "nodes", "policies", "parallelism")
_POLICY_KEYS = ("by_type", "by_name")


def _known_models() -> list[str]:

    return available_models()


def _known_datasets() -> list[str]:

    return available_datasets()


@dataclasses.dataclass(frozen=True)
class StudyConfig:
    """The whole grid and the training recipe shared by its runs. Validated on construction."""

    name: str = "study"
    description: str = ""
    networks: tuple[str, ...] = ("mlp", "small_cnn")
    datasets: tuple[str, ...] = ("digits",)
    codecs: tuple[str, ...] = ("fp32", "qsgd:bits=8,bucket=512")
    algorithms: tuple[str, ...] = ("scatter_gather",)
    world_sizes: tuple[int, ...] = (1, 2)
    nodes: tuple[int, ...] = (1,)  # (emulated) nodes the ranks are split into: docs/multinode.md
    # data: DDP with lowbit's hook; model: every linear layer split over the ranks, activations in the
    # codec; hybrid: features data-parallel, classifier model-parallel (docs/parallel.md)
    parallelism: tuple[str, ...] = ("data",)
    sub_batches: int = 1           # hybrid runs: sub-batches whose transfers overlap compute
    # localsgd runs (lowbit.localsgd): H inner steps a period, F streaming fragments, the inner steps a
    # fragment's exchange overlaps (Streaming DiLoCo; 0: synchronous), the outer SGD's learning rate
    # and Nesterov momentum (DiLoCo's 0.7 / 0.9)
    local_steps: int = 0
    fragments: int = 1
    overlap: int = 0
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    # per-layer overrides of the run's codec ({} = none): {by_type = {Conv2d = "fp32"}}, {by_name = {...}}
    policies: tuple[Mapping[str, Mapping[str, str]], ...] = ({},)
    backends: tuple[str, ...] = ("gloo",)
    batch_sizes: tuple[int | str, ...] = (32,)
    epochs: int = 3
    seeds: tuple[int, ...] = (0,)
    error_feedback: bool | str | tuple[bool | str, ...] = "auto"
    compress_at_world_size_1: bool = False
    optimizer: str = "sgd"
    lr: float = 0.05
    momentum: float = 0.9
    weight_decay: float = 0.0
    lr_schedule: str = "cosine"
    threads_per_worker: int = 1
    max_train_samples: int = 0
    max_test_samples: int = 0
    max_steps_per_epoch: int = 0
    device: str = "auto"
    start_iter: int = 2
    # gloo only: lowbit's collectives cross an emulated link of this speed ("400mbit", "50MB/s"; none:
    # the real one) and, after "@", this one-way latency per collective ("100mbit@25ms"; none: 0), and
    # every run registers lowbit's hook up front so that fp32 crosses it too; a list of links is a grid
    # dimension
    emulate_link: str | tuple[str, ...] | None = None
    # "fig3": each network's epochs and initial learning rate from the Grubic paper's Figure 3 (over
    # `epochs` and `lr`; networks it does not list are an error)
    recipe: str | None = None
    # Time to accuracy (docs/study.md): each run stops at its target or at its budget of training seconds,
    # validating on a fixed held-out subset every `eval_every` steps or `eval_every_s` training seconds
    time_budget_s: float | None = None
    target_loss: float | None = None        # validation loss to reach (or:)
    target_accuracy: float | None = None    # validation accuracy to reach, a fraction
    # a `codecs` entry run first per setting and seed: its final validation loss is the target of the others,
    # and its number of steps their learning-rate schedule's length
    target_from: str | None = None
    # the budget of the runs whose target comes from `target_from`, as a multiple of `time_budget_s`: a
    # configuration slower per step than the one that set the target needs more time for the same schedule
    # (it ends at the same step, where the others stop at the latest)
    target_budget_factor: float = 1.0
    # the learning-rate schedule of the runs whose target comes from `target_from`: "replay" (the target
    # run's, step by step; its end a stop) or "own" (each run's own, over its own budget of training
    # seconds, time_budget_s x target_budget_factor, as the target run's runs over its budget)
    target_schedule: str = "replay"
    eval_every: int = 0
    eval_every_s: float = 0.0
    eval_samples: int = 0                   # the fixed subset: this many test samples, evenly spaced (0: all)
    warmup: float = 0.0                     # lr_schedule "warmup_cosine": the warm-up's share of the schedule
    autocast: str | None = None             # "bf16": forward passes under CUDA autocast
    model_args: Mapping[str, Mapping[str, Any]] = dataclasses.field(default_factory=dict)
    dataset_args: Mapping[str, Mapping[str, Any]] = dataclasses.field(default_factory=dict)
    # more grids, unioned with this one: each table overrides keys of this config for its own runs (local
    # SGD's codecs beside DDP's, a streaming row: presets/localsgd.toml); they share its target
    also: tuple[Mapping[str, Any], ...] = ()

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):  # every number of the config, nested tables and lists too
            _check_finite(f.name, getattr(self, f.name))
        for key in _LIST_KEYS:
            value = getattr(self, key)
            if isinstance(value, (str, int)) or not isinstance(value, Iterable):
                raise ValueError(f"study config: {key!r} must be a list, got {value!r}")
            value = tuple(value)
            if not value:
                raise ValueError(f"study config: {key!r} is empty")
            if len(set(map(repr, value))) != len(value):
                raise ValueError(f"study config: {key!r} lists a value twice: {list(value)}")
            object.__setattr__(self, key, value)
        _check_names("networks", self.networks, _known_models(), "model")
        _check_names("datasets", self.datasets, _known_datasets(), "data set")
        _check_names("algorithms", self.algorithms, registered_algorithms(), "algorithm")
        _check_names("backends", self.backends, BACKENDS, "backend")
        canon = []
        for spec in self.codecs:
            if not isinstance(spec, str):
                raise ValueError(f"study config: 'codecs' entries are spec strings, got {spec!r}")
            try:
                level = auto_level(spec)  # lowbit.ddp's codec="auto": chosen per tensor while training
            except ValueError as exc:
                raise ValueError(f"study config: 'codecs': {exc}") from None
            if level is not None:
                canon.append(auto_spec(level))
                continue
            if is_baseline(spec):  # PyTorch's own hooks (lowbit.lab.baselines): torch:fp16, torch:powersgd:rank=4
                try:
                    canon.append(get_baseline(spec).spec)
                except ValueError as exc:
                    raise ValueError(f"study config: 'codecs': {exc}") from None
                continue
            try:
                canon.append(get_codec(spec).spec)
            except ValueError as exc:
                raise ValueError(f"study config: 'codecs': {spec!r}: {exc}") from None
        if len(set(canon)) != len(canon):
            raise ValueError(f"study config: 'codecs' lists the same codec twice: {list(self.codecs)}")
        object.__setattr__(self, "codecs", tuple(c if is_auto(c) or is_baseline(c) else s
                                                 for c, s in zip(canon, self.codecs)))
        for ws in self.world_sizes:
            _check_int("world_sizes", ws, 1, MAX_WORLD_SIZE, "ranks, the most a study starts")
        for nn in self.nodes:
            _check_int("nodes", nn, 1, MAX_WORLD_SIZE, "nodes, one rank each at most")
        _check_names("parallelism", self.parallelism, STUDY_PARALLELISMS, "parallelism")
        self._check_localsgd()
        _check_int("sub_batches", self.sub_batches, 1)
        canon_pol = []
        for pol in self.policies:
            canon_pol.append(_check_policy(pol))
        object.__setattr__(self, "policies", tuple(canon_pol))
        for seed in self.seeds:
            _check_int("seeds", seed, 0)
        for b in self.batch_sizes:
            _check_batch(b)
        _check_int("epochs", self.epochs, 1)
        _check_int("threads_per_worker", self.threads_per_worker, 0)
        _check_int("max_train_samples", self.max_train_samples, 0)
        _check_int("max_test_samples", self.max_test_samples, 0)
        _check_int("max_steps_per_epoch", self.max_steps_per_epoch, 0)
        _check_int("start_iter", self.start_iter, 0)
        if self.recipe is not None:
            if self.recipe != "fig3":
                raise ValueError(f"study config: 'recipe' must be \"fig3\" (the Grubic paper's Figure 3) or absent, "
                                 f"got {self.recipe!r}")
            missing = [n for n in self.networks if n not in seed_data.FIG3_RECIPE]
            if missing:
                raise ValueError(f"study config: 'recipe' \"fig3\" has no epochs / learning rate for {missing}; "
                                 f"Figure 3 lists {sorted(seed_data.FIG3_RECIPE)}")
        if self.emulate_link is not None:
            links = self.emulate_link
            if isinstance(links, (list, tuple)):
                if not links or len(set(links)) != len(links):
                    raise ValueError(f"study config: 'emulate_link' as a list must be non-empty, without repeats: {links!r}")
                object.__setattr__(self, "emulate_link", tuple(links))
            for link in links if isinstance(links, (list, tuple)) else (links,):
                if not isinstance(link, str):
                    raise ValueError(f"study config: 'emulate_link' is a speed such as \"400mbit\", with a "
                                     f"latency after '@' if any (\"100mbit@25ms\"), or a list of them, got {link!r}")
                try:
                    parse_emulated_link(link)
                except ValueError as exc:
                    raise ValueError(f"study config: 'emulate_link': {exc}") from None
            if any(b != "gloo" for b in self.backends):
                raise ValueError("study config: 'emulate_link' emulates a link for gloo (CPU) runs; for NCCL "
                                 "use a real slow path (docs/multinode.md: sockets, emulated nodes)")
        if "torch:bf16" in self.codecs and any(b != "nccl" for b in self.backends):
            raise ValueError("study config: 'codecs': torch:bf16 (PyTorch's bf16_compress_hook) runs on NCCL only; "
                             f"backends are {list(self.backends)} (torch:fp16 runs on gloo)")
        efs = self.error_feedback
        if isinstance(efs, (list, tuple)):
            if not efs or len(set(map(repr, efs))) != len(efs):
                raise ValueError(f"study config: 'error_feedback' as a list must be non-empty, without repeats: {list(efs)}")
            object.__setattr__(self, "error_feedback", tuple(efs))
        for ef in (self.error_feedback if isinstance(self.error_feedback, tuple) else (self.error_feedback,)):
            if ef not in EF_CHOICES or isinstance(ef, int) and not isinstance(ef, bool):
                raise ValueError("study config: 'error_feedback' must be true, false, \"auto\" or \"biased\" (or a list "
                                 f"of them), got {ef!r}")
        if not isinstance(self.compress_at_world_size_1, bool):
            raise ValueError(f"study config: 'compress_at_world_size_1' must be true or false, got {self.compress_at_world_size_1!r}")
        _check_names("optimizer", (self.optimizer,), OPTIMIZERS, "optimizer")
        _check_names("lr_schedule", (self.lr_schedule,), SCHEDULES, "schedule")
        _check_names("device", (self.device,), DEVICES, "device")
        for key in ("lr", "momentum", "weight_decay"):
            v = getattr(self, key)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0 or v != v:
                raise ValueError(f"study config: {key!r} must be a number >= 0, got {v!r}")
            object.__setattr__(self, key, float(v))
        if self.lr == 0:
            raise ValueError("study config: 'lr' must be > 0")
        self._check_time_to_accuracy()
        self._check_also()
        for key, names, what in (("model_args", _known_models(), "model"), ("dataset_args", _known_datasets(), "data set")):
            table = getattr(self, key)
            if not isinstance(table, Mapping):
                raise ValueError(f"study config: {key!r} must be a table of tables, got {table!r}")
            for name, args in table.items():
                if name not in names:
                    raise ValueError(f"study config: '{key}.{name}': unknown {what} {name!r}; known: {', '.join(names)}")
                if not isinstance(args, Mapping):
                    raise ValueError(f"study config: '{key}.{name}' must be a table, got {args!r}")
                try:
                    json.dumps(dict(args))
                except TypeError:
                    raise ValueError(f"study config: '{key}.{name}' holds a value that is not plain data: {args!r}") from None
            object.__setattr__(self, key, {k: dict(v) for k, v in table.items()})

    def _check_localsgd(self) -> None:
        _check_int("local_steps", self.local_steps, 0)
        _check_int("fragments", self.fragments, 1)
        _check_int("overlap", self.overlap, 0)
        if LOCALSGD in self.parallelism:
            if self.local_steps < 1:
                raise ValueError("study config: parallelism \"localsgd\" needs 'local_steps' (inner steps between "
                                 "two outer synchronisations), an integer >= 1")
            if self.fragments > self.local_steps:
                raise ValueError(f"study config: 'fragments' ({self.fragments}) must be at most 'local_steps' "
                                 f"({self.local_steps})")
            if self.overlap >= self.local_steps // self.fragments:
                raise ValueError(f"study config: 'overlap' ({self.overlap}) must be less than local_steps // "
                                 f"fragments ({self.local_steps // self.fragments}): one fragment's exchange lands "
                                 "before the next one's starts")
        for key, lo, hi in (("outer_lr", 0.0, math.inf), ("outer_momentum", 0.0, 1.0)):
            v = getattr(self, key)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not lo <= v < hi or (key == "outer_lr" and v == 0):
                raise ValueError(f"study config: {key!r} must be a number "
                                 + ("> 0" if key == "outer_lr" else "in [0, 1)") + f", got {v!r}")
            object.__setattr__(self, key, float(v))

    def _check_also(self) -> None:
        also = self.also
        if isinstance(also, Mapping) or not isinstance(also, (list, tuple)):
            raise ValueError(f"study config: 'also' is a list of tables ([[also]] in TOML), got {also!r}")
        object.__setattr__(self, "also", tuple(also))
        for i, t in enumerate(self.also):
            if not isinstance(t, Mapping):
                raise ValueError(f"study config: 'also' entry {i} must be a table, got {t!r}")
            bad = sorted(k for k in t if k in _NOT_IN_ALSO or k not in _field_names())
            if bad:
                raise ValueError(f"study config: 'also' entry {i}: key {bad[0]!r} cannot be set there (an 'also' table "
                                 f"sets grid keys; not {', '.join(_NOT_IN_ALSO)})")
            try:
                self.also_config(i)
            except ValueError as exc:
                raise ValueError(f"study config: 'also' entry {i}: {exc}") from None

    def also_config(self, i: int) -> StudyConfig:
        """The config of ``also`` entry ``i``: this one with the entry's keys (no target of its own: its runs
        take this config's, :func:`expand_runs`)."""
        return dataclasses.replace(self, also=(), target_from=None, target_budget_factor=1.0, target_schedule="replay",
                                   **dict(self.also[i]))

    def _check_time_to_accuracy(self) -> None:
        for key in ("time_budget_s", "target_loss", "target_accuracy"):
            v = getattr(self, key)
            if v is None:
                continue
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < math.inf:
                raise ValueError(f"study config: {key!r} must be a number > 0 (or absent), got {v!r}")
            object.__setattr__(self, key, float(v))
        if self.target_accuracy is not None and self.target_accuracy > 1:
            raise ValueError(f"study config: 'target_accuracy' is a fraction (0.5 = 50%), got {self.target_accuracy!r}")
        given = [k for k in ("target_loss", "target_accuracy", "target_from") if getattr(self, k) is not None]
        if len(given) > 1:
            raise ValueError(f"study config: give one target, not {' and '.join(map(repr, given))}")
        if self.target_from is not None:
            names = {c if is_auto(c) or is_baseline(c) else get_codec(c).spec: c for c in self.codecs}
            spec = self.target_from
            try:
                canon = (auto_spec(auto_level(spec)) if is_auto(spec)
                         else get_baseline(spec).spec if is_baseline(spec) else get_codec(spec).spec)
            except (ValueError, AttributeError) as exc:
                raise ValueError(f"study config: 'target_from': {spec!r}: {exc}") from None
            if canon not in names:
                raise ValueError(f"study config: 'target_from' {spec!r} is not one of 'codecs' ({list(self.codecs)}): "
                                 "the target comes from a configuration the study runs")
            object.__setattr__(self, "target_from", canon)  # (as the runs name their codec)
        v = self.target_budget_factor
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 1 <= v < math.inf:
            raise ValueError(f"study config: 'target_budget_factor' must be a number >= 1, got {v!r}")
        object.__setattr__(self, "target_budget_factor", float(v))
        if v != 1 and (self.target_from is None or self.time_budget_s is None):
            raise ValueError("study config: 'target_budget_factor' scales the budget of the runs that take their "
                             "target from 'target_from': it needs both 'target_from' and 'time_budget_s'")
        if self.target_schedule not in TARGET_SCHEDULES:
            raise ValueError(f"study config: 'target_schedule' must be one of {', '.join(map(repr, TARGET_SCHEDULES))}, "
                             f"got {self.target_schedule!r}")
        if self.target_schedule == "own" and (self.target_from is None or self.time_budget_s is None):
            raise ValueError("study config: 'target_schedule' \"own\" runs each run's schedule over its own budget "
                             "of the runs that take their target from 'target_from': it needs both 'target_from' "
                             "and 'time_budget_s'")
        _check_int("eval_every", self.eval_every, 0)
        _check_int("eval_samples", self.eval_samples, 0)
        v = self.eval_every_s
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < math.inf:
            raise ValueError(f"study config: 'eval_every_s' must be a number >= 0, got {v!r}")
        object.__setattr__(self, "eval_every_s", float(v))
        if given and not (self.eval_every or self.eval_every_s):
            raise ValueError(f"study config: {given[0]!r} needs validation while training: set 'eval_every' (steps) "
                             "or 'eval_every_s' (training seconds)")
        v = self.warmup
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < 1:
            raise ValueError(f"study config: 'warmup' is the warm-up's share of the schedule, in [0, 1), got {v!r}")
        object.__setattr__(self, "warmup", float(v))
        if self.warmup and self.lr_schedule != "warmup_cosine":
            raise ValueError("study config: 'warmup' applies to lr_schedule = \"warmup_cosine\" only")
        if self.autocast is not None:
            _check_names("autocast", (self.autocast,), AUTOCASTS, "autocast")
            if self.device == "cpu" or (self.device == "auto" and any(b != "nccl" for b in self.backends)):
                raise ValueError("study config: 'autocast' runs forward passes under CUDA autocast: it needs "
                                 "device = \"cuda\" (or the nccl backend)")
            if any(p != "data" for p in self.parallelism):
                raise ValueError("study config: 'autocast' applies to data parallelism only")

    @property
    def time_to_accuracy(self) -> bool:
        """Whether runs validate while training and may stop early (a target, a budget, an eval cadence)."""
        return any(getattr(self, k) is not None for k in ("time_budget_s", "target_loss", "target_accuracy",
                                                            "target_from")) or bool(self.eval_every or self.eval_every_s)

    # -------------------------------------------------------------------------------- dict view
    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        for key in _LIST_KEYS:
            d[key] = list(d[key])
        return d

    def replace(self, **changes: Any) -> StudyConfig:
        unknown = sorted(set(changes) - {f.name for f in dataclasses.fields(self)})
        if unknown:
            raise ValueError(f"study config: unknown key {unknown[0]!r} (known keys: {', '.join(_field_names())})")
        return dataclasses.replace(self, **changes)


def _field_names() -> list[str]:
    return [f.name for f in dataclasses.fields(StudyConfig)]


def _check_names(key: str, values: Iterable[Any], known: Iterable[str], what: str) -> None:
    known = list(known)
    for v in values:
        if v not in known:
            raise ValueError(f"study config: {key!r}: unknown {what} {v!r}; known: {', '.join(known)}")


def _check_policy(pol: Any) -> dict[str, dict[str, str]]:
    """A ``policies`` entry: a table with ``by_type`` and/or ``by_name`` tables of codec specs; canonical."""
    if not isinstance(pol, Mapping):
        raise ValueError(f"study config: 'policies' entries are tables like {{by_type = {{Conv2d = \"fp32\"}}}}, "
                         f"got {pol!r}")
    unknown = sorted(set(pol) - set(_POLICY_KEYS))
    if unknown:
        raise ValueError(f"study config: 'policies': unknown key(s) {unknown}; a policy has {list(_POLICY_KEYS)} "
                         "(the default codec comes from 'codecs')")
    out: dict[str, dict[str, str]] = {}
    for key in _POLICY_KEYS:
        table = pol.get(key, {})
        if not isinstance(table, Mapping) or not all(isinstance(k, str) and isinstance(v, str) for k, v in table.items()):
            raise ValueError(f"study config: 'policies': {key} must map names to codec specs, got {table!r}")
        try:
            canon = {k: get_codec(v).spec for k, v in table.items()}
        except ValueError as exc:
            raise ValueError(f"study config: 'policies': {key}: {exc}") from None
        if canon:
            out[key] = dict(sorted(canon.items()))
    return out


def policy_label(policy: Mapping[str, Mapping[str, str]]) -> str:
    """Short text of a run's per-layer overrides, e.g. ``[Conv2d 32bit]`` ('' for none)."""
    parts = [f"{k} {get_codec(v).label}" for table in (policy.get("by_type", {}), policy.get("by_name", {}))
             for k, v in table.items()]
    return f" [{', '.join(parts)}]" if parts else ""


def _check_int(key: str, value: Any, lo: int, hi: int | None = None, what: str = "") -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < lo:
        raise ValueError(f"study config: {key!r} must be an integer >= {lo}, got {value!r}")
    if hi is not None and value > hi:
        raise ValueError(f"study config: {key!r}: {value} is more than any machine starts; at most {hi} "
                         f"{what} (lowbit.lab.study.config.MAX_WORLD_SIZE)")


def _check_finite(key: str, value: Any) -> None:
    """A number anywhere in a config key's value (lists and tables included) must be finite: an infinite
    learning rate trains nothing, and JSON (the run keys, the result rows) has no inf or NaN."""
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"study config: {key!r} must be a finite number, got {value!r}")
    if isinstance(value, Mapping):
        for k, v in value.items():
            _check_finite(f"{key}.{k}", v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            _check_finite(key, v)


def _check_batch(b: Any) -> None:
    if isinstance(b, int) and not isinstance(b, bool):
        if b < 1:
            raise ValueError(f"study config: 'batch_sizes' must be >= 1, got {b}")
        return
    if isinstance(b, str):
        if b == "fig4":
            return
        if b.startswith("fig4:"):
            net = b.split(":", 1)[1]
            if net not in seed_data.FIG4_BATCH:
                raise ValueError(
                    f"study config: 'batch_sizes': {b!r}: Figure 4 has no network {net!r} "
                    f"(it has {', '.join(sorted(seed_data.FIG4_BATCH))})"
                )
            return
        if b.startswith("global:"):
            n = b.split(":", 1)[1]
            if n.isdigit() and int(n) >= 1:
                return
    raise ValueError(
        f"study config: 'batch_sizes': {b!r} is neither a per-worker size nor a preset "
        "('fig4', 'fig4:NETWORK', 'global:N')"
    )


def resolve_batch(preset: int | str, network: str, world_size: int) -> int:
    """Per-worker batch size of a ``batch_sizes`` entry for one run (see the module doc)."""
    if isinstance(preset, int):
        return preset
    if preset == "fig4":
        return seed_data.fig4_batch_per_worker(network, world_size)
    if preset.startswith("fig4:"):
        return seed_data.fig4_batch_per_worker(preset.split(":", 1)[1], world_size)
    total = int(preset.split(":", 1)[1])
    if total % world_size:
        raise ValueError(f"batch preset {preset!r}: {total} samples do not split over {world_size} workers")
    return total // world_size


# ------------------------------------------------------------------------------------ codec="auto" in a study
AUTO = "auto"
#: lowbit.ddp.DDPConfig's default ``auto_level``: the level a plain ``"auto"`` runs (and spells it)
DEFAULT_AUTO_LEVEL = "conservative"


def is_auto(spec: object) -> bool:
    """Whether a study codec entry (or a run's codec) is lowbit.ddp's ``codec="auto"``, at any level."""
    return isinstance(spec, str) and spec.strip().lower().partition(":")[0].strip() == AUTO


def auto_level(spec: object) -> str | None:
    """The ``auto_level`` a study codec entry names: ``"auto"`` the default (conservative), ``"auto:bold"``
    bold; None when the entry is not ``auto``. A ``ValueError`` names an unknown level and the known ones."""
    if not is_auto(spec):
        return None
    _, sep, level = str(spec).strip().lower().partition(":")
    level = level.strip()
    if not sep:
        return DEFAULT_AUTO_LEVEL
    if level not in AUTO_LEVELS:
        raise ValueError(f"{spec!r}: codec='auto''s level must be one of {', '.join(AUTO_LEVELS)} ('auto:bold'; "
                         f"plain 'auto' is the default, {DEFAULT_AUTO_LEVEL}), got {level!r}")
    return level


def auto_spec(level: str) -> str:
    """The canonical study name of ``codec="auto"`` at ``level``: ``"auto"`` for the default level (the
    name, and so the run keys, of the runs made before levels existed), else ``"auto:LEVEL"``."""
    return AUTO if level == DEFAULT_AUTO_LEVEL else f"{AUTO}:{level}"

#: RunConfig's local SGD fields (in a run's key only when its parallelism is localsgd)


EF_CHOICES = (True, False, "auto", "biased")
