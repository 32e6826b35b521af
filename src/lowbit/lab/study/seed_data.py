"""Numbers from the seed study (Grubic, Tam, Alistarh, Zhang, EDBT 2018) that the study compares with.

* :data:`FIG4_BATCH` — Figure 4, the *global* minibatch per network and number of GPUs (CNTK's
  minibatch is the global one: "at 8 GPUs, the batch for VGG19 consists of just 16 images" = 128 / 8).
  :func:`fig4_batch_per_worker` divides by the number of GPUs to get the per-worker size a run uses.
* :data:`FIG10_MPI` / :data:`FIG11_NCCL` — samples per second on the 16-GPU EC2 p2.16xlarge (K80s)
  with MPI reduce-and-broadcast and with NCCL allreduce, per precision and number of GPUs. ``None``
  is the seed's "/" (not run) or an empty cell.
* :data:`SEED_PRECISIONS` — the seed's precision labels with the canonical lowbit codec spec of each.
* :data:`FIG3_RECIPE` — Figure 3, the epochs and initial learning rate (CNTK's defaults, tuned for fp32)
  per network, with the data set it was trained on.

Transcribed from the paper's text; the order of the GPU columns is :data:`GPUS`.
"""

from __future__ import annotations

from lowbit.codecs.base import available_codecs, get_codec

__all__ = [
    "GPUS",
    "FIG3_RECIPE",
    "FIG4_BATCH",
    "FIG10_MPI",
    "FIG11_NCCL",
    "SEED_PRECISIONS",
    "SEED_MACHINE",
    "fig4_batch_per_worker",
    "seed_precision",
    "seed_samples_per_s",
]

GPUS: tuple[int, ...] = (1, 2, 4, 8, 16)

#: Figure 3: (epochs, initial learning rate, data set) per network (lowbit model names). The paper gives
#: no schedule beyond the initial rate (CNTK's per-network defaults); the study's lr_schedule applies.
FIG3_RECIPE: dict[str, tuple[int, float, str]] = {
    "alexnet": (112, 0.07, "ImageNet"),
    "bn_inception": (300, 3.6, "ImageNet"),
    "resnet50": (120, 1.0, "ImageNet"),
    "resnet110": (160, 0.1, "CIFAR-10"),
    "resnet152": (120, 1.0, "ImageNet"),
    "vgg19": (80, 0.1, "ImageNet"),
    "lstm": (20, 0.5, "AN4"),
}

#: Figure 4: global batch per network (lowbit model names) for 1, 2, 4, 8, 16 GPUs; None = "NA".
FIG4_BATCH: dict[str, tuple[int | None, ...]] = {
    "alexnet": (256, 256, 256, 256, 256),
    "bn_inception": (64, 128, 256, 256, 256),
    "vgg19": (32, 64, 128, 128, 128),
    "resnet50": (32, 64, 128, 256, 256),
    "resnet152": (16, 32, 64, 128, 256),
    "resnet110": (128, 128, 128, 128, 128),
    "lstm": (16, 16, None, None, None),
}

SEED_MACHINE = "Amazon EC2 p2.16xlarge, 16 x NVIDIA K80 (Kepler), CNTK 2.0 beta 9"

# Seed label, bucket as printed, lowbit spec (canonicalised below).
_PRECISIONS: list[tuple[str, str, str]] = [
    ("32bit", "/", "fp32"),
    ("QSGD 16bit", "8192", "qsgd:bits=16,bucket=8192"),
    ("QSGD 8bit", "512", "qsgd:bits=8,bucket=512"),
    ("QSGD 4bit", "512", "qsgd:bits=4,bucket=512"),
    ("QSGD 2bit", "128", "qsgd:bits=2,bucket=128"),
    ("1bitSGD", "/", "onebit:bucket=0"),
    ("1bitSGD*", "64", "onebit:bucket=64"),
    ("1bitSGD*", "512", "onebit:bucket=512"),
]

#: canonical lowbit spec -> (seed's label, seed's bucket column)
SEED_PRECISIONS: dict[str, tuple[str, str]] = {get_codec(spec).spec: (label, bucket) for label, bucket, spec in _PRECISIONS}

_N = None  # the seed's "/" or an empty cell

# network -> seed label -> samples/s at GPUS. "1bitSGD*|512" keys the 512-bucket row.
FIG10_MPI: dict[str, dict[str, tuple[float | None, ...]]] = {
    "alexnet": {
        "32bit": (240.80, 301.45, 328.00, 272.90, 192.10),
        "QSGD 16bit": (_N, 388.80, 508.80, 500.90, 335.60),
        "QSGD 8bit": (_N, 424.90, 544.60, 739.10, 535.00),
        "QSGD 4bit": (_N, 466.50, 598.70, 964.90, 748.50),
        "QSGD 2bit": (_N, 449.20, 609.15, 1076.50, 889.80),
        "1bitSGD": (_N, 424.05, 564.30, 971.10, 849.40),
        "1bitSGD*": (_N, 370.80, 476.50, 761.20, 712.70),
        "1bitSGD*|512": (_N, _N, _N, _N, _N),
    },
    "resnet50": {
        "32bit": (47.20, 80.80, 142.40, 247.90, 272.30),
        "QSGD 16bit": (_N, 90.20, 156.30, 275.80, 348.70),
        "QSGD 8bit": (_N, 92.60, 162.70, 313.70, 416.80),
        "QSGD 4bit": (_N, 93.90, 165.70, 326.10, 461.20),
        "QSGD 2bit": (_N, 93.30, 178.35, 330.45, 472.25),
        "1bitSGD": (_N, 45.10, 81.70, 160.15, 155.20),
        "1bitSGD*": (_N, 88.10, 156.50, 296.70, 442.40),
    },
    "resnet110": {
        "32bit": (343.70, 555.00, 957.70, 1229.10, 831.60),
        "QSGD 16bit": (_N, 551.00, 942.70, 1164.20, 763.40),
        "QSGD 8bit": (_N, 550.20, 960.10, 1193.10, 759.70),
        "QSGD 4bit": (_N, 571.10, 957.40, 1257.10, 784.30),
        "QSGD 2bit": (_N, 557.20, 973.10, 1227.90, 780.40),
        "1bitSGD": (_N, 465.60, 643.30, 610.90, 406.90),
        "1bitSGD*": (_N, 550.40, 884.80, 1156.70, 757.70),
    },
    "resnet152": {
        "32bit": (16.90, 26.10, 45.00, 73.90, 113.50),
        "QSGD 16bit": (_N, 31.20, 54.50, 95.50, 151.00),
        "QSGD 8bit": (_N, 32.80, 62.70, 109.20, 182.50),
        "QSGD 4bit": (_N, 33.60, 60.20, 121.90, 203.20),
        "QSGD 2bit": (_N, 33.50, 64.35, 123.55, 208.50),
        "1bitSGD": (_N, 10.55, 22.10, 41.40, 63.15),
        "1bitSGD*": (_N, 30.40, 55.50, 108.10, 193.50),
    },
    "vgg19": {
        "32bit": (12.40, 20.40, 36.30, 53.95, 40.60),
        "QSGD 16bit": (_N, 24.80, 46.40, 35.80, 67.80),
        "QSGD 8bit": (_N, 24.20, 47.50, 119.50, 106.60),
        "QSGD 4bit": (_N, 27.00, 52.30, 151.65, 143.80),
        "QSGD 2bit": (_N, 24.60, 49.35, 160.35, 170.50),
        "1bitSGD": (_N, 22.20, 43.15, 117.35, 120.60),
        "1bitSGD*": (_N, 22.90, 44.80, 99.15, 134.30),
    },
    "bn_inception": {
        "32bit": (88.30, 164.80, 316.75, 473.75, 500.40),
        "QSGD 16bit": (_N, 171.80, 337.10, 482.70, 592.30),
        "QSGD 8bit": (_N, 173.60, 342.50, 552.90, 696.30),
        "QSGD 4bit": (_N, 174.80, 346.90, 593.40, 743.30),
        "QSGD 2bit": (_N, 173.40, 343.70, 591.80, 747.50),
        "1bitSGD": (_N, 127.60, 236.25, 336.15, 321.30),
        "1bitSGD*": (_N, 170.30, 335.10, 480.50, 700.40),
    },
}

# Figure 11 (NCCL; the seed reports up to 8 GPUs; low precision there is *simulated* by sending the
# same number of bytes through NCCL's fp32 allreduce).
FIG11_NCCL: dict[str, dict[str, tuple[float | None, ...]]] = {
    "alexnet": {
        "32bit": (240.80, 458.20, 625.00, 1138.30, _N),
        "QSGD 16bit": (_N, 462.80, 632.10, 1157.60, _N),
        "QSGD 8bit": (_N, 458.40, 641.80, 1214.80, _N),
        "QSGD 4bit": (_N, 471.90, 659.40, 1247.70, _N),
        "QSGD 2bit": (_N, 471.00, 661.60, 1229.70, _N),
    },
    "resnet50": {
        "32bit": (47.20, 93.80, 164.80, 291.10, _N),
        "QSGD 16bit": (_N, 93.70, 164.50, 324.20, _N),
        "QSGD 8bit": (_N, 94.00, 165.80, 297.40, _N),
        "QSGD 4bit": (_N, 95.60, 167.90, 298.40, _N),
        "QSGD 2bit": (_N, 95.50, 168.20, 304.10, _N),
    },
    "resnet152": {
        "32bit": (16.90, 33.60, 60.10, 112.10, _N),
        "QSGD 16bit": (_N, 33.40, 59.80, 112.20, _N),
        "QSGD 8bit": (_N, 33.70, 60.80, 115.10, _N),
        "QSGD 4bit": (_N, 34.20, 62.10, 118.70, _N),
        "QSGD 2bit": (_N, 34.30, 62.20, 119.90, _N),
    },
    "vgg19": {
        "32bit": (12.40, 24.90, 48.70, 163.10, _N),
        "QSGD 16bit": (_N, 24.90, 49.10, 168.00, _N),
        "QSGD 8bit": (_N, 25.50, 50.50, 175.20, _N),
        "QSGD 4bit": (_N, 25.60, 51.00, 179.50, _N),
        "QSGD 2bit": (_N, 25.60, 51.10, 177.80, _N),
    },
    "bn_inception": {
        "32bit": (88.30, 173.30, 342.00, 486.70, _N),
        "QSGD 16bit": (_N, 174.30, 342.70, 497.10, _N),
        "QSGD 8bit": (_N, 174.50, 345.30, 510.10, _N),
        "QSGD 4bit": (_N, 178.60, 349.00, 598.90, _N),
        "QSGD 2bit": (_N, 177.20, 349.00, 608.20, _N),
    },
}


def fig4_batch_per_worker(network: str, world_size: int) -> int:
    """Figure 4's global batch for ``network`` at ``world_size`` GPUs, divided by the GPUs."""
    if network not in FIG4_BATCH:
        raise ValueError(
            f"batch preset 'fig4': network {network!r} is not in the seed's Figure 4 "
            f"(it has {', '.join(sorted(FIG4_BATCH))})"
        )
    if world_size not in GPUS:
        raise ValueError(f"batch preset 'fig4': Figure 4 has no column for {world_size} GPUs (it has {list(GPUS)})")
    total = FIG4_BATCH[network][GPUS.index(world_size)]
    if total is None:
        raise ValueError(f"batch preset 'fig4': Figure 4 gives no batch for {network} on {world_size} GPUs (NA)")
    if total % world_size:
        raise ValueError(f"batch preset 'fig4': {total} samples do not split over {world_size} workers")
    return total // world_size


def seed_precision(codec_spec: str) -> tuple[str, str]:
    """The seed's (precision label, bucket) of a codec spec; ("", "") when the seed has none, and for a
    study entry that is not a lowbit codec (the study's "auto" at any level, a choice rather than a codec;
    PyTorch's hooks)."""
    if codec_spec.partition(":")[0].strip().lower() not in available_codecs():
        return "", ""
    return SEED_PRECISIONS.get(get_codec(codec_spec).spec, ("", ""))


def seed_samples_per_s(network: str, codec_spec: str, world_size: int, backend: str) -> tuple[float | None, str]:
    """The seed's samples/s for a setting, and which figure it comes from ('' when none).

    ``gloo`` and ``mpi`` map to the MPI table (Figure 10: CPU-staged point-to-point, like gloo), ``nccl``
    to Figure 11.
    """
    label, bucket = seed_precision(codec_spec)
    if not label or world_size not in GPUS:
        return None, ""
    if label == "1bitSGD*" and bucket == "512":
        label = "1bitSGD*|512"
    table, fig = (FIG11_NCCL, "Figure 11 (NCCL)") if backend == "nccl" else (FIG10_MPI, "Figure 10 (MPI)")
    row = table.get(network, {}).get(label)
    if row is None:
        return None, ""
    value = row[GPUS.index(world_size)]
    return value, (fig if value is not None else "")
