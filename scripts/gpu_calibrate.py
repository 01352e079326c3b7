"""Calibration time against a bare forward over the same tokens, on a synthetic Llama-3-8B-shaped model.

    python scripts/gpu_calibrate.py --out DIR --samples 2000 --seq 256          # on a GPU (bf16)
    python scripts/gpu_calibrate.py --out DIR --shape tiny --samples 16 --seq 32  # a quick CPU check

The model is built from a `LlamaConfig` with random weights, directly on the device in the chosen dtype (no
download, no internet); the tokens are seeded random ids. For each label, `tide_hf.calibrate_tokens` is timed
end to end and split into model body (forward), labelling and training (router training plus exit paths),
and compared with stock forwards (logits included) over the same batches, timed before and after the
calibrations. Writes DIR/gpu_calibrate.json with the device named; the acceptance figure is
`total_over_bare` (calibration wall time / bare forward time).
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch
import transformers
from transformers import LlamaForCausalLM

import tide_hf
from tide_hf.calibration import pad_right
from tide_hf.eval.synthetic import SHAPES, build_model  # the bench's shapes, built on the device in the dtype

FIRST_ID = 3  # random ids start above the special ids (pad 0, bos 1, eos 2)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def bare_forward(model: LlamaForCausalLM, samples: list[torch.Tensor], batch_size: int, device: torch.device) -> float:
    """Seconds of stock forwards (logits included) over `samples` in calibration's batches."""
    sync(device)
    started = time.perf_counter()
    for i in range(0, len(samples), batch_size):
        ids, mask = pad_right(samples[i : i + batch_size], 0)
        model(input_ids=ids.to(device), attention_mask=mask.to(device), use_cache=False)
    sync(device)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="folder for gpu_calibrate.json")
    parser.add_argument("--samples", type=int, default=2000)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--labels", default="top1,cosine", help="comma-separated label kinds to calibrate")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama3-8b")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default=None,
                        help="default: bfloat16 on a GPU, float32 on the CPU")
    args = parser.parse_args()
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    started = time.perf_counter()
    model = build_model(args.shape, str(device), dtype)
    sync(device)
    build_s = time.perf_counter() - started
    gen = torch.Generator().manual_seed(0)
    vocab = SHAPES[args.shape]["vocab_size"]
    samples = list(torch.randint(FIRST_ID, vocab, (args.samples, args.seq), generator=gen))
    bare_forward(model, samples[: args.batch_size], args.batch_size, device)  # warm-up (kernels, allocator)
    bare = [bare_forward(model, samples, args.batch_size, device)]
    runs = []
    for label in args.labels.split(","):
        sync(device)
        t0 = time.perf_counter()
        router = tide_hf.calibrate_tokens(model, samples, batch_size=args.batch_size, label=label, progress=False)
        sync(device)
        total = time.perf_counter() - t0
        cfg = router.config
        runs.append({"label": label, "total_s": total, "seconds": cfg.calibration_seconds,
                     "epochs": {k: m.get("epochs") for k, m in cfg.metrics.items()},
                     "best_epoch": {k: m["best_epoch"] for k, m in cfg.metrics.items()},
                     "positive_rate": {k: m["positive_rate"] for k, m in cfg.metrics.items()}})
        print(json.dumps(runs[-1]), flush=True)
    bare.append(bare_forward(model, samples, args.batch_size, device))
    bare_s = sum(bare) / len(bare)
    for run in runs:
        run["total_over_bare"] = run["total_s"] / bare_s
    result = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__, "transformers": transformers.__version__, "tide_hf": tide_hf.__version__,
        "shape": {"name": args.shape, **SHAPES[args.shape]}, "dtype": str(dtype), "samples": args.samples,
        "seq": args.seq, "batch_size": args.batch_size, "model_build_s": build_s, "bare_forward_s": bare,
        "runs": runs,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_calibrate.json").write_text(json.dumps(result, indent=2))
    for run in runs:
        s = run["seconds"]
        print(f"{run['label']}: total {run['total_s']:.1f} s = forward {s['forward']:.1f} + label {s['label']:.1f} "
              f"+ train {s['train']:.1f}; bare forward {bare_s:.1f} s; total / bare = {run['total_over_bare']:.2f}")


if __name__ == "__main__":
    main()
