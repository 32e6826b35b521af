"""Which tensors get which codec.

The seed's rule (Grubic et al. 2018, after Alistarh et al.): matrices with fewer than 10K elements are
not quantised, yet more than 99% of the parameters are. :class:`Policy` implements it and lets a user
override by module type (the seed found convolutions need more bits than fully connected layers) or by
parameter-name pattern::

    Policy("qsgd:bits=4")                                         # the seed's rule, 4-bit everywhere else
    Policy("qsgd:bits=4", by_type={"Conv2d": "qsgd:bits=8"})      # more bits for convolutions
    Policy("qsgd:bits=4", by_name={"*.bias": "fp32", "head.*": "fp16"})

Resolution order for a parameter: name patterns (first match), then module type, then the size rule
(1-D tensors and tensors below the threshold stay fp32; the threshold is lowered from ``min_numel``
until at least ``min_compressed_fraction`` of the parameters are compressed), then ``default``.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import hashlib
import json
from collections.abc import Mapping

from torch import nn

from lowbit.codecs.base import Codec, get_codec

FP32 = "fp32"


@dataclasses.dataclass(frozen=True)
class Policy:
    default: str = "qsgd:bits=8,bucket=512"
    min_numel: int = 10_000
    min_compressed_fraction: float = 0.99
    keep_1d: bool = True
    by_type: Mapping[str, str] = dataclasses.field(default_factory=dict)
    by_name: Mapping[str, str] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        for spec in [self.default, *self.by_type.values(), *self.by_name.values()]:
            get_codec(spec)  # raises ValueError naming a bad codec
        if not 0.0 <= self.min_compressed_fraction <= 1.0:
            raise ValueError(f"min_compressed_fraction must be in [0, 1], got {self.min_compressed_fraction}")
        if self.min_numel < 0:
            raise ValueError(f"min_numel must be >= 0, got {self.min_numel}")
        # canonical specs, so equal policies hash equally
        object.__setattr__(self, "default", get_codec(self.default).spec)
        object.__setattr__(self, "by_type", {k: get_codec(v).spec for k, v in self.by_type.items()})
        object.__setattr__(self, "by_name", {k: get_codec(v).spec for k, v in self.by_name.items()})

    @classmethod
    def coerce(cls, policy: Policy | str | Codec | None, codec: str | Codec | None = None) -> Policy:
        if isinstance(policy, Policy):
            return policy
        spec = policy if policy is not None else codec
        if spec is None:
            return cls()
        return cls(default=spec.spec if isinstance(spec, Codec) else spec)

    def describe(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True, default=dict)

    def fingerprint(self) -> str:
        return hashlib.sha256(self.describe().encode()).hexdigest()[:16]

    def resolve(self, model: nn.Module) -> dict[str, Codec]:
        """Codec for every trainable parameter of ``model`` by qualified name."""
        owner: dict[str, str] = {}
        for mname, mod in model.named_modules():
            for pname, _ in mod.named_parameters(recurse=False):
                owner[f"{mname}.{pname}" if mname else pname] = type(mod).__name__
        params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        types = set(owner.values())
        unknown = sorted(t for t in self.by_type if t not in types)
        if unknown:
            raise ValueError(f"Policy.by_type names module types this model does not have: {unknown}; its "
                             f"types with parameters are {sorted(types)}")
        idle = sorted(pat for pat in self.by_name if not any(fnmatch.fnmatchcase(n, pat) for n, _ in params))
        if idle:
            raise ValueError(f"Policy.by_name patterns match no trainable parameter of this model: {idle} "
                             f"(names look like {[n for n, _ in params[:3]]})")
        chosen: dict[str, str | None] = {}
        for name, p in params:
            spec = next((s for pat, s in self.by_name.items() if fnmatch.fnmatchcase(name, pat)), None)
            if spec is None:
                spec = self.by_type.get(owner.get(name, ""))
            chosen[name] = spec
        # The size rule for the rest: lower the threshold until enough parameters are compressed.
        free = [(n, p.numel()) for n, p in params if chosen[n] is None and not (self.keep_1d and p.dim() <= 1)]
        total = sum(p.numel() for _, p in params) or 1
        fixed_compressed = sum(p.numel() for n, p in params if chosen[n] not in (None, FP32))
        threshold = self.min_numel
        for size in sorted({s for _, s in free}, reverse=True):
            if size >= threshold:
                continue
            covered = fixed_compressed + sum(s for _, s in free if s >= threshold)
            if covered / total >= self.min_compressed_fraction:
                break
            threshold = size
        out: dict[str, Codec] = {}
        for name, p in params:
            spec = chosen[name]
            if spec is None:
                small = p.numel() < threshold or (self.keep_1d and p.dim() <= 1)
                spec = FP32 if small else self.default
            out[name] = get_codec(spec)
        return out

    def summary(self, model: nn.Module) -> dict[str, int]:
        """Parameters per codec spec."""
        counts: dict[str, int] = {}
        plan = self.resolve(model)
        for name, p in model.named_parameters():
            if name in plan:
                counts[plan[name].spec] = counts.get(plan[name].spec, 0) + p.numel()
        return counts
