"""``codec="auto"``'s guard: cheap signals watched while training, and the rule that steps a tensor up.

A decision is taken on a few steps at the start of training; gradients change as training goes on, and
a codec that was harmless then may not stay so. Every ``every`` steps (``guard_every``) the tuner
(:mod:`lowbit.auto.ddp_tuner`, :mod:`lowbit.auto.fsdp_tuner`) watches one step and hands
:meth:`Guard.check` what every rank saw, summed over the ranks in rank order (:func:`combine`), so that
every rank takes the same decision:

* per compressed tensor: whether its gradient (a sample of it) and its error-feedback residual were
  finite, the chosen codec's squared error on the gradient sample and the sample's squared norm, the
  residual's squared norm;
* the mean of the losses the user reported since the last check (``state.auto.report_loss(loss)``;
  optional).

The rule, per tensor unless said otherwise (each change is one level up the ladder of allowed codecs,
by bits per value, except where it says fp32; fp32 is the top):

1. **non-finite** residual: straight to fp32. A non-finite gradient: checked again at the very next
   step, and straight to fp32 if it is still not finite there (a single overflow, as AMP's
   GradScaler makes and skips, is not counted);
2. **error drift**: the codec's relative error (squared error over the gradient's squared norm) has
   grown to more than ``ERROR_DRIFT`` times its value when the codec was chosen (gradients whose
   distribution changed so that the codec no longer fits them; samples of at least
   ``MIN_DRIFT_VALUES`` values only, where one step's estimate is steady);
3. **residual growth** (error feedback): the residual's squared norm, relative to the gradient's, is
   above 1 and grew more than ``RESIDUAL_GROWTH`` times since the last check (feedback no longer keeps
   up with what the codec leaves out);
4. **loss** (every compressed tensor, when the user reports one): non-finite: fp32; above
   ``LOSS_RISE`` times the lowest mean seen so far (the fp32 steps before the decision included) and
   not lower than at the last check: one level up.

A tensor stepped up keeps that precision as a floor: re-measuring (``remeasure_every``) chooses among
the codecs at or above it only. The guard's state (floors, the changes made, its references) is plain
data, saved in the DDP (or FSDP) state's checkpoints.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping, Sequence
from typing import Any, Optional

import torch

from lowbit.auto.estimates import codec_errors, squared_norm

__all__ = ["Guard", "ReportedLoss", "combine", "local_entry", "ERROR_DRIFT", "RESIDUAL_GROWTH", "LOSS_RISE",
           "MIN_DRIFT_VALUES"]

#: a codec's relative error this many times its value at decision time: one level up
ERROR_DRIFT = 4.0
#: the error-feedback residual (relative to the gradient) growing this much between checks: one level up
RESIDUAL_GROWTH = 4.0
#: the reported loss this many times its lowest mean so far, and not coming down: every tensor one level up
LOSS_RISE = 1.5
#: gradient samples smaller than this are not judged on their error (one step's estimate is too noisy)
MIN_DRIFT_VALUES = 4096

_SEP = "@"  # lowbit.choose.ALGORITHM_SEP (a choice: spec, or spec@algorithm)


def local_entry(x: torch.Tensor, n: int, spec: str, finite: bool, residual: Optional[float]) -> dict[str, Any]:
    """One rank's numbers for one compressed tensor at a check: codec ``spec``'s squared error on the
    gradient sample ``x`` (of a gradient of ``n`` values) and the sample's squared norm (zeros where it is
    not ``finite``), whether it is finite, the error-feedback ``residual``'s squared norm (None: none) and
    the sample's size; :func:`combine` sums them over the ranks."""
    return {"err": codec_errors(x, n, [spec])[spec] if finite else 0.0, "norm": squared_norm(x, n) if finite else 0.0,
            "finite": bool(finite), "residual": residual, "values": int(x.numel())}


def combine(per_rank: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Every rank's local check (both tuners build them with :func:`local_entry`: ``{"tensors": {name:
    {"err", "norm", "residual", "finite", "values"}}, "loss": float | None, "loss_finite": bool}``) as
    one: errors, norms and residuals summed in rank order, finite only where finite on every rank,
    the loss averaged over the ranks that reported one. The same result on every rank."""
    first = per_rank[0]
    tensors: dict[str, dict[str, Any]] = {}
    for name in first["tensors"]:
        rows = [r["tensors"][name] for r in per_rank]
        finite = all(bool(x["finite"]) for x in rows)
        res = [x["residual"] for x in rows]
        tensors[name] = {
            "err": sum(float(x["err"]) for x in rows) if finite else math.nan,
            "norm": sum(float(x["norm"]) for x in rows) if finite else math.nan,
            "residual": None if any(v is None for v in res) else sum(float(v) for v in res),
            "residual_finite": all(v is None or math.isfinite(float(v)) for v in res),
            "finite": finite,
            "values": min(int(x["values"]) for x in rows),
        }
    losses = [float(r["loss"]) for r in per_rank if r.get("loss") is not None]
    return {"tensors": tensors,
            "loss": (sum(losses) / len(losses)) if losses else None,
            "loss_finite": all(bool(r.get("loss_finite", True)) for r in per_rank)}


class ReportedLoss:
    """The losses the user reports between two checks (``state.auto.report_loss(loss)``, the loss rule's
    input): summed where they are (a tensor on its device: no host sync until the check), taken as their
    mean by :meth:`take` and handed to :func:`combine` as :meth:`entry` makes them. Not saved in
    checkpoints (the guard's references are)."""

    def __init__(self) -> None:
        self.total: Any = None
        self.n = 0

    def add(self, loss: Any) -> None:
        """One step's loss: a float or a tensor of one value (detached; added on its device)."""
        if hasattr(loss, "detach"):
            v = loss.detach().reshape(()).float()
            self.total = v.clone() if self.total is None else self.total + v
        else:
            self.total = float(loss) + (0.0 if self.total is None else self.total)
        self.n += 1

    def take(self) -> Optional[float]:
        """The mean of the losses added since the last call (None: none); starts a new sum."""
        if not self.n:
            return None
        total, n = self.total, self.n
        self.total, self.n = None, 0
        return float(total) / n

    @staticmethod
    def entry(loss: Optional[float]) -> dict[str, Any]:
        """A rank's ``loss`` and ``loss_finite`` for :func:`combine` (a non-finite mean: not averaged, flagged)."""
        finite = loss is None or math.isfinite(loss)
        return {"loss": loss if finite else None, "loss_finite": finite}


class Guard:
    """The guard's rule (module doc) and its state. ``ladder``: the allowed codec specs with their bits per
    value; ``hierarchical``: the specs that may go by the hierarchical algorithm (on several nodes), so
    that a hierarchical tensor stepped up stays hierarchical where it can."""

    def __init__(self, every: int, ladder: Sequence[tuple[str, float]], hierarchical: Collection[str] = (),
                 fp32: str = "fp32") -> None:
        self.every = every
        self.fp32 = fp32
        self.ladder = sorted(ladder, key=lambda sb: (sb[1], sb[0]))
        self.bits = dict(self.ladder)
        self.hierarchical = set(hierarchical)
        self.next_check: Optional[int] = None  # the step to watch next (its gradients are sampled)
        self.floors: dict[str, float] = {}      # tensor -> the fewest bits it may take again
        self.strikes: set[str] = set()          # tensors whose gradient was not finite at the last check
        self.reference: dict[str, float] = {}   # tensor -> relative error of its codec, where not measured
        self.last_residual: dict[str, float] = {}  # tensor -> relative residual at the last check
        self.loss_best: Optional[float] = None
        self.loss_last: Optional[float] = None
        self.changes: list[dict[str, Any]] = []

    # ------------------------------------------------------------------------------ the ladder
    def spec_bits(self, key: str) -> float:
        return self.bits.get(key.partition(_SEP)[0], 32.0)

    def up(self, key: str) -> str:
        """The next choice up from ``key``: the allowed spec with the fewest bits above its own, by the same
        algorithm where that spec can go by it; fp32 stays fp32."""
        spec, _, algorithm = key.partition(_SEP)
        bits = self.bits.get(spec, 32.0)
        higher = [s for s, b in self.ladder if b > bits]
        if not higher:
            return self.fp32
        nxt = higher[0]
        return f"{nxt}{_SEP}{algorithm}" if algorithm and nxt in self.hierarchical else nxt

    def allowed(self, name: str, keys: Collection[str]) -> list[str]:
        """The choices among ``keys`` that tensor ``name`` may take (its floor, if it has one)."""
        floor = self.floors.get(name)
        return list(keys) if floor is None else [k for k in keys if self.spec_bits(k) >= floor]

    # ------------------------------------------------------------------------------ the checks
    def start(self, step: int, loss: Optional[float] = None) -> None:
        """A (new) decision runs from ``step``: the first check watches ``step + every``. ``loss``: the mean
        loss reported before it (the fp32 steps), the first reference of the loss rule."""
        self.next_check = step + self.every if self.every else None
        self.strikes.clear()
        self.reference.clear()
        self.last_residual.clear()
        if loss is not None and math.isfinite(loss):
            self.loss_best = loss if self.loss_best is None else min(self.loss_best, loss)

    def check(self, step: int, assignment: Mapping[str, str], stats: Mapping[str, Any],
              reference: Mapping[str, Optional[float]]) -> dict[str, tuple[str, str]]:
        """Apply the rule (module doc) to ``stats`` (:func:`combine`'s, of the watched step ``step - 1``) for
        the tensors of ``assignment`` that are compressed; ``reference[name]``: the relative error of the
        tensor's codec when it was chosen (None: not measured; the first check's value stands in).
        Returns tensor -> (new choice, reason) and schedules the next check."""
        out: dict[str, tuple[str, str]] = {}
        strikes = set()

        def change(name: str, to: str, reason: str) -> None:
            if name not in out and to != assignment[name]:
                out[name] = (to, reason)

        for name, t in stats["tensors"].items():
            key = assignment.get(name)
            if key is None or key == self.fp32:
                continue
            if not t.get("residual_finite", True):
                change(name, self.fp32, "its error-feedback residual is not finite")
                continue
            if not t["finite"]:
                if name in self.strikes:
                    change(name, self.fp32, "its gradient was not finite at two checks in a row")
                else:
                    strikes.add(name)
                continue
            norm, err = float(t["norm"]), float(t["err"])
            if norm > 0:
                rel = err / norm
                ref = reference.get(name)
                if ref is None:
                    ref = self.reference.setdefault(name, rel)
                if t["values"] >= MIN_DRIFT_VALUES and ref > 0 and rel > ERROR_DRIFT * ref:
                    change(name, self.up(key), f"its gradient error grew {rel / ref:.1f}x since it was chosen "
                                               f"(relative error {rel:.3g}, was {ref:.3g})")
                res = t.get("residual")
                if res is not None:
                    rho = float(res) / norm
                    last = self.last_residual.get(name)
                    self.last_residual[name] = rho
                    if last is not None and rho > 1.0 and rho > RESIDUAL_GROWTH * last:
                        change(name, self.up(key), f"its error-feedback residual grew {rho / max(last, 1e-30):.1f}x "
                                                   f"since the last check (now {rho:.3g}x the gradient's squared norm)")
        loss = stats.get("loss")
        compressed = [n for n, k in assignment.items() if k != self.fp32]
        if not stats.get("loss_finite", True) or (loss is not None and not math.isfinite(loss)):
            for name in compressed:
                change(name, self.fp32, "the reported loss is not finite")
        elif loss is not None:
            best, last = self.loss_best, self.loss_last
            if best is not None and best > 0 and loss > LOSS_RISE * best and (last is None or loss >= last):
                for name in compressed:
                    change(name, self.up(assignment[name]), f"the reported loss {loss:.4g} is {loss / best:.2f}x "
                                                            f"its lowest mean {best:.4g} and not coming down")
            self.loss_best = loss if best is None else min(best, loss)
            self.loss_last = loss
        for name, (to, reason) in out.items():
            self.floors[name] = max(self.floors.get(name, 0.0), self.spec_bits(to))
            self.reference.pop(name, None)
            self.last_residual.pop(name, None)
            self.changes.append({"step": step - 1, "tensor": name, "from": assignment[name], "to": to,
                                 "reason": reason})
        self.strikes = strikes - set(out)
        # a strike is confirmed (or cleared) at once: the step now starting is watched
        self.next_check = (step if self.strikes else step - 1 + self.every) if self.every else None
        return out

    # ------------------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        return {"next_check": self.next_check, "floors": dict(self.floors), "strikes": sorted(self.strikes),
                "reference": dict(self.reference), "last_residual": dict(self.last_residual),
                "loss_best": self.loss_best, "loss_last": self.loss_last, "changes": list(self.changes)}

    def load_state_dict(self, d: Mapping[str, Any]) -> None:
        if not isinstance(d, Mapping):
            raise ValueError(f"lowbit checkpoint: codec='auto''s guard state must be a dict, got {type(d).__name__}")
        self.next_check = d.get("next_check")
        self.floors = {str(k): float(v) for k, v in d.get("floors", {}).items()}
        self.strikes = set(d.get("strikes", ()))
        self.reference = {str(k): float(v) for k, v in d.get("reference", {}).items()}
        self.last_residual = {str(k): float(v) for k, v in d.get("last_residual", {}).items()}
        self.loss_best, self.loss_last = d.get("loss_best"), d.get("loss_last")
        self.changes = [dict(c) for c in d.get("changes", ())]
