"""Speed model of low-precision gradient communication (docs/perfmodel.md).

    from lowbit.lab.perfmodel import Cluster, predict_network
    pred = predict_network("vgg19", Cluster(64, 8, "nvlink", "100gbit"), batch_per_gpu=64,
                           device_tflops=100, codec="qsgd:bits=4,bucket=512")
    pred.step_s, pred.samples_per_s, pred.scaling_efficiency, pred.speedup_vs_fp32, pred.breakdown

Modules: ``links``, ``collectives``, ``model`` (the step timeline), ``networks``, ``calibrate`` and ``fit``
(parameters from measurements), ``validate``, ``advise``, ``dettmers`` and ``projection`` (the papers' models).
The commands are :mod:`lowbit.lab.cli.predict` and :mod:`lowbit.lab.cli.advise`.
"""

from __future__ import annotations

from lowbit.lab.perfmodel.calibrate import Calibration, fit_link
from lowbit.lab.perfmodel.fit import calibrate
from lowbit.lab.perfmodel.collectives import CommCost, Topology, collective, modeled_algorithms
from lowbit.lab.perfmodel.links import PRESETS, Link, parse_link
from lowbit.lab.perfmodel.model import (Breakdown, Cluster, Layer, LayerCodec, Prediction, bits_per_value,
                                    predict, predict_network)
from lowbit.lab.perfmodel.networks import NETWORKS, Network, get_network
from lowbit.lab.perfmodel.projection import projected_speedup, speedup_bound

__all__ = ["Breakdown", "Calibration", "Cluster", "CommCost", "Layer", "LayerCodec", "Link", "NETWORKS",
           "Network", "PRESETS", "Prediction", "Topology", "bits_per_value", "calibrate", "collective",
           "fit_link", "modeled_algorithms", "get_network", "parse_link", "predict", "predict_network",
           "projected_speedup", "speedup_bound"]

