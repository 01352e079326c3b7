"""Continuous batching (`model.generate_batch`, `init_continuous_batching`): refused while a router is attached.

transformers' continuous batching does not go through `generate`: a manager thread schedules many requests
into flattened forwards over a paged KV cache. TIDE's exits are decided per (row, position) of generate's
batch, skip mode's K/V policies and speculative mode's drafts work on generate's caches, and the statistics
belong to the calling thread's generate call; none of this holds there, so the attached model would decode
with exits nobody accounts for (select / skip mode) or silently without drafting (speculative mode). The
entry every continuous-batching path takes, `init_continuous_batching`, refuses instead, before any work
(`enable_generate_keyword` wraps it beside `generate`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from ..errors import TideUnsupportedError
from ..runtime import get_handle


def refuse_attached(model: Any) -> None:
    """Raise `TideUnsupportedError` when a router is attached to `model` and not turned off in this thread."""
    handle = get_handle(model)
    if handle is None or handle.is_disabled():
        return
    raise TideUnsupportedError(
        f"continuous batching (generate_batch / init_continuous_batching) with a TIDE router attached in mode="
        f"{handle.options.mode!r}: its scheduler feeds flattened requests over a paged KV cache, which TIDE's exits, "
        "skipped layers and drafts do not serve; call handle.detach() first (or leave the `with tide_hf.attach(...)` "
        "block), or use model.generate() on a padded batch")


def guarded(original: Callable[..., Any]) -> Callable[..., Any]:
    """`original` (`init_continuous_batching`) preceded by `refuse_attached`."""

    @functools.wraps(original)
    def init_continuous_batching(self: Any, *args: Any, **kwargs: Any) -> Any:
        refuse_attached(self)
        return original(self, *args, **kwargs)

    return init_continuous_batching
