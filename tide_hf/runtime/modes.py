"""What a mode asks of the model, checked by `attach` before anything is patched."""

from __future__ import annotations

import dataclasses
import warnings

from torch import nn

from ..callers import caller_stacklevel
from ..compat import is_stateful
from ..errors import TideUnsupportedError
from ..modeling import ModelAdapter, TideRouter, check_head, text_config
from ..modeling.depth import check_depth_follows_config
from ..modeling.fingerprint import remembered
from ..record import CLOSED
from .options import AUTO_MODE, DEFAULT_KV, TideConfig, TideOptions
from .skip.kv import propagate_support
from .skip.skipper import LayerSkipper, SkipPlan


def check_mode(model: nn.Module, adapter: ModelAdapter, options: TideOptions, router: TideRouter
               ) -> SkipPlan | None:
    """Raise a `TideUnsupportedError` when `options.mode` cannot run on `model`: skip mode where a layer it may
    skip cannot keep its cache sound (`LayerSkipper.check`, which also returns skip mode's plan); speculative
    mode on a model that keeps a recurrent state (stock assisted decoding takes back rejected drafts by cropping
    the KV cache, and transformers refuses such a model only once generate runs) or one that ignores a lowered
    `config.num_hidden_layers` (`check_depth_follows_config`, one tiny forward). Speculative drafts over a
    draft vocabulary use the adapter's head, sliced: it is checked against the model's (`check_head`)."""
    eligible = [k for k in router.checkpoint_layers if k >= options.min_layers and options.threshold(k) < CLOSED]
    if options.mode == "skip" and eligible:
        return LayerSkipper.check(model, adapter.layers, eligible[0], options.kv, text_config(model))
    if options.mode == "speculative" and is_stateful(model):
        raise TideUnsupportedError(
            f"mode='speculative' on {type(model).__name__}: it keeps a recurrent (state-space or linear-attention) "
            "state, which assisted decoding cannot roll back to the last accepted token the way it crops a KV "
            "cache; use mode='select'")
    if options.mode == "speculative":  # the way out names skip mode where its layers have the parts it needs
        skips = all(propagate_support(layer) is None for layer in adapter.layers)
        layer = options.draft_layer or min(router.checkpoint_layers)
        remembered(model, ("depth follows config", layer), lambda: check_depth_follows_config(
            model, adapter, layer, "use mode='select' or 'skip'" if skips else "use mode='select'"))
    if options.mode == "speculative" and router.config.draft_vocab_coverage:
        head = (id(adapter.final_norm), id(adapter.pre_head), id(adapter.lm_head), adapter.logit_scale,
                adapter.logit_softcap)  # what the adapter computes logits with
        remembered(model, ("head", head), lambda: check_head(model, adapter))
    return None


class ModeFallbackWarning(UserWarning):
    """attach's default mode ("auto") runs select mode on a model whose layers skip mode cannot serve."""


def resolve_mode(model: nn.Module, adapter: ModelAdapter, router: TideRouter, request: TideConfig
                 ) -> tuple[TideOptions, SkipPlan | None]:
    """The options `request` resolves to on this router and model, checked (`check_mode`), and skip mode's plan.

    Mode "auto" is skip mode where `check_mode` accepts it, else select mode with a `ModeFallbackWarning` that
    names the reason."""
    fields = {f.name: getattr(request, f.name) for f in dataclasses.fields(request)}
    if request.mode != AUTO_MODE:
        options = TideOptions.resolve(router.config, **fields)
        options.validate(adapter.num_layers, router.checkpoint_layers)
        return options, check_mode(model, adapter, options, router)
    options = TideOptions.resolve(router.config, **{**fields, "mode": "skip"})
    options.validate(adapter.num_layers, router.checkpoint_layers)
    try:
        return options, check_mode(model, adapter, options, router)
    except TideUnsupportedError as err:
        warnings.warn(f"tide_hf: attach runs mode='select' (every layer; no compute saved) on {type(model).__name__}:"
                      f" skip mode cannot serve it ({err})", ModeFallbackWarning, stacklevel=caller_stacklevel())
        return dataclasses.replace(options, mode="select", kv=DEFAULT_KV), None
