"""Dettmers' hybrid parallelism: convolutions data-parallel, fully connected layers model-parallel, and
the activations between them sent in sub-batches that overlap the transfer with compute.

Per training step, on every rank (``K`` ranks, local batch ``B``, ``S`` sub-batches of ``B/S`` rows):

1. the data-parallel ``features`` (the caller's DDP module: its gradients go through its comm hook,
   e.g. :mod:`lowbit.ddp`) run on the local batch;
2. the ``S`` compressed all-gathers of the sub-batches' activations are issued at once
   (:func:`lowbit.comm.gather.all_gather`): sub-batch ``i+1`` travels while sub-batch ``i`` computes;
3. for each sub-batch: wait for its activations (``K * B/S`` rows, the same bits on every rank), run the
   model-parallel classifier forward and backward (every rank: its slice of every layer), then issue the
   compressed reduce-scatter of the activations' gradient (each rank gets the sum over ranks of its own
   rows) — it travels while the next sub-batch computes. With ``update_each`` the classifier's optimiser
   steps after every sub-batch (the paper's option);
4. wait for the gradients of this rank's rows and run the features' backward with them (times ``K`` when
   DDP averages the features' gradients over ranks: the classifier's loss is the mean over the global
   batch, whose gradient in the features is the sum of the ranks' parts).

The classifier's loss is the mean over the global batch (each sub-batch's mean weighted by its share), so
``S`` sub-batches without per-sub-batch updates compute the gradients of one batch (to float tolerance).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from lowbit.comm import collectives as C
from lowbit.comm.gather import all_gather, part_sizes, reduce_scatter
from lowbit.parallel.layers import ParallelComm, parallelize

__all__ = ["Hybrid"]


class Hybrid(nn.Module):
    """``features`` data-parallel, ``classifier`` model-parallel, activations in ``sub_batches``.

    ``classifier``: a plain ``Sequential`` of Linear / ReLU / Dropout (split here with
    :func:`lowbit.parallel.parallelize`, same values on every rank required) or one already split with
    ``first_reduces_input_grad=False``. ``ddp_average``: the features' gradients are averaged over ranks
    (DDP); the activations' gradients are then scaled by ``K`` so that the average is the global batch's
    gradient. ``pair``: the classifier's linear layers split in column/row pairs (fewer transfers;
    :func:`lowbit.parallel.parallelize`).
    """

    def __init__(self, features: nn.Module, classifier: nn.Sequential, comm: ParallelComm | None = None,
                 sub_batches: int = 1, update_each: bool = False, ddp_average: bool = True, seed: int = 0,
                 pair: bool = False) -> None:
        super().__init__()
        if not isinstance(sub_batches, int) or isinstance(sub_batches, bool) or sub_batches < 1:
            raise ValueError(f"sub_batches must be a positive int, got {sub_batches!r}")
        self.comm = comm if comm is not None else ParallelComm()
        self.features = features
        split = any(hasattr(m, "comm") for m in classifier)
        self.classifier = classifier if split else parallelize(classifier, self.comm, first_reduces_input_grad=False,
                                                                seed=seed, pair=pair)
        self.sub_batches, self.update_each, self.ddp_average = sub_batches, update_each, ddp_average

    def _labels(self, y: torch.Tensor) -> Callable[[], torch.Tensor]:
        """Issue the all-gather of every rank's labels now; returns a function that waits for them
        ((K, B) in rank order)."""
        rank, k = self.comm.world
        if k == 1:
            return lambda: y.reshape(1, -1)
        out = torch.empty(k * y.numel(), dtype=y.dtype, device=y.device)
        work = C.all_gather_async(out, y.contiguous().view(-1), self.comm.group)

        def wait() -> torch.Tensor:
            C.wait(work, "all_gather_into_tensor", self.comm.group)
            return out.view(k, -1)

        return wait

    def train_step(self, x: torch.Tensor, y: torch.Tensor, loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                   opt_features: torch.optim.Optimizer | None = None,
                   opt_classifier: torch.optim.Optimizer | None = None) -> torch.Tensor:
        """One step on the local batch ``(x, y)`` (the same size on every rank); returns the global batch's
        mean loss (a 0-d tensor, the same on every rank). Steps the optimisers given (and zeroes their
        gradients first); without them the gradients are left in ``.grad``."""
        rank, k = self.comm.world
        comm = self.comm
        for opt in (opt_features, opt_classifier):
            if opt is not None:
                opt.zero_grad(set_to_none=True)
        labels_of = self._labels(y)  # issued first: they cross while the features compute
        feats = self.features(x)
        b = feats.shape[0]
        s = min(self.sub_batches, b)
        sizes = part_sizes(b, s)
        starts = [sum(sizes[:i]) for i in range(s)]
        det = feats.detach()
        futs = [all_gather(det.narrow(0, lo, n).contiguous(), comm.codec, comm.group, dim=0,
                           seed=comm.step * 1_009 + i, stats=comm.stats, async_op=True)
                for i, (lo, n) in enumerate(zip(starts, sizes))]
        labels = labels_of()
        total = torch.zeros((), dtype=torch.float32, device=feats.device)
        back = []
        for i, (lo, n) in enumerate(zip(starts, sizes)):
            xs = C.wait(futs[i], "all_gather_into_tensor", comm.group)
            xs = xs.detach().requires_grad_(True)  # type: ignore[union-attr]
            ys = labels[:, lo : lo + n].reshape(-1)
            loss = loss_fn(self.classifier(xs), ys) * (n / b)
            loss.backward()
            total += loss.detach()
            if self.update_each and opt_classifier is not None:
                opt_classifier.step()
                opt_classifier.zero_grad(set_to_none=True)
            back.append(reduce_scatter(xs.grad, comm.grad_codec, comm.group, dim=0, sizes=[n] * k,  # type: ignore[arg-type]
                                       seed=comm.step * 1_009 + s + i, stats=comm.stats, async_op=True))
        grads = [C.wait(f, "all_to_all_single", comm.group) for f in back]
        g = torch.cat(grads, dim=0) if len(grads) > 1 else grads[0]  # type: ignore[arg-type]
        if self.ddp_average and k > 1:
            g = g * k
        feats.backward(g.to(feats.dtype))
        if opt_classifier is not None and not self.update_each:
            opt_classifier.step()
        if opt_features is not None:
            opt_features.step()
        comm.step += 1
        return total

    @torch.no_grad()
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits of this rank's rows (evaluation: every rank passes its batch, of one size on all)."""
        rank, k = self.comm.world
        feats = self.features(x)
        xs = all_gather(feats.contiguous(), self.comm.codec, self.comm.group, dim=0, stats=self.comm.stats)
        out = self.classifier(xs)  # type: ignore[arg-type]
        return out.view(k, feats.shape[0], *out.shape[1:])[rank]

    def classifier_parameters(self) -> list[nn.Parameter]:
        return list(self.classifier.parameters())

    def extra_repr(self) -> str:
        return f"sub_batches={self.sub_batches}, update_each={self.update_each}, codec={self.comm.codec.spec}"  # type: ignore[union-attr]
