"""codec="auto"'s DDP timeline on a GPU: the end of the backward pass is the autograd engine's callback,
marked on the stream the gradient hooks ran on, after every kernel of the backward (the CPU case is
tests/distributed/test_auto_fastlink.py's emulated test)."""

from __future__ import annotations

import types

import pytest
import torch
from torch import nn

from lowbit.auto.clock import DeviceClock
from lowbit.auto.ddp_tuner import AutoTuner

pytestmark = pytest.mark.gpu

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


class _SlowInput(torch.autograd.Function):
    """A backward node after every parameter's gradient: a long chain of kernels on the input's grad."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        for _ in range(200):
            g = torch.tanh(g @ torch.eye(g.shape[-1], device=g.device)) + 0
        return g


@needs_cuda
def test_the_backward_end_is_marked_after_the_last_node_on_the_hooks_stream() -> None:
    dev = torch.device("cuda")
    clock = DeviceClock(dev)
    fake = types.SimpleNamespace(_clock=lambda: clock)
    net = nn.Sequential(nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 512)).to(dev)
    for side in (False, True):  # the default stream, and a side stream the user trains on
        stream = torch.cuda.Stream(dev) if side else torch.cuda.current_stream(dev)
        rec: dict = {"grads": []}

        def hook(p: torch.Tensor) -> None:
            rec["grads"].append(clock.mark())
            if "end" not in rec:
                rec["end"] = None
                AutoTuner._queue_end_mark(fake, rec, p.device)

        with torch.cuda.stream(stream):  # warm up first: the first backward's cuBLAS setup would dwarf the chain
            net(_SlowInput.apply(torch.randn(4096, 512, device=dev, requires_grad=True))).square().mean().backward()
        torch.cuda.synchronize()
        handles = [p.register_post_accumulate_grad_hook(hook) for p in net.parameters()]
        with torch.cuda.stream(stream):
            x = torch.randn(4096, 512, device=dev, requires_grad=True)
            start = clock.mark()
            net(_SlowInput.apply(x)).square().mean().backward()
            after = clock.mark()
        for h in handles:
            h.remove()
        torch.cuda.synchronize()
        last_grad = max(clock.elapsed(start, m) for m in rec["grads"])
        end, total = clock.elapsed(start, rec["end"]), clock.elapsed(start, after)
        # the slow input node runs after the last gradient: the end mark comes after it, with the stream
        assert end > last_grad * 1.5, (side, last_grad, end, total)
        assert end <= total + 1e-4, (side, end, total)
