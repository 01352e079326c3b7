"""tide_hf: TIDE (Token-Informed Depth Execution) early exit for HuggingFace causal LMs."""

from __future__ import annotations

from .adapters import ModelAdapter, get_adapter, register_adapter
from .config import TideOptions, TideRouterConfig
from .router import TideCompatibilityError, TideRouter, model_fingerprint

__all__ = [
    "ModelAdapter",
    "TideCompatibilityError",
    "TideOptions",
    "TideRouter",
    "TideRouterConfig",
    "get_adapter",
    "model_fingerprint",
    "register_adapter",
]
