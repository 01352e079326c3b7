"""tide_hf: TIDE (Token-Informed Depth Execution) early exit for HuggingFace causal LMs."""

from __future__ import annotations

from .adapters import ModelAdapter, get_adapter, register_adapter
from .attach import TideHandle, attach, detach, get_handle, last_stats
from .calibrate import calibrate
from .config import TideOptions, TideRouterConfig
from .data import TideDataError, load_texts
from .generate import install as _install_generate
from .processor import TideLogitsProcessor
from .router import TideCompatibilityError, TideRouter, model_fingerprint
from .stats import ExitStats

_install_generate()

__all__ = [
    "ExitStats",
    "ModelAdapter",
    "TideCompatibilityError",
    "TideDataError",
    "TideHandle",
    "TideLogitsProcessor",
    "TideOptions",
    "TideRouter",
    "TideRouterConfig",
    "attach",
    "calibrate",
    "detach",
    "get_adapter",
    "get_handle",
    "last_stats",
    "load_texts",
    "model_fingerprint",
    "register_adapter",
]
