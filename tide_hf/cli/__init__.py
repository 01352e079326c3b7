"""`tide-hf`, the command line: its arguments (parsed before torch is imported, so `tide-hf --help` answers at
once) and its commands (each imports its room when it runs)."""

from __future__ import annotations

from .commands import build_parser, command_error, main
from .values import OWN_FLAGS, SET_FIELDS

__all__ = ["OWN_FLAGS", "SET_FIELDS", "build_parser", "command_error", "main"]
