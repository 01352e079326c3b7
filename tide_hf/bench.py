"""`tide-hf bench`: stock generate and TIDE side by side, in one process, on the same prompts.

Speed is a ratio against stock transformers measured in the same run, interleaved repetition by
repetition; quality is reported beside it (greedy continuation match against stock, perplexity on text
the routers were never calibrated on).
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from .attach import attach, get_handle, last_stats
from .calibrate import _pad, held_out_texts
from .data import load_texts
from .router import TideRouter
from .stats import PhaseStats


def _left_pad(rows: list[torch.Tensor], pad_id: int) -> dict[str, torch.Tensor]:
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, width - len(r):], mask[i, width - len(r):] = r, 1
    return {"input_ids": ids, "attention_mask": mask}


def evaluation_text(tokenizer: Any, dataset: str, router: TideRouter, num_prompts: int, prompt_len: int,
                    num_chunks: int, chunk_len: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Prompts and perplexity chunks from documents the router's calibration never read."""
    texts = held_out_texts(tokenizer, load_texts(dataset), router.config)
    ids = [torch.tensor(tokenizer(t, add_special_tokens=False)["input_ids"]) for t in texts]
    prompts = [d[:prompt_len] for d in ids if len(d) > prompt_len][:num_prompts]
    chunks = [d[prompt_len : prompt_len + chunk_len] for d in ids if len(d) >= prompt_len + chunk_len][:num_chunks]
    if len(prompts) < num_prompts or len(chunks) < num_chunks:
        raise ValueError(f"held-out text too short: {len(prompts)} prompts / {len(chunks)} chunks available")
    return prompts, chunks


@torch.no_grad()
def generate(model: Any, batch: dict, new_tokens: int, **kwargs: Any) -> tuple[torch.Tensor, float]:
    """Greedy continuation (new tokens only) and wall seconds."""
    started = time.perf_counter()
    out = model.generate(**batch, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, **kwargs)
    return out[:, batch["input_ids"].shape[1]:], time.perf_counter() - started


@torch.no_grad()
def perplexity(model: Any, chunks: list[torch.Tensor], batch_size: int) -> tuple[float, PhaseStats | None]:
    """Teacher-forced perplexity and, with TIDE attached, the exits of all positions (prefill exits)."""
    nll, count, exits = 0.0, 0, None
    for i in range(0, len(chunks), batch_size):
        ids, mask = _pad(chunks[i : i + batch_size], 0)
        logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1].float()
        target, keep = ids[:, 1:], mask[:, 1:].bool()
        losses = torch.nn.functional.cross_entropy(logits.transpose(1, 2), target, reduction="none")
        nll, count = nll + float(losses[keep].sum()), count + int(keep.sum())
        stats = last_stats(model) if get_handle(model) is not None else None
        if stats is not None:
            exits = exits or PhaseStats(stats.num_layers)
            exits.exits.update(stats.prefill.exits)
            exits.executed.update(stats.prefill.executed)
    return math.exp(nll / count), exits


def match_rate(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float]:
    """(share of continuations identical to stock, mean share of tokens before the first divergence)."""
    same = a == b
    prefix = same.int().cumprod(dim=1).sum(dim=1).float() / a.shape[1]
    return float(same.all(dim=1).float().mean()), float(prefix.mean())


def overhead(model: Any, router: TideRouter, prompts: list[torch.Tensor], pad_id: int, batch_sizes: list[int],
             new_tokens: int, reps: int) -> list[dict]:
    """Tokens/s of stock vs TIDE attached with exits disabled (threshold 1.0), interleaved."""
    rows = []
    for bs in batch_sizes:
        batch = _left_pad(prompts[:bs], pad_id)
        generate(model, batch, 2)  # warm-up
        times = {"stock": 0.0, "tide": 0.0}
        handle = attach(model, router, exit_threshold=1.0)
        try:
            for _ in tqdm(range(reps), desc=f"overhead bs{bs}", leave=False):
                for name, flag in (("stock", False), ("tide", True)):
                    times[name] += generate(model, batch, new_tokens, tide=flag)[1]
        finally:
            handle.detach()
        tokens = reps * bs * new_tokens
        rows.append({"batch_size": bs, "stock_tok_s": tokens / times["stock"], "tide_tok_s": tokens / times["tide"],
                     "ratio": times["stock"] / times["tide"]})
    return rows


def quality(model: Any, routers: list[TideRouter], thresholds: list[float], prompts: list[torch.Tensor],
            chunks: list[torch.Tensor], pad_id: int, batch_size: int, new_tokens: int) -> dict:
    """Exit rate, mean layers, greedy match and perplexity change per label kind and threshold."""
    batches = [_left_pad(prompts[i : i + batch_size], pad_id) for i in range(0, len(prompts), batch_size)]
    stock_runs = [generate(model, b, new_tokens) for b in batches]
    stock_tokens = torch.cat([t for t, _ in stock_runs])
    stock_s = sum(s for _, s in stock_runs)
    base_ppl, _ = perplexity(model, chunks, batch_size)
    rows = []
    for router in routers:
        for thr in tqdm(thresholds, desc=f"quality ({router.config.label})", leave=False):
            handle = attach(model, router, exit_threshold=thr)
            try:
                tokens, seconds, decode_tok, exited, layers = [], 0.0, 0, 0.0, 0.0
                for b in batches:
                    t, s = generate(model, b, new_tokens, tide=True)
                    tokens.append(t)
                    seconds += s
                    d = handle.last_stats.decode
                    decode_tok, exited, layers = decode_tok + d.tokens, exited + d.exit_rate * d.tokens, layers + d.mean_layers * d.tokens
                exact, prefix = match_rate(torch.cat(tokens), stock_tokens)
                ppl, prefill = perplexity(model, chunks, batch_size)
            finally:
                handle.detach()
            rows.append({"label": router.config.label, "threshold": thr, "decode_exit_rate": exited / decode_tok,
                         "decode_mean_layers": layers / decode_tok, "prefill_exit_rate": prefill.exit_rate,
                         "prefill_mean_layers": prefill.mean_layers,
                         "greedy_exact_match": exact, "greedy_prefix_match": prefix, "perplexity": ppl,
                         "perplexity_change": ppl / base_ppl - 1.0, "speed_ratio": stock_s / seconds})
    return {"stock_perplexity": base_ppl, "rows": rows}


def format_table(result: dict) -> str:
    """Markdown tables of a bench result (the README shows these)."""
    lines = ["| batch | stock tok/s | TIDE (exits off) tok/s | ratio |", "|---|---|---|---|"]
    for r in result["overhead"]:
        lines.append(f"| {r['batch_size']} | {r['stock_tok_s']:.1f} | {r['tide_tok_s']:.1f} | {r['ratio']:.3f} |")
    lines += ["", f"stock perplexity {result['quality']['stock_perplexity']:.3f}", "",
              "| label | threshold | decode exit rate | mean layers | greedy exact | greedy prefix | ppl change | speed vs stock |",
              "|---|---|---|---|---|---|---|---|"]
    for r in result["quality"]["rows"]:
        lines.append(f"| {r['label']} | {r['threshold']} | {r['decode_exit_rate']:.1%} | {r['decode_mean_layers']:.2f} | "
                     f"{r['greedy_exact_match']:.1%} | {r['greedy_prefix_match']:.1%} | {r['perplexity_change']:+.2%} | "
                     f"{r['speed_ratio']:.3f} |")
    return "\n".join(lines)


def run(args: Any) -> dict:
    """The `tide-hf bench` command: writes JSON and Markdown tables to `args.output` and prints them.

    Default: overhead and quality of TIDE vs stock. `--modes`: skip mode vs stock and ideal.
    `--baselines`: TIDE vs fixed depth, static skipping and softmax confidence. `--kernels`: fused kernels
    vs the PyTorch path.
    """
    from .cli import default_dataset, load_model

    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    if args.kernels:
        return _write(out, "kernels", {"rows": kernel_rows(args.dtype)}, format_kernels)
    model, tokenizer = load_model(args.model, args.dtype)
    routers = [TideRouter.from_pretrained(r) for r in args.router]
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    prompts, chunks = evaluation_text(tokenizer, default_dataset(args.dataset), routers[0], args.num_prompts,
                                      args.prompt_len, args.num_chunks, args.chunk_len)
    result = {"model": args.model, "device": str(next(model.parameters()).device),
              "torch_threads": torch.get_num_threads(),
              "settings": {k: v for k, v in vars(args).items() if k != "func"}}
    if args.baselines:
        from .baselines import format_baselines, run_baselines
        from .plots import pareto

        result.update(run_baselines(model, tokenizer, routers[-1], default_dataset(args.dataset), prompts, chunks,
                                    pad_id, args))
        print("Pareto plot:", pareto(result, out / "pareto.png"))
        return _write(out, "baselines", result, format_baselines)
    if args.modes:
        from .bench_modes import format_modes, run_modes

        result.update(run_modes(model, routers[-1], prompts, chunks, pad_id, args))
        return _write(out, "modes", result, format_modes)
    result["overhead"] = overhead(model, routers[0], prompts, pad_id, args.batch_sizes, args.new_tokens, args.reps)
    result["quality"] = quality(model, routers, args.thresholds, prompts, chunks, pad_id, args.quality_batch_size,
                                args.new_tokens)
    return _write(out, "bench", result, format_table)


def kernel_rows(dtype: str) -> list[dict]:
    """Microbenchmark of the fused kernels at SmolLM2's and an 8B model's hidden size, on this machine."""
    from .kernels import microbench

    device = "cuda" if torch.cuda.is_available() else "cpu"
    shapes = [(1, 576, 128), (8, 576, 128), (64, 576, 128), (1, 4096, 128), (256, 4096, 128)]
    return microbench(shapes, getattr(torch, dtype), device)


def format_kernels(result: dict) -> str:
    keys = ["rows", "hidden", "bottleneck", "dtype", "backend", "kernel_us", "torch_us", "speedup"]
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    for r in result["rows"]:
        lines.append("| " + " | ".join(f"{r[k]:.1f}" if isinstance(r[k], float) else str(r[k]) for k in keys) + " |")
    return "\n".join(lines)


def _write(out: Path, name: str, result: dict, formatter: Any) -> dict:
    (out / f"{name}.json").write_text(json.dumps(result, indent=2))
    table = formatter(result)
    (out / f"{name}.md").write_text(table + "\n")
    print(table)
    return result
