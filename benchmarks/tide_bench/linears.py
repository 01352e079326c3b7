"""`tide-hf bench linears`: where the speed comes from on the CPU, each linear path timed in one run.

Two parts. First, what a forward over k new tokens costs (a cache of `--cache-len` tokens), with eager
`nn.Linear` and with the fast path (`fast_linears`: oneDNN on packed weights), in each `--dtypes`: TIDE saves time
only where k tokens cost about one step. Second, greedy generation at batch 1 on held-out prompts, interleaved
prompt by prompt: stock on both paths, then on the fast path transformers' prompt lookup and each TIDE mode. Each
ratio is a median over repetitions of (stock seconds / method seconds), against stock on the same path and
against stock eager; tokens are compared with stock on the same path.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from tqdm.auto import tqdm

from tide_hf.assets import load_model
from tide_hf.compat import cache_in, with_cache
from tide_hf.integrations import attach
from tide_hf.integrations.draft import DRAFT_SOURCES, EARLY_EXIT, LOOKUP, with_acceptance
from tide_hf.integrations.speculative import only_sources
from tide_hf.modeling import TideRouter
from tide_hf.runtime import fast_linears

from .measure import generate, left_pad, match_rate
from .modes import source_counts

FORWARD_TOKENS = (1, 2, 4, 8, 16)  # new tokens per forward in the cost table
WARMUP_FORWARDS = 3  # untimed forwards before each cost's timed ones
LOOKUP_PEER_TOKENS = 10  # prompt lookup's draft length (transformers' recommended setting)
EAGER, FAST = "eager", "fast"
# method -> (generate keywords, TIDE mode attached or None, the draft sources speculative mode may use). Stock runs
# on both paths, the rest on the fast path; speculative mode with one source alone is the ablation of the other.
METHODS: dict[str, tuple[dict[str, Any], str | None, tuple[str, ...]]] = {
    "stock": ({}, None, DRAFT_SOURCES),
    "lookup": ({"prompt_lookup_num_tokens": LOOKUP_PEER_TOKENS}, None, DRAFT_SOURCES),
    "speculative": ({}, "speculative", DRAFT_SOURCES),
    "speculative, early-exit drafts only": ({}, "speculative", (EARLY_EXIT,)),
    "speculative, lookup drafts only": ({}, "speculative", (LOOKUP,)),
    "skip": ({}, "skip", DRAFT_SOURCES),
}


def median_seconds(fn: Callable[[], Any], repeats: int) -> float:
    """The median wall time of `fn()` over `repeats` calls, after `WARMUP_FORWARDS` untimed ones."""
    for _ in range(WARMUP_FORWARDS):
        fn()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


@torch.no_grad()
def forward_costs(model: Any, cache_len: int, repeats: int, vocab: int) -> dict[str, Any]:
    """Milliseconds of a forward over k new tokens (`FORWARD_TOKENS`) on a cache of `cache_len` tokens, per
    path, and the fast path's `rows_from` (measured); the cache is cropped back after each forward, so every one
    reads the same cache."""
    generator = torch.Generator().manual_seed(0)
    device = next(model.parameters()).device
    cache = cache_in(model(torch.randint(vocab, (1, cache_len), generator=generator).to(device), use_cache=True))
    costs: dict[str, Any] = {}
    for path in (EAGER, FAST):
        row = []
        linear_path = fast_linears(model) if path == FAST else None
        try:
            for k in FORWARD_TOKENS:
                new = torch.randint(vocab, (1, k), generator=generator).to(device)

                def step(new: torch.Tensor = new, k: int = k) -> None:
                    model(new, **with_cache({}, cache), use_cache=True)
                    cache.crop(-k)

                row.append(1e3 * median_seconds(step, repeats))
        finally:
            if linear_path is not None:
                costs["rows_from"] = linear_path.rows_from
                linear_path.undo()
        costs[path] = row
    return costs


def cost_rows(model_name: str, dtypes: list[str], cache_len: int, repeats: int) -> list[dict]:
    """`forward_costs` of `model_name` loaded in each of `dtypes`: a row per dtype and path, each k's cost also in
    one-token steps of that path."""
    rows = []
    for dtype in dtypes:
        model, tokenizer = load_model(model_name, dtype)
        costs = forward_costs(model, cache_len, repeats, len(tokenizer))
        for path, ms in ((EAGER, costs[EAGER]), (FAST, costs[FAST])):
            rows.append({"dtype": dtype, "path": path, "tokens": list(FORWARD_TOKENS), "ms": ms,
                         "steps": [m / ms[0] for m in ms], "step_speedup_vs_eager": costs[EAGER][0] / ms[0],
                         "rows_from": costs["rows_from"] if path == FAST else None})
        del model
    return rows


def generation(model: Any, router: TideRouter, batches: list[dict], new_tokens: int, reps: int) -> dict:
    """Stock on both paths and each of `METHODS` on the fast path, interleaved prompt by prompt (the fast path is
    set up, and TIDE attached, outside the timed calls). Per method: median speed ratios against stock on the
    same path and against stock eager, the share of prompts whose tokens equal stock's on the same path; the
    speculative rounds per draft source, skip mode's layers per decode token."""
    runs = [(EAGER, "stock"), *((FAST, name) for name in METHODS)]
    seconds = {run: [0.0] * reps for run in runs}
    tokens: dict[tuple[str, str], list[torch.Tensor]] = {run: [] for run in runs}
    sources: dict[str, dict[str, dict[str, int]]] = {}  # speculative method -> its rounds per draft source
    executed, decoded = 0.0, 0
    for rep in tqdm(range(reps), desc="linear paths", leave=False):
        for batch in batches:
            for path, name in runs:
                kwargs, mode, allowed = METHODS[name]
                linear_path = fast_linears(model) if path == FAST else None
                handle = attach(model, router, mode=mode) if mode is not None else None
                try:
                    with only_sources(*allowed):
                        out, s = generate(model, batch, new_tokens, **kwargs, tide=mode is not None)
                    if mode == "speculative":
                        found = sources.setdefault(name, {})
                        sources[name] = source_counts(found, handle.last_stats.speculative["sources"])
                    elif mode == "skip":
                        decode = handle.last_stats.decode
                        executed, decoded = executed + decode.mean_executed * decode.tokens, decoded + decode.tokens
                finally:
                    if handle is not None:
                        handle.detach()
                    if linear_path is not None:
                        linear_path.undo()
                seconds[path, name][rep] += s
                tokens[path, name].append(out)
    eager_stock, fast_stock = seconds[EAGER, "stock"], seconds[FAST, "stock"]
    stock_tokens = {path: torch.cat(tokens[path, "stock"]) for path in (EAGER, FAST)}
    rows = []
    for path, name in runs:
        mine = seconds[path, name]
        rows.append({"path": path, "method": name,
                     "ratio_vs_stock_same_path": statistics.median(a / b for a, b in zip(seconds[path, "stock"], mine)),
                     "ratio_vs_stock_eager": statistics.median(a / b for a, b in zip(eager_stock, mine)),
                     "identical_to_stock_same_path": match_rate(torch.cat(tokens[path, name]), stock_tokens[path])[0],
                     "seconds_per_rep": statistics.median(seconds[path, name])})
    fast_vs_eager = match_rate(stock_tokens[FAST], stock_tokens[EAGER])[0]
    return {"rows": rows, "stock_fast_identical_to_eager": fast_vs_eager,
            "stock_fast_speedup": statistics.median(a / b for a, b in zip(eager_stock, fast_stock)),
            "speculative_sources": {name: {key: with_acceptance(counts) for key, counts in found.items()}
                                    for name, found in sources.items()},
            "skip_layers_per_decode_token": executed / decoded if decoded else None}


def run_linears(model: Any, router: TideRouter, prompts: list[torch.Tensor], pad_id: int, args: Any) -> dict:
    """The `linears` bench JSON: forward costs by k on both paths (per `--dtypes`), then generation at batch 1."""
    costs = cost_rows(args.model, args.dtypes, args.cache_len, args.cost_repeats)
    batches = [left_pad([p], pad_id) for p in prompts]
    return {"forward_costs": costs, "generation": generation(model, router, batches, args.new_tokens, args.reps)}

