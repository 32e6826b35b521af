"""``codec="auto"``: measure the running job, then choose per tensor (DDP) or per module (FSDP) the
gradient exchange that pays, and guard the choice while training.

One tuner's parts, shared by both integrations:

* :mod:`lowbit.auto.options` — the options and their named levels (:class:`AutoOptions`, the base of
  ``DDPConfig`` and ``FSDPConfig``), one check for both;
* :mod:`lowbit.auto.clock` — the one clock every measurement reads (:class:`DeviceClock`; a test
  injects its own through ``clock=``);
* :mod:`lowbit.auto.estimates` — the codecs' errors on gradient samples, the gradients' sampling
  noise between the ranks, and the agreement of every rank's numbers (averaged in rank order);
* :mod:`lowbit.auto.trials` — the one trial procedure and its timing rule (blocks of one warm-up and
  two timed steps per finalist, the median per rank, the mean over the ranks, a second pass in reverse
  order for the finalists within 10 % of the fastest);
* :mod:`lowbit.auto.decide` — the error limits (bold's noise allowance for unbiased codecs only) and
  the choice among measured finalists;
* :mod:`lowbit.auto.guard` — the checks after the decision that step a tensor up.

The adapters are :mod:`lowbit.auto.ddp_tuner` (``AutoTuner``: the backward timeline, link probes and
replay that predict DDP's finalists) and :mod:`lowbit.auto.fsdp_tuner` (``FSDPAuto``: admission per
FSDP module); :mod:`lowbit.ddp` and :mod:`lowbit.fsdp` import their own, and this package imports
neither, so using one integration does not load the other's tuner.
"""

from __future__ import annotations

from lowbit.auto.clock import Clock, DeviceClock
from lowbit.auto.decide import choose_measured, error_limit, module_limit
from lowbit.auto.estimates import agree, codec_errors, sampling_noise
from lowbit.auto.guard import Guard, ReportedLoss
from lowbit.auto.options import (AUTO_LEVELS, BASELINE, BOLD_ALLOW, DEFAULT_ALLOW, AutoOptions, check_auto_options,
                                 default_allow)
from lowbit.auto.trials import Trials, close_finalists, mean_of_passes

__all__ = ["AUTO_LEVELS", "BASELINE", "BOLD_ALLOW", "DEFAULT_ALLOW", "AutoOptions", "Clock", "DeviceClock", "Guard",
           "ReportedLoss", "Trials", "agree", "check_auto_options", "choose_measured", "close_finalists",
           "codec_errors", "default_allow", "error_limit", "mean_of_passes", "module_limit", "sampling_noise"]
