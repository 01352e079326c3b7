"""transformers integration: the `generate(tide=...)` keyword, the per-step logits processor, and the
speculative candidates stock assisted decoding verifies; `tide_hf.compat` holds every private transformers name."""

from __future__ import annotations

from .generate import install, resolve_router, uninstall
from .processor import TideLogitsProcessor
from .rows import SpeculativeFallbackWarning

__all__ = ["SpeculativeFallbackWarning", "TideLogitsProcessor", "install", "resolve_router", "uninstall"]
