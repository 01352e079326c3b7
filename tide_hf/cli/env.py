"""`tide-hf env`: versions, devices, kernel backends and cache folders (what a bug report needs). Its parser and
its run (tide_hf.eval.environment, imported when it runs)."""

from __future__ import annotations

import argparse

from .values import CPU, HelpFormatter

NAME = "env"


def add_parser(sub: argparse._SubParsersAction) -> None:
    sub.add_parser(NAME, formatter_class=HelpFormatter, help="versions, devices, kernel backends and cache folders "
                   "(what a bug report needs)", description="Print the versions of Python, torch, transformers, "
                   "accelerate and tide_hf, the devices torch sees, the kernel backend of each (building the kernels "
                   "if needed) and the cache folders, one `name: value` per line.\n\nexample: tide-hf env\n"
                   f"time {CPU}: ~10 s (torch's import and the kernels' load)")


def check(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Nothing beyond parsing."""


def run(args: argparse.Namespace) -> None:
    from ..eval.environment import run as env

    env(args)
