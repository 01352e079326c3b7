"""transformers integration: the `generate(tide=...)` keyword, the per-step logits processor, and the
speculative candidates stock assisted decoding verifies; `tide_hf.compat` holds every private transformers name."""

from __future__ import annotations

from .attaching import attach, attach_with
from .generate import disable_generate_keyword, enable_generate_keyword, resolve_router
from .processor import TideLogitsProcessor
from .rows import SpeculativeFallbackWarning

__all__ = ["SpeculativeFallbackWarning", "TideLogitsProcessor", "attach", "attach_with", "disable_generate_keyword",
           "enable_generate_keyword", "resolve_router"]
