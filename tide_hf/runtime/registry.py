"""Which model has which handle: the registry `attach`, `get_handle`, `detach` and `last_stats` share.

Handles are held weakly: a handle references its model, so a strong value would keep every attached model alive
forever. The model's own hooks keep its handle alive while the model lives. This module knows handles only as
objects with a `detach()`; `handle.py` builds them and registers them here, under `LOCK`.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

from torch import nn

from ..errors import TideArgumentError, TideConcurrencyError
from ..modeling import check_model
from .stats import ExitStats

LOCK = threading.RLock()  # held while a handle is built and registered, or removed
_HANDLES: weakref.WeakKeyDictionary[nn.Module, weakref.ref] = weakref.WeakKeyDictionary()  # attach's, every thread
_LAST_STATS: weakref.WeakKeyDictionary[nn.Module, ExitStats] = weakref.WeakKeyDictionary()
# Per-call attaches (`generate(tide=router)`) running now, per model: handle id -> handle (each acts in its thread)
_CALL_HANDLES: weakref.WeakKeyDictionary[nn.Module, dict[int, Any]] = weakref.WeakKeyDictionary()


def check_free(model: nn.Module) -> None:
    """Refuse an `attach` while `model` has a handle, or a per-call attach is running on it (call under `LOCK`)."""
    if get_handle(model) is not None:
        raise TideArgumentError("this model already has a TIDE router attached; call handle.detach() first")
    if _CALL_HANDLES.get(model):
        raise TideConcurrencyError(
            "a generate(tide=<router>) call is running on this model (in another thread); attach after it ends")


def register(model: nn.Module, handle: Any) -> None:
    """`handle` is `model`'s attach (acting in every thread)."""
    _HANDLES[model] = weakref.ref(handle)


def register_call(model: nn.Module, handle: Any) -> None:
    """`handle` is a per-call attach on `model`, running now in its own thread."""
    _CALL_HANDLES.setdefault(model, {})[id(handle)] = handle


def unregister(model: nn.Module, handle: Any) -> None:
    """Forget `handle`, `model`'s attach or one of its per-call attaches (call under `LOCK`)."""
    if get_handle(model) is handle:
        del _HANDLES[model]
    _CALL_HANDLES.get(model, {}).pop(id(handle), None)


def publish_stats(model: nn.Module, stats: ExitStats) -> None:
    """`stats` are the latest TIDE call's on `model` (what `last_stats` returns)."""
    _LAST_STATS[model] = stats


def get_handle(model: nn.Module) -> Any:
    """The handle of the router attached to `model`, if any.

    Args:
        model: the model `attach` hooked.

    Returns:
        Its `TideHandle`, or None when no router is attached (a per-call `tide=` attach is not one).
    """
    check_model(model)
    ref = _HANDLES.get(model)
    return ref() if ref is not None else None


def detach(model: nn.Module) -> None:
    """Detach the router attached to `model`: the model is exactly as before `attach`.

    Args:
        model: the model; one without a router is left as it is.
    """
    handle = get_handle(model)
    if handle is not None:
        handle.detach()


def last_stats(model: nn.Module) -> ExitStats | None:
    """Exit statistics of the latest TIDE call on `model`, also after an on-the-fly `tide=` attach.

    Args:
        model: the model.

    Returns:
        The `ExitStats` (prefill and decode: exits per layer, layers executed), or None before any TIDE call.
    """
    check_model(model)
    return _LAST_STATS.get(model)
