"""``codec="auto"``'s decision rules that DDP and FSDP share: how much error a choice may add, and which
measured finalist wins.

**The error limit** (``error_budget`` times a reference, None: no limit). The reference is uniform
8-bit QSGD's squared error (:data:`lowbit.auto.options.BASELINE`) at the conservative level; at the bold
one the larger of that and the gradients' sampling noise between the ranks (:func:`lowbit.auto.
estimates.sampling_noise`). DDP bounds the error summed over the tensors (:func:`error_limit` on the
summed references), FSDP each module's (:func:`module_limit`).

Bold's noise allowance is for unbiased codecs: a codec whose error is zero-mean adds noise as a smaller
batch would, within the noise the batch already has. A biased codec's error (1bitSGD*, top-k, with
error feedback) is a systematic distortion that error feedback repays late, not noise: it is held to
the conservative limit. On the MLP on MNIST-1D (issue 29) 1bitSGD* was admitted under the noise (0.86
against 1.53) and, forced, cost 1.1-5.8 points of accuracy over 8 seeds (mean 3.2): docs/ddp.md, "How
far auto may go". Per module that is a lower limit for the biased codecs (:func:`module_limit`); in
DDP's search over a summed budget, a biased codec's error is weighed by bold's limit over the
conservative one (:func:`biased_weight`), which comes to the same bound.

**The measured choice** (:func:`choose_measured`): the finalists' measured step times against the
baseline's (fp32 for DDP, FSDP's own reduce-scatter for FSDP): the baseline unless a finalist is at
least ``faster_than`` (2 %) faster; of the finalists within 3 % of the fastest, the one with the most
bits (the more precise). :func:`lowbit.choose.pick` is the rule, shared with ``lowbit advise``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import NamedTuple, Optional

from lowbit.choose import AUTO_FASTER_THAN_FP32, WITHIN_BEST, Tried, pick, split_choice
from lowbit.codecs.base import get_codec

__all__ = ["error_limit", "module_limit", "biased_weight", "weighed_errors", "Measured", "choose_measured"]


def error_limit(level: str, budget: Optional[float], ref: float, noise: float) -> Optional[float]:
    """The most squared error a choice may add: ``budget`` times ``ref`` (8-bit QSGD's error), or at the
    bold level times the larger of ``ref`` and ``noise`` (the gradients' sampling noise); None when
    ``budget`` is None (no limit)."""
    if budget is None:
        return None
    return budget * (max(ref, noise) if level == "bold" else ref)


def module_limit(level: str, budget: Optional[float], ref: float, noise: float, biased: bool) -> float:
    """:func:`error_limit` for one codec on one module: a biased codec held to the conservative limit
    (module doc); ``inf`` without a budget."""
    if budget is None:
        return math.inf
    if biased:
        return budget * ref
    lim = error_limit(level, budget, ref, noise)
    return math.inf if lim is None else lim


def biased_weight(level: str, budget: Optional[float], ref: float, noise: float) -> float:
    """The factor a biased codec's error is weighed by in a search under the summed :func:`error_limit`
    so that it keeps within the conservative limit: bold's limit over it (``noise / ref`` where the noise
    is the larger), else 1."""
    if level != "bold" or budget is None or not (ref > 0 and noise > ref):
        return 1.0
    return noise / ref


def weighed_errors(errors: Mapping[str, Mapping[str, float]], level: str, budget: Optional[float], ref: float,
                   noise: float) -> dict[str, dict[str, float]]:
    """``errors`` (tensor -> choice -> squared error; a choice is a codec spec, or spec@algorithm) with
    each biased codec's weighed by :func:`biased_weight`, for a search under the summed limit."""
    w = biased_weight(level, budget, ref, noise)
    return {name: {key: e * w if w != 1.0 and get_codec(split_choice(key)[0]).biased else e
                   for key, e in errs.items()} for name, errs in errors.items()}


class Measured(NamedTuple):
    """A finalist tried: its ``label``, per tensor (or module) ``assignment``, the ``bits`` per value
    weighted by size, and its agreed step time ``seconds``."""

    label: str
    assignment: Mapping[str, str]
    bits: float
    seconds: float


def choose_measured(finalists: Sequence[Measured], baseline: Measured,
                    faster_than: float = AUTO_FASTER_THAN_FP32) -> tuple[Measured, bool]:
    """The finalist chosen on its measured step time against ``baseline`` (module doc).

    Returns:
        The winner (``baseline`` when nothing pays) and whether nothing paid."""
    tried = [Tried(f.assignment, baseline.seconds / f.seconds, f.bits, f) for f in finalists]
    best, none_pays = pick(tried, Tried(baseline.assignment, 1.0, baseline.bits, baseline),
                           within_best=WITHIN_BEST, faster_than_fp32=faster_than)
    return best.extra, none_pays


