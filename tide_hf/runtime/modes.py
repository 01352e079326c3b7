"""What a mode asks of the model, checked by `attach` before anything is patched."""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

from torch import nn

from ..callers import caller_stacklevel
from ..compat import is_stateful
from ..errors import TideUnsupportedError
from ..modeling import ModelAdapter, TideRouter, check_head, text_config
from ..modeling.depth import check_depth_follows_config
from ..modeling.fingerprint import remembered
from ..record import CLOSED
from .options import AUTO_MODE, EXIT_SETTINGS, TideConfig, TideOptions
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
    """attach's default mode ("auto") serves another mode than it would choose: the model's layers cannot serve
    the one it chose (speculative mode, or skip mode for a quality target)."""


def exit_settings(request: TideConfig) -> list[str]:
    """The exit settings `request` gives (`EXIT_SETTINGS`): under mode "auto" they ask for skip mode."""
    return [name for name in EXIT_SETTINGS if getattr(request, name) not in (None, False)]


def checked(model: nn.Module, adapter: ModelAdapter, router: TideRouter, fields: dict[str, Any]
            ) -> tuple[TideOptions, SkipPlan | None]:
    """`fields` resolved against the router, validated and checked against the model (`check_mode`)."""
    options = TideOptions.resolve(router.config, **fields)
    options.validate(adapter.num_layers, router.checkpoint_layers)
    return options, check_mode(model, adapter, options, router)


def resolve_mode(model: nn.Module, adapter: ModelAdapter, router: TideRouter, request: TideConfig
                 ) -> tuple[TideOptions, SkipPlan | None]:
    """The options `request` resolves to on this router and model, checked (`check_mode`), and skip mode's plan.

    Mode "auto" is speculative mode (the same tokens as stock, faster where drafts pay) when the request gives no
    exit setting, else skip mode (exits at a quality target). Where that mode cannot serve the model, the next
    of skip and select mode that can, with a `ModeFallbackWarning` that names the reason. The mode is chosen by
    what the model supports, never by timing. `options.reason` says why."""
    fields = {f.name: getattr(request, f.name) for f in dataclasses.fields(request)}
    if request.mode != AUTO_MODE:
        return checked(model, adapter, router, fields)
    given = exit_settings(request)
    if request.draft_layer is not None and not given:  # a draft checkpoint asks for speculative mode itself
        options, plan = checked(model, adapter, router, {**fields, "mode": "speculative"})
        return dataclasses.replace(options, auto=True, reason="attach's default with draft_layer given"), plan
    why = {"speculative": "attach's default with no exit setting given: the output is stock's, drafts verified at "
                          "full depth",
           "skip": f"attach's default with {', '.join(given)} given: tokens exit at a quality target"}
    refusals: list[str] = []
    for mode in dict.fromkeys(("skip" if given else "speculative", "skip", "select")):
        asked = {**fields, "mode": mode, **({"kv": None, "pricing": None} if mode == "select" else {})}
        try:
            options, plan = checked(model, adapter, router, asked)
        except TideUnsupportedError as err:
            if mode == "select":
                raise
            refusals.append(f"mode='{mode}' ({err})")
            continue
        if not refusals:
            return dataclasses.replace(options, auto=True, reason=why[mode]), plan
        saves = " (every layer runs; no compute saved)" if mode == "select" else ""
        reason = f"attach's default: {type(model).__name__} refused {' and '.join(refusals)}"
        warnings.warn(f"tide_hf: attach runs mode='{mode}'{saves} on {type(model).__name__}: {reason}",
                      ModeFallbackWarning, stacklevel=caller_stacklevel())
        return dataclasses.replace(options, auto=True, reason=reason), plan
    raise AssertionError("unreachable: select mode serves every model or raises")
