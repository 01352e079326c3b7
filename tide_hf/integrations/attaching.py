"""`attach`: a router's hooks on the model's layers (`tide_hf.runtime.hook_model`) and the model's own `generate`
wired to them (`wire_generate`), both taken back by `handle.detach()`."""

from __future__ import annotations

import os
from typing import Any

from torch import nn

from ..modeling import TideRouter
from ..runtime import TideConfig, TideHandle, hook_model
from .generate import wire_generate


def attach(model: nn.Module, router: TideRouter | str | os.PathLike, config: TideConfig | None = None, *,
           ignore_fingerprint: bool = False, **options: Any) -> TideHandle:
    """Attach `router` to `model`: its plain forwards, its `generate()` and `pipeline()` then use TIDE.

    Everything is checked before the model is touched; `handle.detach()` puts it back exactly as it was.

    Args:
        model: a transformers causal LM (`AutoModelForCausalLM`), eager or under accelerate's hooks.
        router: a `TideRouter`, or its folder, or its Hub repo id.
        config: what to serve (`TideConfig`; None: its defaults, speculative mode where the model allows it).
        ignore_fingerprint: attach even if the model's weights differ from those the router was calibrated on.
        **options: `TideConfig` fields as keywords, laid over `config` (`attach(model, router, mode="select")`).

    Returns:
        The `TideHandle`: `handle.last_stats` after each call, `handle.detach()`.

    Raises:
        TideArgumentError: an option out of range, or a router already attached to `model`.
        TideCompatibilityError: the router was calibrated for another model.
        TideUnsupportedError: the mode cannot run on this model (the message names the way out).

    Example:
        >>> with tide_hf.attach(model, router, min_agreement=0.97) as handle:  # doctest: +SKIP
        ...     model.generate(**inputs)
    """
    return attach_with(TideHandle, model, router, config, ignore_fingerprint=ignore_fingerprint, **options)


def attach_with(handle_class: type[TideHandle], model: nn.Module, router: TideRouter | str | os.PathLike,
                config: TideConfig | None = None, *, ignore_fingerprint: bool = False, **options: Any) -> TideHandle:
    """`attach` with a `TideHandle` subclass that scores checkpoints differently (the bench's baselines)."""
    handle = hook_model(handle_class, model, router, config, ignore_fingerprint=ignore_fingerprint, **options)
    wire_generate(handle)
    return handle
