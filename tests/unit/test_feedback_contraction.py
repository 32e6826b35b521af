"""Error feedback converges only with a codec that contracts (its error smaller than its input):
lowbit.feedback.relative_error measures it; local SGD's error_feedback="auto" leaves it off where the
codec does not contract, and error_feedback=True warns there."""

from __future__ import annotations

import warnings

import pytest
import torch

from lowbit.codecs.base import get_codec
from lowbit.feedback import ErrorFeedback, feedback_contracts, relative_error
from lowbit.localsgd.config import _resolve_feedback


@pytest.mark.parametrize("spec,contracts", [
    ("qsgd:bits=2,bucket=512", False), ("qsgd:bits=2,bucket=512,norm=l2", False),
    ("qsgd:bits=4,bucket=512,norm=l2", False), ("qsgd:bits=2,bucket=512,rounding=nearest", True),
    ("qsgd:bits=4,bucket=512", True), ("onebit:bucket=64", True), ("qsgd:bits=8", True)])
def test_which_codecs_contract(spec: str, contracts: bool) -> None:
    assert feedback_contracts(spec) is contracts, relative_error(spec)


def _residual_growth(spec: str, steps: int = 100) -> float:
    """One rank's error feedback on the same input every step: the residual's norm over the input's."""
    fb, x = ErrorFeedback(spec), torch.randn(8192, generator=torch.Generator().manual_seed(1))
    for step in range(steps):
        fb.encode("t", x, seed=step)
    return float(fb.residuals["t"].norm() / x.norm())


def test_a_codec_that_does_not_contract_makes_the_residual_grow_one_that_does_not() -> None:
    assert _residual_growth("qsgd:bits=2,bucket=512,norm=l2") > 1e3  # grows without bound
    assert _residual_growth("qsgd:bits=2,bucket=512,rounding=nearest") < 3
    assert _residual_growth("qsgd:bits=4,bucket=512") < 1


def test_local_sgd_auto_feedback_follows_contraction_and_true_warns() -> None:
    assert _resolve_feedback("auto", get_codec("qsgd:bits=4,bucket=512")) is True
    assert _resolve_feedback("auto", get_codec("qsgd:bits=2,bucket=512,rounding=nearest")) is True
    assert _resolve_feedback("auto", get_codec("qsgd:bits=2,bucket=512")) is False  # stochastic 2-bit
    assert _resolve_feedback("auto", get_codec("onebit:bucket=64")) is True  # biased
    with pytest.warns(RuntimeWarning, match="may not converge"):
        assert _resolve_feedback(True, get_codec("qsgd:bits=2,bucket=512,norm=l2")) is True
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _resolve_feedback(True, get_codec("qsgd:bits=4,bucket=512")) is True


def test_ddp_warns_when_error_feedback_is_forced_on_a_codec_that_does_not_contract() -> None:
    from lowbit import feedback
    from lowbit.ddp.config import DDPConfig

    feedback._WARNED.discard("qsgd:bits=1,bucket=512,norm=max,rounding=stochastic")
    cfg = DDPConfig(codec="qsgd:bits=1,bucket=512", error_feedback=True)
    with pytest.warns(RuntimeWarning, match="lowbit.ddp.*may not converge"):
        assert cfg.uses_feedback(get_codec("qsgd:bits=1,bucket=512"))
