"""Every private transformers name tide_hf relies on, in one place (pyproject bounds transformers to >=5.17,<6).

Speculative mode hands its candidates to stock assisted decoding through the instance attribute stock
looks up (`_get_candidate_generator`), reads a call's settings as generate merges them
(`_prepare_generation_config`), extends a prompt's model kwargs to a draft with stock's own helpers,
reads the EOS ids generate prepared, and refuses the models with a recurrent state (`is_stateful`: a class flag
before transformers 5.25, the config's cache layer types since).
Calibration's continuations reset a model's decoding settings to the values generate fills in for unset ones
(`GenerationConfig._get_default_generation_params`).
Compiled skip mode reads transformers' output-capture collector the way transformers' own compiled forward
does. Calibration records the Hub revision a model was loaded
from (`config._commit_hash`). transformers 5.24 renamed the KV cache's keyword, generate's model kwarg and the
outputs' field from `past_key_values` to `cache` (the old name still works, with a warning; generate also
takes `cache_params`): `cache_in`, `split_cache` and `with_cache` read and write it by any of these names.
The GPU suite's dry run compiles on the CPU, which transformers allows only with `CompileConfig._compile_all_devices`
(`compile_anywhere`).
Continuous batching writes a paged KV cache (`PagedAttentionCache`), whose `update` takes the layer's keyword
arguments (its read and write indices) since transformers 5.24; before, the attention function wrote it
(`PAGED_UPDATE_TAKES_KWARGS`; `write_kv` writes it as a layer would). Its manager's attention switch is undone
with `_original_attn_impl` (`undo_attention_switch`). `ContinuousBatchingConfig`'s tokens per page are
`page_size` since transformers 5.24, `block_size` before (`paged_config`).
transformers 5.25's assisted decoding reads a candidate generator's `num_drafting_tokens` (speculative mode provides
it).
The CPU fast path of linear layers (`runtime/linears.py`) calls oneDNN's prepacked matmul, which torch exposes
only as private ops (`torch.ops.mkldnn._reorder_linear_weight`, `_linear_pointwise`, since torch 2.1; inductor's
CPU backend uses them): `onednn_available`, `onednn_dtypes`, `prepack_linear_weight` and `packed_linear`.
Should transformers or torch rename any of these, this module is the one to change.
"""

from __future__ import annotations

import functools
import inspect
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from transformers import ContinuousBatchingConfig, GenerationConfig, GenerationMixin
from transformers.generation.candidate_generator import (
    _prepare_attention_mask,
    _prepare_position_ids,
    _prepare_token_type_ids,
)
from transformers.generation.continuous_batching import PagedAttentionCache
from transformers.utils.output_capturing import _active_collector

# The newest transformers release the whole test suite has passed on (CI installs the newest one pyproject allows:
# raise this in the commit whose CI passes on a newer one); `tide-hf env` warns above it.
NEWEST_TESTED_TRANSFORMERS = "5.25.0"
CANDIDATE_GENERATOR_FACTORY = "_get_candidate_generator"  # GenerationMixin method that builds the drafter
# config.layer_types whose cache layer keeps a recurrent or convolution state (transformers >= 5.25's cache_utils)
RECURRENT_LAYER_TYPES = frozenset({"conv", "linear_attention", "hybrid", "hybrid_sliding"})
# the KV cache's keyword: transformers >= 5.24's, then older ones' (generate >= 5.24 also takes state-space
# models' `cache_params` as its cache)
CACHE_KWARGS = ("cache", "past_key_values", "cache_params")
# the name this transformers' generate keeps the cache under in its model kwargs (and passes to forward)
CACHE_KWARG = next(name for name in CACHE_KWARGS
                   if name in inspect.signature(GenerationMixin.prepare_inputs_for_generation).parameters)


# transformers >= 5.24: the attention writes the paged cache through `update(..., kwargs=<the layer's kwargs>)`
PAGED_UPDATE_TAKES_KWARGS = "kwargs" in inspect.signature(PagedAttentionCache.update).parameters
# transformers >= 5.24 names a paged cache's tokens per page `page_size` (`block_size` before)
PAGE_SIZE_KEYWORD = ("page_size" if "page_size" in inspect.signature(ContinuousBatchingConfig.__init__).parameters
                     else "block_size")


def paged_config(page_size: int, **kwargs: Any) -> ContinuousBatchingConfig:
    """A `ContinuousBatchingConfig` with `page_size` tokens per page, under this transformers' name for it."""
    return ContinuousBatchingConfig(**{PAGE_SIZE_KEYWORD: page_size}, **kwargs)


def is_paged(cache: Any) -> bool:
    """Whether `cache` is continuous batching's paged cache (one packed row of many requests)."""
    return isinstance(cache, PagedAttentionCache)


def writes_cache(kwargs: dict[str, Any]) -> bool:
    """Whether a layer called with `kwargs` writes K/V: it has a cache, and `use_cache` is not False (continuous
    batching passes `use_cache=False` to its layers and they write its paged cache all the same)."""
    cache = cache_in(kwargs)
    return cache is not None and (kwargs.get("use_cache", True) is not False or is_paged(cache))


def write_kv(cache: Any, key: Any, value: Any, layer_idx: int, kwargs: dict[str, Any]) -> Any:
    """Write `key` / `value` (B, heads, T, d) of layer `layer_idx` as the layer called with `kwargs` would: a
    paged cache reads where to write from a copy of those kwargs (it edits the dict it gets)."""
    if is_paged(cache):
        return cache.update(key, value, layer_idx, kwargs=dict(kwargs))
    return cache.update(key, value, layer_idx)


def undo_attention_switch(manager: Any) -> None:
    """Put back the attention implementation a continuous-batching manager switched its model to (flash or
    paged eager), as its own `stop` does."""
    original = getattr(manager, "_original_attn_impl", None)
    if original is not None:
        manager.model.set_attn_implementation(original)
        manager._original_attn_impl = None


def cache_in(kwargs: dict[str, Any]) -> Any:
    """The KV cache a forward (or generate's model kwargs) was given, by any of its names; None without one."""
    return next((kwargs[name] for name in CACHE_KWARGS if kwargs.get(name) is not None), None)


def split_cache(kwargs: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """generate's model kwargs as their cache (by any of its names) and the rest."""
    return cache_in(kwargs), {k: v for k, v in kwargs.items() if k not in CACHE_KWARGS}


def with_cache(kwargs: dict[str, Any], cache: Any) -> dict[str, Any]:
    """A copy of a forward's `kwargs` holding `cache` under the name they already use (else `CACHE_KWARG`), so
    a layer is called the way the model calls it."""
    name = next((name for name in CACHE_KWARGS if name in kwargs), CACHE_KWARG)
    return {**split_cache(kwargs)[1], name: cache}


def model_revision(config: Any) -> str | None:
    """The Hub commit a model's config was loaded from (None for a local or in-memory model)."""
    return getattr(config, "_commit_hash", None)


def extend_model_kwargs(model_kwargs: dict[str, Any], length: int) -> dict[str, Any]:
    """Stock's extension of the prompt's attention mask, positions and token types to `length` tokens."""
    kwargs = _prepare_attention_mask(dict(model_kwargs), length, False)
    return _prepare_token_type_ids(_prepare_position_ids(kwargs, length, False), length)


def merged_generation_config(model: Any, kwargs: dict[str, Any]) -> Any:
    """The generation config this generate call runs with: its `generation_config` (or none) merged with the
    model's defaults and the call's keywords, by generate's own `_prepare_generation_config`."""
    quiet = {k: v for k, v in kwargs.items() if k != "generation_config"}
    with warnings.catch_warnings():  # generate itself warns about the same settings once
        warnings.simplefilter("ignore")
        config, _ = model._prepare_generation_config(kwargs.get("generation_config"), **quiet)
    return config


def default_generation_settings() -> dict[str, Any]:
    """The values generate gives settings that neither the model nor the call sets (a `GenerationConfig` leaves
    them None and generate fills them in: greedy, one beam, no penalty)."""
    return {**GenerationConfig().to_dict(), **GenerationConfig._get_default_generation_params()}


def is_stateful(model: Any) -> bool:
    """The model keeps a recurrent state besides (or instead of) a KV cache: Mamba, Jamba, Qwen3-Next, ...
    Before transformers 5.25 a class flag says so (`_is_stateful`); since, the cache layer types of its config do
    (`RECURRENT_LAYER_TYPES`)."""
    if getattr(type(model), "_is_stateful", False):
        return True
    config = getattr(model, "config", None)
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    return any(kind in RECURRENT_LAYER_TYPES for kind in (getattr(text, "layer_types", None) or ()))


def eos_token_tensor(generation_config: Any) -> Any:
    """The EOS ids generate prepared for this call (a tensor, or None)."""
    return generation_config._eos_token_tensor


@contextmanager
def traceable_output_capture() -> Iterator[None]:
    """Let dynamo trace transformers' output-capturing hooks inside a graph that starts below the model.

    `@capture_outputs` sets its collector (a `ContextVar`, which dynamo cannot read) when the model's forward
    starts; under a compiled whole-model forward transformers keeps it in a plain attribute instead. Segment
    graphs compile decoder layers only, so for their duration the collector set in eager is moved to that
    attribute, as transformers' compiled path would have it.
    """
    collector = _active_collector
    if collector.compiling:  # already inside a compiled forward: nothing to move
        yield
        return
    collector.global_var, collector.compiling = collector.context_var.get(), True
    try:
        yield
    finally:
        collector.global_var, collector.compiling = None, False


def compile_anywhere(config: Any) -> Any:
    """`config` (a `CompileConfig`) allowed to compile on any device: transformers compiles only on accelerators
    unless its private `_compile_all_devices` is set. Returns `config`."""
    config._compile_all_devices = True
    return config


ONEDNN_OPS = ("_reorder_linear_weight", "_linear_pointwise")  # torch.ops.mkldnn's prepacked linear (torch >= 2.1)
# dtype -> torch's check that oneDNN computes it on this CPU (fp32 needs none)
ONEDNN_DTYPE_CHECKS = {torch.bfloat16: "_is_mkldnn_bf16_supported", torch.float16: "_is_mkldnn_fp16_supported"}


@functools.cache
def onednn_available() -> bool:
    """Whether this torch build has oneDNN and its prepacked linear ops."""
    return torch.backends.mkldnn.is_available() and all(hasattr(torch.ops.mkldnn, op) for op in ONEDNN_OPS)


@functools.cache
def onednn_dtypes() -> frozenset[torch.dtype]:
    """The weight dtypes oneDNN's prepacked linear computes on this CPU (none without oneDNN)."""
    if not onednn_available():
        return frozenset()
    checks = {dtype: getattr(torch.ops.mkldnn, name, None) for dtype, name in ONEDNN_DTYPE_CHECKS.items()}
    return frozenset({torch.float32, *(dtype for dtype, check in checks.items() if check is not None and check())})


def prepack_linear_weight(weight: torch.Tensor) -> torch.Tensor:
    """A copy of a CPU linear weight (out, in) in oneDNN's blocked layout, for `packed_linear` (no autograd)."""
    with torch.no_grad():
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`x @ weight.T + bias` for 2-D `x` (rows, in) with the weight as `prepack_linear_weight` packed it."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
