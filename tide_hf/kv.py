"""Keeping the KV cache sound for layers that skip mode did not run.

`kv="propagate"` (CALM-style state propagation): a skipped layer gets the K/V it would have computed if
its input were the exit hidden state, which is exactly what flows past it. Only the K and V
projections run (plus the layer's input norm, the K norm where the family has one, and rotary
embeddings), a small fraction of a layer, and every layer's cache keeps the same length.
"""

from __future__ import annotations

import sys
from typing import Any

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
