"""One run of the study on this rank: data, model, DDP + lowbit (or model / hybrid parallelism, or local
SGD: lowbit.localsgd), the
training loop with its timing, and the run's row (:func:`train_run`). Scheduling runs onto worker
groups is :mod:`lowbit.lab.study.runner`; what each number means is :mod:`lowbit.lab.study.metrics`."""

from __future__ import annotations

import dataclasses
import math
import time
import uuid
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import lowbit.lab.baselines
import lowbit.ddp
import lowbit.localsgd
from lowbit.comm import collectives as C
from lowbit.codecs.base import get_codec
from lowbit.comm.allreduce import get_algorithm
from lowbit.lab.data.sharding import ShardedLoader
from lowbit.lab.models import build_model
from lowbit.parallel import Hybrid, ParallelComm, hybrid_parts, model_parallel_chain, parallelize
from lowbit.lab.perfmodel.links import parse_emulated_link
from lowbit.policy import Policy
from lowbit.lab.study.config import LOCALSGD
from lowbit.lab.study.runs import RunConfig
from lowbit.lab.study.metrics import TailClock, environment
from lowbit.lab.study.steps import (_METRIC_FIELDS, _device_for, _epoch_record, _evaluate, _gflop,  # noqa: F401
                                _load_data, _loss, _mean_over_ranks, _schedule, _summary, _train_epoch,
                                ddp_options, lr_factor, make_optimizer, now, time_to_target, timed_epochs,
                                validation_subset)
from lowbit.lab.study.tta import TARGET_TOLERANCE, tolerant_target
from lowbit.launch import forkserver_preload

__all__ = ["train_run", "timed_epochs", "make_optimizer", "now", "lr_factor", "validation_subset", "time_to_target"]

# a forkserver started after this import (the study's workers, the test suite's) imports this module once,
# not every child of it
forkserver_preload(__name__)

_AUTOCAST_DTYPES = {"bf16": torch.bfloat16}  # config.AUTOCASTS -> the dtype of CUDA autocast


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
                model, None, local_steps=run.local_steps, fragments=run.fragments, overlap=run.overlap,
                codec=run.codec,
                error_feedback=run.error_feedback, algorithm="auto" if run.algorithm == "none" else run.algorithm,
                outer_lr=run.outer_lr, outer_momentum=run.outer_momentum)
            self.lsgd.stats.timing = not (run.time_to_accuracy and cuda)
            self.compressed = 0 if get_codec(run.codec).sums_on_wire else sum(
                p.numel() for p in model.parameters() if p.requires_grad)
            return
        from torch.nn.parallel import DistributedDataParallel as DDP

        if lowbit.lab.baselines.is_baseline(run.codec):  # PyTorch's own hook, as a user registers it
            ddp = DDP(model, device_ids=[device.index] if cuda else None)
            self.state = lowbit.lab.baselines.register(ddp, run.codec)
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

    def counters(self) -> tuple[Any, Any, int]:
        return (dataclasses.replace(self.state.stats) if self.state is not None else None,
                dataclasses.replace(self.comm.stats) if self.comm is not None else None, C.issued())

    def after_step(self) -> None:
        """Bookkeeping after a training step (outside its time): PyTorch's hooks count their bytes here."""
        if isinstance(self.state, lowbit.lab.baselines.BaselineState):
            self.state.count_step()

    def add_counters(self, m: dict[str, float], before: tuple[Any, Any, int]) -> None:
        s0, c0, n0 = before
        m["collectives"] = C.issued() - n0
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
        # the target rule (lowbit.lab.study.tta): a baseline's final loss plus 1 %; the strict time beside it
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
    if lowbit.lab.baselines.is_baseline(run.codec):  # PowerSGD compresses from its start_iter; the casts at once
        b = lowbit.lab.baselines.get_baseline(run.codec)
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
    C.emulate_link(*(parse_emulated_link(run.emulate_link) if run.emulate_link and world > 1 else (None,)))
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
