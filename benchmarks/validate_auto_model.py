"""How well codec="auto"'s step-time model predicts fixed codecs it was never fitted on.

auto predicts from what it measures on the job itself (each network's own fp32 step timeline, the link
probed with each codec, the codecs' encoding), with no constant fitted on other networks or cards, so
every prediction is held out by construction: leave-one-network-out is the only way it runs. This script
sets each auto run's predictions for the fixed assignments it considered (each allowed codec applied as a
fixed codec would be: tensors >= 10,000 values) beside the same bench_ddp run's measured step of that
fixed codec (``lowbit:bf16``, ``lowbit:qsgd:bits=8,bucket=512``; the median of its rounds), and the fp32
step auto measured beside plain DDP's.

    python benchmarks/validate_auto_model.py benchmarks/results/ddp_2xh100_sockets_auto_de7d7c2.json \
        [--out benchmarks/results/auto_model_validation_2xh100_sockets.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

FIXED = {"bf16": "lowbit:bf16", "qsgd:bits=8": "lowbit:qsgd:bits=8,bucket=512"}


def cells(doc: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for model, r in doc["results"].items():
        hooks = r["hooks"]
        autos = [a for a in hooks.get("lowbit:auto", {}).get("auto", []) if a]
        if not autos:
            continue
        def step_ms(hook: str) -> float | None:  # as bench_ddp recorded it (global batch / samples/s)
            row = hooks.get(hook, {})
            return row.get("step_ms") if row.get("samples_per_s") else None

        for prefix, hook in FIXED.items():
            preds = [v for a in autos for k, v in a.get("finalists_predicted_step_ms", {}).items()
                     if k.startswith(prefix) and "tensors >=" in k]
            meas = step_ms(hook)
            if preds and meas:
                p = statistics.median(preds)
                out.append({"model": model, "codec": prefix, "kind": "predicted", "predicted_ms": p,
                            "measured_ms": meas, "rounds": len(preds), "error": (p - meas) / meas})
        fp32 = [a["fp32_predicted_step_ms"] for a in autos]
        meas = step_ms("ddp")
        if meas:
            p = statistics.median(fp32)
            out.append({"model": model, "codec": "fp32", "kind": "measured by auto (fp32 steps)",
                        "predicted_ms": p, "measured_ms": meas, "rounds": len(fp32), "error": (p - meas) / meas})
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("results", nargs="+", type=Path, help="bench_ddp JSON files with a lowbit:auto column")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    rows = []
    for f in args.results:
        doc = json.loads(f.read_text())
        for c in cells(doc):
            rows.append({"file": f.name, "device": doc["meta"].get("device_name"), **c})
    if not rows:
        print("no lowbit:auto rows with predictions in these files", file=sys.stderr)
        return 1
    print("| model | codec | auto's prediction (ms/step) | bench_ddp measured | error |\n|---|---|---:|---:|---:|")
    for r in rows:
        print(f"| {r['model']} | {r['codec']}{' (measured)' if r['kind'] != 'predicted' else ''} | "
              f"{r['predicted_ms']:.1f} | {r['measured_ms']:.1f} | {r['error']:+.1%} |")
    pred = [abs(r["error"]) for r in rows if r["kind"] == "predicted"]
    allc = [abs(r["error"]) for r in rows]
    summary = {"median_abs_error_predicted": statistics.median(pred) if pred else None,
               "cells_predicted": len(pred), "median_abs_error_all": statistics.median(allc), "cells_all": len(allc)}
    print(f"\nmedian |error|: {summary['median_abs_error_predicted']:.1%} over {len(pred)} predicted cells; "
          f"{summary['median_abs_error_all']:.1%} over all {len(allc)} (fp32 included)")
    if args.out:
        args.out.write_text(json.dumps({"summary": summary, "cells": rows}, indent=1) + "\n")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
