"""Local steps with a low-bit outer synchronisation (local SGD, DiLoCo, Streaming DiLoCo).

Below roughly a gigabit per rank even 1-bit gradients every step bound the step. Local SGD trades
communication for staleness: every rank (or every group of ranks, running DDP inside) takes ``H`` inner
steps alone, then the groups exchange the weight change they made since the last synchronisation and
an outer optimizer applies its mean. DiLoCo (Douillard et al. 2023) uses AdamW inside and SGD with
Nesterov momentum outside (lr 0.7, momentum 0.9); the exchange here runs in any lowbit codec, with error
feedback per rank for biased and low-bit codecs (4-bit and 2-bit QSGD, 1bitSGD, top-k).

One outer synchronisation of fragment ``f`` (all of the parameters when ``fragments=1``):

1. **pseudo-gradient**: ``delta = anchor - current``, flat float32 (``anchor``: the weights every
   rank agreed on at the fragment's last synchronisation);
2. **exchange**: ``delta`` is averaged across the groups by :func:`lowbit.comm.allreduce.all_reduce` in
   the codec, its residual (error feedback, :mod:`lowbit.feedback`) compensating what earlier rounds
   failed to send. With ``node_size`` (groups of consecutive ranks doing DDP inside), local rank ``l``
   of each group sends only chunk ``l`` of the fragment across groups, among the ranks of the same
   local index, and a native all-gather inside the group puts the chunks together (as HSDP does);
3. **outer step**: ``anchor.grad = mean delta``; the outer optimizer steps the anchor;
4. **reset**: the fragment's parameters become the new anchor.

The mean is bit-identical on every rank (lowbit's collectives decode and sum in rank order), the
anchor and the outer optimizer's state start identical (the anchor is broadcast from the group's
rank 0 at construction), so every rank ends each outer step with bit-identical weights.

Streaming (``fragments=F``, Douillard et al. 2025): the parameters, in model order, are cut into ``F``
fragments of about equal size (whole tensors); fragment ``f`` is synchronised after inner step
``(f + 1) * H // F`` of each period (the last fragment at the period's end), so the peak traffic is
``1/F`` of the model. With ``overlap=τ`` (Streaming DiLoCo's overlapping communication) the fragment's
exchange is only issued there: the next ``τ`` inner steps run while it crosses, and at the ``τ``-th the
outer step is applied to the pseudo-gradient formed ``τ`` steps earlier and the fragment's parameters
become ``mix * local + (1 - mix) * anchor`` (the paper's mixing; ``mix=0``: the anchor, as without
overlap). The anchors stay bit-identical on every rank; with ``mix > 0`` each rank keeps its mixed share
of the ``τ`` local steps.

Memory beyond the model: the anchor (one float32 copy of the parameters), a float32 scratch buffer
of the largest fragment, the outer optimizer's state (SGD with momentum: one more copy) and, with error
feedback, a float32 residual of what this rank sends (the whole model, or ``1/node_size`` of it).

Model buffers (BatchNorm's running statistics) are not synchronised: DDP inside a group keeps them
as it does. Parameters sharded by FSDP2 (DTensors) are not supported yet.

How the package is organised:

* this module: the public names, re-exported;
* :mod:`lowbit.localsgd.config`: :class:`LocalSGDConfig`, every option validated once, DiLoCo's outer
  optimizer (:func:`default_outer_optimizer`) and the groups of ``node_size`` ranks (:func:`node_groups`);
* :mod:`lowbit.localsgd.fragments`: the parameters cut into fragments, and the tensor work on one
  fragment (pseudo-gradient, reset, mix), with no communication;
* :mod:`lowbit.localsgd.rounds`: one fragment's outer round, synchronous or overlapped (issued, then
  landed ``overlap`` steps later): the exchange across and inside groups and the outer step;
* :mod:`lowbit.localsgd.checkpoint`: :meth:`LocalSGD.state_dict` and :meth:`LocalSGD.load_state_dict`;
* :mod:`lowbit.localsgd.core`: :class:`LocalSGD`, its construction (options agreed on by every rank,
  the first anchor broadcast) and the loop that runs each fragment's round at its inner step.
"""

from lowbit.comm.agreement import ConfigMismatchError
from lowbit.localsgd.config import (DEFAULT_OUTER_LR, DEFAULT_OUTER_MOMENTUM, LocalSGDConfig,
                                    OuterFactory,  # noqa: F401 (the type of outer_optimizer=, importable as before)
                                    default_outer_optimizer, node_groups)
from lowbit.localsgd.core import LocalSGD

__all__ = ["LocalSGD", "LocalSGDConfig", "ConfigMismatchError", "node_groups", "default_outer_optimizer",
           "DEFAULT_OUTER_LR", "DEFAULT_OUTER_MOMENTUM"]
