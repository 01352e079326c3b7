"""Attach-time check that skip mode writes the KV cache the model's own layers would write.

`kv="propagate"` rebuilds a skipped layer's K/V by hand (`propagate_kv` / `FusedPropagation`: input norm, K/V
projections, K norm, rotary). Architectures differ in details attribute names do not reveal (layers without
rotary embeddings, value scales, a key norm over all heads at once), so before anything is patched a forward
of a few random tokens through the model itself is compared with the rebuilt K/V of every layer that may be
skipped; a failure or a mismatch refuses `kv="propagate"`, naming the layer and the size of the error. The same
forward tells which layers return a tuple, so a layer skipped before it ever ran returns the same kind.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ...compat import cache_in, with_cache
from ...errors import TideUnsupportedError
from ...modeling.devices import execution_device, onloaded
from .kv import FusedPropagation, propagate_kv

PROBE_ROWS = 2  # rows of the probe forward
PROBE_MIN_TOKENS = 3  # its token count: the first at least this that differs from every head count (a layout
# mistake that swaps heads and tokens passes when the two are equal)
PROBE_SEED = 0
PROBE_EPS_FACTOR = 8  # rebuilt K/V may differ by this many dtype epsilons of the largest |K| / |V| ...
PROBE_MIN_RELATIVE = 1e-2  # ... and at least this share of it (folded norms reorder sums; fp32 matmuls may run
# in TF32, 10 mantissa bits): what it refuses (no rotary, a missing norm or value scale) is off by far more


class Recorder:
    """A cache stand-in that keeps the first K/V written for each layer index."""

    def __init__(self) -> None:
        self.writes: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any) -> tuple:
        self.writes.setdefault(layer_idx, (key, value))
        return key, value


def probe_tokens(config: Any) -> int:
    """The probe's token count: differs from the model's head counts."""
    heads = {getattr(config, name, None) for name in ("num_attention_heads", "num_key_value_heads")}
    count = PROBE_MIN_TOKENS
    while count in heads:
        count += 1
    return count


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| over the largest |want| (at least 1), in fp32; inf on a shape mismatch."""
    if got.shape != want.shape:
        return float("inf")
    return float((got.float() - want.float()).abs().max()) / max(float(want.float().abs().max()), 1.0)


@torch.no_grad()
def probe_skipped_layers(model: nn.Module, layers: nn.ModuleList, first_checkpoint: int, kv: str,
                         fused: FusedPropagation | None, text_config: Any) -> dict[int, bool]:
    """Run the probe forward; return, per layer number after `first_checkpoint`, whether it returns a tuple.

    With `kv="propagate"`, raise `TideUnsupportedError` unless the K/V that skip mode would write for each of
    those layers (through `fused` when given) equal the ones the layer's own attention cached. With
    `kv="recompute"` (the real layers run later) a failing probe only leaves the return kinds unknown.
    """
    numbers = range(first_checkpoint + 1, len(layers) + 1)
    inputs: dict[int, tuple[torch.Tensor, dict[str, Any]]] = {}
    returns: dict[int, bool] = {}

    def capture(number: int) -> tuple[Callable, Callable]:
        def before(_module: nn.Module, args: tuple, kwargs: dict) -> None:
            inputs[number] = (args[0] if args else kwargs["hidden_states"], dict(kwargs))

        def after(_module: nn.Module, _args: tuple, _kwargs: dict, output: Any) -> None:
            returns[number] = isinstance(output, tuple)
        return before, after

    handles = []
    for number in numbers:
        before, after = capture(number)
        handles += [layers[number - 1].register_forward_pre_hook(before, with_kwargs=True),
                    layers[number - 1].register_forward_hook(after, with_kwargs=True)]
    embeddings = model.get_input_embeddings()
    device = execution_device(embeddings)
    generator = torch.Generator().manual_seed(PROBE_SEED)
    ids = torch.randint(0, embeddings.num_embeddings, (PROBE_ROWS, probe_tokens(text_config)), generator=generator)
    training = {module: module.training for module in model.modules()}
    model.eval()  # as served: training with gradient checkpointing would turn the cache off
    try:
        cache = cache_in(model(input_ids=ids.to(device), use_cache=True))
    except Exception as err:
        if kv == "propagate":
            raise TideUnsupportedError(f"mode='skip' with kv='propagate': checking the K/V it writes needs a plain "
                                       f"forward of {type(model).__name__}, which failed: {err}") from err
        return returns
    finally:
        for handle in handles:
            handle.remove()
        for module, mode in training.items():
            module.training = mode
    if kv == "propagate":
        for number in numbers:
            check_layer(layers[number - 1], number, inputs.get(number), cache, fused)
    return returns


def check_layer(layer: nn.Module, number: int, captured: tuple[torch.Tensor, dict[str, Any]] | None, cache: Any,
                fused: FusedPropagation | None) -> None:
    """Raise unless the K/V skip mode writes for `layer` (number `number`) from its probe input equal its own."""
    where = f"mode='skip' with kv='propagate' on layer {number} ({type(layer).__name__})"
    index = layer.self_attn.layer_idx
    cached = getattr(cache, "layers", None)
    if captured is None or cached is None or index >= len(cached) or not hasattr(cached[index], "keys"):
        raise TideUnsupportedError(f"{where}: the probe forward did not run this layer or cache its K/V; "
                                   "use kv='recompute'")
    hidden, kwargs = captured
    recorder = Recorder()
    try:
        with onloaded(layer):  # (offloaded weights come in as the layer's own forward brings them in)
            if fused is not None:
                fused.write(number - 1, hidden, with_cache(dict(kwargs, use_cache=True), recorder))
            else:
                propagate_kv(layer, hidden, with_cache(dict(kwargs, use_cache=True), recorder))
        key, value = recorder.writes[index]
    except Exception as err:
        raise TideUnsupportedError(f"{where}: rebuilding this layer's K/V failed ({type(err).__name__}: {err}); "
                                   "use kv='recompute'") from err
    want_key, want_value = cached[index].keys, cached[index].values
    length = min(key.shape[-2], want_key.shape[-2])  # a sliding-window layer keeps only its last positions
    errors = (relative_error(key[..., -length:, :], want_key[..., -length:, :]),
              relative_error(value[..., -length:, :], want_value[..., -length:, :]))
    tolerance = max(PROBE_EPS_FACTOR * torch.finfo(want_key.dtype).eps, PROBE_MIN_RELATIVE)
    if max(errors) > tolerance:
        raise TideUnsupportedError(
            f"{where}: the K/V it would write differ from the ones the layer's attention computes (relative error "
            f"K {errors[0]:.2g}, V {errors[1]:.2g}, tolerance {tolerance:.2g}): this attention does something "
            "propagate does not reproduce (e.g. no rotary on some layers, a value scale); use kv='recompute'")
