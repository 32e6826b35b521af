"""Dettmers' predictive speedup models (ICLR 2016, Appendix 5), from his published inputs (docs/perfmodel.md,
section 4, sets every number beside the paper's).

**Single node, 4 GPUs** (AlexNet; data-parallel conv layers, model-parallel fc layers in K sub-batches)::

    speedup = K * T_total / ((T_total - T_fc) + P_conv + K * T_fc,par + P_fc)

with his Tables 3 and 4 (:class:`SingleNodeInputs`). The 32-bit ``P_fc`` terms sum to 7.01 ms where the paper
prints 6.81 (an arithmetic slip, ``p_fc_as_printed=True``); both round to its 3.53x.

**Cluster, 32 nodes x 3 GPUs** (the conv-3 activations go to the fc layers in sub-batches of b, each transfer
hidden under the 1.3 ms fc matmul of the previous one; :class:`ClusterInputs`)::

    total(b)   = (12288 / b) * T_fc + 31 * max(0, t_sync(b) - 1.3 ms)   (or one t_sync(b) when hidden)
    speedup(b) = 96 * T_total / ((T_total - T_fc) + total(b))           (his Table 7)

``source="table6"`` takes total(b) as his Table 6 prints it, which reproduces all 24 entries of Table 7;
``source="formula"`` evaluates it, within 0.3% (0.43% for the "(?)" row).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

__all__ = ["SingleNodeInputs", "ClusterInputs", "SpeedupRow", "single_node_p_fc", "single_node_step_ms",
           "single_node_speedup", "single_node_table", "cluster_forward_ms", "cluster_total_ms", "cluster_speedup",
           "cluster_table", "PAPER_SINGLE_NODE", "PAPER_CLUSTER", "BASELINES_MS"]

#: Single-GPU AlexNet pass (ms): NervanaGPU kernels on a GTX Titan X, and cuda-convnet2 kernels.
BASELINES_MS: dict[str, float] = {"nervanagpu": 104.1, "convnet2": 177.0}


# ------------------------------------------------------------------------------------ single node
@dataclasses.dataclass(frozen=True)
class SingleNodeInputs:
    """Dettmers' Tables 3 and 4 and the P_fc terms of Appendix 5.1."""

    gpus: int = 4
    #: Table 4, fc layers, baseline ms (fprop, bprop, update): 9216->3072, 3072->3072, 3072->1000.
    fc_times_ms: tuple[tuple[float, float, float], ...] = ((1.3, 1.3, 1.5), (0.45, 0.45, 0.5), (0.4, 0.4, 0.2))
    #: Table 4, same layers with the output divided by 4 (model parallel).
    fc_par_times_ms: tuple[tuple[float, float, float], ...] = ((0.9, 0.9, 0.43), (0.3, 0.3, 0.13), (0.15, 0.15, 0.08))
    #: Table 3: sync of the first conv layer's gradients, the only data-parallel sync not hidden.
    conv_penalty_ms: float = 0.05
    #: Table 3 sync times (32-bit, 8-bit) in ms: conv-3 activations, fc 9216->3072, 3072->3072, 3072->1000.
    sync_ms: Mapping[str, tuple[float, float]] = dataclasses.field(default_factory=lambda: {
        "conv3_act": (0.9, 0.4), "fc1": (1.1, 0.5), "fc2": (1.1, 0.5), "fc3": (0.4, 0.25)})
    #: The six overlapped transfers of P_fc: (message, ms of matmul that hides it), in the paper's order.
    #: Which 1.1 ms message sits in the 5th and 6th term is not stated; fc1 and fc2 sync equally fast.
    overlapped: tuple[tuple[str, float], ...] = (
        ("conv3_act", 0.9), ("fc1", 0.3), ("fc2", 0.15), ("fc3", 0.3), ("fc1", 0.9), ("fc2", 0.64))
    #: Transfers nothing overlaps: the first conv-3 activations and the last error activities.
    unhidden: tuple[str, int] = ("conv3_act", 5)
    #: The paper's printed (mis-added) 32-bit P_fc.
    p_fc_32_printed_ms: float = 6.81

    @property
    def fc_ms(self) -> float:
        """T_fc: sum of Table 4's baseline fc times (6.5 ms)."""
        return sum(sum(t) for t in self.fc_times_ms)

    @property
    def fc_par_ms(self) -> float:
        """T_fc,par: sum of Table 4's model-parallel fc times (3.34 ms)."""
        return sum(sum(t) for t in self.fc_par_times_ms)


def _bits_index(bits: int) -> int:
    if bits not in (32, 8):
        raise ValueError(f"Dettmers' models have 32-bit and 8-bit inputs only, got bits={bits!r}")
    return 0 if bits == 32 else 1


def single_node_p_fc(bits: int, inputs: SingleNodeInputs | None = None) -> float:
    """P_fc in ms: ``sum(max(0, sync - overlap)) + n_unhidden * sync(conv3 activations)``."""
    inp = inputs or SingleNodeInputs()
    j = _bits_index(bits)
    hidden = sum(max(0.0, inp.sync_ms[msg][j] - ov) for msg, ov in inp.overlapped)
    msg, count = inp.unhidden
    return hidden + count * inp.sync_ms[msg][j]


def single_node_step_ms(total_ms: float, fc_ms: float, k_fc_par_ms: float, conv_penalty_ms: float,
                        p_fc_ms: float) -> float:
    """The hybrid step on K GPUs: ``(T_total - T_fc) + P_conv + K T_fc,par + P_fc`` (ms): the conv part of
    one GPU's step, the unhidden conv sync, the model-parallel fc layers over all K sub-batches and the
    unhidden activation transfers. ``benchmarks/bench_hybrid.py`` evaluates it with measured inputs."""
    return (total_ms - fc_ms) + conv_penalty_ms + k_fc_par_ms + p_fc_ms


def single_node_speedup(bits: int, total_ms: float = BASELINES_MS["nervanagpu"], inputs: SingleNodeInputs | None = None,
                        p_fc_as_printed: bool = False) -> float:
    """``K T / ((T - T_fc) + P_conv + K T_fc,par + P_fc)``; ``p_fc_as_printed`` uses 6.81 for 32-bit."""
    inp = inputs or SingleNodeInputs()
    p_fc = single_node_p_fc(bits, inp)
    if p_fc_as_printed and bits == 32:
        p_fc = inp.p_fc_32_printed_ms
    k = inp.gpus
    return k * total_ms / single_node_step_ms(total_ms, inp.fc_ms, k * inp.fc_par_ms, inp.conv_penalty_ms, p_fc)


#: The paper's printed single-node speedups, for side-by-side display: (baseline, bits) -> speedup.
PAPER_SINGLE_NODE: dict[tuple[str, int], float] = {
    ("nervanagpu", 32): 3.53, ("nervanagpu", 8): 3.67, ("convnet2", 32): 3.71, ("convnet2", 8): 3.80}


@dataclasses.dataclass(frozen=True)
class SpeedupRow:
    """One model prediction next to the number the paper prints."""

    baseline: str
    bits: int
    speedup: float
    paper: float | None
    sub_batch: int | None = None
    detail: str = ""


def single_node_table(inputs: SingleNodeInputs | None = None) -> list[SpeedupRow]:
    """Both baselines x {32, 8} bits, with P_fc from its terms (and the printed 6.81 for 32-bit)."""
    inp = inputs or SingleNodeInputs()
    rows = []
    for base, total in BASELINES_MS.items():
        for bits in (32, 8):
            paper = PAPER_SINGLE_NODE[(base, bits)]
            rows.append(SpeedupRow(base, bits, single_node_speedup(bits, total, inp), paper,
                                   detail=f"P_fc = {single_node_p_fc(bits, inp):.2f} ms (sum of terms)"))
            if bits == 32:
                rows.append(SpeedupRow(base, bits, single_node_speedup(bits, total, inp, p_fc_as_printed=True), paper,
                                       detail=f"P_fc = {inp.p_fc_32_printed_ms:.2f} ms (as printed)"))
    return rows


# ---------------------------------------------------------------------------------------- cluster
@dataclasses.dataclass(frozen=True)
class ClusterInputs:
    """Dettmers' Table 6 and the constants of Appendix 5.2."""

    nodes: int = 32
    gpus_per_node: int = 3
    global_batch: int = 12288       # 96 x 128
    fc_ms: float = 6.5              # T_fc, as in the single-node model
    overlap_ms: float = 1.3         # fc matmul under which the next sub-batch's transfer hides
    #: Table 6, single-pass sync time of the conv-3 activations (32-bit, 8-bit), ms, per sub-batch b.
    t_sync_ms: Mapping[int, tuple[float, float]] = dataclasses.field(default_factory=lambda: {
        128: (2.1, 0.35), 256: (4.2, 0.55), 512: (7.15, 1.13), 1024: (17.4, 2.25), 2048: (25.5, 3.26),
        12288: (250.0, 31.0)})
    #: Table 6, "Total time (ms)" as printed (forward + exposed sync, rounded by Dettmers).
    table6_total_ms: Mapping[int, tuple[float, float]] = dataclasses.field(default_factory=lambda: {
        128: (650.0, 624.0), 256: (402.0, 312.0), 512: (337.0, 157.0), 1024: (577.0, 108.0), 2048: (789.0, 100.0),
        12288: (7750.0, 928.0)})

    @property
    def gpus(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def peers(self) -> int:
        """Nodes each transfer must reach: 31."""
        return self.nodes - 1


def cluster_forward_ms(b: int, inputs: ClusterInputs | None = None) -> float:
    """Table 6 forward time: ``(global_batch / b)`` fc passes of ``T_fc`` each."""
    inp = inputs or ClusterInputs()
    return inp.global_batch / b * inp.fc_ms


def cluster_total_ms(b: int, bits: int, inputs: ClusterInputs | None = None, source: str = "formula") -> float:
    """Time of the fc stage per step: exact formula, or Dettmers' printed Table 6 total."""
    inp = inputs or ClusterInputs()
    j = _bits_index(bits)
    if b not in inp.t_sync_ms:
        raise ValueError(f"no Table 6 inputs for sub-batch {b}; known: {sorted(inp.t_sync_ms)}")
    if source == "formula":  # exposed: peers * (t_sync - overlap) when the transfer outlasts the matmul
        t = inp.t_sync_ms[b][j]
        return cluster_forward_ms(b, inp) + (inp.peers * (t - inp.overlap_ms) if t > inp.overlap_ms else t)
    if source == "table6":
        return inp.table6_total_ms[b][j]
    raise ValueError(f"unknown source {source!r}; choose 'formula' or 'table6'")


def cluster_speedup(b: int, bits: int, total_ms: float = BASELINES_MS["nervanagpu"],
                    inputs: ClusterInputs | None = None, source: str = "table6") -> float:
    """``96 * T_total / ((T_total - T_fc) + total(b))`` (Dettmers' Table 7)."""
    inp = inputs or ClusterInputs()
    fc_stage = cluster_total_ms(b, bits, inp, source)
    return inp.gpus * total_ms / ((total_ms - inp.fc_ms) + fc_stage)


#: Dettmers' Table 7 as printed, for side-by-side display: (b, bits) -> (NervanaGPU, convnet2).
#: (The 2048 row is printed as "2056".)
PAPER_CLUSTER: dict[tuple[int, int], tuple[float, float]] = {
    (128, 32): (13.4, 20.7), (128, 8): (13.8, 21.4), (256, 32): (20.0, 29.7), (256, 8): (24.4, 35.2),
    (512, 32): (23.0, 33.5), (512, 8): (39.3, 51.9), (1024, 32): (14.8, 22.7), (1024, 8): (48.6, 61.0),
    (2048, 32): (11.3, 17.7), (2048, 8): (50.6, 62.8), (12288, 32): (1.3, 2.15), (12288, 8): (9.7, 15.5)}


def cluster_table(inputs: ClusterInputs | None = None, source: str = "table6") -> list[SpeedupRow]:
    """Every (sub-batch, bits, baseline) of Table 7, computed, next to the printed value."""
    inp = inputs or ClusterInputs()
    rows = []
    for b in sorted(inp.t_sync_ms):
        for bits in (32, 8):
            for col, (base, total) in enumerate(BASELINES_MS.items()):
                paper = PAPER_CLUSTER.get((b, bits))
                fc_stage = cluster_total_ms(b, bits, inp, source)
                rows.append(SpeedupRow(base, bits, cluster_speedup(b, bits, total, inp, source),
                                       paper[col] if paper else None, sub_batch=b,
                                       detail=f"fc stage {fc_stage:.1f} ms ({source})"))
    return rows
