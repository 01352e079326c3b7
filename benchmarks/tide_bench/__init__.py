"""The benchmarks of `tide-hf bench`, kept out of the tide_hf wheel: they run from a checkout of the repository
(`tide-hf bench` finds this package in its benchmarks/ folder). They may import tide_hf; tide_hf never imports them.

What `tide-hf bench` reads, importable without torch (so `tide-hf --help` answers at once): `add_sections` (the
SECTION parsers), `check` (flags that go together) and `run` (a section's body, torch imported when it runs)."""

from __future__ import annotations

import argparse

from .checks import check
from .sections import add_sections


def run(args: argparse.Namespace) -> dict:
    """Run `args.section` (tide_bench.bench.run: writes its JSON and Markdown to --output)."""
    from .bench import run as run_section

    return run_section(args)


__all__ = ["add_sections", "check", "run"]
