"""A study run's pieces around the training loop: data and optimizer, evaluation, the learning-rate
schedule, one epoch of steps, the records and the summary (:mod:`lowbit.lab.study.train` runs them)."""

from __future__ import annotations

import datetime as _dt
import json
import math
import os
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import lowbit.lab.baselines
import lowbit.ddp
import lowbit.localsgd
from lowbit.lab.data import load_dataset
from lowbit.policy import Policy
from lowbit.lab.study.config import DEFAULT_AUTO_LEVEL, auto_level
from lowbit.lab.study.runs import RunConfig
from lowbit.lab.study.metrics import TailClock, fwd_bwd_gflop_per_sample

__all__ = ["timed_epochs", "make_optimizer", "now", "lr_factor", "validation_subset", "time_to_target"]


_METRIC_FIELDS = ("train_s", "exposed_comm_s", "encode_s", "comm_s", "decode_s", "bytes_sent", "loss_sum",
                  "steps", "samples", "calls", "collectives")


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
        # collectives issued through lowbit's wrapper a step (a slow link's latency is paid per collective)
        "collectives_per_step": sum(e.get("collectives_per_step", 0.0) * e["steps"] for e in timed)
        / max(1, sum(e["steps"] for e in timed)),
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


def _train_epoch(trainer: Any, loader: Any, steps: int, opt: torch.optim.Optimizer, sched: Any,
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
        "collectives_per_step": g["collectives"] / g["steps"] if g["steps"] else 0.0,
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
