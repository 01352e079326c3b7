"""Calibration samples: documents split into token chunks in a seeded order, the held-out remainder,
and the right-padded batches the model body runs on."""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from typing import Any

import torch

from ..config import TideRouterConfig


def pad_token_id(tokenizer: Any) -> int:
    """The tokenizer's pad id, or 0 without one: padded positions are masked out, so any id works."""
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0


def document_chunks(
    tokenizer: Any, texts: list[str], seq_len: int, seed: int
) -> Iterator[tuple[int, list[torch.Tensor]]]:
    """Documents in a seeded order, each split into chunks of at most `seq_len` tokens."""
    for i in torch.randperm(len(texts), generator=torch.Generator().manual_seed(seed)).tolist():
        ids = tokenizer(texts[i], add_special_tokens=False)["input_ids"]
        yield i, [torch.tensor(ids[s : s + seq_len]) for s in range(0, len(ids), seq_len)]


def make_samples(tokenizer: Any, texts: list[str], num_samples: int, seq_len: int, seed: int) -> list[torch.Tensor]:
    """Split documents (in a seeded order) into chunks of at most `seq_len` tokens; take `num_samples`."""
    chunks: list[torch.Tensor] = []
    for _, doc in document_chunks(tokenizer, texts, seq_len, seed):
        chunks.extend(doc)
        if len(chunks) >= num_samples:
            break
    if len(chunks) < num_samples:
        warnings.warn(f"the dataset yields only {len(chunks)} samples of <= {seq_len} tokens, fewer than the "
                      f"{num_samples} asked for; calibrating on all {len(chunks)}", stacklevel=3)
    return chunks[:num_samples]


def held_out_texts(tokenizer: Any, texts: list[str], cfg: TideRouterConfig) -> list[str]:
    """The documents a calibration with `cfg` never read (for honest evaluation on the same corpus)."""
    seen, used = 0, set()
    for i, doc in document_chunks(tokenizer, texts, cfg.seq_len, cfg.seed):
        if seen >= cfg.num_samples:
            break
        used.add(i)
        seen += len(doc)
    return [t for i, t in enumerate(texts) if i not in used]


def pad_right(batch: list[torch.Tensor], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ids and attention mask of token sequences of different lengths."""
    width = max(len(s) for s in batch)
    ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for row, s in enumerate(batch):
        ids[row, : len(s)], mask[row, : len(s)] = s, 1
    return ids, mask

