"""What `tide-hf bench`'s sections run on: their results folder, routers, text and result files, and the overhead
section's measurements (stock generate and TIDE side by side, in one process, on the same prompts).

Speed is a ratio against stock transformers measured in the same run: the overhead run interleaves stock
and TIDE repetition by repetition; the quality rows time stock once, before every threshold's run on the
same prompts (their speed ratio is a by-product of generating the continuations they compare). Quality is
reported beside speed (greedy continuation match against stock, perplexity on text the routers were never
calibrated on).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, NamedTuple

import torch
from tqdm.auto import tqdm

from tide_hf.assets import default_dataset
from tide_hf.calibration import pad_token_id
from tide_hf.integrations import attach
from tide_hf.modeling import TideRouter
from tide_hf.modeling.files import check_results_folder
from tide_hf.record import CLOSED

from .measure import evaluation_text, generate, left_pad, match_rate, perplexity
from .tables import format_speculative


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


def results_folder(args: Any, reads_text: bool = True) -> Path:
    """The section's --output, checked (made when the first file is written, so a refusal leaves none); apart from
    the --dataset folder where the section `reads_text`."""
    out = Path(args.output)
    check_results_folder(out, "--output", *([args.dataset] if reads_text else []))
    return out


def load_routers(args: Any) -> dict[str, TideRouter]:
    """The --router routers by the names they were given, loaded before the model (a bad one fails first)."""
    return {name: TideRouter.from_pretrained(name) for name in args.router or []}


class TextSetup(NamedTuple):
    """What a section measured on held-out text starts from (`text_setup`)."""

    out: Path  # the checked results folder
    routers: dict[str, TideRouter]
    model: Any
    tokenizer: Any
    pad_id: int
    prompts: list
    chunks: list
    result: dict  # the result's header, which the section adds its figures to

    @property
    def router(self) -> TideRouter:
        """The router of a section that takes one."""
        (router,) = self.routers.values()
        return router


def text_setup(args: Any) -> TextSetup:
    """The results folder and the routers (checked and loaded before the model: a bad one fails first), the model
    and tokenizer, then `text_run`'s prompts, chunks and header."""
    from tide_hf.assets import load_model

    out, routers = results_folder(args), load_routers(args)
    model, tokenizer = load_model(args.model, args.dtype)
    return TextSetup(out, routers, model, tokenizer, *text_run(args, tokenizer, routers, model))


def text_run(args: Any, tokenizer: Any, routers: dict[str, TideRouter], model: Any) -> tuple[int, list, list, dict]:
    """The pad id, the held-out prompts and perplexity chunks (none where the section reads no --num-chunks) and
    the result's header (model, device, threads, settings)."""
    prompts, chunks = evaluation_text(tokenizer, default_dataset(args.dataset), list(routers.values()),
                                      args.num_prompts, args.prompt_len, getattr(args, "num_chunks", 0),
                                      getattr(args, "chunk_len", 0))
    return pad_token_id(tokenizer), prompts, chunks, result_header(args, model)


def result_header(args: Any, model: Any) -> dict:
    return {"model": args.model, "device": str(next(model.parameters()).device),
            "torch_threads": torch.get_num_threads(), "settings": {k: v for k, v in vars(args).items() if k != "func"}}


def easy_modes(model: Any, tokenizer: Any, args: Any, out: Path) -> dict:
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
    result = {**result_header(args, model), "near_identity": {"after": args.near_identity_after, "scale": scale},
              "speculative": speculative(model, router, batches, left_pad(prompts[: args.quality_batch_size], pad_id),
                                         args.new_tokens, args.reps, assisted_layer=args.near_identity_after)}
    return write_result(out, "modes-easy", result, lambda r: format_speculative(r["speculative"]))


def write_result(out: Path, name: str, result: dict, formatter: Any) -> dict:
    """`name`.json and its Markdown (`formatter`) in `out`, the Markdown printed."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(result, indent=2))
    table = formatter(result)
    (out / f"{name}.md").write_text(table + "\n")
    print(table)
    return result
