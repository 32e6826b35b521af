"""Error feedback (residual memory) for any codec: the sigma-delta trick of 1bitSGD.

For each key (a tensor name, a DDP message group, a chunk of a collective)::

    p = x + e          # compensate: add what previous steps failed to send
    payload = encode(p)
    e = p - decode(payload)   # remember what this step failed to send

so the sum of everything delivered tracks the sum of everything produced, within one step's error.

This module is error feedback's one home, used by the collectives (:mod:`lowbit.comm`), the DDP hook
and :class:`ErrorFeedback` alike:

* :func:`encode_with_feedback` — the update above, in place on a float32 residual;
* :func:`restore_unless_finite` — the one rule for non-finite values: a step whose *result* holds an Inf
  or NaN leaves every residual as it was before the step. In a collective the result is the reduced
  tensor, the same on every rank (one rank's Inf reaches all, and AMP's GradScaler skips the step
  everywhere), so every rank puts its residual back (a reduce-scatter, whose ranks each hold a shard of
  it, combines the shards' verdicts first: :func:`lowbit.comm.residual.restore_unless_finite_anywhere`);
  for one rank alone it is what its payload delivers.
  The bad step's Inf/NaN still reaches the output (codecs keep non-finite values non-finite).
* :func:`flat_residual` — one buffer for several keys sent as one message (the DDP hook's message
  groups), the residuals by key being its views;
* :func:`residuals_state` / :func:`load_residuals` — the one checkpoint format of residuals: a dict
  name -> flat float32 CPU tensor, checked whole on load before anything is applied (none missing,
  none unexpected, float32, finite, the right size): the one check DDP, FSDP and :class:`ErrorFeedback`
  share.
"""

from __future__ import annotations

from collections.abc import Collection, Hashable, Mapping, Sequence
from typing import Any

import torch

from lowbit.codecs.base import Codec, get_codec

__all__ = ["ErrorFeedback", "encode_with_feedback", "restore_unless_finite", "flat_residual", "residuals_state",
           "load_residuals", "relative_error", "feedback_contracts", "warn_unless_contracting"]

#: values of the standard-normal sample :func:`relative_error` encodes (seeded: the same on every rank)
_SAMPLE = 1 << 16
_RELATIVE: dict[str, float | None] = {}
_WARNED: set[str] = set()


def relative_error(codec: Codec | str) -> float | None:
    """``E ||decode(encode(x)) - x||^2 / ||x||^2`` of ``codec`` on a standard-normal sample of 65,536
    values (seed 0; stochastic codecs: the mean over 4 rounding seeds), cached per spec; None for a codec
    that needs a tensor's shape (per-tensor codecs) or cannot code a flat sample.

    Error feedback converges only for a *contracting* codec, one whose error is smaller than its input
    (Stich et al. 2018; Karimireddy et al. 2019): the residual is ``p - C(p)`` of the compensated ``p``,
    so where ``||C(p) - p|| >= ||p||`` it can grow step after step. Stochastic QSGD with few levels does
    not contract (measured here: 2 bits, bucket 512, max norm 1.61; l2 norm 17.0; 4 bits l2 1.58), its
    deterministic rounding and more levels do (2 bits nearest 0.71; 4 bits max norm 0.037; 1bitSGD 0.35)."""
    c = get_codec(codec) if isinstance(codec, str) else codec
    if c.spec in _RELATIVE:
        return _RELATIVE[c.spec]
    out: float | None = None
    if not c.per_tensor and not c.sums_on_wire:
        x = torch.randn(_SAMPLE, generator=torch.Generator().manual_seed(0))
        try:
            errs = []
            for seed in range(4 if c.stochastic else 1):
                y = c.decode(c.encode(x, seed), x.numel())
                errs.append(float((y - x).square().sum() / x.square().sum()))
            out = sum(errs) / len(errs)
        except (ValueError, RuntimeError, NotImplementedError):
            out = None
    _RELATIVE[c.spec] = out
    return out


def feedback_contracts(codec: Codec | str) -> bool:
    """Whether error feedback converges with ``codec``: its :func:`relative_error` is below 1 (unknown:
    assumed so)."""
    r = relative_error(codec)
    return r is None or r < 1.0


def warn_unless_contracting(codec: Codec | str, where: str) -> None:
    """Warn once per spec when error feedback is on for a codec that does not contract."""
    c = get_codec(codec) if isinstance(codec, str) else codec
    if feedback_contracts(c) or c.spec in _WARNED:
        return
    _WARNED.add(c.spec)
    import warnings

    warnings.warn(
        f"lowbit ({where}): error feedback with {c.spec} may not converge: its error is "
        f"{relative_error(c):.2f}x its input's (squared, on a normal sample), and error feedback needs a "
        "codec whose error is smaller than what it codes, or the residual can grow step after step "
        "(2-bit stochastic QSGD with l2 norm: to 1e17 in 200 steps). Use rounding=nearest, more bits or "
        "norm=max, or error_feedback=False (docs/localsgd.md, 'Error feedback')", RuntimeWarning, stacklevel=3)


def encode_with_feedback(codec: Codec, comp: torch.Tensor, residual: torch.Tensor | None, seed: int,
                         shape: tuple[int, ...] | None = None) -> torch.Tensor:
    """Encode ``comp`` (flat ``(n,)`` float32, already compensated: ``x + residual``; viewed as ``shape``
    for per-tensor codecs) and, with error feedback, leave ``residual = comp - decode(payload)`` (in place;
    ``residual`` must not alias ``comp``)."""
    payload = codec.encode(comp.view(shape) if shape is not None else comp, seed=seed)
    if residual is not None and comp.numel():
        codec.decode(payload, comp.numel(), out=residual,
                     shape=shape if shape is not None else codec.flat_shape(comp.numel()))
        torch.sub(comp, residual, out=residual)
    return payload


def restore_unless_finite(residual: torch.Tensor, before: torch.Tensor, result: torch.Tensor) -> None:
    """The rule for non-finite values (module doc): ``residual`` goes back to ``before`` (its value before
    the step) when ``result`` holds an Inf or NaN. Decided on the device: no host synchronisation."""
    torch.where(torch.isfinite(result).all(), residual, before, out=residual)


def flat_residual(residuals: dict[Any, torch.Tensor], members: Sequence[tuple[Any, int]],
                  device: torch.device | str) -> torch.Tensor:
    """One flat ``(sum n,)`` float32 residual buffer for several keys (``members``: (key, n) in order),
    sent as one message; ``residuals[key]`` becomes its view of the buffer, filled from the residual it
    held (e.g. loaded from a checkpoint), zeros where none. Views keep the residuals by key, so they
    survive a change of messages (DDP's bucket rebuild) and checkpoint as any other."""
    flat = torch.zeros(sum(n for _, n in members), dtype=torch.float32, device=device)
    pos = 0
    for key, n in members:
        view = flat[pos : pos + n]
        old = residuals.get(key)
        if old is not None:
            if old.numel() != n:
                raise ValueError(f"lowbit: the residual of {key} holds {old.numel()} values, the tensor has {n}")
            view.copy_(old.reshape(-1))
        residuals[key] = view
        pos += n
    return flat


def residuals_state(residuals: Mapping[Any, torch.Tensor]) -> dict[Any, torch.Tensor]:
    """Residuals as checkpointed: flat float32 copies on the CPU, by key."""
    return {k: v.detach().reshape(-1).to("cpu", torch.float32).clone() for k, v in residuals.items()}


def load_residuals(residuals: Any, where: str, numels: Mapping[Any, int | None] | None = None,
                   devices: Mapping[Any, torch.device | str] | Any = None,
                   required: Collection[Any] = ()) -> dict[Any, torch.Tensor]:
    """Check a :func:`residuals_state` dict whole, then return its residuals as flat float32 tensors on
    their devices (``devices``: one device for all, a mapping key -> device (CPU where absent), or None:
    where they are). The one check of residuals from a checkpoint, shared by the DDP hook, FSDP and
    :class:`ErrorFeedback`: every residual is checked before any tensor is made, and the caller assigns
    only what this returns, so a refused checkpoint leaves the caller's state as it was.

    Refused with a ``ValueError`` (its message starts with ``where`` and names the keys): not a dict; a
    key of ``required`` that is missing (that residual would silently restart from zero); with
    ``numels`` (key -> the size this state's residual has, None where unknown), a key it does not hold
    (unexpected) or a residual of another size; a residual that is not a float32 tensor (as
    :func:`residuals_state` saves it) or holds an Inf or NaN."""
    if not isinstance(residuals, dict):
        raise ValueError(f"{where}: 'residuals' must be a dict, got {type(residuals).__name__}")
    lost = [k for k in required if k not in residuals]
    if lost:
        raise ValueError(f"{where} has no error-feedback residuals for {_some(lost)}: resuming without them would "
                         "restart them from zero and not continue the run (save state_dict() after the steps, on "
                         "every rank)")
    if numels is not None:
        unknown = [k for k in residuals if k not in numels]
        if unknown:
            raise ValueError(f"{where} holds residuals that this state does not keep: {_some(unknown)} (another "
                             "model, or another codec or error-feedback setting?)")
    for k, v in residuals.items():
        if not isinstance(v, torch.Tensor) or v.dtype != torch.float32:
            raise ValueError(f"{where}: the residual of {k} must be a float tensor of dtype float32 (as state_dict() "
                             f"saves it), got {getattr(v, 'dtype', type(v).__name__)}")
        want = numels.get(k) if numels is not None else None
        if want is not None and v.numel() != want:
            raise ValueError(f"{where}: the residual of {k} has {v.numel()} values, this state's has {want}")
        if not bool(torch.isfinite(v).all()):
            raise ValueError(f"{where}: the residual of {k} holds Inf or NaN")
    out = {}
    for k, v in residuals.items():
        device = devices.get(k, "cpu") if isinstance(devices, Mapping) else (devices if devices is not None else v.device)
        out[k] = v.detach().to(device, torch.float32).reshape(-1).clone()
    return out


def _some(keys: list[Any]) -> str:
    """The first few of ``keys`` for an error message, and how many more."""
    return f"{keys[:5]}" + (f" and {len(keys) - 5} more" if len(keys) > 5 else "")


class ErrorFeedback:
    """Residuals by key for one codec: :meth:`residual` hands a collective its buffer (it updates it with
    :func:`encode_with_feedback` and the non-finite rule), :meth:`encode` does a whole step for one rank
    alone; ``state_dict()`` / ``load_state_dict()`` carry the residuals through checkpoints (per rank)."""

    def __init__(self, codec: Codec | str) -> None:
        self.codec = get_codec(codec) if isinstance(codec, str) else codec
        self.residuals: dict[Hashable, torch.Tensor] = {}

    def residual(self, key: Hashable, numel: int, device: torch.device | str) -> torch.Tensor:
        """The residual buffer of ``key`` ((numel,) float32, zeros the first time); collectives update
        it in place."""
        e = self.residuals.get(key)
        if e is None:
            e = self.residuals[key] = torch.zeros(numel, dtype=torch.float32, device=device)
        elif e.numel() != numel:
            raise ValueError(
                f"error feedback for key {key!r}: residual has {e.numel()} elements but the tensor has "
                f"{numel} (did the model or bucket layout change?)"
            )
        return e

    def encode(
        self, key: Hashable, x: torch.Tensor, seed: int = 0, shape: Sequence[int] | None = None
    ) -> torch.Tensor:
        """Compensate ``x`` with ``key``'s residual, encode, and remember what the payload lost; returns
        the payload. A payload that delivers an Inf or NaN leaves the residual as it was."""
        e = self.residual(key, x.numel(), x.device)
        comp = x.reshape(-1).to(torch.float32) + e  # (n,) float32, a new tensor
        before = e.clone()
        if shape is None and x.dim():
            shape = tuple(x.shape)
        payload = encode_with_feedback(self.codec, comp, e, seed, tuple(shape) if shape is not None else None)
        # one rank alone: what it delivers is comp - e, not finite exactly where e is not
        restore_unless_finite(e, before, e)
        return payload

    def reset(self) -> None:
        self.residuals.clear()

    def residual_norm(self) -> float:
        return float(sum(float(e.double().pow(2).sum()) for e in self.residuals.values()) ** 0.5)

    def state_dict(self) -> dict[str, Any]:
        return {"codec": self.codec.spec, "residuals": residuals_state(self.residuals)}

    def load_state_dict(self, state: dict[str, Any], device: torch.device | str | None = None,
                        numels: Mapping[Hashable, int | None] | None = None,
                        required: Collection[Hashable] = ()) -> None:
        """Load :meth:`state_dict`'s residuals, all checked first (:func:`load_residuals`, with ``numels``
        and ``required`` as there; a ``ValueError`` leaves this object as it was)."""
        if not isinstance(state, dict):
            raise ValueError(f"error-feedback checkpoint must be a dict (from state_dict()), got {type(state).__name__}")
        if state.get("codec") != self.codec.spec:
            raise ValueError(
                f"error-feedback checkpoint was saved for codec {state.get('codec')!r}, "
                f"but this state uses {self.codec.spec!r}"
            )
        if "residuals" not in state:
            raise ValueError("error-feedback checkpoint has no 'residuals' (save ErrorFeedback.state_dict() as it is)")
        self.residuals = load_residuals(state["residuals"], "error-feedback checkpoint", numels, device, required)
