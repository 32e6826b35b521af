"""Step time of synchronous data-parallel training with (compressed) gradient exchange (docs/perfmodel.md,
section 3): the layers in forward order (parameters; forward + backward seconds for the per-GPU batch) on
a :class:`Cluster`, each layer's codec (a :class:`LayerCodec`: bits, algorithm, encode/decode costs), one
step on two resources, the GPU's compute stream and one communication stream::

    compute:  | forward | bwd L_n | enc M1 | bwd L_n-1 ... | enc Mm | ...decode M1..Mm... |
    comm:                          | xfer M1 |    ...      | xfer Mm |

Forward takes ``(1 - f) * sum(c_i)``, backward ``f * c_i`` per layer (``f = 2/3``: gradients for inputs and
for weights, each about one forward). Gradients become ready in DDP's buckets, in backward order, and
travel in the messages ``lowbit.ddp``'s hook sends (:func:`lowbit.timeline.plan_step`, one plan for the
hook, ``codec="auto"`` and this model). A message is encoded on the compute stream once its last layer's
backward ends, then sent as soon as the comm stream is free (so it overlaps the backward of the layers
before it); decoding runs after the backward, message by message. Values encoded / decoded per message
are the algorithm's ``work`` (:func:`codec_work`), seconds = ``4 * values / throughput`` (bytes of
float32 per second); fp32 is never encoded. The step ends at the last decode, transfer or backward.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Collection, Mapping, Sequence
from typing import Any

from lowbit.codecs.base import get_codec
from lowbit.comm.allreduce import AUTO, auto_algorithm
from lowbit.comm.allreduce import resolve_algorithm as comm_resolve_algorithm
from lowbit.lab.perfmodel.collectives import Topology, collective, model_of, positive_int
from lowbit.lab.perfmodel.links import Link, parse_link
from lowbit.lab.perfmodel.networks import Network, get_network
from lowbit.timeline import DDP_BUCKET_BYTES, ddp_buckets, plan_step

__all__ = ["codec_fact", "short_codec", "bits_per_value", "Layer", "LayerCodec", "Cluster", "Breakdown", "Prediction",
           "layers_for_network", "step_collectives", "codec_work", "simulate_step", "resolve_algorithm", "predict",
           "predict_network"]

FP32_BITS = 32.0


def codec_fact(spec: str, fact: str, default: Any = None) -> Any:
    """One of the codec's own facts (an attribute of :class:`lowbit.Codec`: ``sums_on_wire``, ``spec``,
    ``short_label``, ``per_tensor``, ``rung``) for a spec; ``default`` for a spec that names no codec (an
    old result row's, or ``"auto"``, a choice and not a codec)."""
    try:
        return getattr(get_codec(spec), fact)
    except ValueError:
        return default


def short_codec(spec: str) -> str:
    """The codec's :attr:`~lowbit.Codec.short_label` (``qsgd:bits=4,bucket=512`` -> ``qsgd4/512``); for a
    spec that names no codec, its name."""
    return codec_fact(spec, "short_label", spec.partition(":")[0])


def bits_per_value(codec: object, numel: int = 1 << 20) -> float:
    """Bits on the wire per value: a number as is, else the codec's own count for a tensor of ``numel``
    values (scales and packing included; :meth:`lowbit.codecs.base.Codec.bits_per_value`) of a spec
    string (parsed by :func:`lowbit.get_codec`) or a codec."""
    if isinstance(codec, bool) or not isinstance(codec, (int, float, str)) and not hasattr(codec, "bits_per_value"):
        raise ValueError(f"bits per value must be a number or a codec spec, got {codec!r}")
    if isinstance(codec, (int, float)):
        bits = float(codec)
    else:  # a spec string (a ValueError names an unknown codec) or a codec
        bits = float((get_codec(codec) if isinstance(codec, str) else codec).bits_per_value(numel))
    if not (math.isfinite(bits) and bits > 0):
        raise ValueError(f"bits per value must be a finite number > 0, got {bits!r}")
    return bits


# ------------------------------------------------------------------------------------------ inputs
@dataclasses.dataclass(frozen=True)
class Layer:
    """A layer (or bucket of layers): parameters and forward + backward seconds for the per-GPU batch."""

    name: str
    params: int
    compute_s: float

    def __post_init__(self) -> None:
        if self.params < 0:
            raise ValueError(f"layer {self.name!r}: params must be >= 0, got {self.params}")
        if not (self.compute_s >= 0 and math.isfinite(self.compute_s)):
            raise ValueError(f"layer {self.name!r}: compute time must be finite and >= 0, got {self.compute_s}")


@dataclasses.dataclass(frozen=True)
class LayerCodec:
    """How one layer's gradients travel: bits per value, algorithm, the codec's throughput (bytes of float32
    per second; None = free) and fixed cost per message (kernel launches, dispatch: what dominates small
    tensors on a CPU). Layers whose codecs are equal (the ``label`` aside) travel in one group."""

    bits: float
    algorithm: str
    encode_Bps: float | None = None
    decode_Bps: float | None = None
    encode_call_s: float = 0.0
    decode_call_s: float = 0.0
    label: str = dataclasses.field(default="", compare=False)
    link: Link | None = None  # a link measured for this algorithm; None = the cluster's links

    def __post_init__(self) -> None:
        if not (math.isfinite(self.bits) and self.bits > 0):
            raise ValueError(f"bits per value must be a finite number > 0, got {self.bits!r}")
        model_of(self.algorithm)  # a ValueError naming the modelled algorithms when it is not one
        for name in ("encode_Bps", "decode_Bps"):
            v = getattr(self, name)
            if v is not None and not v > 0:
                raise ValueError(f"{name} must be > 0 bytes/s or None, got {v!r}")
        for name in ("encode_call_s", "decode_call_s"):
            v = getattr(self, name)
            if not (v >= 0 and math.isfinite(v)):
                raise ValueError(f"{name} must be a finite number of seconds >= 0, got {v!r}")


@dataclasses.dataclass(frozen=True)
class Cluster:
    """GPUs, how many per node, and the links (a :class:`Link` or a spec string such as ``"nvlink"``)."""

    gpus: int
    gpus_per_node: int = 8
    intra: Link | str = "nvlink"
    inter: Link | str | None = None
    nics_per_node: int = 1

    def __post_init__(self) -> None:
        positive_int(self.gpus, "number of GPUs")
        positive_int(self.gpus_per_node, "GPUs per node")
        object.__setattr__(self, "intra", parse_link(self.intra))
        if self.inter is not None:
            object.__setattr__(self, "inter", parse_link(self.inter))

    def topology(self) -> Topology:
        assert isinstance(self.intra, Link)
        inter = self.inter if isinstance(self.inter, Link) else None
        return Topology(self.gpus, self.gpus_per_node, self.intra, inter, self.nics_per_node)


def layers_for_network(network: str | Network, batch_per_gpu: int, device_tflops: float) -> list[Layer]:
    """The layers of a known network (its :mod:`networks` profile): time = FLOPs x batch / device rate."""
    if not (device_tflops > 0 and math.isfinite(device_tflops)):
        raise ValueError(f"device rate must be > 0 TFLOP/s, got {device_tflops!r}")
    positive_int(batch_per_gpu, "batch per GPU")
    net = get_network(network) if isinstance(network, str) else network
    return [Layer(name, int(p), float(f) * batch_per_gpu / (device_tflops * 1e12)) for name, p, f in net.layers()]


# ------------------------------------------------------------------------------------------ pieces
def codec_work(algorithm: str, numel: int, world: int, gpus_per_node: int, bits: float) -> tuple[float, float]:
    """Values ``(encoded, decoded)`` per rank for one message: the registry's ``work`` of the algorithm
    (default: each value encoded and decoded once)."""
    if world == 1 or bits >= FP32_BITS:
        return 0.0, 0.0
    n, k, g = float(numel), world, min(gpus_per_node, world)
    work = model_of(algorithm).work
    return (n, n) if work is None else work(n, k, g)


@dataclasses.dataclass(frozen=True)
class Breakdown:
    """Where a step's time goes. ``compute + exposed_comm + encode + decode = step``."""

    compute_s: float
    exposed_comm_s: float
    encode_s: float
    decode_s: float
    comm_s: float  # total time the comm stream is busy (hidden or not)


def simulate_step(layers: Sequence[Layer], topo: Topology, *, algorithm: str, bits: float,
                  encode_Bps: float | None = None, decode_Bps: float | None = None, overlap: bool = True,
                  bucket_bytes: float = DDP_BUCKET_BYTES, backward_fraction: float = 2 / 3,
                  layer_codecs: Sequence[LayerCodec] | None = None, first_bucket_bytes: float | None = None,
                  message_mb: float | str = "auto") -> tuple[float, Breakdown, float, int]:
    """One step on the two-stream timeline of the module doc -> (step_s, breakdown, bytes/rank, buckets), the
    messages those of :func:`step_collectives`. ``layer_codecs`` (one per layer) overrides ``algorithm``,
    ``bits`` and the rates layer by layer."""
    if not layers:
        raise ValueError("the network has no layers")
    if not 0 <= backward_fraction <= 1:
        raise ValueError(f"backward fraction must be in [0, 1], got {backward_fraction!r}")
    for rate in (encode_Bps, decode_Bps):
        if rate is not None and not float(rate) > 0:
            raise ValueError("encode/decode throughput must be > 0 bytes/s")
    if layer_codecs is None:
        layer_codecs = [LayerCodec(bits, algorithm, encode_Bps, decode_Bps)] * len(layers)
    elif len(layer_codecs) != len(layers):
        raise ValueError(f"{len(layer_codecs)} layer codecs for {len(layers)} layers")
    compute = sum(layer.compute_s for layer in layers)
    t = (1 - backward_fraction) * compute                 # compute stream: forward done
    order = list(reversed(range(len(layers))))            # backward order
    kinds = {lc: str(k) for k, lc in enumerate(dict.fromkeys([layer_codecs[i] for i in order]))}
    codec_of = {key: lc for lc, key in kinds.items()}
    native = {key for lc, key in kinds.items() if lc.bits >= FP32_BITS or lc.algorithm == "allreduce"}
    first = next((lc for lc, key in kinds.items() if key not in native), None)
    rider = next((key for lc, key in kinds.items() if lc.bits >= FP32_BITS), None) \
        if first is not None and first.algorithm == "allgather" else None
    events, n_buckets = step_collectives(
        layers, [kinds[lc] for lc in layer_codecs], native=native, rider=rider, message_mb=message_mb,
        per_tensor={key for lc, key in kinds.items() if codec_fact(lc.label, "per_tensor", False)},
        bucket_bytes=bucket_bytes, first_bucket_bytes=first_bucket_bytes) if topo.world > 1 else ([], 0)
    sends: list[tuple[float, float, float]] = []           # (ready, duration, decode) per collective, in order
    encode_total, sent = 0.0, 0.0
    for pos, i in enumerate(order if topo.world > 1 else ()):
        t += backward_fraction * layers[i].compute_s
        while events and events[0][0] == pos:
            _, key, numel, riders = events.pop(0)
            lc = codec_of[key]
            enc_vals, dec_vals = codec_work(lc.algorithm, numel, topo.world, topo.gpus_per_node, lc.bits)
            enc = lc.encode_call_s + (4 * enc_vals / lc.encode_Bps if lc.encode_Bps else 0.0) if enc_vals else 0.0
            dec = lc.decode_call_s + (4 * dec_vals / lc.decode_Bps if lc.decode_Bps else 0.0) if dec_vals else 0.0
            group_topo = topo if lc.link is None else dataclasses.replace(
                topo, intra=lc.link, inter=lc.link if topo.inter is not None else None)
            cost = collective(lc.algorithm, numel * lc.bits / 8 + 4 * riders, group_topo,
                              fp32_bytes=4 * (numel + riders) if lc.bits < FP32_BITS else None)
            t += enc  # encoding runs on the compute stream, before the send
            encode_total += enc
            sent += cost.bytes_per_rank
            sends.append((t, cost.time_s, dec))
    if topo.world == 1:
        t = compute
    backward_end = d = t
    comm_free = comm_busy = 0.0
    for ready, duration, dec in sends:  # transfers in order; each decode after its own
        comm_free = max(ready if overlap else backward_end, comm_free) + duration
        d = max(d, comm_free) + dec
        comm_busy += duration
    step = max(d, comm_free, backward_end)
    decode_total = sum(dec for _, _, dec in sends)
    exposed = max(0.0, step - compute - encode_total - decode_total)
    return step, Breakdown(compute, exposed, encode_total, decode_total, comm_busy), sent, n_buckets


def step_collectives(layers: Sequence[Layer], specs: Sequence[str], *, native: Collection[str],
                     rider: str | None = None, per_tensor: Collection[str] = (), message_mb: float | str = "auto",
                     bucket_bytes: float = DDP_BUCKET_BYTES,
                     first_bucket_bytes: float | None = None) -> tuple[list[tuple[int, str, int, int]], int]:
    """The collectives of a step in the order the hook issues them on :func:`lowbit.timeline.plan_step`'s plan
    of the layers (``specs[i]``: layer i's codec), ``(backward position after which it goes, spec, values, fp32
    values riding)``, and the number of DDP buckets (:func:`lowbit.timeline.ddp_buckets`; ``first_bucket_bytes``
    None: the others' cap, 0: a bucket a layer; a layer without parameters goes with the next bucket)."""
    if bucket_bytes < 0 or (first_bucket_bytes is not None and first_bucket_bytes < 0):
        raise ValueError(f"bucket size must be >= 0 bytes, got {bucket_bytes!r} / {first_bucket_bytes!r}")
    order = list(reversed(range(len(layers))))  # backward order: the order gradients become ready
    params = [layers[i].params for i in order]
    real = ddp_buckets([n for n in params if n], bucket_bytes,
                       first_bytes=bucket_bytes if first_bucket_bytes is None else first_bucket_bytes)
    buckets, nxt = [], real[-1] if real else 0
    for n in reversed(params):  # from the input side: a layer without parameters takes the next one's bucket
        nxt = real.pop() if n else nxt
        buckets.append(nxt)
    buckets.reverse()
    plan = plan_step(params, [specs[i] for i in order], native=native, rider=rider, per_tensor=per_tensor,
                     message_mb=message_mb, buckets=buckets)
    completes = {m.last: m for m in plan.messages}
    native_at = set(plan.native)
    out: list[tuple[int, str, int, int]] = []
    units: dict[str, int] = {}
    for pos, n in enumerate(params):
        m = completes.get(pos)
        if m is not None:
            out.append((pos, m.spec, sum(params[j] for j in m.members), sum(params[j] for j in m.riders)))
        if pos in native_at:
            units[specs[order[pos]]] = units.get(specs[order[pos]], 0) + n
        if pos + 1 == len(params) or buckets[pos + 1] != buckets[pos]:
            out += [(pos, spec, k, 0) for spec, k in units.items()]
            units = {}
    return [e for e in out if e[2] + e[3] > 0], len(set(buckets))  # parameter-free layers send nothing


def resolve_algorithm(algorithm: str, codec: Any, world: int) -> str:
    """The algorithm :func:`predict` prices for ``codec`` (a spec, or bits per value) on ``world`` GPUs:
    ``auto`` as lowbit's collectives resolve it for a CUDA tensor (:func:`lowbit.comm.allreduce.resolve_algorithm`,
    one rule for both; a number of bits is a float type that sums on the wire from 16 bits on, a quantised
    codec below); any other name must be a modelled algorithm."""
    if algorithm == AUTO:
        if isinstance(codec, (int, float)):
            return "allreduce" if bits_per_value(codec) >= 16 else auto_algorithm(world, device="cuda")
        return comm_resolve_algorithm(AUTO, get_codec(codec) if isinstance(codec, str) else codec, world,
                                      device="cuda")
    try:
        model_of(algorithm)
    except ValueError as exc:
        raise ValueError(str(exc).replace("choose one of", "choose auto or one of", 1)) from None
    return algorithm


# ------------------------------------------------------------------------------------------ result
@dataclasses.dataclass(frozen=True)
class Prediction:
    """The model's answer for one configuration."""

    network: str
    gpus: int
    gpus_per_node: int
    batch_per_gpu: int
    algorithm: str
    codec: str
    bits_per_value: float
    step_s: float
    samples_per_s: float
    single_gpu_samples_per_s: float
    scaling_efficiency: float
    fp32_step_s: float
    speedup_vs_fp32: float
    breakdown: Breakdown
    bytes_per_rank: float
    buckets: int


def predict(layers: Sequence[Layer] | Mapping[str, tuple[int, float]], cluster: Cluster, *, batch_per_gpu: int,
            codec: str | float = FP32_BITS, algorithm: str = "auto", encode_Bps: float | None = None,
            decode_Bps: float | None = None, overlap: bool = True, bucket_bytes: float = DDP_BUCKET_BYTES,
            backward_fraction: float = 2 / 3, network: str = "",
            layer_codecs: Sequence[LayerCodec] | None = None) -> Prediction:
    """Predict one step for ``codec`` (bits per value or a codec spec) and for fp32 (the native ring allreduce,
    hierarchical when ``algorithm`` is; the same buckets and overlap) on the same cluster. ``layer_codecs`` (one
    :class:`LayerCodec` per layer: a mixed-precision policy) replaces ``codec``, ``algorithm`` and the rates;
    ``bits_per_value`` is then the parameter-weighted mean, ``codec`` ``"policy"`` unless given as a string."""
    positive_int(batch_per_gpu, "batch per GPU")
    layer_list = [Layer(n, int(p), float(t)) for n, (p, t) in layers.items()] if isinstance(layers, Mapping) \
        else list(layers)
    if layer_codecs is not None:
        if len(layer_codecs) != len(layer_list):
            raise ValueError(f"{len(layer_codecs)} layer codecs for {len(layer_list)} layers")
        total = sum(layer.params for layer in layer_list) or 1
        bits = sum(lc.bits * layer.params for lc, layer in zip(layer_codecs, layer_list)) / total
        algos = {lc.algorithm for lc in layer_codecs if lc.bits < FP32_BITS}
        algo = algos.pop() if len(algos) == 1 else ("mixed" if algos else "allreduce")
        label = codec if isinstance(codec, str) and codec != str(FP32_BITS) else "policy"
    else:
        bits = bits_per_value(codec)
        algo = resolve_algorithm(algorithm, codec, cluster.gpus)
        label = str(codec)
    topo = cluster.topology()
    common = dict(overlap=overlap, bucket_bytes=bucket_bytes, backward_fraction=backward_fraction)
    step, breakdown, sent, nb = simulate_step(
        layer_list, topo, algorithm=algo if layer_codecs is None else "allreduce", bits=bits,
        encode_Bps=encode_Bps, decode_Bps=decode_Bps, layer_codecs=layer_codecs, **common
    )
    base_algo = "hierarchical" if algo == "hierarchical" else "allreduce"
    fp32_step, _, _, _ = simulate_step(layer_list, topo, algorithm=base_algo, bits=FP32_BITS, **common)
    compute = breakdown.compute_s
    if compute <= 0:
        raise ValueError("total compute time must be > 0 (give layer times or a device rate)")
    k = cluster.gpus
    return Prediction(network=network, gpus=k, gpus_per_node=cluster.gpus_per_node, batch_per_gpu=batch_per_gpu,
                      algorithm=algo, codec=label, bits_per_value=bits, step_s=step,
                      samples_per_s=k * batch_per_gpu / step, single_gpu_samples_per_s=batch_per_gpu / compute,
                      scaling_efficiency=compute / step, fp32_step_s=fp32_step, speedup_vs_fp32=fp32_step / step,
                      breakdown=breakdown, bytes_per_rank=sent, buckets=nb)


def predict_network(network: str | Network, cluster: Cluster, *, batch_per_gpu: int, device_tflops: float,
                    **kwargs: Any) -> Prediction:
    """:func:`predict` for a known network whose layer times are FLOPs / ``device_tflops``."""
    net = get_network(network) if isinstance(network, str) else network
    layers = layers_for_network(net, batch_per_gpu, device_tflops)
    return predict(layers, cluster, batch_per_gpu=batch_per_gpu, network=net.name, **kwargs)
