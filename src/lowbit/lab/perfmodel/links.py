"""Links of the alpha-beta (latency-bandwidth) model, named presets, and a spec parser (docs/perfmodel.md,
section 1).

A link moves ``n`` bytes in ``latency_s + n / bandwidth_Bps`` seconds (Hockney's alpha-beta model): the
*effective* one-direction rate a collective achieves per step and the per-message (per ring step) cost,
software included. Specs: a preset (``"nvlink"``), a preset with overrides (``"10gbit:latency=50us"``; keys
latency|lat, bandwidth|bw), or a custom link (``"bw=5GB/s,lat=10us"``; latency 0 when left out).
"""

from __future__ import annotations

import dataclasses
import math
import re

__all__ = ["Link", "PRESETS", "parse_link", "parse_bandwidth", "parse_latency", "parse_emulated_link"]


@dataclasses.dataclass(frozen=True)
class Link:
    """One hop of the alpha-beta model: ``time(n) = latency_s + n / bandwidth_Bps``."""

    latency_s: float
    bandwidth_Bps: float
    name: str = ""

    def __post_init__(self) -> None:
        if not (isinstance(self.latency_s, (int, float)) and math.isfinite(self.latency_s)):
            raise ValueError(f"link latency must be a finite number of seconds, got {self.latency_s!r}")
        if self.latency_s < 0:
            raise ValueError(f"link latency must be >= 0, got {self.latency_s!r} s")
        if not (isinstance(self.bandwidth_Bps, (int, float)) and self.bandwidth_Bps > 0):
            raise ValueError(f"link bandwidth must be > 0 bytes/s, got {self.bandwidth_Bps!r}")  # NaN too

    def time(self, nbytes: float, messages: float = 1.0) -> float:
        """Seconds to send ``nbytes`` as ``messages`` messages: ``messages * alpha + nbytes * beta``."""
        return messages * self.latency_s + nbytes / self.bandwidth_Bps


# --------------------------------------------------------------------------------------- presets
# Effective per-direction bandwidth and per-message latency: the published signalling rates and the share of
# them assumed effective (docs/perfmodel.md, section 1, gives each source). Calibrate to replace them.
_PRESET_TABLE: dict[str, tuple[float, float]] = {  # name: (latency_s, bandwidth_Bps)
    "nvlink": (2e-6, 230e9),           # NVLink 3 (A100 SXM): 300 GB/s; nccl-tests' bus bandwidth on 8xA100
    "nvlink4": (2e-6, 360e9),          # NVLink 4 (H100 SXM): 450 GB/s; 80% assumed
    "nvlink-v100": (3e-6, 130e9),      # NVLink 2 (DGX-1V): 150 GB/s; ~130 assumed
    "pcie3": (5e-6, 12e9),             # PCIe 3.0 x16: 15.75 GB/s; ~12 device-to-device (assumed)
    "pcie3-switch": (5e-6, 5e9),       # PCIe 3.0 behind shared switches: Dettmers (2016, App. 5.1) measured ~5
    "pcie4": (5e-6, 24e9),             # PCIe 4.0 x16: 31.5 GB/s; ~24 achieved (assumed)
    "pcie5": (5e-6, 48e9),             # PCIe 5.0 x16: 63 GB/s; ~48 achieved (assumed)
    "ethernet": (50e-6, 0.117e9),      # 1 GbE: ~941 Mbit/s TCP goodput; ~50 us TCP round through the kernel
    "10gbit": (30e-6, 1.15e9),         # 10 GbE: ~9.2 Gbit/s TCP goodput (assumed)
    "25gbit": (20e-6, 2.9e9),          # 25 GbE: 3.125 GB/s raw; ~93% goodput assumed
    "100gbit": (5e-6, 11.5e9),         # 100 GbE with RDMA (RoCE): 12.5 GB/s raw; ~92% goodput assumed
    "ib-qdr": (2e-6, 3.2e9),           # InfiniBand QDR 4x: 4 GB/s of data; Dettmers quotes 3 practical
    "ib-fdr": (1e-6, 6e9),             # InfiniBand FDR 4x: 6.8 GB/s of data; Dettmers (App. 5.2) uses 6
    "ib-edr": (1e-6, 12e9),            # InfiniBand EDR 4x: 12.5 GB/s; osu_bw peaks near 12 (assumed)
    "ib-hdr": (1e-6, 24e9),            # InfiniBand HDR 4x: 25 GB/s; ~24 assumed
}
PRESETS: dict[str, Link] = {name: Link(latency_s=lat, bandwidth_Bps=bw, name=name)
                            for name, (lat, bw) in _PRESET_TABLE.items()}


# --------------------------------------------------------------------------------------- parsing
_NUM = r"([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)"
_BW_RE = re.compile(rf"^{_NUM}\s*([A-Za-z/]*)$")
_LAT_RE = re.compile(rf"^{_NUM}\s*([a-zA-Zµ]*)$")

_PREFIX = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12,
           "ki": 2.0**10, "mi": 2.0**20, "gi": 2.0**30, "ti": 2.0**40}
_LAT_UNITS = {"": 1.0, "s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9}


def parse_bandwidth(text: str) -> float:
    """``"5GB/s"`` -> 5e9 bytes/s; ``"100Gbit/s"`` / ``"100Gb/s"`` / ``"100gbit"`` / ``"100Gbps"`` -> 12.5e9 bytes/s.

    Units: B/s, KB/s, MB/s, GB/s, TB/s (decimal), KiB/s, MiB/s, GiB/s (binary), bits with ``bit`` or a lower-case
    ``b``; a bare number is bytes/s."""
    m = _BW_RE.match(text.strip())
    if not m:
        raise ValueError(f"cannot parse bandwidth {text!r}; write e.g. 5GB/s, 800MiB/s or 100Gbit/s")
    value, unit = float(m.group(1)), m.group(2)
    unit = re.sub(r"(/s|ps)$", "", unit)
    low = unit.lower()
    if low.endswith("bit"):
        prefix, per_unit = low[:-3], 1 / 8  # bits
    elif unit.endswith("b"):  # lower-case b: bits (Gb/s)
        prefix, per_unit = low[:-1], 1 / 8
    elif unit.endswith("B"):
        prefix, per_unit = low[:-1], 1.0
    elif unit == "":
        prefix, per_unit = "", 1.0
    else:
        raise ValueError(f"unknown bandwidth unit in {text!r}; use B/s, KB/s, MB/s, GB/s, GiB/s, Gbit/s")
    if prefix not in _PREFIX:
        raise ValueError(f"unknown bandwidth unit prefix in {text!r}")
    bw = value * _PREFIX[prefix] * per_unit
    if bw <= 0:
        raise ValueError(f"bandwidth must be > 0, got {text!r}")
    return bw


def parse_latency(text: str) -> float:
    """``"10us"`` -> 1e-5 s; units s, ms, us, µs, ns; a bare number is seconds."""
    m = _LAT_RE.match(text.strip())
    if not m or m.group(2).lower() not in _LAT_UNITS:
        raise ValueError(f"cannot parse latency {text!r}; write e.g. 10us, 0.5ms or 2e-6s")
    return float(m.group(1)) * _LAT_UNITS[m.group(2).lower()]


def parse_emulated_link(text: str) -> tuple[float, float]:
    """A study's emulated link (``emulate_link``; :func:`lowbit.comm.collectives.emulate_link`):
    ``"100mbit"`` -> (12.5e6 bytes/s, 0 s); ``"100mbit@25ms"`` -> (12.5e6, 0.025): a speed, then after
    ``@`` the one-way latency each collective adds (:func:`parse_bandwidth`, :func:`parse_latency`)."""
    if not isinstance(text, str):
        raise ValueError(f"an emulated link is a string such as \"100mbit\" or \"100mbit@25ms\", got {text!r}")
    speed, at, lat = text.partition("@")
    if at and not lat.strip():
        raise ValueError(f"emulated link {text!r}: a latency after '@', e.g. \"100mbit@25ms\"")
    return parse_bandwidth(speed), (parse_latency(lat) if at else 0.0)


def parse_link(spec: str | Link) -> Link:
    """Build a :class:`Link` from a preset name, ``preset:key=value,...`` or ``bw=...,lat=...``."""
    if isinstance(spec, Link):
        return spec
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"link spec must be a non-empty string, got {spec!r}")
    text = spec.strip()
    head, sep, rest = text.partition(":")
    if "=" in head:  # no preset: "bw=5GB/s,lat=10us"
        base, params_txt = None, text
    else:
        key = head.strip().lower()
        if key not in PRESETS:
            raise ValueError(
                f"unknown link {spec!r}; known presets: {', '.join(sorted(PRESETS))}; "
                f"or give bw=...,lat=... (e.g. 'bw=5GB/s,lat=10us')"
            )
        base, params_txt = PRESETS[key], (rest if sep else "")
    latency = base.latency_s if base else None
    bandwidth = base.bandwidth_Bps if base else None
    for item in filter(None, (p.strip() for p in params_txt.split(","))):
        k, eq, v = item.partition("=")
        k = k.strip().lower()
        if not eq or not v.strip():
            raise ValueError(f"link spec {spec!r}: {item!r} is not of the form key=value")
        try:
            if k in ("lat", "latency"):
                latency = parse_latency(v)
            elif k in ("bw", "bandwidth"):
                bandwidth = parse_bandwidth(v)
            else:
                raise ValueError(f"unknown key {k!r} (use latency|lat, bandwidth|bw)")
        except ValueError as exc:
            raise ValueError(f"link spec {spec!r}: {exc}") from None
    if bandwidth is None:
        raise ValueError(f"link spec {spec!r} gives no bandwidth; add bw=..., e.g. bw=5GB/s")
    name = base.name if base and not params_txt else text
    return Link(latency_s=latency or 0.0, bandwidth_Bps=bandwidth, name=name)
