"""`tide-hf bench continuous`: continuous batching (`model.generate_batch`) with TIDE against stock.

Every held-out prompt goes to one `generate_batch` call, which packs prompt chunks and decode tokens of all of
them into its steps. Skip mode (`kv="propagate"`, the one continuous batching takes) at each quality target is
timed against stock continuous batching in the same run (interleaved repetitions), with the layers executed per
decode token and per prompt position, and the delivered top-1 agreement: the share of generated tokens equal to
the full model's top-1 after the same prefix (one stock forward over each output).
"""

from __future__ import annotations

import math
import time
from typing import Any

import torch
from transformers import ContinuousBatchingConfig, GenerationConfig

from tide_hf.compat import paged_config
from tide_hf.integrations import attach
from tide_hf.modeling import TideRouter

from .batches import decode_agreement, timed_runs
from .measure import left_pad

PAGE = 256  # tokens per cache page (transformers' default)
HEADROOM = 2  # pages per request beyond its prompt and output: the paged cache never runs out mid-call


def batch_config(prompts: list[torch.Tensor], new_tokens: int) -> ContinuousBatchingConfig:
    """A paged cache sized to the requests (the default sizes it from free memory: tens of seconds on a CPU)."""
    pages = sum(math.ceil((len(p) + new_tokens) / PAGE) + HEADROOM for p in prompts)
    return paged_config(PAGE, num_blocks=pages, use_cuda_graph=False)


def generate_batch(model: Any, prompts: list[torch.Tensor], new_tokens: int) -> tuple[torch.Tensor, float]:
    """Greedy continuations of every prompt in one continuous-batching call (no EOS: each gets `new_tokens`), as a
    (prompts, new_tokens) tensor in prompt order, and the call's wall seconds."""
    config = GenerationConfig(max_new_tokens=new_tokens, do_sample=False, eos_token_id=-1)
    started = time.perf_counter()
    out = model.generate_batch([p.tolist() for p in prompts], generation_config=config, warmup=False,
                               progress_bar=False, continuous_batching_config=batch_config(prompts, new_tokens))
    seconds = time.perf_counter() - started
    failed = [r.error for r in out.values() if r.error is not None]
    if failed:
        raise RuntimeError(f"generate_batch failed: {failed[0]}")
    return torch.tensor([r.generated_tokens for r in out.values()]), seconds


def run_continuous(model: Any, router: TideRouter, prompts: list[torch.Tensor], pad_id: int, args: Any) -> dict:
    """The `continuous` bench JSON: one row per target, skip mode against stock continuous batching."""
    rows = []
    for target in args.targets:
        options = {"mode": "skip", "kv": "propagate", "min_agreement": target}

        def tide(options: dict = options) -> float:
            with attach(model, router, **options):
                return generate_batch(model, prompts, args.new_tokens)[1]

        seconds = timed_runs({"stock": lambda: generate_batch(model, prompts, args.new_tokens)[1], "tide": tide},
                             args.reps, f"continuous batching, target {target}")
        with attach(model, router, **options) as handle:
            out, _ = generate_batch(model, prompts, args.new_tokens)
            stats = handle.last_stats
        rows.append({"target": target, "kv": "propagate", "requests": len(prompts), "new_tokens": args.new_tokens,
                     "decode_mean_executed_layers": stats.decode.mean_executed,
                     "prefill_mean_executed_layers": stats.prefill.mean_executed,
                     "decode_exit_rate": stats.decode.exit_rate, "speedup_vs_stock": seconds["stock"] / seconds["tide"],
                     "stock_s": seconds["stock"], "tide_s": seconds["tide"],
                     "top1_agreement": decode_agreement(model, left_pad(prompts, pad_id), out)})
    return {"continuous": rows}
