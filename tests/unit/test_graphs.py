"""lowbit.comm.graphs on CPU: where a call may be captured, and the eager path it keeps elsewhere.
(The replays themselves run on a GPU: tests/gpu/test_fsdp_graphs.py, bit-identical to the eager path.)"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from lowbit.codecs.base import get_codec
from lowbit.comm import graphs
from lowbit.kernels import dispatch


def test_cpu_calls_and_the_switch_are_never_captured(monkeypatch):
    assert not graphs.capturable(torch.device("cpu"), [None])
    monkeypatch.setenv("LOWBIT_CUDA_GRAPHS", "0")
    assert not graphs.enabled()
    assert not graphs.capturable(torch.device("cuda", 0), [None])
    monkeypatch.setenv("LOWBIT_CUDA_GRAPHS", "1")
    assert graphs.enabled()


def test_a_gloo_group_is_not_capturable(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/rdv", rank=0, world_size=1)
    try:
        assert not graphs.capturable(torch.device("cuda", 0), [dist.group.WORLD])
    finally:
        dist.destroy_process_group()


def test_an_eager_signature_runs_its_function_on_the_callers_tensors():
    """Graphs.run on CPU tensors stays eager for good (WARM calls, then a failed capture or none)."""
    g = graphs.Graphs("test")
    seen = []

    def fn(ins, outs, seeds):
        outs[0].copy_(ins[0] * 2)
        seeds_now = [int(s) if isinstance(s, int) else int(s.item()) for s in seeds]
        seen.append(seeds_now)

    x, y = torch.arange(4.0), torch.empty(4)
    g.run("k", fn, [x], [y], keyed=False)
    assert torch.equal(y, x * 2) and g.replays == 0
    g.run("s", fn, [x], [y], seeds=[5, 6], keyed=False)
    assert seen[-1] == [5, 6]  # a signature whose seeds cannot live on the device passes them as ints


def test_write_keys_holds_the_int32_keys_and_a_key_tensor_is_refused_off_triton():
    keys = dispatch.write_keys(torch.zeros(3, dtype=torch.int32), [0, 1, 2**31 + 5])
    assert keys.tolist() == dispatch.signed_keys([0, 1, 2**31 + 5])
    assert all(-(2**31) <= k < 2**31 for k in keys.tolist())
    with pytest.raises(ValueError, match="device key"):
        get_codec("qsgd:bits=8").encode(torch.randn(10_000), seed=keys[0:1])
