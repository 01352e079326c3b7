"""`tide-hf`, the command line: its arguments (parsed before torch is imported, so `tide-hf --help` answers at
once) and its commands (each imports its room when it runs)."""

from __future__ import annotations

from .arguments import (
           CALIBRATED_EXIT_HEAD,
           CONTINUATIONS,
           EXIT_HEADS,
           LABEL_KINDS,
           ROUTER_DEFAULTS,
           SYNTHETIC_CONFIGS,
           SYNTHETIC_SHAPES,
           build_parser,
)
from .commands import main

__all__ = ["CALIBRATED_EXIT_HEAD", "CONTINUATIONS", "EXIT_HEADS", "LABEL_KINDS", "ROUTER_DEFAULTS", "SYNTHETIC_CONFIGS",
           "SYNTHETIC_SHAPES", "build_parser", "main"]
