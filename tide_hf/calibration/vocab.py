"""The draft vocabulary: the tokens a model emits most often, so speculative drafts can skip the rest of its head.

A draft forward of speculative mode ends in the LM head, a vocab x hidden matmul that is a large share of a
shallow forward when the vocabulary is large next to the layers (a third of SmolLM2-135M's 16-layer draft).
Drafts only propose tokens, each checked by the full model, so their logits may cover only the tokens the model
is likely to emit (FR-Spec, Zhao et al. 2025). Calibration ranks tokens by how often they are the final layer's
top-1 on the training tokens (ties: lower token id first) and measures, for each candidate size n (powers of
two from `DRAFT_VOCAB_MIN`, below the vocabulary size), the coverage: the share of held-out tokens whose final
top-1 is among the first n.
A draft can only be right where the token is covered, so speculative mode weighs each size's cheaper draft
against its lost acceptance and takes the best (`tide_hf.integrations.draft.draft_plan`).
"""

from __future__ import annotations

import torch

from ..modeling import TideRouter
from .labels import Collected

DRAFT_VOCAB_MIN = 256  # the smallest candidate size (below it the head is a negligible share of any draft)


def candidate_sizes(vocab_size: int) -> list[int]:
    """Powers of two from `DRAFT_VOCAB_MIN` up to, not including, `vocab_size`."""
    sizes, n = [], DRAFT_VOCAB_MIN
    while n < vocab_size:
        sizes.append(n)
        n *= 2
    return sizes


def fit_draft_vocab(router: TideRouter, data: Collected, vocab_size: int) -> None:
    """Rank the vocabulary by the training tokens' final top-1 and store the ranking with the held-out coverage
    of each candidate size in `router` (nothing when the vocabulary is too small or nothing is held out)."""
    top1 = data.final_top1
    if bool((top1 < 0).any()):
        raise RuntimeError("fit_draft_vocab needs the final top-1 of every kept token: run `label` first")
    held = top1[data.is_val]
    sizes = candidate_sizes(vocab_size)
    if not sizes or held.numel() == 0:
        return
    counts = torch.bincount(top1[~data.is_val], minlength=vocab_size)
    ranking = torch.sort(counts, descending=True, stable=True).indices  # stable: ties keep token-id order
    rank = torch.empty_like(ranking)
    rank[ranking] = torch.arange(vocab_size)
    held_rank = rank[held]
    coverage = {str(n): float((held_rank < n).float().mean()) for n in sizes}
    router.set_draft_vocab(ranking[: sizes[-1]], coverage)
