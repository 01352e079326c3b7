"""Serving: attach / detach (`TideHandle`) and which model has which handle (`registry`), per-call state, skip
mode and its KV policies (`skip/`), exit statistics, the CPU fast path of linear layers (`fast_linears`), and the
one reversible patching mechanism they all use."""

from __future__ import annotations

from .handle import TideHandle, attach_for_call, hook_model
from .linears import LinearPath, LinearPathWarning, fast_linears
from .modes import ModeFallbackWarning
from .options import TideConfig, TideOptions
from .patching import Patches
from .registry import detach, get_handle, last_stats
from .session import Session, Step
from .stats import ExitStats, PhaseStats

__all__ = ["ExitStats", "LinearPath", "LinearPathWarning", "ModeFallbackWarning", "Patches", "PhaseStats", "Session",
           "Step", "TideConfig", "TideHandle", "TideOptions", "attach_for_call", "detach", "fast_linears", "get_handle",
           "hook_model", "last_stats"]
