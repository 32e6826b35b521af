"""GPU time (graph-timed, cold L2) of the codec steps of one FSDP2 gpt_350m block's call, 2 ranks:
8-bit QSGD encode of a shard row, decode into float32, decode into float32 then cast to bf16, the
fp32 sum of two bf16 rows (bf16_r16's reduce), and a copy of the same bytes. Diagnostic for issue 41."""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))
from gputime import graph_ms  # noqa: E402

from lowbit.codecs.base import get_codec  # noqa: E402

dev = torch.device("cuda")
s = int(sys.argv[1]) if len(sys.argv) > 1 else 6_300_000
c = get_codec("qsgd:bits=8,bucket=512")
x = torch.randn(s, device=dev)
xb = x.bfloat16()
pay = c.encode(x)
out = torch.empty(s, device=dev)
outb = torch.empty(s, device=dev, dtype=torch.bfloat16)
a, b = torch.randn(s, device=dev).bfloat16(), torch.randn(s, device=dev).bfloat16()
rows = {
    "copy fp32 (s)": lambda: out.copy_(x),
    "encode q8 from fp32": lambda: c.encode(x),
    "encode q8 from bf16": lambda: c.encode(xb),
    "decode q8 -> fp32": lambda: c.decode(pay, s, out=out),
    "decode q8 -> fp32 -> bf16": lambda: outb.copy_(c.decode(pay, s, out=out)),
    "cast fp32 -> bf16": lambda: outb.copy_(out),
    "decode_sum q8 (1 payload)": lambda: c.decode_sum([pay], s, out=out),
    "fp32 = bf16 + bf16 (copy, add_)": lambda: out.copy_(a).add_(b),
    "fp32 = a.float() + b": lambda: torch.add(a.float(), b, out=out),
}
for name, fn in rows.items():
    print(f"{graph_ms(fn) * 1e3:9.1f} us  {name}")
