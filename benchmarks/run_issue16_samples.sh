#!/usr/bin/env bash
# Issue 16's must-show CPU study: the on-disk loaders (CIFAR-10, ImageNet, AN4) on small files generated
# in exactly their formats (by the tests' writers), RMSProp and the conv-vs-fc sensitivity grid; one
# results directory, one report.   bash benchmarks/run_issue16_samples.sh [OUT]
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
OUT=${1:-benchmarks/results/study_cpu_issue16_samples}
DATA=$(mktemp -d)
PYTHONPATH=src:tests/unit $PY - "$DATA" <<'PYEOF'
import pickle
import sys
from pathlib import Path
import numpy as np
import test_an4_loader as an4
import test_imagenet_loader as imnet
root = Path(sys.argv[1])
# CIFAR-10's python batches, with images a network can learn: a class colour plus noise
rng = np.random.default_rng(0)
colours = rng.integers(0, 256, (10, 3))
def batch(n):
    y = rng.integers(0, 10, n)
    x = np.clip(colours[y][:, :, None] + rng.normal(0, 40, (n, 3, 1024)), 0, 255).astype(np.uint8)
    return {b"labels": y.tolist(), b"data": x.reshape(n, 3072), b"batch_label": b"sample"}
(root / "cifar10").mkdir(parents=True)
for i in range(1, 6):
    pickle.dump(batch(40), open(root / "cifar10" / f"data_batch_{i}", "wb"), protocol=2)
pickle.dump(batch(100), open(root / "cifar10" / "test_batch", "wb"), protocol=2)
imnet._make(root / "imagenet", per_class=40, val_per_class=10)
an4.UTTS = {"train": [(f"an4_clstk/spk{i % 3}/utt{i}-spk{i % 3}-b", w) for i, w in enumerate(
    ["YES", "NO", "GO", "STOP", "RUBOUT G M", "ENTER", "ONE TWO", "THREE", "FOUR FIVE", "SIX", "SEVEN EIGHT", "NINE"])],
    "test": [(f"an4test_clstk/spk9/tst{i}-spk9-b", w) for i, w in enumerate(["YES", "NO", "GO", "STOP"])]}
an4._make(root / "an4")
PYEOF
export LOWBIT_DATA_DIR=$DATA
for cfg in cifar10_sensitivity imagenet an4; do
  $PY -m lowbit study --config benchmarks/configs/issue16/$cfg.toml --out "$OUT" --no-progress --no-report
done
$PY -m lowbit report "$OUT"
rm -rf "$DATA"
