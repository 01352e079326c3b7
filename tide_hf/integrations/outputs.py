"""A batch decoded row by row, re-assembled the way stock batched generate lays out its output.

Speculative mode decodes each row alone (stock assisted decoding takes one row at a time). Stock batched
generate runs every row until the last one ends: a row that ended gets the pad id (the EOS id without one) at
each later step, and its later scores, logits, hidden states and cache entries come from forwards of those
pad tokens. A row decoded alone never ran those forwards, so the re-assembly fills them in: sequences with
the pad id; scores and logits with a row that gives the pad id all the mass (0 there, -inf elsewhere: the
certainty with which the row emits it, so `compute_transition_scores` reads 0 for it); hidden states and
attentions with zeros; the cache with zero keys and values, every layer as long as stock's. Every step at
which a row was still generating equals stock's for that row.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from transformers.cache_utils import Cache, DynamicLayer, DynamicSlidingWindowLayer

from ..errors import TideArgumentError, TideUnsupportedError

STACKABLE_LAYERS = (DynamicLayer, DynamicSlidingWindowLayer)  # cache layers whose rows re-assemble exactly
Filler = Callable[[Tensor], Tensor]  # a step's tensor of a row that had ended, from another row's tensor


def first_id(value: Any) -> int | None:
    """The first token id of an int, a list or a tensor of them (None for none)."""
    ids = None if value is None else torch.as_tensor(value).reshape(-1)
    return None if ids is None or ids.numel() == 0 else int(ids[0])


def pad_id(gc: Any) -> int | None:
    """The id stock batched generate writes after a row's EOS: the pad id, else the (first) EOS id."""
    pad = first_id(gc.pad_token_id)
    return first_id(gc.eos_token_id) if pad is None else pad


def stack_rows(rows: list[Tensor], gc: Any) -> Tensor:
    """Right-pad the rows' sequences with the id stock batched generate pads with after EOS."""
    pad = pad_id(gc)
    width = max(r.shape[1] for r in rows)
    if pad is None and any(r.shape[1] != width for r in rows):
        raise TideArgumentError("rows ended at different lengths but there is neither a pad nor an EOS token id to "
                                "pad with")
    return torch.cat([torch.nn.functional.pad(r, (0, width - r.shape[1]), value=pad or 0) for r in rows], dim=0)


def stack_outputs(rows: list[Any], gc: Any) -> Any:
    """One output for the batch from one per row (tensors of sequences, or `return_dict_in_generate` outputs),
    laid out as stock batched generate lays it out."""
    if isinstance(rows[0], Tensor):
        return stack_rows(rows, gc)
    pad = pad_id(gc)
    fields: dict[str, Any] = {}
    for key, first in rows[0].items():
        values = [row.get(key) for row in rows]
        if key == "sequences":
            fields[key] = stack_rows(values, gc)
        elif isinstance(first, Cache):
            fields[key] = stack_caches(values)
        elif key in ("scores", "logits"):
            fields[key] = stack_steps(values, lambda t: certain(t, pad))
        elif isinstance(first, tuple):
            fields[key] = stack_steps(values, torch.zeros_like)
        else:
            raise TideUnsupportedError(f"speculative mode decodes a batch row by row and cannot re-assemble the "
                                       f"output field {key!r} ({type(first).__name__}); pass one row per call")
    return type(rows[0])(**fields)


def certain(template: Tensor, token: int | None) -> Tensor:
    """Scores of a row that emits `token` with certainty: 0 there, -inf elsewhere."""
    if token is None:  # rows that ended early without a pad id are refused by `stack_rows`
        raise TideArgumentError("rows ended at different lengths but there is neither a pad nor an EOS token id")
    out = torch.full_like(template, -torch.inf)
    out[..., token] = 0.0
    return out


def stack_steps(rows: list[tuple], fill: Filler) -> tuple:
    """Per-step tuples (of tensors, or of per-layer tuples of tensors) of each row, concatenated over rows; a
    step a row did not reach is `fill`ed from another row's tensor of that step."""
    steps = max(len(row) for row in rows)
    return tuple(stack_step([row[t] if t < len(row) else None for row in rows], fill) for t in range(steps))


def stack_step(items: list[Any], fill: Filler) -> Any:
    template = next(item for item in items if item is not None)
    if isinstance(template, Tensor):
        return torch.cat([fill(template) if item is None else item for item in items], dim=0)
    if template is None or not isinstance(template, tuple):
        return template
    return tuple(stack_step([None if item is None else item[j] for item in items], fill)
                 for j in range(len(template)))


def stack_caches(caches: list[Any]) -> Any:
    """The rows' KV caches as one batch cache: each row's keys and values right-padded with zeros to the longest
    row's length (the positions at which stock fed the row pad tokens), sliding-window layers then cut to the
    window the longest row keeps."""
    if any(cache is None for cache in caches):
        return None
    stacked = copy.copy(caches[0])
    stacked.layers = [stack_layer(list(layers)) for layers in zip(*(cache.layers for cache in caches))]
    return stacked


def stack_layer(layers: list[Any]) -> Any:
    kinds = {type(layer) for layer in layers}
    if len(kinds) != 1 or not issubclass(kinds.pop(), STACKABLE_LAYERS) or \
            any(layer.keys is None or layer.keys.dim() != 4 for layer in layers):
        raise TideUnsupportedError(f"speculative mode decodes a batch row by row and cannot re-assemble a "
                                   f"{type(layers[0]).__name__} cache layer into one batch cache; pass one row per "
                                   "call, or return_dict_in_generate=False")
    seen = [getattr(layer, "cumulative_length", layer.keys.shape[-2]) for layer in layers]  # tokens each row fed
    longest = max(seen)
    keys = [torch.nn.functional.pad(layer.keys, (0, 0, 0, longest - n)) for layer, n in zip(layers, seen)]
    values = [torch.nn.functional.pad(layer.values, (0, 0, 0, longest - n)) for layer, n in zip(layers, seen)]
    kept = min(k.shape[-2] for k in keys)  # a sliding window keeps the last positions of the longest row
    out = copy.copy(layers[seen.index(longest)])
    out.keys = torch.cat([k[..., k.shape[-2] - kept:, :] for k in keys], dim=0)
    out.values = torch.cat([v[..., v.shape[-2] - kept:, :] for v in values], dim=0)
    if hasattr(out, "record_past"):  # assisted decoding's past recording: stock batched decoding keeps none
        out.record_past = False
    return out
