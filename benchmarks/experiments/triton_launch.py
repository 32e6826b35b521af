"""Host cost of one Triton launch on this machine: the JIT path (``kernel[grid](...)``: binding,
specialisation key, cache lookup) against calling the cached compiled kernel's launcher directly, and
against one torch op. Also prints the Triton version and checks the direct launch computes the same."""

from __future__ import annotations

import time

import torch
import triton
import triton.language as tl
from triton import knobs


@triton.jit
def _k(x_ptr, y_ptr, n, A: tl.constexpr, B: tl.constexpr, C: tl.constexpr, D: tl.constexpr, E: tl.constexpr,
       F: tl.constexpr, G: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    o = pid * BLOCK + tl.arange(0, BLOCK)
    m = o < n
    v = tl.load(x_ptr + o, mask=m)
    tl.store(y_ptr + o, v * (A + B + C + D + E + F + G), mask=m)


def main() -> None:
    print("triton", triton.__version__)
    x = torch.randn(1 << 16, device="cuda")
    y = torch.empty_like(x)
    n = x.numel()
    kw = dict(A=1, B=0, C=0, D=0, E=0, F=0, G=0, BLOCK=1024)
    kern = _k[(n // 1024,)](x, y, n, **kw)
    torch.cuda.synchronize()
    reps = 2000

    def jit() -> None:
        _k[(n // 1024,)](x, y, n, **kw)

    dev = triton.runtime.driver.active.get_current_device()
    get_stream = triton.runtime.driver.active.get_current_stream
    allargs = (x, y, n, 1, 0, 0, 0, 0, 0, 0, 1024)

    def direct() -> None:
        kern.run(n // 1024, 1, 1, get_stream(dev), kern.function, kern.packed_metadata, None,
                 knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook, *allargs)

    def torch_op() -> None:
        torch.mul(x, 2.0, out=y)

    for name, fn in (("jit launch", jit), ("direct launch", direct), ("torch op", torch_op)):
        try:
            for _ in range(20):
                fn()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(reps):
                fn()
            h = (time.perf_counter() - t0) / reps
            torch.cuda.synchronize()
            print(f"{name:16s} {h * 1e6:7.1f} us host per launch")
        except Exception as exc:  # noqa: BLE001
            print(f"{name:16s} FAILED {exc!r}"[:300])
    y.zero_()
    try:
        direct()
        torch.cuda.synchronize()
        print("direct launch correct:", torch.equal(y, x))
    except Exception as exc:  # noqa: BLE001
        print("direct FAILED", repr(exc)[:300])


if __name__ == "__main__":
    main()
