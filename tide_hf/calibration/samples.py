"""Calibration samples: documents split into token chunks in a seeded order, the held-out remainder,
and the right-padded batches the model body runs on."""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from typing import Any

import torch

from ..config import TideRouterConfig


def pad_token_id(tokenizer: Any) -> int:
    """The tokenizer's pad id, or 0 without one: padded positions are masked out, so any id of the model's
    embeddings works."""
    pad = getattr(tokenizer, "pad_token_id", None)
    return pad if pad is not None else 0


# A long document is tokenized from a prefix of this many characters per token still wanted (doubled until it
# yields enough), so one huge file is never tokenized whole (~130 bytes of memory per byte of text) for a few
# samples; a document shorter than that is tokenized whole, as before.
CHARS_PER_TOKEN = 16
# Tokens read past the ones kept from a prefix: where the prefix is cut, tokenization may differ from the whole
# text's, so the kept tokens end this far from the cut.
CUT_MARGIN = 64
# Spread samples (`spread_chunks`) of a long document are spaced over at most this many chunks per sample taken.
SPREAD_SPAN = 16


def document_order(count: int, seed: int) -> list[int]:
    """The seeded order documents are read in (samples and the held-out split agree on it)."""
    return torch.randperm(count, generator=torch.Generator().manual_seed(seed)).tolist()


def leading_ids(tokenizer: Any, text: str, limit: int | None = None) -> list[int]:
    """The token ids of `text`, or (with `limit`) its first `limit` ids, tokenizing no more of it than they need."""
    chars = len(text) if limit is None else limit * CHARS_PER_TOKEN
    while chars < len(text):
        ids = tokenizer(text[:chars], add_special_tokens=False)["input_ids"]
        if len(ids) >= limit + CUT_MARGIN:
            return ids[:limit]
        chars *= 2
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def chunks_of(tokenizer: Any, text: str, seq_len: int, max_chunks: int | None = None) -> list[torch.Tensor]:
    """`text` split into chunks of at most `seq_len` tokens (only its first `max_chunks` when given)."""
    ids = leading_ids(tokenizer, text, None if max_chunks is None else max_chunks * seq_len)
    return [torch.tensor(ids[s : s + seq_len]) for s in range(0, len(ids), seq_len)]


def document_chunks(
    tokenizer: Any, texts: list[str], seq_len: int, seed: int
) -> Iterator[tuple[int, list[torch.Tensor]]]:
    """Documents in a seeded order, each split into chunks of at most `seq_len` tokens."""
    for i in document_order(len(texts), seed):
        yield i, chunks_of(tokenizer, texts[i], seq_len)


def spread_chunks(tokenizer: Any, text: str, seq_len: int, count: int) -> list[torch.Tensor]:
    """At most `count` chunks of `text`, evenly spaced through it (each at the middle of its share), so a sample
    is not always a document's opening; a long document's chunks spread over its first `SPREAD_SPAN` x `count`
    chunks (it is never tokenized whole)."""
    ids = leading_ids(tokenizer, text, SPREAD_SPAN * count * seq_len)
    slots = -(-len(ids) // seq_len)
    taken = min(count, slots)
    starts = [((2 * t + 1) * slots // (2 * taken)) * seq_len for t in range(taken)]
    return [torch.tensor(ids[s : s + seq_len]) for s in starts]


def spread_samples(tokenizer: Any, texts: list[str], num_samples: int, seq_len: int, seed: int
                   ) -> list[torch.Tensor]:
    """Documents in the seeded order, each giving at most n chunks evenly spaced through it (`spread_chunks`),
    n = ceil(num_samples / documents), doubled while documents that had more left the samples short."""
    order = document_order(len(texts), seed)
    per_document = -(-num_samples // max(len(texts), 1))
    while True:
        chunks: list[torch.Tensor] = []
        capped = False
        for i in order:
            got = spread_chunks(tokenizer, texts[i], seq_len, min(per_document, num_samples - len(chunks)))
            capped |= len(got) == per_document
            chunks.extend(got)
            if len(chunks) >= num_samples:
                return chunks
        if not capped:
            return chunks
        per_document *= 2


def make_samples(tokenizer: Any, texts: list[str], num_samples: int, seq_len: int, seed: int,
                 spread: bool = False) -> list[torch.Tensor]:
    """Split documents (in a seeded order) into chunks of at most `seq_len` tokens; take `num_samples` (a long
    document is tokenized only as far as the samples still wanted reach). Calibration reads consecutive chunks.
    With `spread` (`spread_samples`) the samples span as many documents as the text allows, which evaluation
    wants: consecutive chunks of a few long documents would measure those few (a document's tokens are
    correlated)."""
    if spread:
        chunks = spread_samples(tokenizer, texts, num_samples, seq_len, seed)
    else:
        chunks = []
        for i in document_order(len(texts), seed):
            chunks.extend(chunks_of(tokenizer, texts[i], seq_len, num_samples - len(chunks)))
            if len(chunks) >= num_samples:
                break
    if len(chunks) < num_samples:
        warnings.warn(f"the dataset yields only {len(chunks)} samples of <= {seq_len} tokens, fewer than the "
                      f"{num_samples} asked for; using all {len(chunks)}", stacklevel=3)
    return chunks[:num_samples]


def held_out_texts(tokenizer: Any, texts: list[str], cfg: TideRouterConfig) -> list[str]:
    """The documents a calibration with `cfg` never read (for honest evaluation on the same corpus); all of them
    for a router that records no reading (`num_samples` / `seq_len` None: made by hand, not by calibrate)."""
    if cfg.num_samples is None or cfg.seq_len is None:
        return list(texts)
    seen, used = 0, set()
    for i in document_order(len(texts), cfg.seed):
        if seen >= cfg.num_samples:
            break
        used.add(i)
        seen += len(chunks_of(tokenizer, texts[i], cfg.seq_len, cfg.num_samples - seen))
    return [t for i, t in enumerate(texts) if i not in used]


def pad_right(batch: list[torch.Tensor], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ids and attention mask of token sequences of different lengths."""
    width = max(len(s) for s in batch)
    ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for row, s in enumerate(batch):
        ids[row, : len(s)], mask[row, : len(s)] = s, 1
    return ids, mask

