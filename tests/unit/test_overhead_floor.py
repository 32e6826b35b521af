"""The codecs' memory-traffic floor (lowbit.lab.perfmodel.overhead.codec_floor_bytes): the formula's parts."""

from __future__ import annotations

import pytest

from lowbit.lab.perfmodel.overhead import codec_floor_bytes, codec_floor_ms


def test_fsdp_floor_counts_each_read_and_write_once() -> None:
    n, k = 1000, 2  # S = 500
    # gradients at 8 bits: encode 1 row (read 4 B, write 1 B a value), decode 1 row (read 1 B), own row
    # read (4 B), shard written (4 B)
    assert codec_floor_bytes("fsdp", n, k, 8) == 500 * 5 + 500 * 1 + 500 * 4 + 500 * 4
    # parameters at 8 bits, bf16: twice (encode the shard: 2 + 1 B; decode 2 rows: 1 + 2 B a value)
    assert codec_floor_bytes("fsdp", n, k, None, 8) == 2 * (500 * 3 + 2 * 500 * 3)


def test_fewer_bits_less_traffic_and_ddp_scales_with_ranks() -> None:
    assert codec_floor_bytes("fsdp", 10**6, 4, 4, 4) < codec_floor_bytes("fsdp", 10**6, 4, 8, 8)
    assert codec_floor_bytes("ddp", 10**6, 4, 8) > codec_floor_bytes("ddp", 10**6, 2, 8)
    assert codec_floor_ms("ddp", 10**9, 2, 8, hbm_gbps=1000.0) == pytest.approx(
        (10**9 * 5 + 2 * 10**9 + 10**9 * 4) / 1e12 * 1e3)
    with pytest.raises(ValueError, match="mode"):
        codec_floor_bytes("tp", 1, 1, 8)
