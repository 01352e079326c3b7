"""`tide-hf bench`: stock generate and TIDE side by side, in one process, on the same prompts.

Speed is a ratio against stock transformers measured in the same run: the overhead run interleaves stock
and TIDE repetition by repetition; the quality rows time stock once, before every threshold's run on the
same prompts (their speed ratio is a by-product of generating the continuations they compare). Quality is
reported beside speed (greedy continuation match against stock, perplexity on text the routers were never
calibrated on).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from tide_hf.assets import default_dataset, load_model
from tide_hf.calibration import pad_token_id
from tide_hf.integrations import attach
from tide_hf.modeling import TideRouter
from tide_hf.modeling.files import check_results_folder
from tide_hf.record import CLOSED

from .measure import check_exit_depths, evaluation_text, generate, left_pad, match_rate, perplexity
from .tables import (
    format_baselines,
    format_batches,
    format_continuous,
    format_kernels,
    format_linears,
    format_modes,
    format_speculative,
    format_synthetic,
    format_table,
)


def overhead(model: Any, router: TideRouter, prompts: list[torch.Tensor], pad_id: int, batch_sizes: list[int],
             new_tokens: int, reps: int) -> list[dict]:
    """Tokens/s of stock vs TIDE attached with exits disabled (threshold `CLOSED`), interleaved."""
    rows = []
    for bs in batch_sizes:
        batch = left_pad(prompts[:bs], pad_id)
        generate(model, batch, 2)  # warm-up
        times = {"stock": 0.0, "tide": 0.0}
        handle = attach(model, router, exit_threshold=CLOSED, mode="select")
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


def quality(model: Any, routers: dict[str, TideRouter], thresholds: list[float], prompts: list[torch.Tensor],
            chunks: list[torch.Tensor], pad_id: int, batch_size: int, new_tokens: int) -> dict:
    """Exit rate, mean layers, greedy match and perplexity change per router (by the name it was given) and
    threshold; the speed ratio divides stock's time, taken once before the first threshold, by each
    threshold's (not interleaved)."""
    batches = [left_pad(prompts[i : i + batch_size], pad_id) for i in range(0, len(prompts), batch_size)]
    stock_runs = [generate(model, b, new_tokens) for b in batches]
    stock_tokens = torch.cat([t for t, _ in stock_runs])
    stock_s = sum(s for _, s in stock_runs)
    base_ppl, _ = perplexity(model, chunks, batch_size)
    rows = []
    for name, router in routers.items():
        for thr in tqdm(thresholds, desc=f"quality ({name})", leave=False):
            handle = attach(model, router, exit_threshold=thr, mode="select")
            try:
                tokens, seconds, decode_tok, exited, layers = [], 0.0, 0, 0.0, 0.0
                for b in batches:
                    t, s = generate(model, b, new_tokens, tide=True)
                    tokens.append(t)
                    seconds += s
                    d = handle.last_stats.decode
                    decode_tok, exited, layers = (decode_tok + d.tokens, exited + d.exit_rate * d.tokens,
                                                  layers + d.mean_layers * d.tokens)
                exact, prefix = match_rate(torch.cat(tokens), stock_tokens)
                ppl, prefill = perplexity(model, chunks, batch_size)
            finally:
                handle.detach()
            rows.append({"router": name, "label": router.config.label, "threshold": thr,
                         "decode_exit_rate": exited / decode_tok, "decode_mean_layers": layers / decode_tok,
                         "prefill_exit_rate": prefill.exit_rate, "prefill_mean_layers": prefill.mean_layers,
                         "greedy_exact_match": exact, "greedy_prefix_match": prefix, "perplexity": ppl,
                         "perplexity_change": ppl / base_ppl - 1.0, "speed_ratio": stock_s / seconds})
    return {"stock_perplexity": base_ppl, "rows": rows}


def run(args: Any) -> dict:
    """The `tide-hf bench SECTION` command (`args.section`): writes JSON and Markdown tables to `args.output` and
    prints them.

    `overhead`: overhead and quality of TIDE vs stock. `modes`: skip mode vs stock and ideal, and speculative mode
    vs stock and `assistant_early_exit` (`--near-identity-after K`: the same on the model with the layers after K
    made near-identity). `batches`: skip mode in batches. `continuous`: skip mode in continuous batching.
    `baselines`: TIDE vs fixed depth, static skipping and softmax confidence. `linears`: eager vs fast-path linear
    layers, forward costs and generation. `kernels`: fused kernels vs the
    PyTorch path. `synthetic`: a real architecture's shape with random weights. `gpu`: the GPU suite
    (`tide_hf.eval.gpu`).
    """
    out, section = Path(args.output), args.section
    if section in ("gpu", "synthetic", "kernels"):  # no text read: no --dataset
        check_results_folder(out, "--output")  # made when the first file is written (a refusal leaves none)
    else:
        check_results_folder(out, "--output", args.dataset)
    if section == "gpu":
        from .gpu import run_suite

        return run_suite(out, args.dry_run, args.command)
    if section == "synthetic":
        from .synthetic import run_synthetic

        return write_result(out, "synthetic", run_synthetic(args), format_synthetic)
    if section == "kernels":
        from .kernels import kernel_rows

        return write_result(out, "kernels", {"rows": kernel_rows(args.dtype)}, format_kernels)
    easy = section == "modes" and args.near_identity_after is not None
    routers = {name: TideRouter.from_pretrained(name) for name in args.router or []}  # a bad one fails before the model
    router = next(iter(routers.values()), None)  # modes, batches and baselines take one (the CLI refuses more)
    if section == "modes" and not easy:
        check_exit_depths(args.depths, router.config.checkpoint_layers, "--depths")
    model, tokenizer = load_model(args.model, args.dtype)
    if easy:
        return _easy_modes(model, tokenizer, args, out)
    pad_id = pad_token_id(tokenizer)
    prompts, chunks = evaluation_text(tokenizer, default_dataset(args.dataset), list(routers.values()),
                                      args.num_prompts, args.prompt_len, getattr(args, "num_chunks", 0),
                                      getattr(args, "chunk_len", 0))  # (continuous: no chunks)
    result = {"model": args.model, "device": str(next(model.parameters()).device),
              "torch_threads": torch.get_num_threads(),
              "settings": {k: v for k, v in vars(args).items() if k != "func"}}
    if section == "baselines":
        from .baselines import run_baselines
        from .plots import pareto

        result.update(run_baselines(model, tokenizer, router, default_dataset(args.dataset), prompts, chunks,
                                    pad_id, args))
        out.mkdir(parents=True, exist_ok=True)
        print("Pareto plot:", pareto(result, out / "pareto.png"))
        return write_result(out, "baselines", result, format_baselines)
    if section == "batches":
        from .batches import run_batches

        if args.forced_depth is not None:
            check_exit_depths([args.forced_depth], router.config.checkpoint_layers, "--forced-depth")
        result.update(run_batches(model, router, prompts, chunks, pad_id, args))
        return write_result(out, "batches", result, format_batches)
    if section == "continuous":
        from .continuous import run_continuous

        result.update(run_continuous(model, router, prompts, pad_id, args))
        return write_result(out, "continuous", result, format_continuous)
    if section == "linears":
        from .linears import run_linears

        result.update(run_linears(model, router, prompts, pad_id, args))
        return write_result(out, "linears", result, format_linears)
    if section == "modes":
        from .modes import run_modes

        result.update(run_modes(model, tokenizer, router, prompts, chunks, pad_id, args))
        return write_result(out, "modes", result, format_modes)
    result["overhead"] = overhead(model, router, prompts, pad_id, args.batch_sizes, args.new_tokens, args.reps)
    result["quality"] = quality(model, routers, args.thresholds, prompts, chunks, pad_id, args.quality_batch_size,
                                args.new_tokens)
    return write_result(out, "bench", result, format_table)


def _easy_modes(model: Any, tokenizer: Any, args: Any, out: Path) -> dict:
    """`bench modes --near-identity-after K`: the speculative section on the easy model, with routers calibrated
    on it, against stock and `assistant_early_exit=K` (writes modes-easy.json)."""
    from .easy import NEAR_IDENTITY_SCALE, easy_router, make_near_identity
    from .modes import speculative

    scale = NEAR_IDENTITY_SCALE if args.near_identity_scale is None else args.near_identity_scale
    make_near_identity(model, args.near_identity_after, scale)
    dataset = default_dataset(args.dataset)
    router = easy_router(model, tokenizer, dataset)
    pad_id = pad_token_id(tokenizer)
    # prompts only (no perplexity here): one one-token chunk is all evaluation_text must find
    prompts, _ = evaluation_text(tokenizer, dataset, router, args.num_prompts, args.prompt_len, 1, 1)
    batches = [left_pad(prompts[i : i + 1], pad_id) for i in range(len(prompts))]
    result = {"model": args.model, "device": str(next(model.parameters()).device),
              "torch_threads": torch.get_num_threads(), "near_identity": {"after": args.near_identity_after,
                                                                          "scale": scale},
              "settings": {k: v for k, v in vars(args).items() if k != "func"},
              "speculative": speculative(model, router, batches, left_pad(prompts[: args.quality_batch_size], pad_id),
                                         args.new_tokens, args.reps, assisted_layer=args.near_identity_after)}
    return write_result(out, "modes-easy", result, lambda r: format_speculative(r["speculative"]))


def write_result(out: Path, name: str, result: dict, formatter: Any) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(result, indent=2))
    table = formatter(result)
    (out / f"{name}.md").write_text(table + "\n")
    print(table)
    return result
