"""Continuous batching (`model.generate_batch`, `init_continuous_batching`): refused while a router is attached.

transformers' continuous batching does not go through `generate`: a manager thread schedules many requests
into flattened forwards over a paged KV cache. TIDE's exits are decided per (row, position) of generate's
batch, skip mode's K/V policies and speculative mode's drafts work on generate's caches, and the statistics
belong to the calling thread's generate call; none of this holds there, so the attached model would decode
with exits nobody accounts for (select / skip mode) or silently without drafting (speculative mode). Every
continuous-batching path (`generate_batch`, `transformers serve`) starts with `model.init_continuous_batching`:
attach shadows it on the model it hooks, with a method that refuses before any work; detach takes it back.
"""

from __future__ import annotations

import functools
from typing import Any

from ..errors import TideUnsupportedError
from .patching import Patches

BATCHING_ENTRY = "init_continuous_batching"  # the method every continuous-batching path starts with


def guard_continuous_batching(model: Any, handle: Any, patches: Patches) -> None:
    """Shadow `model.init_continuous_batching` by one that raises `TideUnsupportedError` unless `handle` is turned
    off in this thread (`tide=False`); `patches` puts the class's method back at detach."""
    original = getattr(type(model), BATCHING_ENTRY, None)
    if original is None:  # a transformers without continuous batching
        return

    @functools.wraps(original)
    def init_continuous_batching(*args: Any, **kwargs: Any) -> Any:
        if not handle.is_disabled():
            raise TideUnsupportedError(
                f"continuous batching (generate_batch / init_continuous_batching) with a TIDE router attached in "
                f"mode={handle.options.mode!r}: its scheduler feeds flattened requests over a paged KV cache, which "
                "TIDE's exits, skipped layers and drafts do not serve; call handle.detach() first (or leave the "
                "`with tide_hf.attach(...)` block), or use model.generate() on a padded batch")
        return original(model, *args, **kwargs)

    patches.set_attr(model, BATCHING_ENTRY, init_continuous_batching)
