"""Serving: attach / detach (`TideHandle`), per-call state, skip mode and its KV policies, exit statistics,
and the one reversible patching mechanism they all use."""

from __future__ import annotations

from .handle import TideHandle, attach, attach_for_call, detach, get_handle, last_stats
from .options import TideOptions
from .patching import Patches
from .session import Session, Step
from .stats import ExitStats, PhaseStats

__all__ = ["ExitStats", "Patches", "PhaseStats", "Session", "Step", "TideHandle", "TideOptions", "attach",
           "attach_for_call", "detach", "get_handle",
           "last_stats"]
