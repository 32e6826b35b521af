"""Start worker processes on one machine, or join a torchrun launch.

``spawn(fn, world_size, *args)`` runs ``fn(rank, world_size, *args)`` in ``world_size`` fresh processes
with an initialised process group (gloo on CPU, NCCL on GPU) and returns the list of every rank's
return value (None for a rank that exited without returning). Each rank
writes its traceback to a file, so the real cause of a failure is shown instead of "connection closed by
peer". A launch whose processes fail before any of them is past the rendezvous (gloo's local full-mesh
connect, now and then, on a loaded machine) is started once more (:data:`INIT_RETRIES`). Under torchrun (RANK / WORLD_SIZE / MASTER_ADDR set) use ``with process_group_from_env() as
(rank, world):`` (or :func:`init_from_env` and :func:`shutdown`) instead: the worker code is the same.

Teardown: every process ends with :func:`shutdown`, which stops lowbit's background threads
(:func:`before_shutdown`), frees what the run left (a DDP reducer, a lowbit state) while the group still
exists, waits for every rank, then destroys the group. Without it a
2-rank gloo run under torchrun sometimes aborts at exit with "terminate called without an active
exception" (plain torch too; docs/ddp.md, "Launching several processes").
"""

from __future__ import annotations

import gc
import os
import pickle
import sys
import tempfile
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

DEFAULT_TIMEOUT = timedelta(seconds=120)


def default_backend() -> str:
    return "nccl" if torch.cuda.is_available() and torch.cuda.device_count() > 0 else "gloo"


def init_from_env(backend: str | None = None, timeout: timedelta = DEFAULT_TIMEOUT) -> tuple[int, int]:
    """Initialise from torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, LOCAL_RANK)."""
    backend = backend or default_backend()
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group(backend, timeout=timeout)
    return dist.get_rank(), dist.get_world_size()


_BEFORE_SHUTDOWN: list[Callable[[], object]] = []


def before_shutdown(fn: Callable[[], object]) -> None:
    """Make :func:`shutdown` call ``fn()`` first, before it frees anything (once, however often given):
    lowbit.comm.threads stops lowbit's background threads there."""
    if fn not in _BEFORE_SHUTDOWN:
        _BEFORE_SHUTDOWN.append(fn)


def shutdown(clean: bool = True) -> None:
    """Destroy the default process group (if any) so that the process exits cleanly. ``clean`` (the run
    finished normally): first stop lowbit's background threads (:func:`before_shutdown`), then collect
    garbage, so that objects holding the group (a DDP reducer, lowbit's state) die while it exists
    (destroyed after it, they can abort the process with "terminate called without an active
    exception"), then wait for every rank (a barrier), so that no rank tears its connections down while
    a peer still uses them. After a failure only the group is destroyed: a barrier would wait for peers
    that may be gone (lowbit's threads are stopped at exit then)."""
    if not (dist.is_available() and dist.is_initialized()):
        return
    try:
        if clean:
            for fn in _BEFORE_SHUTDOWN:
                fn()
            gc.collect()
            try:
                dist.barrier()
            except Exception:  # noqa: BLE001 — a peer already gone (fault-injection tests) is fine here
                pass
    finally:
        dist.destroy_process_group()


@contextmanager
def process_group_from_env(backend: str | None = None,
                           timeout: timedelta = DEFAULT_TIMEOUT) -> Iterator[tuple[int, int]]:
    """``with process_group_from_env() as (rank, world): ...`` under torchrun: :func:`init_from_env` on the
    way in, :func:`shutdown` on the way out (a clean one when the body finished)."""
    rank, world = init_from_env(backend, timeout)
    ok = False
    try:
        yield rank, world
        ok = True
    finally:
        shutdown(clean=ok)


def emulate_node(rank: int, node_size: int) -> None:
    """Make this process a member of emulated node ``rank // node_size``: NCCL sees a host of its own per
    node (``NCCL_HOSTID``; with ``NCCL_IB_DISABLE=1`` the nodes then talk over sockets, inside a node over
    NVLink/shared memory), and lowbit's hierarchical algorithm takes the same node size
    (``LOWBIT_NODE_SIZE``). Call before the process group is created."""
    os.environ["LOWBIT_NODE_SIZE"] = str(node_size)
    os.environ["NCCL_HOSTID"] = f"node{rank // node_size}"
    os.environ["NCCL_IB_DISABLE"] = "1"


def _fail_once(env: str, here: bool) -> None:
    """Test hook: where ``here`` and ``$env`` names a path that does not exist yet, create it and fail as
    gloo's full-mesh connect does now and then (:data:`_FAULT_INIT_ENV`, :data:`_FAULT_LATE_INIT_ENV`)."""
    path = os.environ.get(env)
    if here and path and not os.path.exists(path):
        Path(path).write_text("failed once")
        raise RuntimeError(f"Gloo connectFullMesh failed: Connection closed by peer (injected by ${env})")


def _worker(rank: int, world_size: int, backend: str, init_file: str, errdir: str, timeout_s: float,
            fn: Callable[..., Any], args: tuple[Any, ...], node_size: int | None = None,
            env: dict[str, str] | None = None) -> None:
    if env is not None:  # a forkserver's child has the server's environment, not the caller's: restore it
        os.environ.clear()
        os.environ.update(env)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if node_size is not None:
        emulate_node(rank, node_size)
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank % torch.cuda.device_count())
        else:
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
        _fail_once(_FAULT_INIT_ENV, rank == 0)  # (tests: the rendezvous fails once)
        dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=timeout_s))
        _fail_once(_FAULT_LATE_INIT_ENV, rank == world_size - 1)  # (tests: a peer's connect fails after another
                                                                  # rank's init returned)
        # every rank past the rendezvous before any counts as started: a rank whose init returned first
        # could otherwise run fn (and tear its sockets down) while a peer is still mid-connect, which then
        # fails with "Connection closed by peer" after this rank's started file has ruled a retry out
        dist.barrier(device_ids=[torch.cuda.current_device()]) if backend == "nccl" else dist.barrier()
        Path(errdir, f"started.{rank}").touch()  # past the rendezvous: from here on, a failure is the run's
        ok = False
        try:
            result = fn(rank, world_size, *args)
            with open(os.path.join(errdir, f"result.{rank}"), "wb") as f:
                pickle.dump(result, f)
            del result
            ok = True
        finally:
            shutdown(clean=ok)
    except BaseException:
        Path(errdir, f"error.{rank}").write_text(traceback.format_exc())
        raise


START_METHOD_ENV = "LOWBIT_START_METHOD"
FORKSERVER_PRELOAD_ENV = "LOWBIT_FORKSERVER_PRELOAD"
_PRELOADED: list[bool] = []
#: What :func:`forkserver_preload` named, for the server to import when it starts.
_PRELOAD_MODULES: list[str] = []


def forkserver_preload(*modules: str) -> None:
    """Name modules for the forkserver to import when it starts, beside lowbit's own: what the functions
    given to :func:`spawn` import (the lab's study worker names itself this way; a script may too, or set
    ``$LOWBIT_FORKSERVER_PRELOAD``). A module that fails to import there is skipped. No effect once the
    server has started (at the first :func:`spawn` under forkserver), nor under spawn."""
    _PRELOAD_MODULES.extend(m for m in modules if m not in _PRELOAD_MODULES)


def start_method() -> str:
    """How :func:`spawn` starts its processes: ``spawn`` (default: a fresh interpreter each, ~3-4 s of
    importing torch on a 2-core machine) or, with ``$LOWBIT_START_METHOD=forkserver``, forks of one
    server process that imported torch once (~0.1 s each after the first; opt-in, issue 31). The
    children of a forkserver get the caller's environment back before anything else runs."""
    method = os.environ.get(START_METHOD_ENV, "spawn").strip() or "spawn"
    if method not in ("spawn", "forkserver"):
        raise ValueError(f"${START_METHOD_ENV}={method!r}: choose spawn or forkserver")
    if method == "forkserver" and not _PRELOADED:
        import multiprocessing

        # before the server starts; lowbit too, so that a child's unpickling of its function finds it loaded,
        # and what DDP's and FSDP's first construction would import in every child (torch._dynamo and its
        # ~900 modules: ~7 s on a 2-core machine). A module that fails to import is skipped.
        # numba's kernels and scikit-learn's data sets too (~2 s of CPU a rank each, in the study's workers).
        # Last, gc.freeze() of all that (lowbit._forkserver_freeze): the children's collections skip it.
        # lowbit's DDP, FSDP and model-parallel modules (compiled from source in each child when no .pyc is
        # written: ~0.1-0.3 s of CPU a rank), the modules forkserver_preload named (the lab's study worker)
        # and those $LOWBIT_FORKSERVER_PRELOAD names (comma-separated: what the functions given to spawn
        # import, such as a test framework).
        extra = [m.strip() for m in os.environ.get(FORKSERVER_PRELOAD_ENV, "").split(",") if m.strip()]
        multiprocessing.set_forkserver_preload(["torch", "torch.distributed", "torch._dynamo", "torch.nn.parallel",
                                                "torch.distributed.fsdp", "lowbit", "lowbit.kernels.numba",
                                                "lowbit.ddp", "lowbit.fsdp", "lowbit.parallel", *_PRELOAD_MODULES,
                                                "sklearn.datasets", *extra, "lowbit._forkserver_freeze"])
        _PRELOADED.append(True)
    return method


class WorkerError(RuntimeError):
    pass


#: Test hook: a path; while it does not exist, rank 0's rendezvous fails once (and creates it).
_FAULT_INIT_ENV = "LOWBIT_FAULT_INIT_ONCE"
#: Test hook: a path; while it does not exist, the last rank fails once just after its own init returned
#: (as a peer whose connect fails after rank 0's init is through: the race behind "started" counting only
#: once every rank has passed the barrier after the rendezvous).
_FAULT_LATE_INIT_ENV = "LOWBIT_FAULT_LATE_INIT_ONCE"
#: Launches :func:`spawn` retries when the processes fail before any of them is past the rendezvous
#: (nothing of ``fn`` has run): on a loaded machine gloo's full-mesh connect between local processes
#: now and then fails with "Connection closed by peer".
INIT_RETRIES = 1


def spawn(fn: Callable[..., Any], world_size: int, *args: Any, backend: str | None = None,
          timeout_s: float = 120.0, node_size: int | None = None) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` local processes; returns every rank's result.
    ``node_size``: split the processes into emulated nodes of that many ranks (:func:`emulate_node`)."""
    if node_size is not None and (node_size < 1 or world_size % node_size):
        raise ValueError(f"node_size {node_size} does not split {world_size} ranks into whole nodes")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    backend = backend or default_backend()
    if backend == "nccl" and torch.cuda.device_count() < world_size:
        raise ValueError(f"backend nccl needs one GPU per rank: {world_size} ranks, {torch.cuda.device_count()} GPUs")
    for attempt in range(INIT_RETRIES + 1):
        with tempfile.TemporaryDirectory(prefix="lowbit-") as tmp:
            init_file = os.path.join(tmp, "rendezvous")
            try:
                method = start_method()
                mp.start_processes(_worker, args=(world_size, backend, init_file, tmp, timeout_s, fn, args, node_size,
                                                  dict(os.environ) if method == "forkserver" else None),
                                   nprocs=world_size, join=True, start_method=method)
            except Exception as exc:
                errors = sorted(Path(tmp).glob("error.*"))
                detail = "\n".join(f"--- rank {p.name.split('.')[1]} ---\n{p.read_text()}" for p in errors)
                if attempt < INIT_RETRIES and not any(Path(tmp).glob("started.*")):
                    print(f"lowbit.launch: the {world_size} processes failed before the rendezvous completed; "
                          f"starting them again ({detail.strip().splitlines()[-1] if detail else exc})",
                          file=sys.stderr, flush=True)
                    continue
                raise WorkerError(f"a worker failed:\n{detail}" if detail else
                                  f"a worker failed without writing an error (killed, or os._exit): {exc}") from None
            return _results(tmp, world_size)
    raise AssertionError("unreachable")  # pragma: no cover


def _results(tmp: str, world_size: int) -> list[Any]:
    """Every rank's pickled return value (None for a rank that exited without returning)."""
    results: list[Any] = []
    for r in range(world_size):
        path = os.path.join(tmp, f"result.{r}")
        if not os.path.exists(path):  # the rank exited without returning (os._exit in a fault test)
            results.append(None)
            continue
        with open(path, "rb") as f:
            results.append(pickle.load(f))
    return results
