"""`tide-hf bench`: stock generate vs TIDE. The benchmarks are not in the wheel: they live in the repository's
benchmarks/tide_bench/ package, which this command imports where it is importable or where it runs from a checkout,
and otherwise says how to get it."""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path
from types import ModuleType

from .values import CPU, HelpFormatter

NAME = "bench"
BENCHMARKS = "tide_bench"  # the benchmark package
CHECKOUT_FOLDER = "benchmarks"  # the checkout's folder holding it
MISSING = (f"the benchmarks are not installed: they are not in the tide_hf wheel but in the source repository "
           f"({CHECKOUT_FOLDER}/{BENCHMARKS}/); clone it and run `tide-hf bench` from the clone (or put its "
           f"{CHECKOUT_FOLDER}/ folder on PYTHONPATH)")


def checkout_folders() -> list[Path]:
    """Where a checkout's benchmarks may be: under the working directory or one above it, and beside the tide_hf
    imported (an editable install, or a checkout on PYTHONPATH)."""
    here = Path.cwd()
    return [folder / CHECKOUT_FOLDER for folder in (here, *here.parents, Path(__file__).resolve().parents[2])]


def find_benchmarks() -> ModuleType | None:
    """The benchmark package, importable already or from a checkout (its folder then joins sys.path); None where
    neither has it."""
    try:
        return importlib.import_module(BENCHMARKS)
    except ModuleNotFoundError as err:
        if err.name != BENCHMARKS:
            raise
    for folder in checkout_folders():
        if (folder / BENCHMARKS / "__init__.py").is_file():
            sys.path.insert(0, str(folder))
            return importlib.import_module(BENCHMARKS)
    return None


def add_parser(sub: argparse._SubParsersAction) -> None:
    bench = sub.add_parser(
        NAME, formatter_class=HelpFormatter, usage="tide-hf bench SECTION [options]",
        help="stock generate vs TIDE in one run: overhead, modes, batches, continuous, baselines, kernels, GPU "
             "(from a checkout)",
        description="Stock generate vs TIDE, measured in one process: each SECTION is one benchmark with its own "
                    "flags (tide-hf bench SECTION --help) and writes SECTION's JSON and Markdown to --output. The "
                    "benchmarks run from a checkout of the repository (they are not in the wheel).\n\n"
                    "example: tide-hf bench overhead --router router-smollm2 --output bench-out\n"
                    f"time {CPU}: ~5-10 min for overhead with the defaults (modes / baselines: ~10-20 min)")
    benchmarks = find_benchmarks()
    if benchmarks is None:
        bench.description += f"\n\n{MISSING}"
        bench.add_argument("section_args", nargs=argparse.REMAINDER, metavar="SECTION [options]", help=MISSING)
    else:
        benchmarks.add_sections(bench)


def check(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """The section's flags go together (tide_bench.check), or the benchmarks are missing (said before torch loads)."""
    benchmarks = find_benchmarks()
    if benchmarks is None:
        raise SystemExit(f"tide-hf bench: error: {MISSING}")
    benchmarks.check(parser, args)


def run(args: argparse.Namespace) -> None:
    find_benchmarks().run(args)
