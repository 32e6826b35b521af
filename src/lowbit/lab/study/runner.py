"""Study runner: trains every pending run of the grid and appends its measurements to the results file.

Plan:

1. Expand the config into runs (:func:`~lowbit.lab.study.runs.expand_runs`), check every network/data
   pair on the meta device, and drop the runs whose key already has a finished row in
   ``results.jsonl`` — an interrupted study resumes where it stopped.
2. Local launch (the default): runs of one (backend, world size) share one set of worker processes
   (:func:`lowbit.launch.spawn`, a process group each), started once per group because starting
   processes costs seconds. Under ``torchrun`` (``RANK``/``WORLD_SIZE`` set, or ``--launcher
   torchrun``) the processes already exist: the runs whose world size is ``WORLD_SIZE`` run there.
3. Every rank trains the run (:func:`lowbit.lab.study.train.train_run`) with DDP + :func:`lowbit.ddp.register` (world size 1: the plain model,
   no DDP and no communication — the single-worker baseline of the scalability plots). Rank 0
   appends an ``epoch`` row after every epoch and a ``run`` row at the end (:mod:`lowbit.lab.study.store`)
   and drives the progress bar. How each number is measured: :mod:`lowbit.lab.study.metrics`.

Time to accuracy with ``target_from`` (docs/study.md): in each group the runs that set a target run first;
the others of their setting and seed take its final validation loss as their target and its learning-rate
schedule, step by step, as theirs (:meth:`RunConfig.with_target`), from the row every rank has just computed, or,
when that run finished in an earlier invocation, from the results file (so their keys, which hold the
target, are known before the group starts and a resumed study skips the finished ones).

Tests inject a crash with ``LOWBIT_STUDY_CRASH_AFTER_RUNS=N``: every rank raises once N runs of this
invocation are finished and saved.
"""

from __future__ import annotations

import dataclasses
import gc
import math
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from lowbit.lab.baselines import is_baseline
from lowbit.codecs.base import get_codec
from lowbit.comm.hierarchical import topology
from lowbit.env import launched_rank_and_size, under_torchrun
from lowbit.extras import require
from lowbit.launch import WorkerError, emulate_node, init_from_env, spawn
from lowbit.lab.study.config import StudyConfig, is_auto
from lowbit.lab.study.runs import RunConfig, check_runs, expand_runs
from lowbit.lab.study.export import TensorBoardLog
from lowbit.lab.study.store import ResultStore
from lowbit.lab.study.train import train_run

__all__ = ["StudyResult", "StudyInterrupted", "run_study", "plan_study", "resolve_targets", "train_run", "CRASH_ENV"]

CRASH_ENV = "LOWBIT_STUDY_CRASH_AFTER_RUNS"


class StudyInterrupted(RuntimeError):
    """A study stopped before its last run; the finished runs are saved and a rerun resumes."""


@dataclasses.dataclass
class StudyResult:
    results_path: Path
    total: int          # runs in the grid
    skipped: int        # already finished before this invocation
    ran: int            # finished by this invocation
    elapsed_s: float


@dataclasses.dataclass
class _GroupPlan:
    runs: list[dict[str, Any]]
    results_path: str
    total: int
    done_before: int
    finished_this_invocation: int
    crash_after: int
    progress: bool
    launcher: str
    study: str = ""
    tensorboard: str | None = None  # rank 0 logs every epoch there (lowbit.lab.study.export.TensorBoardLog)


# ------------------------------------------------------------------------------------ a group of runs
def _warm_up_codecs(specs: set[str], device: torch.device) -> None:
    """Encode, decode and sum once with every codec, so just-in-time compilation of the CPU kernels
    (numba; seconds per kernel) happens before the first timed step rather than inside a run."""

    for n in (4096, 4099):  # (Triton specialises on sizes divisible by 16 or not: compile both)
        x = torch.randn(n, device=device)
        for spec in sorted(specs):
            if is_auto(spec) or is_baseline(spec):
                continue  # (auto's codecs warm up when it probes them; PyTorch's hooks have no kernels)
            codec = get_codec(spec)
            if codec.name == "fp32":
                continue
            p = codec.encode(x, seed=1)
            codec.decode(p, x.numel(), shape=codec.flat_shape(x.numel()))
            codec.decode_sum([p, p], x.numel(), shape=codec.flat_shape(x.numel()))


def measure_links(world: int, nodes: int, device: torch.device, mib: int = 16, reps: int = 3) -> dict[str, Any]:
    """Bus bandwidth of a native fp32 allreduce of ``mib`` MiB (best of ``reps``, after one warm-up): over
    the whole group, and with emulated nodes inside a node and between nodes (among ranks of one local
    index), as every rank of the group measures it (rank 0's figures are returned everywhere). Recorded
    in every result row of the group as ``env.links``: the link a run had, not the one it should have."""

    x = torch.ones(mib * 2**20 // 4, dtype=torch.float32, device=device)

    def busbw(group: Any, k: int) -> float | None:
        if k < 2:
            return None
        best = math.inf
        for i in range(reps + 1):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            dist.all_reduce(x, group=group)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if i:
                best = min(best, time.perf_counter() - t0)
        return 2 * (k - 1) / k * x.numel() * 4 / best / 1e9

    out: dict[str, Any] = {"nodes": nodes, "node_size": world // nodes, "allreduce_mib": mib,
                           "world_GBps": busbw(None, world)}
    if nodes > 1:
        topo = topology(None, world // nodes)
        out["intra_GBps"] = busbw(topo.intra, topo.node_size) if topo.intra is not None else None
        out["inter_GBps"] = busbw(topo.cross, topo.nodes)
    out["env"] = {key: os.environ.get(key) for key in
                  ("NCCL_HOSTID", "NCCL_IB_DISABLE", "NCCL_P2P_DISABLE", "NCCL_SHM_DISABLE", "LOWBIT_NODE_SIZE")}
    box = [out]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _run_group(rank: int, world: int, plan: _GroupPlan) -> int:
    """Every rank: train the plan's runs in order; rank 0 saves rows and shows progress."""
    store = ResultStore(plan.results_path)
    links: dict[str, Any] | None = None
    if world > 1 and plan.runs:
        dev = torch.device("cuda", torch.cuda.current_device()) if plan.runs[0]["device"] == "cuda" else torch.device("cpu")
        _warm_up_codecs({rd["codec"] for rd in plan.runs}, dev)
        links = measure_links(world, int(plan.runs[0].get("nodes", 1)), dev)
    bar = None
    if rank == 0 and plan.progress:
        from tqdm import tqdm

        bar = tqdm(total=plan.total, initial=plan.done_before, unit="run", dynamic_ncols=True, file=sys.stderr,
                   desc=f"study K={world}", smoothing=0.1)
    tb = None
    if rank == 0 and plan.tensorboard:

        tb = TensorBoardLog(plan.tensorboard)
    done = 0
    targets: dict[str, dict[str, Any]] = {}  # target setting -> row of the run that set it (this group)
    try:
        for rd in plan.runs:
            run = RunConfig.from_dict(rd)
            if run.awaits_target:  # its target_from run ran first in this group (the plan's order)
                source = targets.get(run.target_setting())
                if source is None:
                    raise RuntimeError(f"the target of {run.describe().strip()} comes from its {run.target_from!r} "
                                       "run, which did not run before it")
                run = run.with_target(source)

            def on_epoch(row: dict[str, Any], run: RunConfig = run) -> None:
                store.append({k: v for k, v in row.items() if k != "run"})
                if tb is not None:
                    tb.log_epoch(row["key"], row, {**run.to_dict(), "label": run.codec_label})
                if bar is not None:
                    bar.set_postfix_str(
                        f"{run.network}/{run.dataset} {run.codec_label} ep {row['epoch']}/{run.epochs} "
                        f"loss {row['train_loss']:.3f} acc {row['test_acc']:.1%} {row['samples_per_s']:.0f} samples/s",
                        refresh=True,
                    )

            row = train_run(run, rank, world, on_epoch=on_epoch, launcher=plan.launcher)
            if run.is_target_source:  # (every rank computed the same validation losses and schedule)
                targets[run.target_setting()] = row
            row["study"] = plan.study
            if links is not None:
                row["env"]["links"] = links  # this group's links, measured before its first run
            done += 1
            if rank == 0:
                store.append(row)
                s = row["summary"]
                acc = "synthetic data" if row["labels"]["synthetic"] else f"acc {s['final_test_acc']:.2%}"
                if run.time_to_accuracy:
                    acc = f"val loss {s['final_val_loss']:.4f} at {s['tta_train_s']:.1f} s ({s['stop_reason']})"
                    if s["reached_target"] is not None:
                        acc += (f", target {s['target_loss'] if s['target_loss'] is not None else s['target_accuracy']:.4g}"
                                + (f" in {s['time_to_target_s']:.1f} s" if s["reached_target"] else " not reached"))
                line = (f"  done {run.describe().strip()}: {acc}, "
                        f"{s['samples_per_s']:.0f} samples/s, {s['wall_s']:.1f} s")
                if bar is not None:
                    bar.write(line, file=sys.stderr)
                    bar.update(1)
                else:
                    print(line, file=sys.stderr, flush=True)
            if plan.crash_after and plan.finished_this_invocation + done >= plan.crash_after:
                raise RuntimeError(f"injected crash ({CRASH_ENV}={plan.crash_after}) after {done} run(s)")
    finally:
        if bar is not None:
            bar.close()
        if tb is not None:
            tb.close()
    return done


def _spawn_worker(rank: int, world: int, plan: _GroupPlan) -> int:
    return _run_group(rank, world, plan)


# ------------------------------------------------------------------------------------ the study
def plan_study(cfg: StudyConfig, out_dir: str | os.PathLike[str]) -> tuple[list[RunConfig], set[str], ResultStore]:
    """(all runs of the grid, keys already finished, the store). Validates everything first. Runs whose
    ``target_from`` run is finished carry its target (:func:`resolve_targets`); the others still await it."""
    runs = expand_runs(cfg)
    check_runs(runs)
    store = ResultStore(out_dir)
    finished = store.finished()
    return resolve_targets(runs, finished), set(finished), store


def resolve_targets(runs: list[RunConfig], finished: dict[str, dict[str, Any]]) -> list[RunConfig]:
    """``runs`` with the target of each one whose ``target_from`` run is among the ``finished`` rows (key ->
    run row), and the runs that set targets first within each group of workers (backend, world size,
    nodes), the order in which the runner trains them."""
    sources = {r.target_setting(): finished[r.key()] for r in runs if r.is_target_source and r.key() in finished}
    out = [r.with_target(sources[r.target_setting()]) if r.awaits_target and r.target_setting() in sources else r
           for r in runs]
    group_of: dict[tuple[str, int, int], int] = {}
    for r in out:
        group_of.setdefault((r.backend, r.world_size, r.nodes), len(group_of))
    return sorted(out, key=lambda r: (group_of[(r.backend, r.world_size, r.nodes)], not r.is_target_source))


def _check_launchable(runs: list[RunConfig], launcher: str) -> None:
    for run in runs:
        if run.backend == "nccl" or run.device == "cuda":
            n = torch.cuda.device_count() if torch.cuda.is_available() else 0
            need = run.world_size if launcher == "spawn" else 1
            if n < need:
                raise ValueError(f"backend {run.backend} on {run.device} needs {need} CUDA GPU(s) per machine; "
                                 f"this one has {n}")
        if run.backend == "mpi":
            if launcher == "spawn":
                raise ValueError("backend mpi needs an MPI launcher; run `mpirun -n K lowbit study --launcher torchrun ...`")
            if not dist.is_mpi_available():
                raise ValueError("backend mpi: this torch build has no MPI support")
        if run.backend == "gloo" and not dist.is_gloo_available():
            raise ValueError("backend gloo: this torch build has no gloo support")


def run_study(
    cfg: StudyConfig,
    out_dir: str | os.PathLike[str],
    launcher: str = "auto",
    progress: bool = True,
    log: Callable[[str], None] = print,
    tensorboard: str | os.PathLike[str] | None = None,
) -> StudyResult:
    """Run every pending run of ``cfg``, appending rows to ``out_dir/results.jsonl``.

    ``launcher``: ``spawn`` (local processes per world size), ``torchrun`` (this process is one rank of a
    torchrun launch; only runs of its ``WORLD_SIZE`` run), or ``auto`` (torchrun when its environment is
    set). ``tensorboard``: a directory where rank 0 logs every epoch (``tensorboard`` extra). Raises
    :class:`StudyInterrupted` if a run fails; finished runs stay saved.
    """
    tb = str(tensorboard) if tensorboard else None
    if tb:

        require("tensorboard", "tensorboard", "--tensorboard")  # before any run starts, not in a worker
    if launcher == "auto":
        launcher = "torchrun" if under_torchrun() else "spawn"
    if launcher not in ("spawn", "torchrun"):
        raise ValueError(f"launcher must be spawn, torchrun or auto, got {launcher!r}")
    crash_after = int(os.environ.get(CRASH_ENV, "0") or 0)
    t0 = time.perf_counter()
    if launcher == "torchrun":
        return _run_under_torchrun(cfg, out_dir, progress, crash_after, log, t0, tb)

    runs, finished, store = plan_study(cfg, out_dir)
    _check_launchable(runs, "spawn")
    pending = [r for r in runs if r.awaits_target or r.key() not in finished]  # (awaiting: its key is to come)
    skipped = len(runs) - len(pending)
    log(f"lowbit study {cfg.name!r}: {len(runs)} runs in the grid, {skipped} already in {store.path}, "
        f"{len(pending)} to run")
    groups: list[tuple[tuple[str, int, int], list[RunConfig]]] = []
    for r in pending:
        gk = (r.backend, r.world_size, r.nodes)
        if groups and groups[-1][0] == gk:
            groups[-1][1].append(r)
        else:
            groups.append((gk, [r]))

    ran = 0
    for (backend, ws, nodes), group in groups:
        plan = _GroupPlan(runs=[r.to_dict() for r in group], results_path=str(store.path), total=len(runs),
                          done_before=skipped + ran, finished_this_invocation=ran, crash_after=crash_after,
                          progress=progress, launcher="spawn", study=cfg.name, tensorboard=tb)
        try:
            spawn(_spawn_worker, ws, plan, backend=backend, timeout_s=900.0,
                  node_size=ws // nodes if nodes > 1 else None)
        except WorkerError as exc:
            now_done = len(store.finished_keys() & {r.key() for r in runs}) - skipped
            raise StudyInterrupted(
                f"the study stopped in the world-size-{ws} group: {now_done} run(s) of this invocation finished "
                f"and are saved in {store.path}; rerun the same command to resume.\n{exc}"
            ) from None
        ran += len(group)
    return StudyResult(store.path, len(runs), skipped, ran, time.perf_counter() - t0)


def _run_under_torchrun(cfg: StudyConfig, out_dir: str | os.PathLike[str], progress: bool, crash_after: int,
                        log: Callable[[str], None], t0: float, tensorboard: str | None = None) -> StudyResult:

    _, world = launched_rank_and_size()
    all_runs = expand_runs(cfg)
    runs = [r for r in all_runs if r.world_size == world]
    if not runs:
        raise ValueError(f"under torchrun WORLD_SIZE={world}, but the study's world sizes are {list(cfg.world_sizes)}")
    backends = sorted({r.backend for r in runs})
    if len(backends) > 1:
        raise ValueError(f"under torchrun one launch has one backend; pass --backend to choose one of {backends}")
    layouts = sorted({r.nodes for r in runs})
    if len(layouts) > 1:
        raise ValueError(f"under torchrun one launch has one node layout; pass --emulate-nodes to choose one of {layouts}")
    check_runs(runs)
    _check_launchable(runs, "torchrun")
    if runs[0].device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    if layouts[0] > 1:  # emulated nodes on this host: before the group (and NCCL) start

        emulate_node(int(os.environ.get("RANK", 0)), world // layouts[0])
    if backends[0] == "mpi":
        dist.init_process_group("mpi")
        rank, world = dist.get_rank(), dist.get_world_size()
    else:
        rank, world = init_from_env(backends[0])
    try:
        store = ResultStore(out_dir)
        # Rank 0 owns the results file (it may live on rank 0's machine only): it decides what is pending.
        box: list[Any] = [None]
        if rank == 0:
            rows = store.finished()
            runs = resolve_targets(runs, rows)
            box[0] = [r.to_dict() for r in runs if r.awaits_target or r.key() not in rows]
            log(f"lowbit study {cfg.name!r} under torchrun (K={world}): {len(runs)} runs of this world size, "
                f"{len(runs) - len(box[0])} already in {store.path}, {len(box[0])} to run")
        dist.broadcast_object_list(box, src=0)
        pending: list[dict[str, Any]] = box[0]
        plan = _GroupPlan(runs=pending, results_path=str(store.path), total=len(runs),
                          done_before=len(runs) - len(pending), finished_this_invocation=0, crash_after=crash_after,
                          progress=progress, launcher="torchrun", study=cfg.name, tensorboard=tensorboard)
        ran = _run_group(rank, world, plan)
        # Free the last run's DDP reducer and lowbit state while the group is alive, and let every rank
        # get here before tearing it down: without this a rank sometimes aborted at exit
        # ("terminate called without an active exception") under torchrun.
        gc.collect()
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return StudyResult(store.path, len(runs), len(runs) - len(pending), ran, time.perf_counter() - t0)
