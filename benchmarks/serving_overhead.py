"""TIDE's own cost on a model it saves nothing on: a repeated attach + detach, and select mode against stock.

Two figures of the "skip mode pays or steps aside" work. First, the wall time of `attach` + `detach` in each mode,
repeated on the same model and router (the first attach probes the model; later ones reuse that work). Second,
select mode at the router's own quality target (every layer runs; the routers score every open checkpoint) against
stock `generate`, interleaved prompt by prompt, at batch 1 and at one batch of all prompts, on held-out prompts.

    python benchmarks/serving_overhead.py --router ROUTER --out serving-overhead.json   # ~3 min on 2 CPU cores
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import time
from pathlib import Path

import torch

import tide_hf
from tide_bench.measure import evaluation_text, generate, left_pad
from tide_hf.assets import default_dataset, load_model
from tide_hf.calibration import pad_token_id

MODES = ("skip", "speculative", "select")


def attach_ms(model, router, mode: str, repeats: int) -> list[float]:
    """Milliseconds of each `attach` + `detach` in `mode`, the first one included."""
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        tide_hf.attach(model, router, mode=mode).detach()
        times.append(1e3 * (time.perf_counter() - started))
    return times


def select_ratios(model, router, batches: list[dict], new_tokens: int, reps: int) -> list[float]:
    """Per repetition, stock seconds over select-mode seconds on all `batches` (interleaved batch by batch)."""
    ratios = []
    with tide_hf.attach(model, router, mode="select"):
        generate(model, batches[0], 2, tide=True)  # warm-up
        for _ in range(reps):
            stock = tide = 0.0
            for batch in batches:
                stock += generate(model, batch, new_tokens, tide=False)[1]
                tide += generate(model, batch, new_tokens, tide=True)[1]
            ratios.append(stock / tide)
    return ratios


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--router", required=True, help="a router folder for the model")
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--num-prompts", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--attach-repeats", type=int, default=5)
    parser.add_argument("--out", default="serving-overhead.json")
    args = parser.parse_args()
    torch.set_num_threads(min(2, torch.get_num_threads()))
    model, tokenizer = load_model(args.model)
    router = tide_hf.TideRouter.from_pretrained(args.router)
    prompts, _ = evaluation_text(tokenizer, default_dataset("sotu"), router, args.num_prompts, 64, 1, 1)
    pad = pad_token_id(tokenizer)
    result = {
        "command": shlex.join(["python", *sys.argv]), "torch_threads": torch.get_num_threads(),
        "attach_detach_ms": {mode: attach_ms(model, router, mode, args.attach_repeats) for mode in MODES},
        "select_vs_stock": {
            "batch_1": select_ratios(model, router, [left_pad([p], pad) for p in prompts], args.new_tokens, args.reps),
            f"batch_{len(prompts)}": select_ratios(model, router, [left_pad(prompts, pad)], args.new_tokens,
                                                   args.reps)},
    }
    Path(args.out).write_text(json.dumps(result, indent=2))
    for mode, times in result["attach_detach_ms"].items():
        print(f"attach + detach, {mode}: first {times[0]:.1f} ms, then median {statistics.median(times[1:]):.1f} ms")
    for batch, ratios in result["select_vs_stock"].items():
        print(f"select / stock, {batch}: median {statistics.median(ratios):.3f} ({min(ratios):.3f}-{max(ratios):.3f})")


if __name__ == "__main__":
    main()
