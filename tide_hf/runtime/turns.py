"""Whose turn it is on a model shared by threads: a speculative call against every other call of that model.

A speculative call's drafts lower the shared `config.num_hidden_layers` (stock early-exit drafting's mechanism),
which every call of the model reads: generate when it builds its cache, the forward when it loops over the
layers. So a speculative call runs alone (`exclusive`): it waits for the generate calls other threads have in
flight (`shared`), and theirs wait for its end.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

from ..errors import TideConcurrencyError


class Turns:
    """Shared turns for generate calls, an exclusive one for a speculative call (at most one at a time)."""

    def __init__(self, enabled: bool) -> None:
        """`enabled`: the handle serves speculative mode (no other mode takes an exclusive turn)."""
        self.enabled = enabled
        self.owner: int | None = None  # the thread holding the exclusive turn
        self._mine = threading.local()  # `mine()` without `threading.get_ident`, which compiled graphs cannot trace
        self._shared: dict[int, int] = {}  # thread -> its calls in flight
        self._wanting: set[int] = set()
        self._changed = threading.Condition()

    @contextmanager
    def shared(self) -> Iterator[None]:
        """A generate call of this thread: it starts once no other thread holds the exclusive turn."""
        if not self.enabled:
            yield
            return
        me = threading.get_ident()
        with self._changed:
            self._changed.wait_for(lambda: self.owner in (None, me))
            self._shared[me] = self._shared.get(me, 0) + 1
        try:
            yield
        finally:
            with self._changed:
                self._shared[me] -= 1
                if not self._shared[me]:
                    del self._shared[me]
                self._changed.notify_all()

    @contextmanager
    def exclusive(self) -> Iterator[None]:
        """This thread alone: wait until the other threads' calls in flight have ended; theirs wait for its end."""
        me = threading.get_ident()
        with self._changed:
            if self._wanting - {me} or self.owner not in (None, me):
                raise TideConcurrencyError("a speculative generate call is already running on this model (one at "
                                           "a time)")
            self._wanting.add(me)
            try:
                self._changed.wait_for(lambda: all(thread == me for thread in self._shared))
            finally:
                self._wanting.discard(me)
            outer, self.owner = self.owner, me
            self._mine.owner = True
        try:
            yield
        finally:
            with self._changed:
                self.owner, self._mine.owner = outer, outer is not None
                self._changed.notify_all()

    def mine(self) -> bool:
        """This thread holds the exclusive turn (read in the forward hooks, traced into compiled graphs)."""
        return getattr(self._mine, "owner", False)

    def wait(self) -> None:
        """A plain forward of another thread than the exclusive turn's: wait for that turn's end (in a compiled
        forward, a graph break: the wait runs eagerly, before the rest of the forward is traced)."""
        with self._changed:
            self._changed.wait_for(lambda: self.owner in (None, threading.get_ident()))
