"""Step aside when exits do not pay: skip mode's probes of a plain step against TIDE's.

Pricing (`pricing.py`) prices exits once, before any call, from costs measured on one row. What it cannot see is
what a call meets: longer contexts, other text, a busier machine. So while a priced skip mode decodes, every
`WINDOW` of its decode steps is followed by `PROBES` plain steps (no exit decided, every layer run); each probe
TIDE wins doubles the window (up to `MAX_WINDOW`). Where TIDE's steps took longer than the plain ones on average,
the next `ASIDE` decode steps run plain (no scoring, no exits), then TIDE is timed again over a `WINDOW`. Each
batch size keeps its own schedule. A plain step gives the full model's token for its row, so stepping aside never
lowers quality; it does make which tokens exit depend on the timings (`pricing=False` turns it off with pricing).
Timed on the CPU only: on an accelerator reading the clock per step would wait for the device.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

WINDOW = 16  # TIDE decode steps timed before the first probe, and again after stepping aside
MAX_WINDOW = 256  # each probe TIDE wins doubles the window up to this: probes cost plain steps where TIDE pays
PROBES = 2  # plain decode steps per probe
ASIDE = 64  # plain decode steps after TIDE measured slower, before TIDE is timed again
MAX_DEFER = 4  # steps a probe waits for no token to be catching up (a catch-up would be timed as plain work)


@dataclass
class StepAside:
    """The probing schedule of one attach and what it measured (`last_stats.aside` reports it per call)."""

    tide_s: list[float] = field(default_factory=list)  # this window's TIDE step times
    plain_s: list[float] = field(default_factory=list)  # this probe's plain step times
    aside_left: int = 0  # plain steps still to run before TIDE is timed again
    window: int = field(default_factory=lambda: WINDOW)  # TIDE steps timed before the next probe (read now)
    deferred: int = 0  # steps the due probe has waited
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def plain_next(self, catching_up: bool) -> bool:
        """Whether the next decode step runs plain: stepped aside, or a probe (deferred while a token of an earlier
        step is `catching_up`, at most `MAX_DEFER` steps)."""
        with self.lock:
            if self.aside_left > 0:
                return True
            if len(self.tide_s) < self.window:
                return False
            if catching_up and self.deferred < MAX_DEFER:
                self.deferred += 1
                return False
            return True

    def record(self, seconds: float, plain: bool, report: dict[str, Any]) -> None:
        """Count one decode step of `seconds` into the schedule and into this call's `report`."""
        with self.lock:
            report["plain_steps" if plain else "tide_steps"] += 1
            if self.aside_left > 0:
                self.aside_left -= 1
                return
            if not plain:
                self.tide_s.append(seconds)
                return
            self.plain_s.append(seconds)
            if len(self.plain_s) < PROBES:
                return
            tide, stock = sum(self.tide_s) / len(self.tide_s), sum(self.plain_s) / len(self.plain_s)
            report["probes"] += 1
            report["last_probe_ms"] = {"tide_step": 1e3 * tide, "plain_step": 1e3 * stock}
            if tide > stock:
                self.aside_left, self.window = ASIDE, WINDOW
                report["stepped_aside"] += 1
            else:
                self.window = min(2 * self.window, MAX_WINDOW)
            self.tide_s, self.plain_s, self.deferred = [], [], 0


def new_report() -> dict[str, Any]:
    """A call's step-aside counters, as `last_stats.aside` shows them; "priced_plain" counts the steps (prefill
    included) that ran plain, untimed, because no exit could pay at their width (`pricing.pays_at`)."""
    return {"tide_steps": 0, "plain_steps": 0, "probes": 0, "stepped_aside": 0, "last_probe_ms": None,
            "priced_plain": 0}
