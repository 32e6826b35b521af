"""One run of the study on this rank: data, model, DDP + lowbit (or model / hybrid parallelism, or local
SGD: lowbit.localsgd), the
training loop with its timing, and the run's row (:func:`train_run`). Scheduling runs onto worker
groups is :mod:`lowbit.study.runner`; what each number means is :mod:`lowbit.study.metrics`."""

from __future__ import annotations

import dataclasses
import datetime as _dt
import json
import math
import os
import time
import uuid
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import lowbit.baselines
import lowbit.ddp
import lowbit.localsgd
from lowbit.comm import collectives as C
from lowbit.codecs.base import get_codec
from lowbit.comm.allreduce import get_algorithm
from lowbit.data import load_dataset
from lowbit.data.sharding import ShardedLoader
from lowbit.models import build_model
from lowbit.parallel import Hybrid, ParallelComm, hybrid_parts, model_parallel_chain, parallelize
from lowbit.perfmodel.links import parse_bandwidth
from lowbit.policy import Policy
from lowbit.study.config import DEFAULT_AUTO_LEVEL, LOCALSGD, auto_level
from lowbit.study.runs import RunConfig
from lowbit.study.metrics import TailClock, environment, fwd_bwd_gflop_per_sample
from lowbit.study.tta import TARGET_TOLERANCE, tolerant_target

__all__ = ["train_run", "timed_epochs", "make_optimizer", "now", "lr_factor", "validation_subset", "time_to_target"]

_AUTOCAST_DTYPES = {"bf16": torch.bfloat16}  # config.AUTOCASTS -> the dtype of CUDA autocast

_METRIC_FIELDS = ("train_s", "exposed_comm_s", "encode_s", "comm_s", "decode_s", "bytes_sent", "loss_sum",
                  "steps", "samples", "calls")


def now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


_DATA_CACHE: dict[str, Any] = {}


def _load_data(run: RunConfig) -> Any:

    args = dict(run.dataset_args)
    if run.dataset == "synthetic":
        args.setdefault("model", run.network)
    key = json.dumps([run.dataset, run.seed, args], sort_keys=True)
    if key not in _DATA_CACHE:
        if len(_DATA_CACHE) > 8:
            _DATA_CACHE.clear()
        _DATA_CACHE[key] = load_dataset(run.dataset, seed=run.seed, **args)
    return _DATA_CACHE[key]


_GFLOP_CACHE: dict[str, float | None] = {}


def _gflop(run: RunConfig, data: Any, make_model: Callable[[], nn.Module], x: torch.Tensor) -> float | None:
    key = json.dumps([run.network, run.model_args, list(data.in_shape), data.num_classes, str(x.dtype)], sort_keys=True)
    if key not in _GFLOP_CACHE:
        _GFLOP_CACHE[key] = fwd_bwd_gflop_per_sample(make_model, x)
    return _GFLOP_CACHE[key]


def _loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    # (N, C) vs (N,) for classification; (N, T, C) vs (N, T) for sequences.
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def make_optimizer(run: RunConfig, params: Any) -> torch.optim.Optimizer:
    """The run's optimizer: ``sgd`` (momentum), ``rmsprop`` (alpha 0.9, the seeds' LSTM/Inception
    recipes, with the run's momentum) or ``adam`` (default betas; ``momentum`` unused)."""
    if run.optimizer == "sgd":
        return torch.optim.SGD(params, lr=run.lr, momentum=run.momentum, weight_decay=run.weight_decay)
    if run.optimizer == "rmsprop":
        return torch.optim.RMSprop(params, lr=run.lr, alpha=0.9, momentum=run.momentum, weight_decay=run.weight_decay)
    if run.optimizer == "adam":
        return torch.optim.Adam(params, lr=run.lr, weight_decay=run.weight_decay)
    raise ValueError(f"unknown optimizer {run.optimizer!r}")


def _evaluate(module: nn.Module, x: torch.Tensor, y: torch.Tensor, rank: int, world: int,
              device: torch.device) -> tuple[float, float, float]:
    """Test loss, accuracy and top-5 accuracy over the whole test set; each rank takes every world-th
    sample. (Top-5 is NaN with 5 classes or fewer, where it is always 1.)"""
    xs, ys = x[rank::world], y[rank::world]
    correct = top5 = count = loss_sum = 0.0
    was_training = module.training
    module.eval()
    with torch.no_grad():
        for i in range(0, xs.shape[0], 1024):
            xb, yb = xs[i : i + 1024].to(device), ys[i : i + 1024].to(device)
            logits = module(xb)
            flat_y = yb.reshape(-1)
            loss_sum += float(nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), flat_y, reduction="sum"))
            flat = logits.reshape(-1, logits.shape[-1])
            correct += float((flat.argmax(1) == flat_y).sum())
            if flat.shape[-1] > 5:
                top5 += float((flat.topk(5, dim=1).indices == flat_y[:, None]).any(dim=1).sum())
            count += flat_y.numel()
    module.train(was_training)
    classes = int(logits.shape[-1]) if xs.shape[0] else 0
    t = torch.tensor([correct, top5, count, loss_sum], dtype=torch.float64, device=device)
    if world > 1:
        dist.all_reduce(t)
    correct, top5, count, loss_sum = t.tolist()
    if not count:
        return math.nan, math.nan, math.nan
    return loss_sum / count, correct / count, (top5 / count if classes > 5 else math.nan)


def _mean_over_ranks(values: dict[str, float], world: int, device: torch.device) -> dict[str, float]:
    t = torch.tensor([float(values[k]) for k in _METRIC_FIELDS], dtype=torch.float64, device=device)
    if world > 1:
        dist.all_reduce(t)
    summed = dict(zip(_METRIC_FIELDS, t.tolist()))
    out = {k: v / world for k, v in summed.items()}
    out["samples"] = summed["samples"]          # global samples: a sum, not a mean
    out["loss_sum"] = summed["loss_sum"]
    out["steps_total"] = summed["steps"]
    return out


def ddp_options(run: RunConfig, policy: Policy | None, algorithm: str, node_size: int | None) -> lowbit.ddp.DDPConfig:
    """lowbit's DDP hook options for a data-parallel run: its codec (or ``policy``), or ``codec="auto"`` at
    the level its name gives (``"auto:bold"``: ``auto_level="bold"``, with error feedback for the biased
    codecs it may choose, lowbit.ddp's ``error_feedback="auto"``)."""
    level = auto_level(run.codec)  # None: not auto
    # (hierarchical in one node keeps the hook, so its bytes and times are measured: one_node_native)
    return lowbit.ddp.DDPConfig(codec=None if policy else run.codec if level is None else "auto", policy=policy,
                                algorithm=algorithm,
                                error_feedback="auto" if level is not None and run.error_feedback
                                else run.error_feedback, start_iter=run.start_iter, seed=run.seed,
                                node_size=node_size, one_node_native=False, auto_level=level or DEFAULT_AUTO_LEVEL)


class _Trainer:
    """How one run trains on this rank under its parallelism: the module the loop drives, the DDP hook's
    state (gradients), the activations' ParallelComm (model / hybrid), and one step, the loader, the
    evaluation and the counters each of them needs."""

    def __init__(self, run: RunConfig, model: nn.Module, rank: int, world: int, device: torch.device) -> None:

        self.run, self.model, self.rank, self.world, self.device = run, model, rank, world, device
        cuda = device.type == "cuda"
        self.state: Any = None
        self.comm: Any = None    # model / hybrid parallelism: the activations' ParallelComm
        self.hybrid: Any = None
        self.lsgd: lowbit.localsgd.LocalSGD | None = None  # local SGD: the outer synchronisation
        self.compressed = 0      # parameters whose gradients cross compressed
        self.net: nn.Module = model
        if world == 1:
            return
        if run.parallelism == LOCALSGD:
            # every rank its own group: inner steps alone, the weight change exchanged every local_steps
            # steps in the run's codec (the inner optimizer is stepped by the loop: after_step counts it)
            self.lsgd = self.state = lowbit.localsgd.LocalSGD(
                model, None, local_steps=run.local_steps, fragments=run.fragments, codec=run.codec,
                error_feedback=run.error_feedback, algorithm="auto" if run.algorithm == "none" else run.algorithm,
                outer_lr=run.outer_lr, outer_momentum=run.outer_momentum)
            self.lsgd.stats.timing = not (run.time_to_accuracy and cuda)
            self.compressed = 0 if get_codec(run.codec).sums_on_wire else sum(
                p.numel() for p in model.parameters() if p.requires_grad)
            return
        from torch.nn.parallel import DistributedDataParallel as DDP

        if lowbit.baselines.is_baseline(run.codec):  # PyTorch's own hook, as a user registers it
            ddp = DDP(model, device_ids=[device.index] if cuda else None)
            self.state = lowbit.baselines.register(ddp, run.codec)
            self.compressed = self.state.baseline.compressed_numel(
                [tuple(p.shape) for p in model.parameters() if p.requires_grad])
            self.net = ddp
            return
        algorithm = run.algorithm if run.algorithm != "none" else "scatter_gather"
        node_size = world // run.nodes if get_algorithm(algorithm).multi_node else None
        if run.parallelism == "model":
            # every linear layer split over the ranks; activations and their gradients in the run's codec

            self.comm = ParallelComm(codec=run.codec)
            self.net = parallelize(model_parallel_chain(model), self.comm, seed=run.seed)
            return
        if run.parallelism == "hybrid":

            features, classifier = hybrid_parts(model)
            grads: nn.Module = features
            ddp = DDP(features, device_ids=[device.index] if cuda else None)
            policy = None
        else:
            grads = model
            ddp = DDP(model, device_ids=[device.index] if cuda else None)
            policy = Policy(default=run.codec, **run.policy) if run.policy else None
        options = ddp_options(run, policy, algorithm, node_size)
        if options.auto and run.emulate_link:
            # the hook up front (as a framework registers it), so that the fp32 steps auto measures cross
            # the emulated link too (DDP's own allreduce would not)
            self.state = lowbit.ddp.make_state(ddp.module, process_group=ddp.process_group, config=options)
            ddp.register_comm_hook(self.state, lowbit.ddp.hook)
        else:
            self.state = lowbit.ddp.register(ddp, config=options)
        # The study reports the encode / communicate / decode split (on CUDA this synchronises the
        # device around each phase, as a profiler does; training outside the study never pays it). Not in
        # a time-to-accuracy run on CUDA: its clock is the result, and PyTorch's hooks beside it pay no such
        # synchronisations (the split is then not measured: NaN).
        self.state.stats.timing = not (run.time_to_accuracy and cuda)
        if self.state.auto is not None:
            self.compressed = 0  # until auto decides (see auto_plan in the summary)
        else:
            summary = (policy or Policy.coerce(None, run.codec)).summary(grads)
            self.compressed = sum(n for spec, n in summary.items() if not spec.startswith("fp32"))
        if run.parallelism == "hybrid":
            self.comm = ParallelComm(codec=run.codec)
            self.hybrid = self.net = Hybrid(ddp, classifier, self.comm, sub_batches=run.sub_batches, seed=run.seed)
        else:
            self.net = ddp

    @property
    def same_batch_everywhere(self) -> bool:
        """Model parallelism: every rank trains (and evaluates) the same samples."""
        return self.comm is not None and self.hybrid is None

    def loader(self, x: torch.Tensor, y: torch.Tensor) -> Any:

        run = self.run
        if self.same_batch_everywhere:  # the global batch on every rank
            return ShardedLoader(x, y, batch_size=run.batch_size * self.world, rank=0, world_size=1, seed=run.seed,
                                 shuffle=True, drop_last=True)
        return ShardedLoader(x, y, batch_size=run.batch_size, rank=self.rank, world_size=self.world, seed=run.seed,
                             shuffle=True, drop_last=True)

    def parameters(self) -> Any:
        return (self.net if self.comm is not None else self.model).parameters()

    def step(self, x: torch.Tensor, y: torch.Tensor, opt: torch.optim.Optimizer, clock: TailClock) -> torch.Tensor:
        if self.hybrid is not None:  # (zeroes, backward and steps the optimiser itself)
            return self.hybrid.train_step(x, y, _loss, opt)
        with self._autocast():
            loss = _loss(self.net(x), y)
        opt.zero_grad(set_to_none=True)
        clock.start()
        loss.backward()
        clock.stop()
        opt.step()
        if self.comm is not None:
            self.comm.step += 1
        if self.lsgd is not None:  # (an outer synchronisation every local_steps steps, inside the step's time)
            self.lsgd.after_step()
        return loss

    def samples(self, x: torch.Tensor) -> float:
        # model parallelism: every rank trains the same global batch (count it once over the ranks)
        return x.shape[0] / self.world if self.same_batch_everywhere else float(x.shape[0])

    def counters(self) -> tuple[Any, Any]:
        return (dataclasses.replace(self.state.stats) if self.state is not None else None,
                dataclasses.replace(self.comm.stats) if self.comm is not None else None)

    def after_step(self) -> None:
        """Bookkeeping after a training step (outside its time): PyTorch's hooks count their bytes here."""
        if isinstance(self.state, lowbit.baselines.BaselineState):
            self.state.count_step()

    def add_counters(self, m: dict[str, float], before: tuple[Any, Any]) -> None:
        s0, c0 = before
        if self.state is not None and s0 is not None:
            s1 = self.state.stats
            timed = s1.timing  # (off: PyTorch's hooks, and time-to-accuracy runs on CUDA: not measured, NaN)
            m["encode_s"] = s1.t_encode - s0.t_encode if timed else math.nan
            m["comm_s"] = s1.t_comm - s0.t_comm if timed else math.nan
            m["decode_s"] = s1.t_decode - s0.t_decode if timed else math.nan
            m["bytes_sent"] = s1.bytes_sent - s0.bytes_sent
            m["calls"] = s1.calls - s0.calls
        if self.comm is not None and c0 is not None:  # the activations' bytes (model / hybrid parallelism)
            m["bytes_sent"] += self.comm.stats.bytes_sent - c0.bytes_sent
            m["calls"] += self.comm.stats.calls - c0.calls

    def _autocast(self) -> Any:
        """The forward pass's autocast (``run.autocast``: "bf16" on CUDA), a no-op otherwise."""
        dtype = _AUTOCAST_DTYPES.get(self.run.autocast)
        return torch.autocast("cuda", dtype=dtype or torch.bfloat16, enabled=dtype is not None)

    def evaluate(self, x: torch.Tensor, y: torch.Tensor) -> tuple[float, float, float]:
        with self._autocast():
            return self._evaluate(x, y)

    def _evaluate(self, x: torch.Tensor, y: torch.Tensor) -> tuple[float, float, float]:
        if self.hybrid is not None:  # every rank's rows, in equal numbers (the gathers need them)
            n_eq = x.shape[0] - x.shape[0] % self.world
            return _evaluate(self.hybrid, x[:n_eq], y[:n_eq], self.rank, self.world, self.device)
        if self.same_batch_everywhere:  # every rank the whole test set, in step
            return _evaluate(self.net, x, y, 0, 1, self.device)
        if self.lsgd is not None:  # the weights the ranks agreed on (between syncs each rank has its own)
            with self.lsgd.anchor_weights():
                return _evaluate(self.model, x, y, self.rank, self.world, self.device)
        return _evaluate(self.model, x, y, self.rank, self.world, self.device)


def timed_epochs(epochs: list[dict[str, Any]], steps: int, steady_from: int) -> list[dict[str, Any]]:
    """The epochs whose speed counts: never the first (it pays warm-up: caches, allocator), nor one
    holding a step before ``steady_from`` (the step after lowbit takes over from DDP's fp32 allreduce,
    whose first compressed step compiles kernels; for codec="auto" the step after its decision). With
    few steps per epoch (4 workers x batch 64 on 512 samples: 2) that is more than the first epoch.
    If no epoch qualifies, the last one (an honest number from a run too short to have a steady state
    beats none)."""
    timed = [e for i, e in enumerate(epochs) if i >= 1 and i * steps >= steady_from]
    return timed or epochs[-1:]


def _summary(epochs: list[dict[str, Any]], steps: int, t_run: float, params: int, compressed: int,
             gflop: float | None, run: RunConfig, world: int, num_classes: int, n_train: int,
             n_test: int, steady_from: int = 1) -> dict[str, Any]:
    """The run's summary over its timed epochs (``timed_epochs``)."""
    timed = timed_epochs(epochs, steps, steady_from)
    tsum = sum(e["train_s"] for e in timed)

    def per_epoch(field: str) -> float:
        return sum(e[field] for e in timed) / len(timed)

    losses = [e["train_loss"] for e in epochs]
    return {
        "samples_per_s": sum(e["samples"] for e in timed) / tsum if tsum > 0 else math.nan,
        "samples_per_s_all_epochs": sum(e["samples"] for e in epochs) / max(1e-12, sum(e["train_s"] for e in epochs)),
        "timed_epochs": [e["epoch"] for e in timed],
        "epoch_train_s": per_epoch("train_s"),
        "epoch_compute_s": per_epoch("compute_s"),
        "epoch_exposed_comm_s": per_epoch("exposed_comm_s"),
        "epoch_encode_s": per_epoch("encode_s"),
        "epoch_comm_s": per_epoch("comm_s"),
        "epoch_decode_s": per_epoch("decode_s"),
        "steps_per_epoch": steps,
        "bytes_per_step_per_rank": sum(e["bytes_sent_per_rank"] for e in timed) / max(1, sum(e["steps"] for e in timed)),
        "bytes_sent_total": sum(e["bytes_sent_per_rank"] for e in epochs),  # per rank, every epoch
        "final_test_acc": epochs[-1]["test_acc"],
        "final_test_top5": epochs[-1]["test_top5"],
        "num_classes": num_classes,
        "best_test_acc": max((e["test_acc"] for e in epochs if e["test_acc"] == e["test_acc"]), default=math.nan),
        "final_train_loss": epochs[-1]["train_loss"],
        "final_test_loss": epochs[-1]["test_loss"],
        "diverged": any(not math.isfinite(v) for v in losses),
        "train_s": sum(e["train_s"] for e in epochs),
        "wall_s": time.perf_counter() - t_run,
        "params": params,
        "compressed_params": compressed,
        "compressed_fraction": compressed / params if params else 0.0,
        "gflop_per_sample": gflop,
        "comm_comp_ratio": (4 * params / 1e6) / (gflop * run.batch_size) if gflop else None,
        "global_batch": run.batch_size * world,
        "n_train": n_train,
        "n_test": n_test,
    }


def _device_for(run: RunConfig, world: int) -> torch.device:
    """The run's device on this rank (CPU: its share of the cores as torch threads)."""
    if run.device == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    torch.set_num_threads(run.threads_per_worker or max(1, (os.cpu_count() or 1) // world))
    return torch.device("cpu")


def _schedule(run: RunConfig, opt: torch.optim.Optimizer, total_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    if run.lr_schedule == "cosine":
        return torch.optim.lr_scheduler.LambdaLR(
            opt, lambda t: 0.5 * (1 + math.cos(math.pi * min(t, total_steps) / total_steps)))
    if run.lr_schedule == "warmup_cosine":
        return torch.optim.lr_scheduler.LambdaLR(opt, lambda t: lr_factor(run, t / total_steps))
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda t: 1.0)


def lr_factor(run: RunConfig, progress: float) -> float:
    """The learning rate's multiplier at ``progress`` (0 to 1) through the run's schedule: ``cosine`` from 1
    to 0; ``warmup_cosine`` linear from 0 to 1 over the first ``warmup`` share, then cosine to 0;
    ``constant`` 1."""
    p = min(max(progress, 0.0), 1.0)
    if run.lr_schedule == "constant":
        return 1.0
    if run.lr_schedule == "warmup_cosine" and p < run.warmup:
        return p / run.warmup
    w = run.warmup if run.lr_schedule == "warmup_cosine" else 0.0
    return 0.5 * (1 + math.cos(math.pi * (p - w) / (1 - w)))


def _train_epoch(trainer: _Trainer, loader: Any, steps: int, opt: torch.optim.Optimizer, sched: Any,
                 clock: TailClock, world: int, device: torch.device) -> dict[str, float]:
    """One epoch's training steps on this rank: the metric sums of :data:`_METRIC_FIELDS` (each step
    timed between device synchronisations; exposed communication from the clock's gradient tail)."""
    cuda = device.type == "cuda"
    before = trainer.counters()
    m = dict.fromkeys(_METRIC_FIELDS, 0.0)
    trainer.net.train()
    for i, (x, y) in enumerate(loader):
        if i >= steps:
            break
        if cuda:
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        loss = trainer.step(x, y, opt, clock)
        sched.step()
        if cuda:
            torch.cuda.synchronize(device)
        m["train_s"] += time.perf_counter() - t0
        trainer.after_step()
        m["exposed_comm_s"] += clock.tail_s() if world > 1 else 0.0
        m["loss_sum"] += float(loss.detach())
        m["steps"] += 1
        m["samples"] += trainer.samples(x)
    trainer.add_counters(m, before)
    return m


def _epoch_record(epoch: int, g: dict[str, float], test: tuple[float, float, float], lr: float, eval_s: float,
                  wall_s: float) -> dict[str, Any]:
    """An epoch's row from the ranks' mean metrics ``g`` (:func:`_mean_over_ranks`) and the test results."""
    test_loss, test_acc, test_top5 = test
    return {
        "epoch": epoch,
        "steps": int(g["steps"]),
        "samples": int(g["samples"]),
        "train_s": g["train_s"],
        "samples_per_s": g["samples"] / g["train_s"] if g["train_s"] > 0 else math.nan,
        "compute_s": g["train_s"] - g["exposed_comm_s"],
        "exposed_comm_s": g["exposed_comm_s"],
        "encode_s": g["encode_s"],
        "comm_s": g["comm_s"],
        "decode_s": g["decode_s"],
        "bytes_sent_per_rank": g["bytes_sent"],
        "bytes_per_step_per_rank": g["bytes_sent"] / g["steps"] if g["steps"] else 0.0,
        "train_loss": g["loss_sum"] / g["steps_total"] if g["steps_total"] else math.nan,
        "test_loss": test_loss,
        "test_acc": test_acc,
        "test_top5": test_top5,
        "lr": lr,
        "eval_s": eval_s,
        "wall_s": wall_s,
    }


# ------------------------------------------------------------------------------------ time to accuracy
def validation_subset(x: torch.Tensor, y: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The fixed held-out subset a time-to-accuracy run validates on: ``n`` test samples evenly spaced
    over the test split (all of them when ``n`` is 0 or more than there are), the same for every run."""
    if not n or n >= x.shape[0]:
        return x, y
    idx = torch.linspace(0, x.shape[0] - 1, n).round().long()  # (n,) distinct: the spacing is >= 1
    return x[idx], y[idx]


def time_to_target(curve: list[dict[str, Any]], target_loss: float | None,
                   target_accuracy: float | None) -> dict[str, Any] | None:
    """The first validation point of ``curve`` that meets the target (validation loss at most
    ``target_loss``, or accuracy at least ``target_accuracy``); None when none does."""
    for point in curve:
        loss, acc = point.get("val_loss"), point.get("val_acc")
        if target_loss is not None and isinstance(loss, (int, float)) and loss <= target_loss:
            return point
        if target_accuracy is not None and isinstance(acc, (int, float)) and acc >= target_accuracy:
            return point
    return None


class _ToTarget:
    """A time-to-accuracy run on this rank: trains step by step until the target is met, the budget of
    training seconds is spent, the learning-rate schedule ends (``run.schedule``) or the epochs run out,
    validating on a fixed subset on the way.

    The clock is the training steps' time only (each step timed between device synchronisations, as every
    study run is): validations (``eval_s``) and the ranks' agreement (``agree_s``) are outside it. Every
    rank stops at the same step: a validation's numbers are summed over the ranks, and when the clock
    decides anything (a budget, ``eval_every_s``, a schedule over the budget) the ranks take the slowest
    rank's clock, one small all-reduce after each step, so the decisions are identical everywhere."""

    def __init__(self, run: RunConfig, trainer: _Trainer, world: int, device: torch.device,
                 steps_per_epoch: int, x_val: torch.Tensor, y_val: torch.Tensor) -> None:
        self.run, self.trainer, self.world, self.device = run, trainer, world, device
        self.steps_per_epoch, self.x_val, self.y_val = steps_per_epoch, x_val, y_val
        self.agree = world > 1 and (run.time_budget_s is not None or run.eval_every_s > 0)
        self.local = 0.0       # this rank's training seconds
        self.clock = 0.0       # the agreed training seconds (the slowest rank's)
        self.step = 0
        self.samples = 0.0     # global samples trained
        self.eval_s = self.agree_s = 0.0
        self.curve: list[dict[str, Any]] = []
        self.schedule: list[float] = []  # the schedule's progress at each step (what with_target replays)
        self.next_eval_s = run.eval_every_s
        self.stop = ""
        self.self_target = run.is_target_source  # its own final loss is its target (known at the end)

    def progress(self) -> float:
        """How far through the learning-rate schedule: the target's run's at this step (``run.schedule``),
        else by the budget's training seconds, else by the epochs' steps."""
        run = self.run
        if run.schedule:
            return run.schedule[self.step] if self.step < len(run.schedule) else 1.0
        if run.time_budget_s is not None:
            return self.clock / run.time_budget_s
        return self.step / (self.steps_per_epoch * run.epochs)

    def _agree(self) -> None:
        if not self.agree:
            self.clock = self.local
            return
        t0 = time.perf_counter()
        t = torch.tensor([self.local], dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        self.clock = float(t.item())
        self.agree_s += time.perf_counter() - t0

    def validate(self, epoch: int, lr: float) -> tuple[float, float, float]:
        t0 = time.perf_counter()
        loss, acc, top5 = self.trainer.evaluate(self.x_val, self.y_val)
        self.eval_s += time.perf_counter() - t0
        self.curve.append({"step": self.step, "train_s": self.clock, "samples": self.samples, "epoch": epoch,
                           "val_loss": loss, "val_acc": acc, "lr": lr})
        if not self.self_target and time_to_target(self.curve[-1:], self.run.target_loss,
                                                   self.run.target_accuracy) is not None:
            self.stop = "target"
        return loss, acc, top5

    def epoch(self, epoch: int, loader: Any, opt: torch.optim.Optimizer, clock: TailClock) -> dict[str, Any]:
        """One pass over the data (or what is left of the run): the epoch's row."""
        run, trainer, cuda = self.run, self.trainer, self.device.type == "cuda"
        t_epoch, eval_before = time.perf_counter(), self.eval_s
        before = trainer.counters()
        m = dict.fromkeys(_METRIC_FIELDS, 0.0)
        trainer.net.train()
        lr = opt.param_groups[0]["lr"]
        for i, (x, y) in enumerate(loader):
            if i >= self.steps_per_epoch:
                break
            progress = self.progress()
            self.schedule.append(round(progress, 7))
            lr = run.lr * lr_factor(run, progress)
            for group in opt.param_groups:
                group["lr"] = lr
            if cuda:
                torch.cuda.synchronize(self.device)
            t0 = time.perf_counter()
            loss = trainer.step(x, y, opt, clock)
            if cuda:
                torch.cuda.synchronize(self.device)
            dt = time.perf_counter() - t0
            trainer.after_step()
            m["train_s"] += dt
            m["exposed_comm_s"] += clock.tail_s() if self.world > 1 else 0.0
            m["loss_sum"] += float(loss.detach())
            m["steps"] += 1
            m["samples"] += trainer.samples(x)
            self.local += dt
            self.step += 1
            self.samples += trainer.samples(x) * self.world  # (samples() is this rank's share)
            self._agree()
            due = bool(run.eval_every and self.step % run.eval_every == 0)
            if run.eval_every_s and self.clock >= self.next_eval_s:
                due = True
                while self.next_eval_s <= self.clock:
                    self.next_eval_s += run.eval_every_s
            if due:
                self.validate(epoch + 1, lr)
            if not self.stop and run.time_budget_s is not None and self.clock >= run.time_budget_s:
                self.stop = "budget"
            if not self.stop and run.schedule and self.step >= len(run.schedule):
                self.stop = "schedule"
            if self.stop:
                break
        trainer.add_counters(m, before)
        g = _mean_over_ranks(m, self.world, self.device)
        if self.curve and self.curve[-1]["step"] == self.step:  # validated at this step already
            last = self.curve[-1]
            test = (last["val_loss"], last["val_acc"], math.nan)
        else:  # the epoch's (or the run's) end
            test = self.validate(epoch + 1, lr)
        return _epoch_record(epoch + 1, g, test, lr, self.eval_s - eval_before, time.perf_counter() - t_epoch)

    def summary(self) -> dict[str, Any]:
        """What the run adds to its summary: the target, when and whether it was met, the stop, the clock."""
        run, curve = self.run, self.curve
        target_loss, target_acc = run.target_loss, run.target_accuracy
        if self.self_target:  # the run that sets its setting's target: its own final validation loss
            target_loss = curve[-1]["val_loss"] if curve else None
        # the target rule (lowbit.study.tta): a baseline's final loss plus 1 %; the strict time beside it
        rule_loss = tolerant_target(target_loss, run.target_from is not None)
        hit = time_to_target(curve, rule_loss, target_acc) if target_loss is not None or target_acc is not None \
            else None
        strict = time_to_target(curve, target_loss, target_acc) if target_loss is not None or target_acc is not None \
            else None
        losses = [p["val_loss"] for p in curve if isinstance(p["val_loss"], float) and math.isfinite(p["val_loss"])]
        return {
            "target_loss": target_loss, "target_accuracy": target_acc, "target_from": run.target_from,
            "reached_target": hit is not None if (target_loss is not None or target_acc is not None) else None,
            "time_to_target_s": hit["train_s"] if hit else None,
            "target_loss_rule": rule_loss, "target_tolerance": TARGET_TOLERANCE if run.target_from is not None else 0.0,
            "time_to_target_strict_s": strict["train_s"] if strict else None,
            "reached_target_strict": strict is not None if (target_loss is not None or target_acc is not None) else None,
            "steps_to_target": hit["step"] if hit else None,
            "samples_to_target": hit["samples"] if hit else None,
            "stop_reason": self.stop or "epochs", "time_budget_s": run.time_budget_s,
            "schedule_steps": len(run.schedule) or None,
            "steps": self.step, "tta_train_s": self.clock, "eval_s": self.eval_s, "agree_s": self.agree_s,
            "eval_points": len(curve), "eval_samples": int(self.x_val.shape[0]),
            "final_val_loss": curve[-1]["val_loss"] if curve else None,
            "final_val_acc": curve[-1]["val_acc"] if curve else None,
            "best_val_loss": min(losses) if losses else None,
        }


def _auto_why(auto: Any, decision: Any) -> dict[str, Any]:
    """Why codec="auto" chose what it did, for the run's row: per tensor its codec (and, where the guard
    stepped it up later, what ran at the end), the finalists' predicted and measured steps, and the error
    limit against each allowed codec's summed error over the tensors (and, at the bold level, the
    gradients' summed sampling noise), as the decision's search weighed them."""
    measured = auto.measured or {}
    errors = measured.get("errors") or {}
    per_codec: dict[str, float] = {}
    for e in errors.values():
        for spec, v in e.items():
            per_codec[spec] = per_codec.get(spec, 0.0) + float(v)
    return {"per_tensor": {r["name"]: r["codec"] for r in decision.rows},
            "stepped_up": {n: c for n, c in auto.assignment.items() if c != decision.assignment.get(n)},
            "finalists": [{"label": label, "predicted_step_s": pred, "measured_step_s": decision.measured_s.get(label)}
                          for label, _, pred in decision.finalists],
            "measured_fp32_step_s": decision.measured_s.get("fp32"),
            "error": decision.error, "error_limit": decision.error_limit,
            "summed_error_per_codec": per_codec,
            "summed_noise": sum(float(v) for v in (measured.get("noise") or {}).values()) or None}


def _steady_from(run: RunConfig, world: int, auto: Any) -> int:
    """The first step whose speed counts (:func:`timed_epochs`)."""
    if lowbit.baselines.is_baseline(run.codec):  # PowerSGD compresses from its start_iter; the casts at once
        b = lowbit.baselines.get_baseline(run.codec)
        return b.start_iter + 1 if b.kind == "powersgd" and world > 1 else 1
    if world > 1 and run.parallelism == LOCALSGD:
        return run.local_steps + 1  # the first outer synchronisation compiles the codec's kernels
    if world > 1 and run.parallelism == "data" and run.codec != "fp32":
        if auto is not None:  # codec="auto": after its decision (measuring and trials come first)
            return (auto.decided_iter if auto.decided_iter is not None else run.start_iter) + 1
        return run.start_iter + 1  # the first compressed step compiles the codec's kernels
    return 1


def train_run(
    run: RunConfig,
    rank: int,
    world: int,
    on_epoch: Callable[[dict[str, Any]], None] | None = None,
    launcher: str = "spawn",
) -> dict[str, Any]:
    """Train one run on this rank (collective: every rank of the group calls it). Returns the run row
    (meaningful on rank 0; every rank computes the same numbers)."""
    if run.world_size != world:
        raise ValueError(f"run wants world size {run.world_size}, the group has {world}")
    t_run, started = time.perf_counter(), now()
    device = _device_for(run, world)
    data = _load_data(run)
    x_tr, y_tr, x_te, y_te = data.x_train, data.y_train, data.x_test, data.y_test
    if run.max_train_samples:
        x_tr, y_tr = x_tr[: run.max_train_samples], y_tr[: run.max_train_samples]
    if run.max_test_samples:
        x_te, y_te = x_te[: run.max_test_samples], y_te[: run.max_test_samples]
    x_tr, y_tr = x_tr.to(device), y_tr.to(device)

    def make_model() -> nn.Module:
        return build_model(run.network, num_classes=data.num_classes, in_shape=data.in_shape, **run.model_args)

    torch.manual_seed(run.seed)                       # same initial weights on every rank
    model = make_model().to(device)
    params = sum(p.numel() for p in model.parameters() if p.requires_grad)
    # an emulated slow link for lowbit's collectives (gloo), or the real one (every run sets it)
    C.emulate_link(parse_bandwidth(run.emulate_link) if run.emulate_link and world > 1 else None)
    trainer = _Trainer(run, model, rank, world, device)
    torch.manual_seed(run.seed * 1_000 + rank + 1)   # dropout masks differ across ranks

    loader = trainer.loader(x_tr, y_tr)
    steps = len(loader) if not run.max_steps_per_epoch else min(len(loader), run.max_steps_per_epoch)
    if steps == 0:
        raise ValueError(f"{run.dataset}: {len(x_tr)} training samples make no full batch of {run.batch_size} "
                         f"on each of {world} workers")
    opt = make_optimizer(run, trainer.parameters())
    sched = _schedule(run, opt, steps * run.epochs)
    gflop = _gflop(run, data, make_model, x_tr) if rank == 0 else None
    env = environment(device, launcher) if rank == 0 else {}
    # exposed communication: measured for data parallelism (the gradients' tail after the backward)
    clock = TailClock(model.parameters() if trainer.comm is None else [], device.type == "cuda")
    epochs: list[dict[str, Any]] = []
    attempt, key = uuid.uuid4().hex[:12], run.key()
    tta = None
    if run.time_to_accuracy:  # stop at the target or the budget, validating on a fixed subset
        tta = _ToTarget(run, trainer, world, device, steps, *validation_subset(x_te, y_te, run.eval_samples))
    try:
        for epoch in range(run.epochs):
            loader.set_epoch(epoch)
            if tta is not None:
                rec = tta.epoch(epoch, loader, opt, clock)
            else:
                t_epoch = time.perf_counter()
                g = _mean_over_ranks(_train_epoch(trainer, loader, steps, opt, sched, clock, world, device), world,
                                     device)
                t_eval = time.perf_counter()
                test = trainer.evaluate(x_te, y_te)
                rec = _epoch_record(epoch + 1, g, test, opt.param_groups[0]["lr"], time.perf_counter() - t_eval,
                                    time.perf_counter() - t_epoch)
            epochs.append(rec)
            if on_epoch is not None and rank == 0:
                on_epoch({"kind": "epoch", "key": key, "attempt": attempt, "run": run, **rec})
            if tta is not None and tta.stop:
                break
    finally:
        clock.remove()

    auto = getattr(getattr(trainer, "state", None), "auto", None)
    decision = auto.decision if auto is not None else None
    compressed = trainer.compressed
    if decision is not None:  # codec="auto": what it chose, per codec (values), and from which step
        compressed = sum(r["numel"] for r in decision.rows if r["codec"] != "fp32")
    summary = _summary(epochs, steps, t_run, params, compressed, gflop, run, world, data.num_classes,
                       int(x_tr.shape[0]), int(x_te.shape[0]), _steady_from(run, world, auto))
    if tta is not None:
        summary.update(tta.summary())
    if auto is not None:
        summary["auto_plan"] = None if decision is None else {
            "values_per_codec": {c: sum(r["numel"] for r in decision.rows if r["codec"] == c)
                                 for c in sorted({r["codec"] for r in decision.rows})},
            "chosen": decision.chosen, "decided_at_step": auto.decided_iter,
            "predicted_speedup_vs_fp32": decision.speedup, **_auto_why(auto, decision)}
    return {
        "kind": "run",
        "key": key,
        "attempt": attempt,
        "schema": 1,
        "config": run.to_dict(),
        "labels": {"codec": run.codec_label, "data": data.label, "synthetic": bool(data.synthetic),
                   "task": data.task},
        "env": env,
        "summary": summary,
        "epochs": epochs,
        **({"curve": tta.curve} if tta is not None else {}),
        **({"schedule": tta.schedule} if tta is not None and run.is_target_source else {}),
        "started": started,
        "finished": now(),
    }
