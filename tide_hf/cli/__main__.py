"""`python -m tide_hf.cli` (what `accelerate launch -m tide_hf.cli` runs): the `tide-hf` command."""

from __future__ import annotations

import sys

from .commands import main

main(sys.argv[1:])
