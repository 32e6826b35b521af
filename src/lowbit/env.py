"""Where a measurement ran, and how this process was launched: the one place that decides both.

Benchmarks (``lowbit bench``) and the study record the same host facts through :func:`host` and decide
"are we one rank of a torchrun / MPI launch" through :func:`under_torchrun` and
:func:`launched_rank_and_size`, so their results files agree on what they mean.
"""

from __future__ import annotations

import os
import platform
import socket
import subprocess
from pathlib import Path
from typing import Any

import torch

from lowbit._version import __version__

__all__ = ["NCCL_ENV", "cpu_model", "device_name", "loadavg", "git_commit", "host", "under_torchrun",
           "launched_rank_and_size"]

#: NCCL variables that change which link a run used; recorded with every measurement.
NCCL_ENV = ("NCCL_P2P_DISABLE", "NCCL_SHM_DISABLE", "NCCL_IB_DISABLE", "NCCL_HOSTID", "NCCL_SOCKET_IFNAME",
            "NCCL_ALGO", "NCCL_PROTO", "NCCL_NVLS_ENABLE")


def cpu_model() -> str:
    """The processor's model name (``/proc/cpuinfo``), else what ``platform`` knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def device_name(device: torch.device) -> str:
    """The GPU's name, or the CPU's model for a CPU device."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_model()


def loadavg() -> list[float] | None:
    """The 1/5/15-minute load averages (other work on the machine skews CPU timings), if known."""
    try:
        return [round(v, 2) for v in os.getloadavg()]
    except (AttributeError, OSError):
        return None


def git_commit() -> str | None:
    """The lowbit checkout's commit (``+dirty`` when tracked files differ), if it runs from one;
    ``$LOWBIT_GIT_COMMIT`` wins (a copy of the tree without its history, e.g. on a lent machine)."""
    forced = os.environ.get("LOWBIT_GIT_COMMIT", "").strip()
    if forced:
        return forced
    root = Path(__file__).resolve().parents[2]
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=5, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=5, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return head + ("+dirty" if dirty else "") if head else None


def host(device: torch.device, launcher: str) -> dict[str, Any]:
    """Versions, machine, processor, threads, device, launcher, load and NCCL variables of this process."""
    return {
        "lowbit": __version__,
        "lowbit_git_commit": git_commit(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "hostname": socket.gethostname(),
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "device": str(device),
        "device_name": device_name(device),
        "launcher": launcher,
        "loadavg_at_start": loadavg(),
        "nccl_env": {k: os.environ[k] for k in NCCL_ENV if k in os.environ},
    }


def under_torchrun() -> bool:
    """One rank of a torchrun launch (its environment is set: RANK, WORLD_SIZE, MASTER_ADDR)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ


def launched_rank_and_size() -> tuple[int, int]:
    """This process's (rank, world size) from torchrun's or an MPI launcher's environment."""
    for rank_var, size_var in (("RANK", "WORLD_SIZE"), ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
                               ("PMI_RANK", "PMI_SIZE")):
        if size_var in os.environ:
            return int(os.environ.get(rank_var, "0")), int(os.environ[size_var])
    raise ValueError("--launcher torchrun: no RANK/WORLD_SIZE in the environment (start with torchrun or mpirun)")
