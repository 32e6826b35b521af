"""Where the host time of one lowbit all_gather goes (sections of lowbit.comm.gather.all_gather timed
inline on the launching thread, no device sync), beside a raw NCCL all-gather.

    torchrun --nproc-per-node 2 benchmarks/experiments/host_sections.py
"""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist

from lowbit.codecs.base import get_codec
from lowbit.comm import collectives as C
from lowbit.comm import gather as G
from lowbit.comm.allreduce import _framed, _keep, _slot

D8 = "dettmers:type=dynamic,bucket=0"


def main() -> None:
    dist.init_process_group("nccl")
    rank, k = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    dev = torch.device("cuda")
    x = torch.randn(64, 9216, device=dev).relu()
    for spec in ("fp32", D8):
        codec = get_codec(spec)
        acc: dict[str, float] = {}
        reps = 200

        def tick(name: str, t: list[float]) -> None:
            now = time.perf_counter()
            acc[name] = acc.get(name, 0.0) + now - t[0]
            t[0] = now

        for it in range(reps + 10):
            if it == 10:
                acc.clear()
                torch.cuda.synchronize()
            t = [time.perf_counter()]
            codec_, d, r, kk, sizes = G._check(x, codec, None, 0, None, "all_gather")
            tick("check", t)
            G._agree(None, "all_gather", (codec.spec, d, tuple(sizes), G._shape(x.shape, d, -1), str(x.dtype)))
            tick("agree", t)
            shapes = [G._shape(x.shape, d, s) for s in sizes]
            slots = [_slot(codec, G._numel(s), G._codec_shape(codec, s)) for s in shapes]
            width = max(size for _, size in slots)
            lead, _ = slots[rank]
            tick("slots", t)
            payload = G._encode(codec, x, 7)
            tick("encode", t)
            send = _framed([(lead, payload, width)], dev)
            tick("framed", t)
            out = torch.empty(G._shape(x.shape, d, sum(sizes)), dtype=x.dtype, device=dev)
            recv = torch.empty(kk * width, dtype=torch.uint8, device=dev)
            tick("empties", t)
            work = C.all_gather_async(recv, send, None)
            tick("nccl issue", t)

            def finish() -> torch.Tensor:
                t2 = [time.perf_counter()]
                _keep(recv)
                _keep(out)
                tick("cb keep", t2)
                at = 0
                for rr, (s, (ld, _)) in enumerate(zip(sizes, slots)):
                    nb = codec.nbytes(G._numel(shapes[rr]), G._codec_shape(codec, shapes[rr]))
                    G._decode_into(codec, recv[rr * width + ld: rr * width + ld + nb], out.narrow(d, at, s))
                    at += s
                tick("cb decode", t2)
                return out

            fut = C.then(work, finish, "all_gather_into_tensor", None)
            tick("then (incl. callback)", t)
            C.wait(fut, "all_gather_into_tensor", None)
            tick("wait", t)
        torch.cuda.synchronize()
        if rank == 0:
            print(f"== {spec}: host us per call by section")
            for name, v in acc.items():
                print(f"  {name:24s} {v / reps * 1e6:8.1f}")
            print(f"  {'total':24s} {sum(v for kk2, v in acc.items() if not kk2.startswith('cb')) / reps * 1e6:8.1f}")
    # raw pieces
    buf = torch.empty(1 << 20, dtype=torch.uint8, device=dev)
    rb = torch.empty(k << 20, dtype=torch.uint8, device=dev)
    for name, fn in {
        "raw all_gather issue": lambda: dist.all_gather_into_tensor(rb, buf, async_op=True),
        "raw all_gather + get_future().then(id)": lambda: dist.all_gather_into_tensor(rb, buf, async_op=True).get_future().then(lambda f: rb),
        "raw + then + wait": lambda: dist.all_gather_into_tensor(rb, buf, async_op=True).get_future().then(lambda f: rb).wait(),
        "torch.empty": lambda: torch.empty(1000, device=dev),
        "record_stream": lambda: buf.record_stream(torch.cuda.current_stream()),
    }.items():
        for _ in range(10):
            fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(200):
            fn()
        h = (time.perf_counter() - t0) / 200
        torch.cuda.synchronize()
        if rank == 0:
            print(f"  {name:40s} {h * 1e6:8.1f} us")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
