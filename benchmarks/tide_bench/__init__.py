"""The benchmarks of `tide-hf bench`, kept out of the tide_hf wheel: they run from a checkout of the repository
(`tide-hf bench` finds this package in its benchmarks/ folder). They may import tide_hf; tide_hf never imports them.

What `tide-hf bench` reads, importable without torch (so `tide-hf --help` answers at once): `add_sections` (the
SECTION parsers), `check` (flags that go together) and `run` (a section's body, torch imported when it runs), one
module of `tide_bench.sections` per section."""

from __future__ import annotations

from .sections import add_sections, check, run

__all__ = ["add_sections", "check", "run"]
