"""Keeping the KV cache sound for layers that skip mode did not run.

`kv="recompute"`: see `KVRecompute` (exact deep K/V, filled later in one batched pass).

`kv="propagate"` (CALM-style state propagation): a skipped layer gets the K/V it would have computed if
its input were the exit hidden state, which is exactly what flows past it. Only the K and V
projections run (plus the layer's input norm, the K norm where the family has one, and rotary
embeddings), a small fraction of a layer, and every layer's cache keeps the same length.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ...compat import cache_in, write_kv, writes_cache
from ...kernels import norm_spec
from ..session import Step


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
        return (f"{type(layer).__name__} lacks {', '.join(missing)}: skip mode supports Llama-style attention "
                "(separate k_proj / v_proj with rotary embeddings)")
    return None


def key_norm(attn: nn.Module) -> nn.Module | None:
    """The per-head norm the attention applies to its keys, if any (Qwen3 / Gemma3 `k_norm`, Phi's
    `k_layernorm` under `qk_layernorm`)."""
    if getattr(attn, "k_norm", None) is not None:
        return attn.k_norm
    return attn.k_layernorm if getattr(attn, "qk_layernorm", False) else None


def rotate_keys(attn: nn.Module, key: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embeddings on `key` (B, heads, T, d) as the attention applies them: not at all on a no-rotary
    layer (SmolLM3's `use_rope=0`), on the first `cos.shape[-1]` dims only under partial rotary (Phi)."""
    if not getattr(attn, "use_rope", True):
        return key
    rotary, rot = sys.modules[type(attn).__module__].apply_rotary_pos_emb, cos.shape[-1]
    if rot < key.shape[-1]:
        return torch.cat([rotary(key[..., :rot], key[..., :rot], cos, sin)[1], key[..., rot:]], dim=-1)
    return rotary(key, key, cos, sin)[1]


def project_kv(layer: nn.Module, hidden: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor]
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """The K/V (B, heads, T, d) `layer` computes for input `hidden` (B, T, H) at the positions of
    `position_embeddings` (cos, sin)."""
    attn = layer.self_attn
    x = layer.input_layernorm(hidden)
    shape = (*x.shape[:-1], -1, attn.head_dim)
    key = attn.k_proj(x).view(shape)
    norm = key_norm(attn)
    if norm is not None:  # normalises each head (over head_dim)
        key = norm(key)
    key, value = key.transpose(1, 2), attn.v_proj(x).view(shape).transpose(1, 2)
    return rotate_keys(attn, key, *position_embeddings), value


def propagate_kv(layer: nn.Module, hidden: torch.Tensor, kwargs: dict[str, Any]) -> None:
    """Append to the cache the K/V `layer` would produce for input `hidden` (B, T, H)."""
    if not writes_cache(kwargs):
        return
    write_kv(cache_in(kwargs), *project_kv(layer, hidden, kwargs["position_embeddings"]), layer.self_attn.layer_idx,
             kwargs)


class FusedPropagation:
    """`kv="propagate"` for every layer after an exit at once.

    Each skipped layer's input norm weight (and LayerNorm bias) is folded into its K/V projections, and
    those are stacked: a skipped step then runs one normalisation, one matmul and one rotary pass for all
    skipped layers instead of a norm, two projections and a rotary pass each, which is most of
    propagate's per-layer cost at decode. Used where every layer has the same norm formula and eps, no
    K norm, rotary on every layer, and its weights on one device; elsewhere `propagate_kv` runs layer by layer.
    """

    @classmethod
    def build(cls, layers: list[nn.Module], first_number: int) -> FusedPropagation | None:
        """The fused form of `layers` (numbered from `first_number`), or None when they do not qualify."""
        if not layers or any(propagate_support(layer) is not None for layer in layers):
            return None
        attns = [layer.self_attn for layer in layers]
        specs = [norm_spec(layer.input_layernorm) for layer in layers]
        params = [p for a in attns for p in (a.k_proj.weight, a.v_proj.weight)]
        if (any(s is None or s.kind == "none" for s in specs) or len({(s.kind, s.eps) for s in specs}) != 1
                or any(key_norm(a) is not None or not getattr(a, "use_rope", True) for a in attns)
                or len({p.device for p in params}) != 1 or params[0].is_meta
                or len({(a.k_proj.out_features, a.v_proj.out_features, a.head_dim) for a in attns}) != 1):
            return None
        return cls(layers, attns, specs, first_number)

    def __init__(self, layers: list[nn.Module], attns: list[nn.Module], specs: list[Any], first_number: int) -> None:
        self.layers, self.first_number, self.spec = layers, first_number, specs[0]
        self.head_dim, self.k_out = attns[0].head_dim, attns[0].k_proj.out_features
        self.width = self.k_out + attns[0].v_proj.out_features
        self._fold(attns, specs)

    @torch.no_grad()
    def _fold(self, attns: list[nn.Module], specs: list[Any]) -> None:
        """Stack the layers' K/V projections with their input norms' weights folded in."""
        weights, biases = [], []
        for attn, spec in zip(attns, specs):
            scale = 1.0 + spec.weight.float() if spec.kind == "rms_gemma" else spec.weight.float()
            for proj in (attn.k_proj, attn.v_proj):
                w = proj.weight.float()
                bias = proj.bias.float() if proj.bias is not None else torch.zeros(w.shape[0], device=w.device)
                if spec.bias is not None:
                    bias = bias + w @ spec.bias.float()
                weights.append(w * scale)
                biases.append(bias)
        dtype = attns[0].k_proj.weight.dtype
        self.weight, self.bias = torch.cat(weights).to(dtype), torch.cat(biases).to(dtype)
        self.folded_from = self.sources()

    def sources(self) -> tuple:
        """Identity, storage, version, dtype and device of every tensor the stacked weights were folded from."""
        return tuple((id(t), t.data_ptr(), t._version, t.dtype, t.device) for layer in self.layers
                     for module in (layer.input_layernorm, layer.self_attn.k_proj, layer.self_attn.v_proj)
                     for t in module.parameters(recurse=False))

    def refresh(self) -> None:
        """Fold again when the layers changed since (`model.to(dtype or device)`, `load_state_dict`, an in-place
        edit that bumps the tensor's version; not one through `.data`, which autograd does not see either): the
        stacked weights are a copy, and a stale one would write the old weights' K/V."""
        if self.sources() != self.folded_from:
            self._fold([layer.self_attn for layer in self.layers],
                       [norm_spec(layer.input_layernorm) for layer in self.layers])

    def _normalize(self, hidden: torch.Tensor) -> torch.Tensor:
        """The input norm without its weight (folded into the projections)."""
        if self.spec.kind == "layernorm":
            return F.layer_norm(hidden, hidden.shape[-1:], None, None, self.spec.eps)
        x = hidden.float()
        return (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.spec.eps)).to(hidden.dtype)

    @torch.no_grad()
    def write(self, after: int, hidden: torch.Tensor, kwargs: dict[str, Any]) -> None:
        """Append the K/V of every layer numbered > `after` for input `hidden` (B, T, H) to the cache."""
        if not writes_cache(kwargs):
            return
        cache = cache_in(kwargs)
        start = after + 1 - self.first_number
        layers = self.layers[start:]
        rows = slice(start * self.width, None)
        out = F.linear(self._normalize(hidden), self.weight[rows], self.bias[rows])
        out = out.view(*hidden.shape[:2], len(layers), self.width)
        batch, length, d = hidden.shape[0], hidden.shape[1], self.head_dim
        keys = out[..., : self.k_out].reshape(batch, length, -1, d).transpose(1, 2)  # heads of all layers
        values = out[..., self.k_out :].reshape(batch, length, -1, d).transpose(1, 2)
        cos, sin = kwargs["position_embeddings"]
        keys = rotate_keys(layers[0].self_attn, keys, cos, sin)  # every layer rotates alike (`build`)
        heads = keys.shape[1] // len(layers)
        for i, layer in enumerate(layers):
            part = slice(i * heads, (i + 1) * heads)
            write_kv(cache, keys[:, part], values[:, part], layer.self_attn.layer_idx, kwargs)


def initialize_cache_layers(cache: Any, layers: list[nn.Module]) -> None:
    """Allocate the static-cache layers of `layers` that no forward has written yet, shaped like the first one.

    A static cache allocates each layer at its first write; under `kv="recompute"` a skipped prefill leaves the
    deep layers unwritten, and a compiled graph traced before that write would be traced again after it.
    """
    cache_layers = getattr(cache, "layers", None)
    if not cache_layers or not getattr(cache_layers[0], "is_initialized", False) \
            or not hasattr(cache_layers[0], "lazy_initialization"):
        return
    template = cache_layers[0]
    for layer in layers:
        target = cache_layers[layer.self_attn.layer_idx]
        if not target.is_initialized:
            target.lazy_initialization(template.keys[:, :, :1], template.values[:, :, :1])


@dataclass
class Pending:
    """Tokens of a skipped step whose deeper layers have not run yet: their state at `depth`."""

    hidden: torch.Tensor  # (B, T, H): output of layer `depth` for these positions
    depth: int
    cos: torch.Tensor  # rotary embeddings of these positions, (B, T, d)
    sin: torch.Tensor

    @property
    def positions(self) -> int:
        """Rows x tokens of the block: the positions one layer's catch-up runs."""
        return self.hidden.shape[0] * self.hidden.shape[1]


def recompute_support(layer: nn.Module) -> str | None:
    """None when `KVRecompute` can catch `layer` up on skipped tokens, else the reason it cannot."""
    reason = propagate_support(layer)
    if reason is None and sliding_window(layer.self_attn):
        reason = f"{type(layer).__name__} uses sliding-window attention; kv='recompute' supports full attention"
    return reason


def sliding_window(attention: nn.Module) -> int | None:
    """The attention window of this layer, None for full attention: the module's own `sliding_window`, else its
    config's (Mistral keeps it there), unless the config's `layer_types` make this layer a full-attention one."""
    window = getattr(attention, "sliding_window", None)
    if window:
        return window
    config = getattr(attention, "config", None)
    window = getattr(config, "sliding_window", None)
    types, index = getattr(config, "layer_types", None), getattr(attention, "layer_idx", None)
    if window and types is not None and index is not None and index < len(types):
        return window if types[index] != "full_attention" else None
    return window or None


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
        self.stock_mask: torch.Tensor | None = None  # the 2-D mask of a call without TIDE using this cache now
        self.mask2d: torch.Tensor | None = None  # the call's 2-D mask when the latest step was parked

    def park(self, hidden: torch.Tensor, depth: int, kwargs: dict[str, Any], mask2d: torch.Tensor | None = None
             ) -> None:
        """Remember the exit state of a step whose layers after `depth` are being skipped (`mask2d`: the call's
        2-D mask so far, for a catch-up without a step, `catch_up`)."""
        cos, sin = kwargs["position_embeddings"]
        self.pending.append(Pending(hidden, depth, cos, sin))
        self.mask2d = mask2d

    def catch_up(self, layers: nn.ModuleList, forwards: dict[int, Callable], kwargs: dict[str, Any]) -> None:
        """Run the waiting tokens through the layers they skipped, without a step of their own (`forwards`: layer
        number -> its forward; `kwargs`: the cache and use_cache), so every layer's cache holds them."""
        while self.pending:
            number = min(p.depth for p in self.pending) + 1
            first = self.pending[0]
            rotary = {"position_embeddings": (first.cos[:, :0], first.sin[:, :0])}
            due, block, ext = self.extend(number, layers[number - 1], first.hidden[:, :0], {**kwargs, **rotary},
                                          self.mask2d)
            out = forwards[number](block, **ext)
            self.advance(due, out[0] if isinstance(out, tuple) else out, number)

    def extend(self, number: int, layer: nn.Module, hidden: torch.Tensor, kwargs: dict[str, Any],
               mask2d: torch.Tensor | None) -> tuple[list[Pending], torch.Tensor, dict[str, Any]] | None:
        """Inputs for layer `number` (`layer`) on [pending tokens at depth number-1, step tokens]: (due blocks, the
        extended hidden states, the layer's kwargs for them); None when no pending token is due there."""
        due = [p for p in self.pending if p.depth == number - 1]
        if not due:
            return None
        block = torch.cat([p.hidden for p in due] + [hidden], dim=1)
        cos, sin = kwargs["position_embeddings"]
        ext = dict(kwargs, position_embeddings=(torch.cat([p.cos for p in due] + [cos], dim=1),
                                                torch.cat([p.sin for p in due] + [sin], dim=1)))
        ext.pop("position_ids", None)  # rotary comes from position_embeddings
        ext["attention_mask"] = self.catch_up_mask(cache_in(kwargs), layer.self_attn.layer_idx, block, mask2d)
        return due, block, ext

    def advance(self, due: list[Pending], states: torch.Tensor, depth: int) -> torch.Tensor:
        """Record `states` (B, due + step tokens, H), the output of layer `depth` for the block `extend` built,
        as the due tokens' new state; return the step's own part."""
        start = 0
        for p in due:
            width = p.hidden.shape[1]
            p.hidden, p.depth, start = states[:, start : start + width], depth, start + width
        self.pending = [p for p in self.pending if p.depth < self.num_layers]
        return states[:, start:]

    def run(self, number: int, layer: nn.Module, original: Callable, hidden: torch.Tensor,
            kwargs: dict[str, Any], step: Step | None) -> Any:
        """Run layer `number` on [pending tokens at depth number-1, step tokens]; return the step's part. The
        pending positions run are added to the step's `SkipState.recomputed` (work the step's own depth does not
        show). Without a step (a call without TIDE) padding comes from `stock_mask`."""
        extended = self.extend(number, layer, hidden, kwargs, self.stock_mask if step is None else step.mask2d)
        if extended is None:
            return original(hidden, **kwargs)
        due, block, ext = extended
        if step is not None:
            step.skip.recomputed += sum(p.positions for p in due)
        out = original(block, **ext)
        mine = self.advance(due, out[0] if isinstance(out, tuple) else out, number)
        return (mine, *out[1:]) if isinstance(out, tuple) else mine

    @staticmethod
    def catch_up_mask(cache: Any, layer_idx: int, block: torch.Tensor, mask2d: torch.Tensor | None) -> torch.Tensor:
        """Additive mask for the extended queries of cache layer `layer_idx`: causal, padding from the call's
        2-D mask."""
        # a DynamicCache() made without a config adds a layer when it is first written: one the parked tokens
        # never reached is not there yet, so it holds nothing and grows as needed
        layer = cache.layers[layer_idx] if layer_idx < len(cache.layers) else None
        cached = layer.get_seq_length() if layer is not None else 0
        queries = block.shape[1]
        width = max(layer.get_max_length() if layer is not None else 0, cached + queries)
        keys = torch.arange(width, device=block.device)
        allowed = keys[None, :] <= cached + torch.arange(queries, device=block.device)[:, None]
        allowed = allowed[None].expand(block.shape[0], -1, -1)
        if mask2d is not None:
            padding = torch.zeros(block.shape[0], width, dtype=torch.bool, device=block.device)
            padding[:, : min(width, mask2d.shape[1])] = mask2d[:, :width].bool()
            allowed = allowed & padding[:, None, :]
        mask = torch.zeros(allowed.shape, dtype=block.dtype, device=block.device)
        return mask.masked_fill(~allowed, torch.finfo(block.dtype).min)[:, None]
