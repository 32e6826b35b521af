"""collectives.join on CPU futures: completes after every input (in any order), with the value computed
then; the first failure fails it. (Its CUDA stream ordering is tested in tests/gpu/test_nccl.py.)"""

from __future__ import annotations

import pytest
import torch

from lowbit.comm import collectives as C

CPU = torch.device("cpu")


def test_join_completes_after_the_last_input_in_any_order() -> None:
    futs = [torch.futures.Future() for _ in range(3)]
    calls = []
    res = C.join(futs, lambda: calls.append(1) or "value", CPU)
    for i in (2, 0):
        futs[i].set_result(i)
        assert not res.done() and not calls
    futs[1].set_result(1)
    assert res.done() and res.value() == "value" and calls == [1]


def test_join_of_nothing_is_complete() -> None:
    assert C.join([], lambda: 7, CPU).value() == 7


def test_join_fails_with_an_input_and_does_not_compute_the_value() -> None:
    futs = [torch.futures.Future() for _ in range(2)]
    res = C.join(futs, lambda: pytest.fail("value() must not run"), CPU)
    futs[0].set_exception(RuntimeError("peer died"))
    assert not res.done()
    futs[1].set_result(None)
    with pytest.raises(RuntimeError, match="peer died"):
        res.wait()


def test_join_passes_on_a_failing_value() -> None:
    fut = torch.futures.Future()
    res = C.join([fut], lambda: 1 / 0, CPU)
    fut.set_result(None)
    with pytest.raises(ZeroDivisionError):
        res.wait()
