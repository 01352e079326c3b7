"""Measurement helpers shared by bench, modes, baselines and synthetic: held-out prompts, timed greedy
generation, teacher-forced perplexity and greedy continuation match against stock."""

from __future__ import annotations

import math
import time
from typing import Any

import torch

from tide_hf.calibration import held_out_texts, load_texts, pad_right
from tide_hf.errors import TideArgumentError, TideDataError
from tide_hf.integrations import enable_generate_keyword
from tide_hf.modeling import TideRouter
from tide_hf.runtime import PhaseStats, get_handle, last_stats


def check_exit_depths(depths: list[int], checkpoints: list[int], flag: str) -> None:
    """Forced exits happen at checkpoints only: a depth between them would be measured at the next one, under
    a name that says otherwise."""
    wrong = [d for d in depths if d not in checkpoints]
    if wrong:
        raise TideArgumentError(f"{flag} {' '.join(map(str, wrong))}: tokens exit only at a checkpoint, here "
                                f"after {', '.join(map(str, checkpoints))} layers")


def left_pad(rows: list[torch.Tensor], pad_id: int) -> dict[str, torch.Tensor]:
    """A left-padded batch (ids and mask), as generate wants its prompts."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, width - len(r):], mask[i, width - len(r):] = r, 1
    return {"input_ids": ids, "attention_mask": mask}


def evaluation_text(tokenizer: Any, dataset: str, routers: TideRouter | list[TideRouter], num_prompts: int,
                    prompt_len: int, num_chunks: int, chunk_len: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Prompts and perplexity chunks from documents no router's calibration read (routers calibrated with other
    samples or seeds read other documents: each is evaluated on text it never saw)."""
    texts: list[str] | None = None
    for router in [routers] if isinstance(routers, TideRouter) else routers:
        held = held_out_texts(tokenizer, load_texts(dataset, unique=router.config.unique_documents), router.config)
        texts = held if texts is None else [t for t in texts if t in set(held)]
    ids = [torch.tensor(tokenizer(t, add_special_tokens=False)["input_ids"]) for t in texts]
    prompts = [d[:prompt_len] for d in ids if len(d) > prompt_len][:num_prompts]
    chunks = [d[prompt_len : prompt_len + chunk_len] for d in ids if len(d) >= prompt_len + chunk_len][:num_chunks]
    if len(prompts) < num_prompts or len(chunks) < num_chunks:
        raise TideDataError(f"held-out text too short: {len(prompts)} prompts of {prompt_len} tokens / {len(chunks)} "
                            f"chunks of {chunk_len} available, {num_prompts} / {num_chunks} asked for")
    return prompts, chunks


@torch.no_grad()
def generate(model: Any, batch: dict, new_tokens: int, **kwargs: Any) -> tuple[torch.Tensor, float]:
    """Greedy continuation (new tokens only) and wall seconds (a `tide=` keyword in `kwargs` is taught to stock
    generate first)."""
    if "tide" in kwargs:
        enable_generate_keyword()
    started = time.perf_counter()
    out = model.generate(**batch, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, **kwargs)
    return out[:, batch["input_ids"].shape[1]:], time.perf_counter() - started


@torch.no_grad()
def perplexity(model: Any, chunks: list[torch.Tensor], batch_size: int) -> tuple[float, PhaseStats | None]:
    """Teacher-forced perplexity and, with TIDE attached, the exits of the positions it scores (prefill exits).

    Each chunk's last token is a target only: it is not fed (its prediction would not be scored, and its exit
    would count in the statistics); a causal model's other logits do not change.
    """
    nll, count, exits = 0.0, 0, None
    for i in range(0, len(chunks), batch_size):
        ids, mask = pad_right(chunks[i : i + batch_size], 0)
        if ids.shape[1] < 2:  # one-token chunks: nothing to predict
            continue
        target, keep = ids[:, 1:], mask[:, 1:].bool()  # right padding: mask[:, 1:] is each row's scored prefix
        logits = model(input_ids=ids[:, :-1], attention_mask=mask[:, 1:]).logits.float()
        losses = torch.nn.functional.cross_entropy(logits.transpose(1, 2), target, reduction="none")
        nll, count = nll + float(losses[keep].sum()), count + int(keep.sum())
        stats = last_stats(model) if get_handle(model) is not None else None
        if stats is not None:
            exits = exits or PhaseStats(stats.num_layers)
            exits.merge(stats.prefill)
    return math.exp(nll / count), exits


def match_rate(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float]:
    """(share of continuations identical to stock, mean share of tokens before the first divergence)."""
    same = a == b
    prefix = same.int().cumprod(dim=1).sum(dim=1).float() / a.shape[1]
    return float(same.all(dim=1).float().mean()), float(prefix.mean())
