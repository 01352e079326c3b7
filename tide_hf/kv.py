"""Keeping the KV cache sound for layers that skip mode did not run.

`kv="recompute"`: see `KVRecompute` (exact deep K/V, filled later in one batched pass).

`kv="propagate"` (CALM-style state propagation): a skipped layer gets the K/V it would have computed if
its input were the exit hidden state, which is exactly what flows past it. Only the K and V
projections run (plus the layer's input norm, the K norm where the family has one, and rotary
embeddings), a small fraction of a layer, and every layer's cache keeps the same length.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn


def propagate_support(layer: nn.Module) -> str | None:
    """None when `propagate_kv` can run on `layer`, else the reason it cannot."""
    attn = getattr(layer, "self_attn", None)
    missing = [name for name, obj in (("self_attn", attn), ("input_layernorm", getattr(layer, "input_layernorm", None)))
               if obj is None]
    if attn is not None:
        missing += [a for a in ("k_proj", "v_proj", "head_dim", "layer_idx") if not hasattr(attn, a)]
        if not hasattr(sys.modules[type(attn).__module__], "apply_rotary_pos_emb"):
            missing.append("apply_rotary_pos_emb")
    if missing:
        return (f"{type(layer).__name__} lacks {', '.join(missing)}: kv='propagate' supports Llama-style attention "
                "(separate k_proj / v_proj with rotary embeddings)")
    return None


def propagate_kv(layer: nn.Module, hidden: torch.Tensor, kwargs: dict[str, Any]) -> None:
    """Append to the cache the K/V `layer` would produce for input `hidden` (B, T, H)."""
    cache = kwargs.get("past_key_values")
    if cache is None or not kwargs.get("use_cache", True):
        return
    attn = layer.self_attn
    x = layer.input_layernorm(hidden)
    shape = (*x.shape[:-1], -1, attn.head_dim)
    key = attn.k_proj(x).view(shape)
    if getattr(attn, "k_norm", None) is not None:  # Qwen3 / Gemma3 normalise each head (over head_dim)
        key = attn.k_norm(key)
    key, value = key.transpose(1, 2), attn.v_proj(x).view(shape).transpose(1, 2)
    cos, sin = kwargs["position_embeddings"]
    _, key = sys.modules[type(attn).__module__].apply_rotary_pos_emb(key, key, cos, sin)
    cache.update(key, value, attn.layer_idx)


@dataclass
class Pending:
    """Tokens of a skipped step whose deeper layers have not run yet: their state at `depth`."""

    hidden: torch.Tensor  # (B, T, H): output of layer `depth` for these positions
    depth: int
    cos: torch.Tensor  # rotary embeddings of these positions, (B, T, d)
    sin: torch.Tensor


def recompute_support(layer: nn.Module) -> str | None:
    """None when `KVRecompute` can catch `layer` up on skipped tokens, else the reason it cannot."""
    reason = propagate_support(layer)
    if reason is None and getattr(layer.self_attn, "sliding_window", None):
        reason = f"{type(layer).__name__} uses sliding-window attention; kv='recompute' supports full attention"
    return reason


class KVRecompute:
    """`kv="recompute"`: tokens of a skipped step run the skipped layers later, batched with the next
    step that runs those layers, as extra query positions ahead of the step's own tokens.

    Their input at layer k+1 is their exit state, which *is* the output of layer k for them, so the
    deep K/V written this way are exactly what the full model writes: later tokens see an exact cache.
    Invariant: a pending block at depth j-1 is always the contiguous run of positions right after
    layer j's cached ones, so appending [pending, step tokens] keeps every layer's cache in order.
    """

    def __init__(self, num_layers: int) -> None:
        self.num_layers = num_layers
        self.pending: list[Pending] = []

    def park(self, hidden: torch.Tensor, depth: int, kwargs: dict[str, Any]) -> None:
        """Remember the exit state of a step whose layers after `depth` are being skipped."""
        cos, sin = kwargs["position_embeddings"]
        self.pending.append(Pending(hidden, depth, cos, sin))

    def run(self, number: int, layer: nn.Module, original: Callable, hidden: torch.Tensor,
            kwargs: dict[str, Any], mask2d: torch.Tensor | None) -> Any:
        """Run layer `number` on [pending tokens at depth number-1, step tokens]; return the step's part."""
        due = [p for p in self.pending if p.depth == number - 1]
        if not due:
            return original(hidden, **kwargs)
        block = torch.cat([p.hidden for p in due] + [hidden], dim=1)
        cos, sin = kwargs["position_embeddings"]
        ext = dict(kwargs, position_embeddings=(torch.cat([p.cos for p in due] + [cos], dim=1),
                                                torch.cat([p.sin for p in due] + [sin], dim=1)))
        ext.pop("position_ids", None)  # rotary comes from position_embeddings
        ext["attention_mask"] = self._mask(layer, kwargs["past_key_values"], block, mask2d)
        out = original(block, **ext)
        states = out[0] if isinstance(out, tuple) else out
        start = 0
        for p in due:
            width = p.hidden.shape[1]
            p.hidden, p.depth, start = states[:, start : start + width], number, start + width
        self.pending = [p for p in self.pending if p.depth < self.num_layers]
        mine = states[:, start:]
        return (mine, *out[1:]) if isinstance(out, tuple) else mine

    @staticmethod
    def _mask(layer: nn.Module, cache: Any, block: torch.Tensor, mask2d: torch.Tensor | None) -> torch.Tensor:
        """Additive mask for the extended queries: causal, padding from the call's 2-D mask."""
        cached = cache.layers[layer.self_attn.layer_idx].get_seq_length()
        queries = block.shape[1]
        width = max(cache.layers[layer.self_attn.layer_idx].get_max_length(), cached + queries)
        keys = torch.arange(width, device=block.device)
        allowed = keys[None, :] <= cached + torch.arange(queries, device=block.device)[:, None]
        allowed = allowed[None].expand(block.shape[0], -1, -1)
        if mask2d is not None:
            padding = torch.zeros(block.shape[0], width, dtype=torch.bool, device=block.device)
            padding[:, : min(width, mask2d.shape[1])] = mask2d[:, :width].bool()
            allowed = allowed & padding[:, None, :]
        mask = torch.zeros(allowed.shape, dtype=block.dtype, device=block.device)
        return mask.masked_fill(~allowed, torch.finfo(block.dtype).min)[:, None]
