"""Which frame a warning names: the first one outside tide_hf (the user's line), however many of tide_hf's own
wrappers lie between (`attach`'s, the model's `generate`, the generate keyword's)."""

from __future__ import annotations

import os
import sys

PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))  # tide_hf/: its frames are never the caller


def caller_stacklevel() -> int:
    """The `warnings.warn` stacklevel, counted from the function that calls this one, of the first frame outside
    tide_hf."""
    frame, level = sys._getframe(2), 2
    while frame is not None and frame.f_code.co_filename.startswith(PACKAGE_DIR):
        frame, level = frame.f_back, level + 1
    return level
