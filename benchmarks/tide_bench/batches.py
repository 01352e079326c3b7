"""`tide-hf bench batches`: skip mode in batches, where rows exit on their own, against stock and the ideal.

Three sections, each at every `--batch-sizes`, timed against stock in the same run (interleaved repetitions), each
with the cache policies of `POLICIES`:
- the cost of a stock decode step at 1 row, at each batch size and at half of it: what running fewer rows saves
  on this machine.
- forced per-row exits: half the rows (the even ones; at batch 1, the one row) leave at `--forced-depth` at every
  step, the others run every layer. The ideal is the time of the mean executed depth, on a line through the
  truncated model at that depth and the full model at the same batch size (layers cost alike, and a layer on
  half the rows costs half). The row-cost ideal instead scales the time of the layers after the exit by a stock
  step's measured cost at the rows still running over its cost at the whole batch.
- real router decisions at quality targets (`--targets`): layers executed per decode token beside the same prompts
  run one at a time, tokens/s against stock, realized / ideal, and the delivered top-1 agreement: the share of
  generated tokens equal to the full model's top-1 after the same prefix (one stock forward over the output).
  Prefill: the perplexity chunks in one forward, timed against stock, with layers executed per position and
  top-1 agreement with the full model's logits.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch
from tqdm.auto import tqdm

from tide_hf.compat import with_cache
from tide_hf.integrations import attach, attach_with
from tide_hf.modeling import TideRouter
from tide_hf.runtime import TideHandle

from .measure import generate, left_pad
from .modes import forced_rows, truncated

STEP_COST_STEPS = 8  # decode steps timed per prefill in `step_cost` (their median)
POLICIES = {"propagate": {"kv": "propagate"}, "recompute": {"kv": "recompute"}}  # name -> attach options


def default_forced_depth(checkpoints: list[int], num_layers: int) -> int:
    """The checkpoint nearest half the model's depth."""
    return min(checkpoints, key=lambda k: abs(k - num_layers / 2))


def timed_runs(runs: dict[str, Any], reps: int, desc: str) -> dict[str, float]:
    """Median seconds of each named callable over `reps` interleaved repetitions (after one warm-up each); each
    returns the seconds of its own generate call or forward (attach and detach are not timed)."""
    for fn in runs.values():
        fn()
    seconds: dict[str, list[float]] = {name: [] for name in runs}
    for _ in tqdm(range(reps), desc=desc, leave=False):
        for name, fn in runs.items():
            seconds[name].append(fn())
    return {name: statistics.median(s) for name, s in seconds.items()}


def _seconds(fn: Any) -> Any:
    """`fn` returning the wall seconds it took."""
    def timed() -> float:
        started = time.perf_counter()
        fn()
        return time.perf_counter() - started
    return timed


def _ideal(stock_s: float, truncated_s: float, depth: int, num_layers: int, executed: float) -> float:
    """Seconds at `executed` mean layers on the line through (depth, truncated_s) and (num_layers, stock_s)."""
    per_layer = (stock_s - truncated_s) / (num_layers - depth)
    return truncated_s + per_layer * (executed - depth)


def _skip_call(model: Any, router: TideRouter, batch: dict, new_tokens: int, stats: dict,
               handle_class: type[TideHandle] = TideHandle, **options: Any) -> Any:
    """A timed skip-mode generate call (seconds of the call only), its mean executed depth left in `stats`."""
    def run() -> float:
        handle = attach_with(handle_class, model, router, mode="skip", **options)
        try:
            seconds = generate(model, batch, new_tokens, tide=True)[1]
            stats["decode"] = handle.last_stats.decode.mean_executed
        finally:
            handle.detach()
        return seconds
    return run


@torch.no_grad()
def step_cost(model: Any, prompts: list[torch.Tensor], pad_id: int, rows: list[int], steps: int, reps: int
              ) -> list[dict]:
    """Median seconds of a stock decode step at each number of `rows` (after a prefill of that many prompts; the
    median over `steps` steps, each count in turn, `reps` times)."""
    def one(n: int) -> float:
        batch = left_pad(prompts[:n], pad_id)
        out = model(**batch, use_cache=True)
        cache, mask, seconds = out.past_key_values, batch["attention_mask"], []
        token = out.logits[:, -1:].argmax(-1)
        for _ in range(steps):
            mask = torch.cat([mask, torch.ones_like(token)], dim=1)
            started = time.perf_counter()
            out = model(input_ids=token, attention_mask=mask, use_cache=True, **with_cache({}, cache))
            seconds.append(time.perf_counter() - started)
            token = out.logits[:, -1:].argmax(-1)
        return statistics.median(seconds)

    samples: dict[int, list[float]] = {n: [] for n in rows}
    for _ in tqdm(range(reps), desc="decode step cost by rows", leave=False):
        for n in rows:
            samples[n].append(one(n))
    base = statistics.median(samples[rows[0]])
    return [{"rows": n, "step_s": statistics.median(s), "over_first": statistics.median(s) / base}
            for n, s in samples.items()]


def _stock_call(model: Any, batch: dict, new_tokens: int, depth: int | None = None) -> Any:
    """A timed stock generate call; with `depth`, of the model truncated to its first `depth` layers."""
    def run() -> float:
        if depth is None:
            return generate(model, batch, new_tokens, tide=False)[1]
        with truncated(model, depth):
            return generate(model, batch, new_tokens)[1]
    return run


def forced(model: Any, router: TideRouter, prompts: list[torch.Tensor], pad_id: int, batch_sizes: list[int],
           depth: int, new_tokens: int, reps: int, costs: dict[int, float]) -> list[dict]:
    """Forced per-row exits at `depth`: skip mode (each of `POLICIES`) against stock, the ideal, and the row-cost
    ideal (`costs`: rows -> seconds of a stock decode step, `step_cost`)."""
    num_layers = router.config.num_hidden_layers
    rows = []
    for bs in batch_sizes:
        batch = left_pad(prompts[:bs], pad_id)
        exiting = torch.arange(bs) % 2 == 0
        running = bs - int(exiting.sum())
        stats: dict[str, dict] = {name: {} for name in POLICIES}
        runs = {"stock": _stock_call(model, batch, new_tokens),
                "truncated": _stock_call(model, batch, new_tokens, depth)}
        for name, options in POLICIES.items():
            runs[name] = _skip_call(model, router, batch, new_tokens, stats[name], exit_threshold=0.5,
                                    min_layers=depth, handle_class=forced_rows(exiting), **options)
        seconds = timed_runs(runs, reps, f"forced per-row exits, batch {bs}")
        deep = seconds["stock"] - seconds["truncated"]  # the layers after the exit, every row running
        row_ideal = seconds["truncated"] + deep * (costs[running] / costs[bs] if running else 0.0)
        for name, options in POLICIES.items():
            executed = stats[name]["decode"]
            ideal = _ideal(seconds["stock"], seconds["truncated"], depth, num_layers, executed)
            rows.append({"batch_size": bs, "kv": options["kv"], "depth": depth, "exiting_rows": int(exiting.sum()),
                         "mean_executed_layers": executed,
                         "speedup_vs_stock": seconds["stock"] / seconds[name],
                         "realized_over_ideal": ideal / seconds[name],
                         "row_cost_ideal_speedup": seconds["stock"] / row_ideal, "stock_s": seconds["stock"],
                         "truncated_s": seconds["truncated"], "skip_s": seconds[name]})
    return rows


@torch.no_grad()
def decode_agreement(model: Any, batch: dict, new: torch.Tensor) -> float:
    """Share of the generated tokens `new` (B, n) equal to the full model's top-1 after the same prefix (one
    forward of the stock model over prompt + output)."""
    ids = torch.cat([batch["input_ids"], new], dim=1)
    mask = torch.cat([batch["attention_mask"], torch.ones_like(new)], dim=1)
    logits = model(input_ids=ids, attention_mask=mask).logits
    width = batch["input_ids"].shape[1]
    top1 = logits[:, width - 1 : -1].argmax(-1)
    return float((top1 == new).float().mean())


def real_router(model: Any, router: TideRouter, prompts: list[torch.Tensor], chunks: list[torch.Tensor],
                pad_id: int, batch_sizes: list[int], targets: list[float], new_tokens: int, reps: int,
                depth: int) -> dict:
    """Real router decisions at each quality target in skip mode: decode per batch size, and prefill."""
    num_layers = router.config.num_hidden_layers
    decode, prefill = [], []
    for target in targets:
        for name, policy in POLICIES.items():
            options = {"min_agreement": target, **policy}
            for bs in batch_sizes:
                batch = left_pad(prompts[:bs], pad_id)
                stats: dict = {}
                runs = {"stock": _stock_call(model, batch, new_tokens),
                        "tide": _skip_call(model, router, batch, new_tokens, stats, **options),
                        "truncated": _stock_call(model, batch, new_tokens, depth)}
                seconds = timed_runs(runs, reps, f"target {target} {name} batch {bs}")
                with attach(model, router, mode="skip", **options) as handle:
                    out, _ = generate(model, batch, new_tokens, tide=True)
                    executed = handle.last_stats.decode.mean_executed
                    alone = []  # the same prompts one at a time: what batching must not change
                    for p in prompts[:bs] if bs > 1 else []:
                        generate(model, left_pad([p], pad_id), new_tokens, tide=True)
                        alone.append(handle.last_stats.decode.mean_executed)
                ideal = _ideal(seconds["stock"], seconds["truncated"], depth, num_layers, executed)
                decode.append({"target": target, "kv": policy["kv"], "batch_size": bs, "mean_executed_layers": executed,
                               "alone_mean_executed_layers": statistics.mean(alone) if alone else executed,
                               "speedup_vs_stock": seconds["stock"] / seconds["tide"],
                               "realized_over_ideal": ideal / seconds["tide"],
                               "top1_agreement": decode_agreement(model, batch, out)})
        prefill.append(_prefill(model, router, chunks, target, reps))
    return {"decode": decode, "prefill": prefill}


@torch.no_grad()
def _prefill(model: Any, router: TideRouter, chunks: list[torch.Tensor], target: float, reps: int) -> dict:
    """One forward over the chunks (B x chunk length): stock vs skip mode at `target` (kv="propagate": a
    prefill's exited positions are read by later ones in the same forward)."""
    ids = torch.stack(chunks)
    stock_logits = model(input_ids=ids).logits
    with attach(model, router, mode="skip", kv="propagate", min_agreement=target) as handle:
        runs = {"stock": _seconds(lambda: _stock_forward(model, handle, ids)),
                "tide": _seconds(lambda: model(input_ids=ids))}
        seconds = timed_runs(runs, reps, f"prefill, target {target}")
        logits = model(input_ids=ids).logits
        stats = handle.last_stats.prefill
    agreement = float((logits.argmax(-1) == stock_logits.argmax(-1)).float().mean())
    return {"target": target, "kv": "propagate", "rows": ids.shape[0], "positions": ids.shape[1],
            "mean_executed_layers": stats.mean_executed, "exit_rate": stats.exit_rate,
            "speedup_vs_stock": seconds["stock"] / seconds["tide"], "top1_agreement": agreement}


def _stock_forward(model: Any, handle: Any, ids: torch.Tensor) -> Any:
    """The model's forward as if TIDE were not attached."""
    with handle.disabled():
        return model(input_ids=ids)


def run_batches(model: Any, router: TideRouter, prompts: list[torch.Tensor], chunks: list[torch.Tensor], pad_id: int,
                args: Any) -> dict:
    """The `batches` bench JSON: the decode step's cost by rows, forced per-row exits and real router decisions,
    decode and prefill."""
    depth = args.forced_depth or default_forced_depth(list(router.config.checkpoint_layers),
                                                      router.config.num_hidden_layers)
    counts = sorted({1, *args.batch_sizes, *(bs - bs // 2 for bs in args.batch_sizes if bs > 1)})
    costs = step_cost(model, prompts, pad_id, counts, STEP_COST_STEPS, args.reps)
    by_rows = {c["rows"]: c["step_s"] for c in costs}
    return {"step_cost": costs,
            "forced": forced(model, router, prompts, pad_id, args.batch_sizes, depth, args.new_tokens, args.reps,
                             by_rows),
            "router": real_router(model, router, prompts, chunks, pad_id, args.batch_sizes, args.targets,
                                  args.new_tokens, args.reps, depth)}
