"""The codec contract and the registry.

A codec is a stateless, pure transform between a float tensor and a 1-D ``torch.uint8`` payload::

    codec = get_codec("qsgd:bits=4,bucket=512")
    n = codec.nbytes(numel)                  # exact payload size, a pure function of numel (and shape
                                             # for per-column codecs)
    payload = codec.encode(x, seed=step)     # (n,) uint8 on x's device
    y = codec.decode(payload, numel)         # (numel,) float32

Payloads are laid out as *scales first* (float32, little-endian, one per bucket/column), then the codes
packed densely at ``bits`` bits each (LSB-first bit stream), so ``nbytes`` counts every byte that
crosses the wire. A codec never communicates and never touches the global RNG: stochastic rounding
draws from a counter-based hash keyed by ``(seed, element index)``.

Facts about a codec that other layers need (its labels, whether a native allreduce sums it, whether it
is biased, its place on the bits ladder) are attributes of its class, with defaults here for a codec
that does not say. Codec classes put themselves in the registry (``@register_codec``); this module
knows none of them (:mod:`lowbit.codecs` imports lowbit's own, ``$LOWBIT_PLUGINS`` names others).
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import logging
import math
import numbers
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any, ClassVar

import torch

__all__ = [
    "Codec",
    "register_codec",
    "get_codec",
    "available_codecs",
    "parse_spec",
    "parse_codec_list",
    "load_plugins",
    "defer_plugins",
]

_REGISTRY: dict[str, type[Codec]] = {}


def register_codec(cls: type[Codec]) -> type[Codec]:
    """Class decorator: make ``cls`` reachable through :func:`get_codec` by ``cls.name``."""
    if not cls.name:
        raise TypeError(f"{cls.__name__} has no codec name")
    _REGISTRY[cls.name] = cls
    return cls


@dataclasses.dataclass(frozen=True)
class Codec:
    """Base class of every codec. Subclasses are frozen dataclasses whose fields are the parameters."""

    name: ClassVar[str] = ""
    #: True when ``encode`` uses random numbers (its output then depends on ``seed``).
    stochastic: ClassVar[bool] = False
    #: True when ``encode`` on CUDA also takes its seed as a one-element int32 device tensor of the seed's
    #: rounding key (:func:`lowbit.kernels.dispatch.write_keys`): a captured CUDA graph then replays with
    #: a new seed each call (:mod:`lowbit.comm.graphs`). Only matters for stochastic codecs.
    device_seed: ClassVar[bool] = False
    #: True when the payload layout depends on the tensor's shape (per-column codecs).
    needs_shape: ClassVar[bool] = False
    #: The dtype in which payloads can be summed by a native (reducing) allreduce, or None when the
    #: payload is packed bytes that must be decoded before summing (every quantiser).
    wire_dtype: ClassVar[torch.dtype | None] = None
    #: True when E[decode(encode(x))] != x: such codecs need error feedback to converge, and
    #: ``error_feedback="auto"`` turns it on for them.
    biased: ClassVar[bool] = False

    @property
    def per_tensor(self) -> bool:
        """True when the codec's groups are a tensor's own (per column, one scale per tensor): lowbit's
        collectives then send each parameter tensor as its own message, encoded with its shape, and
        never cut it into chunks (allgather only), as the papers did."""
        return self.needs_shape

    @property
    def sums_on_wire(self) -> bool:
        """True when a native allreduce can carry (and sum) this codec's values."""
        return self.wire_dtype is not None

    # ----------------------------------------------------------------------------- facts
    # What the layers above ask of a codec, so that none keeps a list of codec names: a plugin codec
    # gets the defaults below, a codec that knows better overrides them in its own file.
    @property
    def label(self) -> str:
        """Human label in the seeds' style, e.g. ``QSGD 4bit/512`` (the study's tables, plots, logs)."""
        return self.spec

    @property
    def short_label(self) -> str:
        """Compact label, e.g. ``qsgd4/512`` (the speed model's and ``lowbit advise``'s tables)."""
        return self.spec

    @property
    def code_bits(self) -> float:
        """Bits of one value's code, scales not counted (8 for 8-bit QSGD, 1 for 1bitSGD): what places the
        codec on the bits ladder (:attr:`rung`). By default the bits per value on the wire, scales included."""
        return self.bits_per_value()

    @property
    def rung(self) -> int:
        """Position on the bits ladder, ``1 + floor(log2(code_bits))``: 1-bit codes are rung 1, 2-bit 2,
        4-bit 3, 8-bit 4, 16-bit 5, 32-bit 6 (0 below a bit a value). ``lowbit advise`` keeps convolutions at
        least one rung above fully connected layers (Grubic et al. 2018) and makes a policy's highest rung
        its default."""
        bits = self.code_bits
        return max(0, 1 + math.floor(math.log2(bits))) if bits > 0 else 0

    @property
    def seeds_feedback(self) -> bool:
        """Whether the seeds' practice trains with error feedback on this codec: what the study's
        ``error_feedback="auto"`` follows (``lowbit.ddp``'s "auto" follows :attr:`biased` alone). By
        default :attr:`biased`: 1bitSGD and top-k need it, unbiased QSGD goes without."""
        return self.biased

    def published_error(self, distribution: str) -> float | None:
        """The mean relative error in % that the codec's paper printed for inputs drawn from
        ``distribution`` (Dettmers' Table 2 names: ``U(0,1)``, ``N(0,1)``, ``N(0,10^2)``, ``N(0,0.2^2)``),
        which ``lowbit codecs`` prints beside its own; None where the paper printed none."""
        return None

    # ----------------------------------------------------------------------------- description
    @property
    def spec(self) -> str:
        """Canonical spec string with every parameter explicit, e.g. ``qsgd:bits=4,bucket=512,...``."""
        fields = dataclasses.fields(self)
        if not fields:
            return self.name
        # a field added later says so (metadata "omit_default"): at its default it stays out of the spec,
        # so specs (and the study's run keys built from them) made before it existed do not change
        params = ",".join(f"{f.name}={getattr(self, f.name)}" for f in fields
                          if not (f.metadata.get("omit_default") and getattr(self, f.name) == f.default))
        return f"{self.name}:{params}"

    def __str__(self) -> str:
        return self.spec

    def bits_per_value(self, numel: int = 1 << 20) -> float:
        """Bits on the wire per value for a (1-D) tensor of ``numel`` elements, scales included."""
        if numel <= 0:
            return 0.0
        return 8.0 * self.nbytes(numel, self.flat_shape(numel)) / numel

    def flat_shape(self, numel: int) -> tuple[int, ...] | None:
        """What to pass as ``shape=`` for a flattened tensor of ``numel`` values (as lowbit's collectives
        send): ``(numel,)`` where the payload layout depends on the shape (``needs_shape``), else None."""
        return (numel,) if self.needs_shape else None

    # ----------------------------------------------------------------------------- contract
    def nbytes(self, numel: int, shape: Sequence[int] | None = None) -> int:
        raise NotImplementedError

    def head_bytes(self, numel: int, shape: Sequence[int] | None = None) -> int:
        """Bytes of the payload before its packed code stream (the scales). Collectives place payloads
        so that the code stream starts 16-byte aligned: the kernels then move it in 16-byte vectors."""
        return 0

    def scale_fields(self, numel: int, shape: Sequence[int] | None = None) -> tuple[int, int] | None:
        """The byte range ``[lo, hi)`` of the payload's float32 fields that every decoded value is
        proportional to (a bucket's scale, a group's means, top-k's values): multiplying them by a power
        of two multiplies every decoded value by it, exactly (outside float32's subnormal range). None:
        the codec has no such fields. A collective's mean uses it to add the K decoded payloads
        already divided by 2^ceil(log2 K), so that the sum cannot overflow (:meth:`scale_payload_`)."""
        return None

    def scale_payload_(self, payload: torch.Tensor, numel: int, factor: float,
                       shape: Sequence[int] | None = None) -> bool:
        """Multiply ``payload``'s :meth:`scale_fields` by ``factor`` (a power of two) in place, so that it
        decodes to ``factor`` times its values; False (payload untouched) if the codec has none."""
        span = self.scale_fields(numel, shape)
        if span is None:
            return False
        lo, hi = span
        if hi > lo:
            fields = payload[lo:hi]
            if fields.storage_offset() % 4 == 0:
                fields.view(torch.float32).mul_(factor)
            else:  # a receive buffer's slice may start at any byte
                fields.copy_(fields.clone().view(torch.float32).mul_(factor).view(torch.uint8))
        return True

    def encode(self, x: torch.Tensor, seed: int = 0) -> torch.Tensor:
        raise NotImplementedError

    def decode(
        self,
        payload: torch.Tensor,
        numel: int,
        out: torch.Tensor | None = None,
        shape: Sequence[int] | None = None,
    ) -> torch.Tensor:
        raise NotImplementedError

    def decode_sum(
        self,
        payloads: Sequence[torch.Tensor],
        numel: int,
        out: torch.Tensor | None = None,
        shape: Sequence[int] | None = None,
        divide_by: int = 1,
    ) -> torch.Tensor:
        """Sum of the decoded payloads, added in the given order in float32 (so every rank that sums
        the same payloads in the same order gets a bit-identical result), then ``div_(divide_by)``
        (an allreduce's mean; fused backends do it in the same pass). Fused backends override."""
        if not payloads:
            raise ValueError("decode_sum needs at least one payload")
        self._check_divisor(divide_by)
        acc = self.decode(payloads[0], numel, out=out, shape=shape)
        if len(payloads) > 1:
            tmp = torch.empty_like(acc)
            for p in payloads[1:]:
                acc.add_(self.decode(p, numel, out=tmp, shape=shape))
        return acc.div_(divide_by) if divide_by != 1 else acc

    @staticmethod
    def _check_divisor(divide_by: int) -> None:
        if isinstance(divide_by, bool) or not isinstance(divide_by, numbers.Integral) or divide_by < 1:
            raise ValueError(f"decode_sum: divide_by must be a positive int, got {divide_by!r}")

    def _sum_output(self, payloads, numel, out, shape, divide_by) -> torch.Tensor:
        """Checks of a fused decode_sum override (payloads, divisor) and its (numel,) float32 output."""
        if not payloads:
            raise ValueError("decode_sum needs at least one payload")
        self._check_divisor(divide_by)
        for p in payloads:
            self._check_payload(p, numel, shape)
        return self._output(out, numel, payloads[0].device)

    # ----------------------------------------------------------------------------- helpers
    @staticmethod
    def _flat_input(x: torch.Tensor) -> torch.Tensor:
        """Any shape, any float dtype, contiguous or not -> contiguous (numel,) float32."""
        if not isinstance(x, torch.Tensor):
            raise ValueError(f"encode expects a torch.Tensor, got {type(x).__name__}")
        if not (x.is_floating_point()):
            raise ValueError(f"encode expects a floating-point tensor, got dtype {x.dtype}")
        return x.reshape(-1).to(torch.float32).contiguous()

    def _check_payload(
        self, payload: torch.Tensor, numel: int, shape: Sequence[int] | None = None
    ) -> None:
        if not isinstance(payload, torch.Tensor):
            raise ValueError(f"{self.name}: payload must be a torch.Tensor, got {type(payload).__name__}")
        if payload.dtype != torch.uint8:
            raise ValueError(f"{self.name}: payload dtype must be torch.uint8, got {payload.dtype}")
        if payload.dim() != 1:
            raise ValueError(f"{self.name}: payload must be 1-D, got shape {tuple(payload.shape)}")
        if not payload.is_contiguous():
            raise ValueError(f"{self.name}: payload must be contiguous (a strided view was given; pass .contiguous())")
        if isinstance(numel, bool) or not isinstance(numel, numbers.Integral):
            raise ValueError(f"{self.name}: numel must be an int, got {type(numel).__name__} {numel!r}")
        if numel < 0:
            raise ValueError(f"{self.name}: numel must be >= 0, got {numel}")
        want = self.nbytes(numel, shape)
        if payload.numel() != want:
            raise ValueError(
                f"{self.name}: payload has {payload.numel()} bytes but {self.spec} needs {want} "
                f"bytes for numel={numel}"
            )

    @staticmethod
    def _output(out: torch.Tensor | None, numel: int, device: torch.device) -> torch.Tensor:
        if out is None:
            return torch.empty(numel, dtype=torch.float32, device=device)
        if out.dtype != torch.float32:
            raise ValueError(f"decode: out must be float32, got {out.dtype}")
        if out.numel() != numel:
            raise ValueError(f"decode: out has {out.numel()} elements, expected {numel}")
        if not out.is_contiguous():
            raise ValueError("decode: out must be contiguous")
        return out.view(-1)


# --------------------------------------------------------------------------------- spec parsing
def _coerce(value: str) -> Any:
    low = value.lower()
    if low in ("true", "false"):
        return low == "true"
    try:
        return int(value)
    except ValueError:
        pass
    try:
        return float(value)
    except ValueError:
        return value


def parse_spec(spec: str) -> tuple[str, dict[str, Any]]:
    """``"qsgd:bits=4,bucket=512"`` -> ``("qsgd", {"bits": 4, "bucket": 512})``."""
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"codec spec must be a non-empty string, got {spec!r}")
    name, _, rest = spec.strip().partition(":")
    params: dict[str, Any] = {}
    for item in filter(None, (p.strip() for p in rest.split(","))):
        key, eq, value = item.partition("=")
        if not eq or not key.strip():
            raise ValueError(f"codec spec {spec!r}: parameter {item!r} is not of the form key=value")
        if key.strip() in params:
            raise ValueError(f"codec spec {spec!r}: parameter {key.strip()!r} is given twice")
        params[key.strip()] = _coerce(value.strip())
    return name.strip().lower(), params


def parse_codec_list(values: Sequence[str] | str, what: str = "codecs", also: Sequence[str] = (),
                     other: Callable[[str], str | None] | None = None) -> list[str]:
    """Codec specs from command-line values, the one syntax of every ``lowbit`` command: specs separated
    by spaces (several values), ``;`` or ``,``. A spec's own parameters are comma-separated too
    (``qsgd:bits=4,bucket=512``), so a comma-separated item of the form ``key=value`` continues the spec
    before it and any other item starts a new one: ``fp32,qsgd:bits=4,bucket=512`` is ``fp32`` and
    ``qsgd:bits=4,bucket=512``. Validated and deduplicated (the first spelling of each codec is kept).
    ``also``: names the caller accepts beside codecs (the study's ``auto``); ``other``: a function giving
    the canonical spec of something else the caller accepts (the study's ``torch:fp16``), None for a spec
    that is not its own, a ValueError for a bad one."""
    specs: list[str] = []
    for value in [values] if isinstance(values, str) else values:
        for group in str(value).replace(";", " ").split():
            current: list[str] = []
            for item in (s.strip() for s in group.split(",")):
                if not item:
                    continue
                if "=" in item and ":" not in item and current:
                    current.append(item)
                    continue
                if current:
                    specs.append(",".join(current))
                current = [item]
            if current:
                specs.append(",".join(current))
    if not specs:
        raise ValueError(f"{what} is empty")
    seen: dict[str, str] = {}  # canonical spec -> the spec as given
    for spec in specs:
        if spec.lower() in also:
            seen.setdefault(spec.lower(), spec.lower())
            continue
        try:
            canonical = other(spec) if other is not None else None
        except ValueError as exc:
            raise ValueError(f"{what} {spec!r}: {exc}") from None
        if canonical is not None:
            seen.setdefault(canonical, canonical)
            continue
        try:
            seen.setdefault(get_codec(spec).spec, spec)
        except ValueError as exc:
            raise ValueError(f"{what} {spec!r}: {exc}") from None
    return list(seen.values())


def get_codec(spec: str | Codec, **params: Any) -> Codec:
    """Build a codec from a spec string (``"qsgd:bits=4"``) or a name plus keyword parameters.

    Args:
        spec: ``"name"`` or ``"name:param=value,..."`` (:func:`parse_spec`), or a :class:`Codec` (returned
            as it is, or with ``params`` replaced).
        **params: the codec's parameters (``get_codec("qsgd", bits=4, bucket=512)``), over the spec's.

    Returns:
        The codec (frozen; ``codec.spec`` is its canonical spec, every parameter explicit).

    Raises:
        ValueError: an unknown codec (the message lists the known ones), a parameter it does not have
            (listing its parameters) or a value out of range.
    """
    _ensure_loaded()
    if isinstance(spec, Codec):
        if params:
            return dataclasses.replace(spec, **params)
        return spec
    name, parsed = parse_spec(spec)
    parsed.update(params)
    cls = _REGISTRY.get(name)
    if cls is None:
        raise ValueError(f"unknown codec {name!r}; available: {', '.join(sorted(_REGISTRY))}")
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(parsed) - known)
    if unknown:
        raise ValueError(
            f"codec {name!r} has no parameter {', '.join(map(repr, unknown))}; "
            f"its parameters are: {', '.join(sorted(known)) or '(none)'}"
        )
    return cls(**parsed)


def available_codecs() -> dict[str, dict[str, Any]]:
    """Every codec name with its parameters and their defaults."""
    _ensure_loaded()
    out: dict[str, dict[str, Any]] = {}
    for name, cls in sorted(_REGISTRY.items()):
        out[name] = {f.name: f.default for f in dataclasses.fields(cls)}
    return out


#: Comma-separated modules that register codecs (``@register_codec``) or collective algorithms
#: (``lowbit.comm.allreduce.register_algorithm``) of their own when imported; read at the first codec or
#: algorithm lookup, in every process (spawned workers inherit it): docs/codecs.md, "Your own codec".
PLUGINS_ENV = "LOWBIT_PLUGINS"
_PLUGINS_LOADED: set[str] = set()


def load_plugins() -> None:
    """Import the modules named in ``$LOWBIT_PLUGINS`` (each once): what registers itself on import
    (codecs, algorithms) is then known. ValueError when a named module does not import. (lowbit's own
    codecs are registered already: :mod:`lowbit.codecs` imports every codec module of its package.)

    Called where a codec or an algorithm is resolved (``get_codec``, ``available_codecs``,
    ``lowbit.comm.allreduce.algorithms``), never by merely importing lowbit; inside :func:`defer_plugins`
    (the CLI while it builds its parsers, so ``lowbit --help`` runs no plugin) it imports nothing.
    Plugins run code: the first import of each is said once per process, one line on stderr (and an INFO
    record of the ``lowbit`` logger) naming the module and its file."""
    if _DEFERRED:
        return
    new = []
    for mod in filter(None, (m.strip() for m in os.environ.get(PLUGINS_ENV, "").split(","))):
        if mod not in _PLUGINS_LOADED:
            if not all(part.isidentifier() for part in mod.split(".")):  # a path, a relative name: not importable
                raise ValueError(f"${PLUGINS_ENV}: {mod!r} is not a module name; name modules as Python imports "
                                 "them, dotted and comma-separated (mypkg.my_codec), not files")
            try:
                module = importlib.import_module(mod)
            except Exception as exc:  # noqa: BLE001 — not found, or its own code failed: it does not import
                raise ValueError(f"${PLUGINS_ENV}: cannot import plugin {mod!r}: {type(exc).__name__}: {exc}") \
                    from exc
            _PLUGINS_LOADED.add(mod)
            new.append(f"{mod} ({getattr(module, '__file__', None) or 'built-in'})")
    if new:
        line = f"lowbit: imported plugin module{'s' if len(new) > 1 else ''} from ${PLUGINS_ENV}: {', '.join(new)}"
        logging.getLogger("lowbit").info(line)
        print(line, file=sys.stderr)


_ensure_loaded = load_plugins
_DEFERRED = False


@contextlib.contextmanager
def defer_plugins() -> Iterator[None]:
    """Within: :func:`load_plugins` loads nothing (``$LOWBIT_PLUGINS`` waits for the first resolution
    outside); the built-in codecs are there all the same."""
    global _DEFERRED
    before, _DEFERRED = _DEFERRED, True
    try:
        yield
    finally:
        _DEFERRED = before


# --------------------------------------------------------------------------------- validation
def check_choice(codec: str, param: str, value: Any, choices: Sequence[Any]) -> None:
    numeric = all(isinstance(c, int) and not isinstance(c, bool) for c in choices)
    if numeric and (isinstance(value, bool) or not isinstance(value, int)):  # 4.0 or True is not the int 4 or 1
        raise ValueError(f"{codec}: {param}={value!r} must be an integer, one of {list(choices)}")
    if value not in choices:
        raise ValueError(f"{codec}: {param}={value!r} is out of range; choose one of {list(choices)}")


def check_int(codec: str, param: str, value: Any, lo: int, hi: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < lo or (hi is not None and value > hi):
        rng = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise ValueError(f"{codec}: {param}={value!r} is out of range; it must be an integer {rng}")


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)

