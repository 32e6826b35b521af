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

import warnings
from collections.abc import Callable

import torch
from torch import nn

from lowbit.comm import collectives as C
from lowbit.comm.gather import all_gather, part_sizes, reduce_scatter
from lowbit.parallel.layers import ParallelComm, SharedDropout, parallelize

__all__ = ["Hybrid", "MAX_GRAPHS"]

#: The most CUDA graphs one Hybrid keeps (each holds a memory pool and a set of gradient buffers).
MAX_GRAPHS = 8


class Hybrid(nn.Module):
    """``features`` data-parallel, ``classifier`` model-parallel, activations in ``sub_batches``.

    ``classifier``: a plain ``Sequential`` of Linear / ReLU / Dropout (split here with
    :func:`lowbit.parallel.parallelize`, same values on every rank required) or one already split with
    ``first_reduces_input_grad=False``. ``ddp_average``: the features' gradients are averaged over ranks
    (DDP); the activations' gradients are then scaled by ``K`` so that the average is the global batch's
    gradient. ``pair``: the classifier's linear layers split in column/row pairs (fewer transfers;
    :func:`lowbit.parallel.parallelize`).

    ``graph=True`` (CUDA): the classifier's step (the labels' and activations' gathers, the classifier's
    forward and backward with their transfers, the activation gradients' reduce-scatter) is captured
    once per input shape into a CUDA graph, after two eager warm-up runs on a side stream, and replayed
    every step: one launch instead of the hundreds of kernel launches and collective calls whose host
    time bounds the step (docs/parallel.md "Speed"). The same arithmetic as eager, dropout masks
    included (drawn before each replay with the eager seeds), gradients accumulated as eagerly when not
    zeroed. A graph is kept per input shape, loss function object, train/eval mode, codec, dropout
    probability and set of trainable parameters (at most :data:`MAX_GRAPHS`; beyond, eager). Needs
    deterministic codecs (stochastic rounding would replay the captured seeds), no ``update_each``, no
    autocast; every rank must see the same shapes in the same order. Ignored off CUDA and on one rank.
    """

    def __init__(self, features: nn.Module, classifier: nn.Sequential, comm: ParallelComm | None = None,
                 sub_batches: int = 1, update_each: bool = False, ddp_average: bool = True, seed: int = 0,
                 pair: bool = False, graph: bool = False) -> None:
        super().__init__()
        if not isinstance(sub_batches, int) or isinstance(sub_batches, bool) or sub_batches < 1:
            raise ValueError(f"sub_batches must be a positive int, got {sub_batches!r}")
        self.comm = comm if comm is not None else ParallelComm()
        if graph:
            if update_each:
                raise ValueError("Hybrid(graph=True) cannot update the classifier after each sub-batch "
                                 "(update_each=True): the optimiser's step is outside the captured graph")
            for c in (self.comm.codec, self.comm.grad_codec):
                if c.stochastic:  # type: ignore[union-attr]
                    raise ValueError(f"Hybrid(graph=True) needs deterministic codecs: {c.spec} rounds "  # type: ignore[union-attr]
                                     "stochastically, and a captured graph would replay one seed every step")
        self.features = features
        split = any(hasattr(m, "comm") for m in classifier)
        self.classifier = classifier if split else parallelize(classifier, self.comm, first_reduces_input_grad=False,
                                                                seed=seed, pair=pair)
        self.sub_batches, self.update_each, self.ddp_average = sub_batches, update_each, ddp_average
        self.graph = graph
        self._dropouts = [m for m in self.classifier.modules() if isinstance(m, SharedDropout)]
        self._graphs: dict[tuple, _Captured] = {}
        self._warned = False

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

    def _classifier_step(self, det: torch.Tensor, labels_of: Callable[[], torch.Tensor],
                         loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                         opt_classifier: torch.optim.Optimizer | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Steps 2-3 of the module doc on this rank's features ``det``: the global batch's mean loss and
        the gradient of this rank's rows (summed over ranks; before the ``K`` of ``ddp_average``)."""
        rank, k = self.comm.world
        comm = self.comm
        b = det.shape[0]
        s = min(self.sub_batches, b)
        sizes = part_sizes(b, s)
        starts = [sum(sizes[:i]) for i in range(s)]
        futs = [all_gather(det.narrow(0, lo, n).contiguous(), comm.codec, comm.group, dim=0,
                           seed=comm.step * 1_009 + i, stats=comm.stats, async_op=True)
                for i, (lo, n) in enumerate(zip(starts, sizes))]
        labels = labels_of()
        total = torch.zeros((), dtype=torch.float32, device=det.device)
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
        return total, g  # type: ignore[return-value]

    def _graphed_step(self, det: torch.Tensor, y: torch.Tensor,
                      loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`_classifier_step` replayed from a CUDA graph (captured on the first call of a shape)."""
        comm = self.comm
        key = (tuple(det.shape), det.dtype, tuple(y.shape), y.dtype, loss_fn, self.training, self.sub_batches,
               comm.codec.spec, comm.grad_codec.spec, tuple(d.p for d in self._dropouts),  # type: ignore[union-attr]
               tuple(p.requires_grad for p in self.classifier.parameters()))
        cap = self._graphs.get(key)
        if cap is None:
            if len(self._graphs) >= MAX_GRAPHS:  # a new loss function or shape every step: stay eager
                if not self._warned:
                    self._warned = True
                    warnings.warn(f"lowbit.parallel.Hybrid(graph=True): {MAX_GRAPHS} CUDA graphs captured "
                                  "already (one per input shape, loss function, mode and codec); new ones run "
                                  "eagerly. Pass the same loss function object every step.", RuntimeWarning,
                                  stacklevel=3)
                return self._classifier_step(det, self._labels(y), loss_fn, None)
            if torch.is_autocast_enabled("cuda"):
                raise RuntimeError("Hybrid(graph=True) under torch.autocast: the autocast cache would hold "
                                   "the captured weights' casts past the graph; use graph=False")
            with torch.cuda.device(det.device):
                cap = self._graphs[key] = _Captured.capture(self, det, y, loss_fn)
        return cap.replay(self, det, y)

    def train_step(self, x: torch.Tensor, y: torch.Tensor, loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                   opt_features: torch.optim.Optimizer | None = None,
                   opt_classifier: torch.optim.Optimizer | None = None) -> torch.Tensor:
        """One step on the local batch ``(x, y)`` (the same size on every rank); returns the global batch's
        mean loss (a 0-d tensor, the same on every rank). Steps the optimisers given (and zeroes their
        gradients first); without them the gradients are left in ``.grad``."""
        rank, k = self.comm.world
        for opt in (opt_features, opt_classifier):
            if opt is not None:
                opt.zero_grad(set_to_none=True)
        graphed = self.graph and x.is_cuda and k > 1
        labels_of = None if graphed else self._labels(y)  # issued first: they cross while the features compute
        feats = self.features(x)
        det = feats.detach()
        if graphed:
            total, g = self._graphed_step(det, y, loss_fn)
        else:
            total, g = self._classifier_step(det, labels_of, loss_fn, opt_classifier)  # type: ignore[arg-type]
        if self.ddp_average and k > 1:
            g = g * k
        feats.backward(g.to(feats.dtype))
        if opt_classifier is not None and not self.update_each:
            opt_classifier.step()
        if opt_features is not None:
            opt_features.step()
        self.comm.step += 1
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
        return (f"sub_batches={self.sub_batches}, update_each={self.update_each}, graph={self.graph}, "
                f"codec={self.comm.codec.spec}")  # type: ignore[union-attr]


class _Captured:
    """One shape's CUDA graph of :meth:`Hybrid._classifier_step`: its static inputs (this rank's
    features and labels) and outputs (loss, gradient of this rank's rows, the classifier's gradients),
    the dropout modules whose masks are drawn before each replay, and what one step adds to the
    byte counters (the captured collectives count once, at capture; each replay adds them again)."""

    def __init__(self) -> None:
        self.graph: torch.cuda.CUDAGraph | None = None
        self.det = self.y = self.total = self.g = torch.empty(0)
        self.grads: list[tuple[nn.Parameter, torch.Tensor]] = []
        self.masks: list[tuple[SharedDropout, list[torch.Tensor]]] = []
        self.calls = self.bytes = 0

    @classmethod
    def capture(cls, h: Hybrid, det: torch.Tensor, y: torch.Tensor,
                loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> "_Captured":
        """Warm up, capture and check that every rank captured (``det``'s device current)."""
        cap = cls()
        stats = h.comm.stats
        if stats is not None and stats.timing:
            raise ValueError("Hybrid(graph=True) cannot time the transfers' phases (CommStats.timing "
                             "synchronises the device, which a CUDA graph capture forbids)")
        cap.det, cap.y = det.clone(), y.clone()
        drops = h._dropouts
        params = [p for p in h.classifier.parameters() if p.requires_grad]
        # Warm up on a side stream: kernels compiled, plans agreed between the ranks, communicators and
        # cuBLAS workspaces made; the first run records the dropout calls.
        side = torch.cuda.Stream(det.device)
        side.wait_stream(torch.cuda.current_stream(det.device))
        calls: dict[SharedDropout, list] = {d: [] for d in drops}
        with torch.cuda.stream(side):
            for i in range(2):
                for d in drops:
                    d._record, d._step = (calls[d] if i == 0 else None), -1
                h._classifier_step(cap.det, h._labels(cap.y), loss_fn, None)
        torch.cuda.current_stream(det.device).wait_stream(side)
        for d in drops:  # (the second warm-up stopped the recording)
            bufs = [torch.empty(shape, dtype=torch.bool, device=dev) for shape, dev in calls[d]]
            if bufs:
                cap.masks.append((d, bufs))
        for d, bufs in cap.masks:
            d._static, d._gcall = bufs, 0
        for p in params:
            p.grad = None  # the captured backward then writes its gradients into buffers of its own
        c0, b0 = (stats.calls, stats.bytes_sent) if stats is not None else (0, 0)
        cap.graph = torch.cuda.CUDAGraph()
        error: BaseException | None = None
        try:
            # thread_local: NCCL's watchdog thread may query its events while the capture runs
            with torch.cuda.graph(cap.graph, capture_error_mode="thread_local"):
                cap.total, cap.g = h._classifier_step(cap.det, h._labels(cap.y), loss_fn, None)
        except Exception as exc:  # noqa: BLE001 — every rank learns of it below
            error = exc
        finally:
            for d in drops:
                d._static = None
            if stats is not None:
                cap.calls, cap.bytes = stats.calls - c0, stats.bytes_sent - b0
                stats.calls, stats.bytes_sent = c0, b0  # nothing was sent at capture
        # A capture that failed on one rank must fail on all: the others would replay collectives the
        # failed one never joins (an eager all-reduce of the outcome, once per capture).
        ok = torch.tensor([0.0 if error is not None else 1.0], device=det.device)
        torch.distributed.all_reduce(ok, op=torch.distributed.ReduceOp.MIN, group=h.comm.group)
        if error is not None:
            raise RuntimeError("lowbit.parallel.Hybrid(graph=True): capturing the classifier's step failed "
                               "on this rank") from error
        if ok.item() < 1.0:
            raise RuntimeError("lowbit.parallel.Hybrid(graph=True): capturing the classifier's step failed on "
                               "another rank (see its error); use graph=False")
        cap.grads = [(p, p.grad) for p in params if p.grad is not None]
        return cap

    def replay(self, h: Hybrid, det: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        with torch.cuda.device(det.device):
            self.det.copy_(det)
            self.y.copy_(y)
            for d, bufs in self.masks:
                d._fill(bufs)
            # gradients not zeroed since the last step accumulate, as eagerly (the graph overwrites its
            # buffers: one that still holds the last step's gradient is kept aside first)
            before = [(p, None if p.grad is None else p.grad.clone() if p.grad is g else p.grad)
                      for p, g in self.grads]
            self.graph.replay()  # type: ignore[union-attr]
            if h.comm.stats is not None:
                h.comm.stats.calls += self.calls
                h.comm.stats.bytes_sent += self.bytes
            for (p, prev), (_, g) in zip(before, self.grads):
                p.grad = g if prev is None else prev.add_(g)
            return self.total.clone(), self.g
