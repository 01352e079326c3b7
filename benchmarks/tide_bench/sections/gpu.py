"""`tide-hf bench gpu`: the GPU suite, every GPU goal in one call (random weights, no download). Its parser, checks
and run (torch imported when it runs)."""

from __future__ import annotations

import argparse
from typing import Any

from tide_hf.cli.values import CPU

from .common import OUTPUT, section

NAME = "gpu"


def add_parser(sub: Any) -> None:
    p = section(sub, NAME, "every GPU goal in one call (tide_bench.gpu; random weights, no download)",
                "The GPU suite: every GPU goal measured in one call on a random-weight Llama-3-8B shape, its plan "
                "fixed (tide_bench.gpu.GPU); writes gpu.json and gpu.md after every section.", "--output gpu-out",
                f"planned to fit 8 min on one H100 / H200, not yet run on one; --dry-run {CPU}: ~1 min", None)
    g = p.add_argument_group("suite")
    g.add_argument("--dry-run", action="store_true", help="the suite's code on tiny shapes on the CPU")
    g.add_argument("--output", default=OUTPUT, metavar="DIR", help="folder for gpu.json and gpu.md")


def check(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Nothing to check beyond parsing."""


def run(args: argparse.Namespace) -> dict:
    from ..bench import results_folder
    from ..gpu import run_suite

    return run_suite(results_folder(args, reads_text=False), args.dry_run, args.command)
