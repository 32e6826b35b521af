"""The study's result rows as the speed model reads them: :func:`run_record` turns a finished run's ``run``
row into a :class:`RunRecord` (times per training step, averaged over ranks and over the timed epochs), whose
keys (:class:`ScaleKey`, :class:`OverheadKey`, ...) index a calibration's tables. The study owns its records'
schema; the speed model (lowbit.lab.perfmodel: calibration, validation, advice) only reads their fields.
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

from lowbit.lab.baselines import is_baseline
from lowbit.lab.perfmodel.model import codec_fact
from lowbit.lab.study.config import is_auto

__all__ = ["RunRecord", "ScaleKey", "OverheadKey", "run_record"]


@dataclasses.dataclass(frozen=True)
class ScaleKey:
    """Backend, device, workers and emulated nodes: the scale a factor or an overhead belongs to
    (a calibration's ``world_factor`` and ``step_overhead_s``)."""

    backend: str
    device: str
    world: int
    nodes: int = 1

    def __str__(self) -> str:
        return f"{self.backend}|{self.device}|{self.world}" + (f"|{self.nodes}nodes" if self.nodes > 1 else "")

    @classmethod
    def parse(cls, text: str) -> "ScaleKey":
        parts = text.split("|")
        if len(parts) not in (3, 4) or (len(parts) == 4 and not parts[3].endswith("nodes")):
            raise ValueError(f"not a scale key: {text!r} (backend|device|K[|Nnodes])")
        return cls(parts[0], parts[1], int(parts[2]), int(parts[3].removesuffix("nodes")) if len(parts) == 4 else 1)


@dataclasses.dataclass(frozen=True)
class OverheadKey:
    """A scale and whether the codec sums on the wire (native: fp32/fp16/bf16, one allreduce) or is
    compressed (encode on the training thread, several collectives per bucket): their overheads differ."""

    scale: ScaleKey
    native: bool

    def __str__(self) -> str:
        return f"{self.scale}|{'native' if self.native else 'compressed'}"

    @classmethod
    def parse(cls, text: str) -> "OverheadKey | ScaleKey":
        """An overhead key, or the plain scale key that holds the overhead of both kinds together."""
        head, _, kind = text.rpartition("|")
        if kind in ("native", "compressed"):
            return cls(ScaleKey.parse(head), kind == "native")
        return ScaleKey.parse(text)


@dataclasses.dataclass(frozen=True)
class RunRecord:
    """One finished study run as the speed model reads it (times per training step, averaged over ranks
    and over the timed epochs), with its keys into a calibration's tables."""

    key: str
    network: str
    dataset: str
    batch: int
    world: int
    backend: str
    device: str
    codec: str
    algorithm: str           # the algorithm the compressed group used (allreduce for fp32/fp16/bf16)
    error_feedback: bool
    seed: int
    synthetic: bool
    params: int
    compressed_params: int
    step_s: float
    compute_s: float
    exposed_s: float
    encode_s: float
    comm_s: float
    decode_s: float
    bytes_per_step: float
    samples_per_s: float
    final_test_acc: float
    epochs: int
    lr: float
    device_name: str = ""
    config_rest: str = ""    # the rest of the training configuration, for pairing runs
    gflop_per_sample: float = math.nan  # forward + backward, counted by the study (FlopCounterMode)
    nodes: int = 1                      # emulated nodes the workers were split into
    intra_Bps: float = math.nan         # the links the run's group measured (bus bandwidth of a 16 MiB
    inter_Bps: float = math.nan         # allreduce inside a node / between nodes; study rows' env.links)

    @property
    def config_key(self) -> tuple[Any, ...]:
        """Everything but the seed: the runs of one configuration (leave-one-config-out holds them out)."""
        return (self.network, self.dataset, self.batch, self.world, self.backend, self.device, self.codec,
                self.algorithm, self.error_feedback, self.config_rest)

    # The run's keys into the Calibration's tables (their text, as JSON holds it):
    @property
    def setting_key(self) -> str:
        """Network, data, batch, backend, device and workers: what sets the compute of a step
        (a calibration's ``compute_at_world``)."""
        return f"{self.network}|{self.dataset}|{self.batch}|{self.backend}|{self.device}|{self.world}"

    @property
    def compute_key(self) -> str:
        """Network, data, batch and device: what sets one worker's compute (a calibration's ``compute``)."""
        return f"{self.network}|{self.dataset}|{self.batch}|{self.device}"

    @property
    def scale(self) -> ScaleKey:
        return ScaleKey(self.backend, self.device, self.world, self.nodes)

    @property
    def scale_key(self) -> str:
        return str(self.scale)

    @property
    def overhead_key(self) -> str:
        """Overheads differ between native (fp32/fp16/bf16: one allreduce) and compressed codecs (encode on
        the training thread, several collectives per bucket)."""
        return str(OverheadKey(self.scale, codec_fact(self.codec_name, "sums_on_wire", False)))

    @property
    def config_id(self) -> str:
        """:attr:`config_key` as text (what a calibration's ``config_keys`` hold)."""
        return json.dumps(self.config_key, sort_keys=True, default=str)

    @property
    def codec_name(self) -> str:
        return self.codec.split(":", 1)[0]

    @property
    def label(self) -> str:
        return f"{self.network}/{self.dataset}"


def run_record(row: dict[str, Any]) -> RunRecord | None:
    """A study result row (a finished run's ``run`` row) as the model reads it; None for runs it does
    not describe (model / hybrid parallelism, the simulated NCCL, ``codec="auto"``, no timed steps). The study's reader
    (:func:`lowbit.lab.study.store.load_run_records`) applies it to a results file."""
    c, s = row.get("config") or {}, row.get("summary") or {}
    epochs = row.get("epochs") or []
    timed = set(s.get("timed_epochs") or [e.get("epoch") for e in epochs[1:]] or [e.get("epoch") for e in epochs])
    use = [e for e in epochs if e.get("epoch") in timed] or epochs
    steps = sum(float(e.get("steps") or 0) for e in use)
    if steps <= 0:
        return None

    def per_step(field: str) -> float:
        return sum(float(e.get(field) or 0.0) for e in use) / steps

    if c.get("parallelism", "data") != "data" or c.get("algorithm") == "simulated":
        return None  # model / hybrid parallelism and the simulated NCCL are not what this model describes
    world = int(c.get("world_size", 1))
    codec = str(c.get("codec", "fp32"))
    if is_auto(codec):
        return None  # lowbit.ddp's codec="auto" chooses per tensor while training; the row holds no codec
    if is_baseline(codec):
        return None  # PyTorch's own hooks: not lowbit's collectives, which the model prices
    algo = "allreduce" if codec_fact(codec, "sums_on_wire", False) else str(c.get("algorithm") or "scatter_gather")
    if algo == "none":
        algo = "scatter_gather"
    rest = {k: v for k, v in c.items() if k not in (
        "network", "dataset", "batch_size", "world_size", "backend", "device", "codec", "algorithm",
        "error_feedback", "seed", "batch_preset")}
    labels = row.get("labels") or {}
    env = row.get("env") or {}
    links = env.get("links") if isinstance(env.get("links"), dict) else {}

    def link_Bps(field: str) -> float:
        v = links.get(field)
        return float(v) * 1e9 if isinstance(v, (int, float)) and v > 0 else math.nan

    return RunRecord(
        key=str(row["key"]), network=str(c.get("network")), dataset=str(c.get("dataset")),
        batch=int(c.get("batch_size", 0)), world=world, backend=str(c.get("backend", "gloo")),
        device=str(c.get("device", "cpu")), codec=codec, algorithm=algo,
        error_feedback=bool(c.get("error_feedback", False)), seed=int(c.get("seed", 0)),
        synthetic=bool(labels.get("synthetic", False)), params=int(s.get("params") or 0),
        compressed_params=int(s.get("compressed_params") or 0),
        step_s=per_step("train_s"), compute_s=per_step("compute_s"), exposed_s=per_step("exposed_comm_s"),
        encode_s=per_step("encode_s"), comm_s=per_step("comm_s"), decode_s=per_step("decode_s"),
        bytes_per_step=per_step("bytes_sent_per_rank"), samples_per_s=float(s.get("samples_per_s") or math.nan),
        final_test_acc=float(s.get("final_test_acc") if s.get("final_test_acc") is not None else math.nan),
        epochs=int(c.get("epochs", len(epochs))), lr=float(c.get("lr", math.nan)),
        device_name=str(env.get("device_name", "")), config_rest=json.dumps(rest, sort_keys=True),
        gflop_per_sample=float(s.get("gflop_per_sample") or math.nan),
        nodes=int(c.get("nodes", 1) or 1), intra_Bps=link_Bps("intra_GBps"), inter_Bps=link_Bps("inter_GBps"),
    )
