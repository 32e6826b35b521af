"""Speed model of low-precision gradient communication (docs/perfmodel.md).

    from lowbit.perfmodel import Cluster, predict_network
    pred = predict_network("vgg19", Cluster(64, 8, "nvlink", "100gbit"), batch_per_gpu=64,
                           device_tflops=100, codec="qsgd:bits=4,bucket=512")
    pred.step_s, pred.samples_per_s, pred.scaling_efficiency, pred.speedup_vs_fp32, pred.breakdown

Modules: ``links`` (alpha-beta links and presets), ``collectives`` (time and bytes of each algorithm),
``model`` (step-time timeline with overlap), ``calibrate`` (fit a link to measured timings),
``dettmers`` (Dettmers' 4-GPU and 96-GPU models), ``projection`` (the seed's Figure 16 projection),
``networks`` (the seed's networks as parameters and FLOPs), ``cli`` (``lowbit predict``).
"""

from __future__ import annotations

from lowbit.perfmodel.calibrate import fit_link
from lowbit.perfmodel.codecbits import bits_per_value
from lowbit.perfmodel.collectives import ALGORITHMS, CommCost, Topology, collective
from lowbit.perfmodel.links import PRESETS, Link, parse_link
from lowbit.perfmodel.model import Breakdown, Cluster, Layer, Prediction, predict, predict_network
from lowbit.perfmodel.networks import NETWORKS, Network, get_network
from lowbit.perfmodel.projection import projected_speedup, speedup_bound

__all__ = [
    "ALGORITHMS",
    "Breakdown",
    "Cluster",
    "CommCost",
    "Layer",
    "Link",
    "NETWORKS",
    "Network",
    "PRESETS",
    "Prediction",
    "Topology",
    "bits_per_value",
    "collective",
    "fit_link",
    "get_network",
    "parse_link",
    "predict",
    "predict_network",
    "projected_speedup",
    "speedup_bound",
]
