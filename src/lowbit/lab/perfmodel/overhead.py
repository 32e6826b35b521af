"""Where lowbit can pay, from its measured overhead: the link bandwidth below which each codec wins.

``benchmarks/bench_overhead.py`` measures, with the wire taken away, what a configuration costs a step
beyond its native baseline (``added`` ms) and how many bytes it would put on the wire (``bytes`` a rank
a step, against the baseline's). On a real link of B bytes/s per GPU whose traffic is not hidden behind
compute, the configuration saves ``(bytes_native - bytes) / B`` seconds of wire time and costs ``added``:
it pays while

    B < B* = (bytes_native - bytes) / added.

B* is an upper bound: where the native collectives are partly hidden behind compute (FSDP's prefetch,
DDP's buckets), the saving is smaller and the real cross-over lies below it. A configuration whose
measured cost is within the noise (``added <= 0``) pays on any link that takes time; one that saves no
bytes never pays.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

__all__ = ["Breakeven", "breakeven", "codec_floor_bytes", "codec_floor_ms", "format_breakeven", "H200_HBM_GBPS"]

#: NVIDIA H200's HBM3e bandwidth as specified (4.8 TB/s); a kernel reaches perhaps 80-90 % of it.
H200_HBM_GBPS = 4800.0


@dataclass(frozen=True)
class Breakeven:
    config: str
    ratio: float              # native ms / this ms, wire free
    added_ms: float           # ms a step this configuration adds (native ms / ratio - native ms)
    bytes_per_step: int       # this rank's bytes a step
    saved_bytes: int          # against the baseline's
    gbps: float               # B*, GB/s per GPU (inf: pays on any link; 0: never)


def breakeven(doc: dict[str, Any]) -> list[Breakeven]:
    """B* for every row of a bench_overhead.py result (``{"meta", "rows"}``) against its baseline."""
    rows = doc.get("rows") or []
    base_name = (doc.get("meta") or {}).get("baseline")
    base = next((r for r in rows if r.get("config") == base_name), None)
    if base is None:
        raise ValueError(f"the results have no row of their baseline {base_name!r}")
    if base.get("wire_bytes_per_step") is None:
        raise ValueError("the results carry no wire_bytes_per_step (made by an older bench_overhead.py)")
    out = []
    for r in rows:
        if r is base or r.get("wire_bytes_per_step") is None:
            continue
        ratio = float(r["ratio"])
        added = base["ms_per_step"] / ratio - base["ms_per_step"]
        saved = int(base["wire_bytes_per_step"]) - int(r["wire_bytes_per_step"])
        if saved <= 0:
            gbps = 0.0
        elif added <= 0:
            gbps = math.inf
        else:
            gbps = saved / (added / 1e3) / 1e9
        out.append(Breakeven(r["config"], ratio, added, int(r["wire_bytes_per_step"]), saved, gbps))
    return out


def format_breakeven(doc: dict[str, Any]) -> str:
    meta = doc.get("meta") or {}
    lines = [f"{meta.get('mode', '?')} {meta.get('model', '?')}, batch {meta.get('batch', '?')}/rank on "
             f"{meta.get('card', '?')} (wire: {meta.get('wire', '?')}), against {meta.get('baseline', '?')}:",
             f"  {'config':34} {'ratio':>6} {'added ms':>9} {'MB/step':>8} {'pays below':>14}"]
    for b in breakeven(doc):
        where = ("any link" if math.isinf(b.gbps) else "never" if b.gbps == 0 else f"{b.gbps:.3g} GB/s")
        lines.append(f"  {b.config[:34]:34} {b.ratio:6.3f} {b.added_ms:9.2f} {b.bytes_per_step / 1e6:8.1f} {where:>14}")
    lines.append("  (per GPU, where the link's time is not hidden behind compute: an upper bound)")
    return "\n".join(lines)


def codec_floor_bytes(mode: str, numel: int, world: int, grad_bits: float | None, param_bits: float | None = None,
                      grad_bytes: int = 4, param_bytes: int = 2) -> float:
    """The memory traffic (bytes a rank a step) of the codecs' own work, what no implementation can avoid:
    each value read once and each code written once, each code read once and each result written once.

    ``fsdp`` (``numel`` parameters over ``world`` ranks, S = numel / world a shard): the gradients'
    reduce-scatter encodes the K-1 rows for the others (read in ``grad_bytes``, write ``grad_bits``) and
    decodes the K-1 rows it receives, adding its own row (read codes and own row, write the fp32 shard);
    the parameters' all-gather, twice a step (forward and the backward's re-gather), encodes its shard
    and decodes every rank's (written in ``param_bytes``). ``ddp`` (the allgather algorithm, as at two
    ranks): encode the whole gradient once, decode and sum every rank's payload. ``grad_bits`` /
    ``param_bits``: bits a value on the wire, scales included (None: that direction is not compressed)."""
    k, n = world, float(numel)
    s = n / k
    total = 0.0
    if mode == "fsdp":
        if grad_bits is not None:
            g = grad_bits / 8
            total += (k - 1) * s * (grad_bytes + g) + (k - 1) * s * g + s * grad_bytes + s * 4
        if param_bits is not None:
            p = param_bits / 8
            total += 2 * (s * (param_bytes + p) + k * s * (p + param_bytes))
    elif mode == "ddp":
        if grad_bits is not None:
            g = grad_bits / 8
            total += n * (4 + g) + k * n * g + n * 4
    else:
        raise ValueError(f"mode must be 'fsdp' or 'ddp', got {mode!r}")
    return total


def codec_floor_ms(mode: str, numel: int, world: int, grad_bits: float | None, param_bits: float | None = None,
                   hbm_gbps: float = H200_HBM_GBPS, **kw: int) -> float:
    """:func:`codec_floor_bytes` at ``hbm_gbps`` GB/s, in ms a step."""
    return codec_floor_bytes(mode, numel, world, grad_bits, param_bits, **kw) / (hbm_gbps * 1e9) * 1e3
