"""Does skip mode pay? Skip mode at a quality target against stock, on held-out text, on both linear paths.

Per linear path (eager `nn.Linear`, then `tide_hf.fast_linears`), stock `generate` and `attach(model, router,
mode="skip", min_agreement=TARGET)` (pricing and step aside on, kv="recompute") decode the same prompts,
interleaved prompt by prompt, at batch 1 and at one batch of all prompts, on open prose (held-out documents) and
on grounded prompts (asking to repeat a held-out passage). Ratios are stock seconds over TIDE seconds per
repetition, against stock on the same path. Beside them: layers run per decode token, TIDE's pricing and step
aside, and top-1 agreement with the model given stock's prefix (stock's continuation fed one token at a time).
Then select mode at the router's own target (every layer runs) and a repeated attach + detach.

    python benchmarks/skip_pays.py --router ROUTER --out skip-pays.json   # ~18 min on 2 CPU cores
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
from tide_bench.modes import grounded_prompts
from tide_hf.assets import default_dataset, load_model
from tide_hf.calibration import pad_token_id
from tide_hf.compat import cache_in, with_cache

ATTACH_REPEATS = 6  # attach + detach timed this many times (the first measures the costs)


def spread(ratios: list[float]) -> dict:
    """Median and range of per-repetition ratios."""
    return {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios), "runs": ratios}


def ratios(model, batches: list[dict], new_tokens: int, reps: int) -> tuple[dict, dict]:
    """(stock / TIDE seconds per repetition, TIDE's decode work) over `batches`, interleaved batch by batch."""
    per_rep, layers, tokens, aside = [], 0.0, 0, {"plain_steps": 0, "tide_steps": 0, "stepped_aside": 0}
    for _ in range(reps):
        stock = tide = 0.0
        for batch in batches:
            stock += generate(model, batch, new_tokens, tide=False)[1]
            tide += generate(model, batch, new_tokens, tide=True)[1]
            stats = tide_hf.last_stats(model)
            layers += stats.decode.mean_executed * stats.decode.tokens
            tokens += stats.decode.tokens
            for key in aside:
                aside[key] += (stats.aside or {}).get(key, 0)
        per_rep.append(stock / tide)
    return spread(per_rep), {"layers_per_decode_token": layers / max(tokens, 1), "decode_tokens": tokens,
                             "aside": aside}


@torch.no_grad()
def agreement(model, prompts: list[torch.Tensor], pad: int, new_tokens: int) -> dict:
    """Top-1 agreement of the attached skip mode with stock's greedy tokens, given stock's prefix: each prompt's
    stock continuation fed one token at a time (decode steps of one row, each exit deciding as in serving), every
    step's top-1 compared with stock's next token."""
    agree = total = 0
    for prompt in prompts:
        continuation = generate(model, left_pad([prompt], pad), new_tokens, tide=False)[0][0]
        out = model(input_ids=prompt[None], use_cache=True)
        for position in range(continuation.numel()):
            agree += int(out.logits[0, -1].argmax() == continuation[position])
            total += 1
            token = continuation[position : position + 1][None]
            out = model(**with_cache({"input_ids": token, "use_cache": True}, cache_in(out)))
    return {"agreement": agree / total, "tokens": total}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--router", required=True, help="a router folder for the model")
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--target", type=float, default=0.95, help="min_agreement skip mode serves")
    parser.add_argument("--num-prompts", type=int, default=8, help="open-prose prompts (held-out documents)")
    parser.add_argument("--num-grounded", type=int, default=4, help="grounded prompts (repeat a held-out passage)")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--out", default="skip-pays.json")
    args = parser.parse_args()
    torch.set_num_threads(min(2, torch.get_num_threads()))
    model, tokenizer = load_model(args.model)
    router = tide_hf.TideRouter.from_pretrained(args.router)
    prompts, _ = evaluation_text(tokenizer, default_dataset("sotu"), router, args.num_prompts, 64, 1, 1)
    pad = pad_token_id(tokenizer)
    sets = {"open": prompts, "grounded": grounded_prompts(tokenizer, prompts[: args.num_grounded])}
    result: dict = {"command": shlex.join(["python", *sys.argv]), "torch_threads": torch.get_num_threads(),
                    "target": args.target, "new_tokens": args.new_tokens, "paths": {}}
    for path in ("eager", "fast"):
        linear = tide_hf.fast_linears(model) if path == "fast" else None
        handle = tide_hf.attach(model, router, mode="skip", min_agreement=args.target)
        generate(model, left_pad([prompts[0]], pad), 2, tide=True)  # warm-up
        runs: dict = {"pricing": handle.options.priced, "thresholds": handle.options.thresholds}
        for name, rows in sets.items():
            for label, batches in (("batch_1", [left_pad([p], pad) for p in rows]),
                                   (f"batch_{len(rows)}", [left_pad(rows, pad)])):
                speed, work = ratios(model, batches, args.new_tokens, args.reps)
                runs[f"{name}_{label}"] = {"skip_vs_stock": speed, **work}
                print(f"{path} {name} {label}: skip / stock {speed['median']:.3f} ({speed['min']:.3f}-"
                      f"{speed['max']:.3f}), {work['layers_per_decode_token']:.2f} layers per decode token",
                      flush=True)
        runs["open_agreement_given_stock_prefix"] = agreement(model, prompts, pad, args.new_tokens)
        print(f"{path}: agreement {runs['open_agreement_given_stock_prefix']}", flush=True)
        handle.detach()
        with tide_hf.attach(model, router, mode="select"):
            for label, batches in (("batch_1", [left_pad([p], pad) for p in prompts]),
                                   (f"batch_{len(prompts)}", [left_pad(prompts, pad)])):
                speed, _ = ratios(model, batches, args.new_tokens, args.reps)
                runs[f"select_{label}"] = {"select_vs_stock": speed}
                print(f"{path} select {label}: {speed['median']:.3f}", flush=True)
        times = []
        for _ in range(ATTACH_REPEATS):
            started = time.perf_counter()
            tide_hf.attach(model, router, mode="skip", min_agreement=args.target).detach()
            times.append(1e3 * (time.perf_counter() - started))
        runs["attach_detach_ms"] = times
        result["paths"][path] = runs
        if linear is not None:
            linear.undo()
    Path(args.out).write_text(json.dumps(result, indent=2, default=str))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
