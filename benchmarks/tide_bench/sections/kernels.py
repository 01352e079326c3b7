"""`tide-hf bench kernels`: the fused kernels vs the PyTorch path (no model or router). Its parser, checks and run
(torch imported when it runs)."""

from __future__ import annotations

import argparse
from typing import Any

from tide_hf.cli.values import CPU, DTYPES

from .common import add_output, section

NAME = "kernels"


def add_parser(sub: Any) -> None:
    p = section(sub, NAME, "the fused kernels vs the PyTorch path (no model or router)",
                "Microbenchmark of the fused kernels against the PyTorch path on this machine's device.",
                "--dtype bfloat16 --output bench-out", f"{CPU}: ~15 s", None)
    p.add_argument_group("kernels").add_argument("--dtype", default=DTYPES[0], choices=DTYPES, metavar="DTYPE",
                                                 help=f"dtype the kernels are timed in: {', '.join(DTYPES)}")
    add_output(p, "kernels.json and kernels.md")


def check(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Nothing to check beyond parsing."""


def run(args: argparse.Namespace) -> dict:
    from ..bench import results_folder, write_result
    from ..kernels import kernel_rows
    from ..tables import format_kernels

    out = results_folder(args, reads_text=False)
    return write_result(out, "kernels", {"rows": kernel_rows(args.dtype)}, format_kernels)
