"""The speed model's validation of runs as emulated nodes (issue 15): a study row as 2 nodes is modelled
with the links its group measured (intra, inter), its layout's own algorithms' formulas, and no fitted link."""

from __future__ import annotations

import dataclasses
import math

from lowbit.lab.perfmodel.calibrate import Calibration
from lowbit.lab.perfmodel.fit import model_step
from lowbit.lab.study.records import RunRecord

BASE = RunRecord(
    key="k", network="vgg19", dataset="synthetic", batch=64, world=4, backend="nccl", device="cuda",
    codec="fp32", algorithm="allreduce", error_feedback=False, seed=0, synthetic=True, params=143_667_240,
    compressed_params=143_652_544, step_s=0.1, compute_s=0.06, exposed_s=0.0, encode_s=0.0, comm_s=0.0,
    decode_s=0.0, bytes_per_step=0.0, samples_per_s=0.0, final_test_acc=math.nan, epochs=3, lr=0.01,
    nodes=2, intra_Bps=277e9, inter_Bps=3.46e9)
CAL = Calibration(compute_at_world={"vgg19|synthetic|64|nccl|cuda|4": {"step_s": 0.06, "runs": 1}})


def _step(**kw: object) -> float:
    m = model_step(dataclasses.replace(BASE, **kw), CAL)
    assert not isinstance(m, str), m
    assert "measured links (intra" in m[3]
    return m[0]


def test_emulated_nodes_use_the_measured_links() -> None:
    m = model_step(BASE, CAL)
    assert not isinstance(m, str) and "measured links (intra 277 GB/s, inter 3.46 GB/s)" in m[3]
    fp32 = _step()
    flat4 = _step(codec="qsgd:bits=4,bucket=512,norm=max,rounding=stochastic", algorithm="scatter_gather")
    hier4 = _step(codec="qsgd:bits=4,bucket=512,norm=max,rounding=stochastic", algorithm="hierarchical")
    # 575 MB of fp32 gradients over 3.46 GB/s sockets dwarf the 60 ms of compute; 4 bits cut it; only
    # the 1/2 shard crossing nodes cuts it further
    assert fp32 > 0.2 and hier4 < flat4 < fp32
    # the same run inside one fast node: far quicker than across the slow link
    one_node = _step(inter_Bps=277e9)
    assert one_node < 0.07 and one_node < fp32 / 4  # (about the 60 ms of compute)
    # without the measured links, no prediction (and it says why)
    why = model_step(dataclasses.replace(BASE, inter_Bps=math.nan), CAL)
    assert isinstance(why, str) and "without the links it measured" in why
    # one rank a node: no intra link is needed
    assert model_step(dataclasses.replace(BASE, world=2, nodes=2, intra_Bps=math.nan),
                      Calibration(compute_at_world={"vgg19|synthetic|64|nccl|cuda|2": {"step_s": 0.06, "runs": 1}}))
