"""`tide-hf bench modes`: what skip and speculative modes really save, against stock and against ideal.

"Ideal" is the speed of the same model truncated to the executed depth (a model that never had the
skipped layers; its embedding and LM head cost what they cost). Truncated models are timed at a few
depths, and `time per step = a + b * depth` is fitted to them (layers are identical in cost), so mixed
exits get an ideal at their mean executed depth too. Forced exits and the speculative section are
interleaved with stock repetition by repetition (prompt by prompt); mixed exits time stock once, before
every threshold's run on the same prompts. All in one process.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from tqdm.auto import tqdm

from tide_hf.integrations import attach
from tide_hf.integrations.draft import (
    EARLY_EXIT,
    SOURCE_COUNTERS,
    best_draft_length,
    interpolated_verify,
    with_acceptance,
)
from tide_hf.modeling import TideRouter
from tide_hf.runtime import Patches, TideHandle

from .measure import generate, left_pad, match_rate, perplexity


@contextmanager
def truncated(model: Any, depth: int) -> Iterator[None]:
    """Run `model` as if it had only its first `depth` layers (same weights, nothing copied).

    Llama-family models iterate `layers[: config.num_hidden_layers]` and size their cache from the config,
    which is what transformers' own early-exit assistant relies on too.
    """
    with Patches() as patches:
        patches.set_attr(model.config, "num_hidden_layers", depth)
        yield


Runner = Callable[[dict, int], tuple[torch.Tensor, float]]  # (batch, new tokens) -> (sequences, seconds)


def _truncated_runner(model: Any, depth: int) -> Runner:
    def run(batch: dict, new_tokens: int) -> tuple[torch.Tensor, float]:
        with truncated(model, depth):
            return generate(model, batch, new_tokens)
    return run


def _timed(runs: dict[str, Any], batch: dict, new_tokens: int, reps: int, desc: str) -> dict[str, float]:
    """Seconds per generated step of each named callable, interleaved over `reps` repetitions."""
    seconds = dict.fromkeys(runs, 0.0)
    for fn in runs.values():
        fn(batch, 2)  # warm-up
    for _ in tqdm(range(reps), desc=desc, leave=False):
        for name, fn in runs.items():
            seconds[name] += fn(batch, new_tokens)[1]
    return {name: s / (reps * new_tokens) for name, s in seconds.items()}


def fit_line(depths: list[int], step_s: list[float]) -> tuple[float, float]:
    """Least-squares `a + b * depth` through the truncated models' step times."""
    x = torch.tensor(depths, dtype=torch.float64)
    y = torch.tensor(step_s, dtype=torch.float64)
    b = float(((x - x.mean()) * (y - y.mean())).sum() / ((x - x.mean()) ** 2).sum())
    return float(y.mean() - b * x.mean()), b


def forced_exits(model: Any, router: TideRouter, batch: dict, depths: list[int], kv_policies: list[str],
                 new_tokens: int, reps: int) -> dict:
    """Every token exits at one checkpoint (threshold 0, min_layers = depth): skip vs truncated vs stock."""
    num_layers = router.config.num_hidden_layers
    rows, ideal_points = [], {num_layers: None}
    for depth in depths:
        runs = {"stock": lambda b, n: generate(model, b, n, tide=False), "ideal": _truncated_runner(model, depth)}
        for kv in kv_policies:
            runs[f"skip/{kv}"] = _skip_runner(model, router, depth, kv)
        step = _timed(runs, batch, new_tokens, reps, f"forced exit at {depth}")
        ideal_points[depth] = step["ideal"]
        ideal_points[num_layers] = step["stock"]
        for kv in kv_policies:
            rows.append({"depth": depth, "kv": kv, "stock_step_ms": 1e3 * step["stock"],
                         "ideal_step_ms": 1e3 * step["ideal"], "skip_step_ms": 1e3 * step[f"skip/{kv}"],
                         "speedup_vs_stock": step["stock"] / step[f"skip/{kv}"],
                         "realized_over_ideal": step["ideal"] / step[f"skip/{kv}"]})
    depths_fit = sorted(ideal_points)
    a, b = fit_line(depths_fit, [ideal_points[d] for d in depths_fit])
    return {"rows": rows, "ideal_fit": {"a_ms": 1e3 * a, "b_ms_per_layer": 1e3 * b}}


def _skip_runner(model: Any, router: TideRouter, min_layers: int, kv: str) -> Runner:
    def run(batch: dict, new_tokens: int) -> tuple[torch.Tensor, float]:  # every token exits at `min_layers`
        handle = attach(model, router, exit_threshold=0.0, min_layers=min_layers, mode="skip", kv=kv)
        try:
            return generate(model, batch, new_tokens, tide=True)
        finally:
            handle.detach()
    return run


def forced_rows(rows: torch.Tensor) -> type[TideHandle]:
    """A handle class whose routers say "exit" for the batch rows where `rows` (B,) is True and "stay" for the
    others, at every checkpoint and step: forced per-row exits (with `exit_threshold=0.5` and `min_layers`, those
    rows leave at the first checkpoint >= `min_layers`, the others run every layer)."""

    class ForcedRows(TideHandle):
        def score(self, layer: int, hidden: torch.Tensor) -> torch.Tensor:
            exits = rows.to(hidden.device)[:, None].expand(hidden.shape[:2])
            return exits.to(torch.float32)

    return ForcedRows


def mixed_exits(model: Any, router: TideRouter, batches: list[dict], chunks: list[torch.Tensor], fit: dict,
                thresholds: list[float], kv_policies: list[str], new_tokens: int, batch_size: int) -> dict:
    """Real router decisions in skip mode: speed vs stock (timed once, before the first threshold), executed
    depth, realized/ideal, quality."""
    stock_runs = [generate(model, b, new_tokens, tide=False) for b in batches]
    stock_tokens = torch.cat([t for t, _ in stock_runs])
    stock_s = sum(s for _, s in stock_runs)
    base_ppl, _ = perplexity(model, chunks, batch_size)
    steps = sum(new_tokens for _ in batches)
    rows = []
    for kv in kv_policies:
        for thr in tqdm(thresholds, desc=f"mixed exits ({kv})", leave=False):
            handle = attach(model, router, exit_threshold=thr, mode="skip", kv=kv)
            try:
                tokens, seconds, executed, decode_tok = [], 0.0, 0.0, 0
                for b in batches:
                    t, s = generate(model, b, new_tokens, tide=True)
                    tokens.append(t)
                    seconds += s
                    d = handle.last_stats.decode
                    executed, decode_tok = executed + d.mean_executed * d.tokens, decode_tok + d.tokens
                ppl, _ = perplexity(model, chunks, batch_size)
            finally:
                handle.detach()
            depth = executed / decode_tok  # own-step depth sets a step's time: the ideal is that truncated model
            ideal_step = (fit["a_ms"] + fit["b_ms_per_layer"] * depth) / 1e3
            exact, prefix = match_rate(torch.cat(tokens), stock_tokens)
            rows.append({"kv": kv, "threshold": thr, "mean_executed_layers": depth,
                         "speedup_vs_stock": stock_s / seconds,
                         "realized_over_ideal": ideal_step * steps / seconds,
                         "greedy_exact_match": exact, "greedy_prefix_match": prefix,
                         "perplexity_change": ppl / base_ppl - 1.0})
    return {"stock_perplexity": base_ppl, "rows": rows}


SPECULATIVE_COUNTERS = ("rounds", "plain_steps", "probes", "planned", "drafted", "accepted", "trials")
LOOKUP_PEER_TOKENS = 10  # prompt lookup's draft length as peer (transformers' recommended setting)
# The input-grounded task: the answer is in the prompt, as in summarizing, answering from or editing a document
GROUNDED_REQUEST = "Repeat the following passage word for word:\n\n{passage}"


def grounded_prompts(tokenizer: Any, passages: list[torch.Tensor]) -> list[torch.Tensor]:
    """Chat prompts (the model's template) asking to repeat each held-out passage: text the answer copies from
    its context, where drafts from the context can pay, beside open prose where they rarely do."""
    prompts = []
    for ids in passages:
        request = GROUNDED_REQUEST.format(passage=tokenizer.decode(ids, skip_special_tokens=True))
        text = tokenizer.apply_chat_template([{"role": "user", "content": request}], add_generation_prompt=True,
                                             tokenize=False)
        prompts.append(torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"]))
    return prompts


def source_counts(totals: dict[str, dict[str, int]], group: dict) -> dict[str, dict[str, int]]:
    """`totals` plus one call's round counters per group (`last_stats.speculative["sources"]`: per draft source;
    `["lookup_matches"]`: per class of lookup match length)."""
    keys = {**totals, **group}
    return {key: {k: totals.get(key, {}).get(k, 0) + group.get(key, {}).get(k, 0)
                  for k in SOURCE_COUNTERS} for key in keys}


def speculative(model: Any, router: TideRouter, batches: list[dict], batched: dict | None, new_tokens: int,
                reps: int, assisted_layer: int | None = None, lookup_tokens: int | None = None) -> dict:
    """Lossless mode vs stock and vs transformers' `assistant_early_exit`, interleaved prompt by prompt.

    Speed ratios are medians over repetitions of (stock seconds / method seconds) on all prompts. Beside
    them: divergence from stock greedy (share of continuations not token-identical; 0 in fp32), the measured
    per-token acceptance, the policy's draft lengths, and the optimum E that acceptance allows with the
    measured draft and verify costs (`realized_over_optimum` = speed ratio / E). `assistant_early_exit`
    drafts at `assisted_layer` (default: the draft layer speculative mode chose). `lookup_tokens`: also
    transformers' prompt lookup (`prompt_lookup_num_tokens`), the built-in lossless peer that needs no model.
    `sources`: the rounds, drafts and acceptance per draft source (lookup, early exit); `lookup_matches`: those
    of lookup per class of match length ("1", "2-3", ..., "16+"). `batched`: prompts
    decoded as one batch, checked token-identical to stock's batch (None: not checked).
    """
    handle = attach(model, router, mode="speculative")
    try:
        generate(model, batches[0], 2, tide=True)  # warm-up (the policy's estimates live as long as the model)
        layer, vocab = (handle.last_stats.speculative[k] for k in ("draft_layer", "draft_vocab"))
        assisted_layer = assisted_layer or layer
        runs = {"stock": {"tide": False}, "speculative": {"tide": True},
                "assisted": {"tide": False, "assistant_early_exit": assisted_layer}}
        if lookup_tokens is not None:
            runs["lookup"] = {"tide": False, "prompt_lookup_num_tokens": lookup_tokens}
        for name in [n for n in runs if n not in ("stock", "speculative")]:
            generate(model, batches[0], 2, **runs[name])  # warm-up
        seconds = {name: [0.0] * reps for name in runs}
        tokens: dict[str, list[torch.Tensor]] = {name: [] for name in runs}
        counters = dict.fromkeys(SPECULATIVE_COUNTERS, 0)
        sources: dict[str, dict[str, int]] = {}
        matches: dict[str, dict[str, int]] = {}
        for rep in tqdm(range(reps), desc="speculative vs stock", leave=False):
            for b in batches:
                for name, kwargs in runs.items():
                    out, s = generate(model, b, new_tokens, **kwargs)
                    seconds[name][rep] += s
                    tokens[name].append(out)
                    if name == "speculative":
                        counters = {k: v + handle.last_stats.speculative[k] for k, v in counters.items()}
                        sources = source_counts(sources, handle.last_stats.speculative["sources"])
                        matches = source_counts(matches, handle.last_stats.speculative["lookup_matches"])
        batch_identical = None if batched is None else torch.equal(generate(model, batched, new_tokens, tide=False)[0],
                                                                   generate(model, batched, new_tokens, tide=True)[0])
        costs = {k: handle.last_stats.speculative[k]  # the latest
                 for k in ("draft_cost", "verify_costs", "lookup_cost", "lookup_verify_costs")}
    finally:
        handle.detach()
    stock = torch.cat(tokens["stock"])
    peers = [name for name in runs if name != "stock"]
    divergence = {name: 1.0 - match_rate(torch.cat(tokens[name]), stock)[0] for name in peers}
    ratio = {name: statistics.median(st / s for st, s in zip(seconds["stock"], seconds[name])) for name in peers}
    lookup = ({} if lookup_tokens is None else
              {"lookup_tokens": lookup_tokens, "lookup_speed_ratio": ratio["lookup"],
               "lookup_divergence": divergence["lookup"]})
    acceptance = counters["accepted"] / counters["trials"] if counters["trials"] else 0.0
    sources, matches = ({key: with_acceptance(counts) for key, counts in group.items()} for group in (sources, matches))
    early = sources.get(EARLY_EXIT, {}).get("acceptance_per_token", 0.0)  # the optimum of early exit's drafts
    optimal_k, optimum = best_draft_length(early, costs["draft_cost"], interpolated_verify(costs["verify_costs"]))
    rounds = counters["rounds"]
    return {"draft_layer": layer, "draft_vocab": vocab, "assisted_layer": assisted_layer, "prompts": len(batches),
            "reps": reps,
            "identical_all_prompts": divergence["speculative"] == 0.0, "identical_batched": batch_identical,
            "batched_rows": 0 if batched is None else int(batched["input_ids"].shape[0]),
            "speed_ratio": ratio["speculative"], "assisted_speed_ratio": ratio["assisted"],
            "divergence": divergence["speculative"], "assisted_divergence": divergence["assisted"],
            "acceptance_rate": counters["accepted"] / counters["drafted"] if counters["drafted"] else 0.0,
            "acceptance_per_token": acceptance,
            "mean_draft_length": counters["drafted"] / rounds if rounds else 0.0,
            "mean_planned_length": counters["planned"] / rounds if rounds else 0.0,
            **costs, "optimal_draft_length": optimal_k, "optimal_speedup": optimum,
            "realized_over_optimum": ratio["speculative"] / optimum, **lookup, **counters, "sources": sources,
            "lookup_matches": matches}


def run_modes(model: Any, tokenizer: Any, router: TideRouter, prompts: list[torch.Tensor], chunks: list[torch.Tensor],
              pad_id: int, args: Any) -> dict:
    """Forced and mixed exits in skip mode, and the lossless speculative mode beside prompt lookup and
    `assistant_early_exit`, on the held-out prose and (`["speculative"]["grounded"]`) on chat prompts asking to
    repeat those passages, written with `tokenizer`'s chat template (the `modes` bench JSON)."""
    kv_policies = ["propagate", "recompute"]
    one = left_pad(prompts[:1], pad_id)
    forced = forced_exits(model, router, one, args.depths, kv_policies, args.new_tokens, args.reps)
    batches = [left_pad(prompts[i : i + 1], pad_id) for i in range(len(prompts))]
    mixed = mixed_exits(model, router, batches, chunks, forced["ideal_fit"], args.thresholds, kv_policies,
                        args.new_tokens, args.quality_batch_size)
    spec = speculative(model, router, batches, left_pad(prompts[: args.quality_batch_size], pad_id),
                       args.new_tokens, args.reps, lookup_tokens=LOOKUP_PEER_TOKENS)
    grounded = [left_pad([p], pad_id) for p in grounded_prompts(tokenizer, prompts)]
    spec["grounded"] = speculative(model, router, grounded, None, args.new_tokens, args.reps,
                                   lookup_tokens=LOOKUP_PEER_TOKENS)
    return {"forced": forced, "mixed": mixed, "speculative": spec}
