"""The seed study's projection (Grubic et al. 2018, Sec. 6 and Figure 16 right; docs/perfmodel.md, section 7).

The seed grows AlexNet's model size artificially (8 GPUs, NCCL) and plots the speedup of 8-bit over 32-bit
against the ratio between communication and computation in MB/GFLOPS, "upper bounded by the difference in
bandwidth usage, which is 4x". It does not say per what; here the ratio is per GPU and per step::

    r        = (4 * params / 1e6 MB of fp32 gradients) / (GFLOPs one GPU computes per step)   [per sample: r * batch]
    t_c      = G / R;   M_32 = r * G * 1e6 bytes
    T(b)     = t_c + t_enc(b) + max(0, C(M_32 * b / 32) - h * t_c);   speedup = T(32) / T(b) <= 32 / b

for ``G`` GFLOP per step at ``R`` GFLOP/s, a collective ``C`` on a link, and ``h`` the fraction of compute that
hides communication. The bound holds because latency does not shrink with ``b``: ``C(M b/32) >= (b/32) C(M)``,
so ``(32/b) T(b) >= T(32)`` for ``h <= 1``. :func:`seed_setting` is the seed's AlexNet on 8 K80s, calibrated
to reproduce its 1-GPU and 8-GPU 32-bit NCCL throughputs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from lowbit.lab.perfmodel.collectives import Topology, collective
from lowbit.lab.perfmodel.links import Link
from lowbit.lab.perfmodel.networks import Network, get_network

__all__ = ["ProjectionSetting", "speedup_bound", "comm_comp_ratio", "network_ratio", "step_time",
           "projected_speedup", "projection_curve", "seed_setting"]


@dataclasses.dataclass(frozen=True)
class ProjectionSetting:
    """Cluster and compute of the projection (see module doc)."""

    gpus: int
    link: Link
    device_gflops: float       # effective GFLOP/s of one GPU
    gflop_per_step: float      # GFLOPs one GPU computes per step
    algorithm: str = "allreduce"
    hidden_fraction: float = 0.0
    encode_s_per_byte: float = 0.0  # codec cost (s per fp32 byte) charged to the low-precision side

    def __post_init__(self) -> None:
        if self.gpus < 1:
            raise ValueError(f"number of GPUs must be >= 1, got {self.gpus}")
        if self.device_gflops <= 0 or self.gflop_per_step <= 0:
            raise ValueError("device rate and GFLOPs per step must be > 0")
        if not 0 <= self.hidden_fraction <= 1:
            raise ValueError(f"hidden fraction must be in [0, 1], got {self.hidden_fraction}")


def speedup_bound(bits: float) -> float:
    """Upper bound of the b-bit over 32-bit speedup: the bandwidth ratio ``32 / b``."""
    if bits <= 0:
        raise ValueError(f"bits must be > 0, got {bits}")
    return 32.0 / bits


def comm_comp_ratio(params: float, gflop: float) -> float:
    """MB of 32-bit gradients (``4 params / 1e6``) per GFLOP of compute."""
    if gflop <= 0:
        raise ValueError(f"GFLOPs must be > 0, got {gflop}")
    return 4.0 * params / 1e6 / gflop


def network_ratio(network: str | Network, batch_per_gpu: int = 1, per: str = "step") -> float:
    """A network's ratio per GPU-step at ``batch_per_gpu`` (``per="step"``) or per sample."""
    net = get_network(network) if isinstance(network, str) else network
    if per not in ("step", "sample"):
        raise ValueError(f"per must be 'step' or 'sample', got {per!r}")
    return comm_comp_ratio(net.params, net.fwd_bwd_gflops * (batch_per_gpu if per == "step" else 1))


def step_time(ratio: float, bits: float, setting: ProjectionSetting) -> float:
    """``T(b) = t_c + t_enc + max(0, C(M_32 b / 32) - h t_c)`` in seconds."""
    if ratio < 0:
        raise ValueError(f"ratio must be >= 0 MB/GFLOP, got {ratio}")
    if bits <= 0:
        raise ValueError(f"bits must be > 0, got {bits}")
    t_c = setting.gflop_per_step / setting.device_gflops
    m32 = ratio * setting.gflop_per_step * 1e6
    topo = Topology(setting.gpus, setting.gpus, setting.link)
    comm = collective(setting.algorithm, m32 * bits / 32.0, topo).time_s
    t_enc = setting.encode_s_per_byte * m32 if bits < 32 and setting.gpus > 1 else 0.0
    return t_c + t_enc + max(0.0, comm - setting.hidden_fraction * t_c)


def projected_speedup(ratio: float, bits: float = 8, setting: ProjectionSetting | None = None) -> float:
    """Speedup of b bits over 32 bits at communication/computation ratio ``ratio`` (MB/GFLOP)."""
    s = setting or seed_setting()
    return step_time(ratio, 32.0, s) / step_time(ratio, bits, s)


def projection_curve(ratios: Iterable[float], bits: float = 8,
                     setting: ProjectionSetting | None = None) -> list[tuple[float, float]]:
    """``[(ratio, speedup)]`` over ``ratios``."""
    s = setting or seed_setting()
    return [(r, projected_speedup(r, bits, s)) for r in ratios]


def seed_setting(gpus: int = 8, batch_total: int = 256, one_gpu_samples_per_s: float = 240.8,
                 fp32_samples_per_s: float = 1138.3, network: str = "alexnet") -> ProjectionSetting:
    """The seed's Figure 16 setting, calibrated on its AlexNet NCCL throughputs (see module doc).

    Device rate ``R = one_gpu_samples_per_s * GFLOPs/sample``. With ``b = batch_total / gpus`` samples
    per GPU, the measured fp32 step ``batch_total / fp32_samples_per_s`` minus the compute
    ``b / one_gpu_samples_per_s`` is the ring allreduce of the fp32 gradients, which gives the
    bandwidth (latency taken as zero: one 248 MB allreduce is bandwidth-bound).
    """
    net = get_network(network)
    per_gpu = batch_total / gpus
    rate = one_gpu_samples_per_s * net.fwd_bwd_gflops
    comm = batch_total / fp32_samples_per_s - per_gpu / one_gpu_samples_per_s
    if comm <= 0:
        raise ValueError("the fp32 throughput leaves no time for communication; cannot calibrate a link")
    ring_bytes = 2 * (gpus - 1) / gpus * 4 * net.params
    link = Link(latency_s=0.0, bandwidth_Bps=ring_bytes / comm, name=f"seed-{network}-nccl")
    return ProjectionSetting(gpus=gpus, link=link, device_gflops=rate,
                             gflop_per_step=per_gpu * net.fwd_bwd_gflops)
