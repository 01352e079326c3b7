"""Calibration's cost against a bare forward on a large-vocabulary shape with random weights, on this machine.

Labelling computes the exit logits of every kept token at every checkpoint, a vocabulary-wide matmul each, while
the model's body does not depend on the vocabulary. This times `tide_hf.calibration.calibrate_tokens` with its default
settings on random token ids against stock forwards (logits included) over the same tokens, timed before and
after it, on a synthetic shape (default: Qwen2-0.5B's, hidden 896, 24 layers, a 151,936-token vocabulary),
with the calibration section of `tide-hf bench gpu`.

    python benchmarks/label_cost.py --out docs/results/smollm2-cpu/label-cost.json   # ~10 min on 2 CPU cores
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shlex
import sys
from pathlib import Path

import torch

from tide_bench.gpu import DRY_RUN, calibration_section
from tide_bench.synthetic import SHAPES, build_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="qwen2-0.5b", choices=sorted(SHAPES))
    parser.add_argument("--samples", type=int, default=32)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--out", required=True, help="JSON file to write")
    args = parser.parse_args()
    plan = dataclasses.replace(DRY_RUN, shape=args.shape, calibration_samples=args.samples,
                               calibration_len=args.seq_len, calibration_batch=args.batch_size)
    model = build_model(args.shape, plan.device, getattr(torch, plan.dtype))
    result = calibration_section(plan, model, lambda partial: None)
    bare = sum(result["bare_forward_s"]) / len(result["bare_forward_s"])
    result.update({"command": shlex.join(["python", "benchmarks/label_cost.py", *sys.argv[1:]]),
                   "shape": {"name": args.shape, **SHAPES[args.shape]}, "torch_threads": torch.get_num_threads(),
                   "label_over_bare": result["seconds"]["label"] / bare,
                   "forward_over_bare": result["seconds"]["forward"] / bare})
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(json.dumps({k: result[k] for k in ("total_over_bare", "label_over_bare", "forward_over_bare", "seconds",
                                             "bare_forward_s")}, indent=1))


if __name__ == "__main__":
    main()
