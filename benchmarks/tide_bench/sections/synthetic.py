"""`tide-hf bench synthetic`: every mode on a random-weight architecture shape (no router or download). Its parser,
checks and run (torch imported when it runs)."""

from __future__ import annotations

import argparse
from typing import Any

from tide_hf.cli.values import CPU, DTYPES, positive_int

from .common import add_output, batch_sizes, check_decode_tokens, section

NAME = "synthetic"
# ..synthetic's SHAPES and CONFIGS, without importing torch (tests/test_cli.py checks they agree)
SHAPES = ("llama3-8b", "qwen2-0.5b", "tiny")
CONFIGS = ("stock", "exits-off", "select-scored", "select-exit", "skip-recompute", "skip-propagate", "truncated")


def add_parser(sub: Any) -> None:
    p = section(sub, NAME, "every mode on a random-weight architecture shape (GPU; no download)",
                "Speed of every mode on an architecture shape with random weights and forced exits (no router or "
                "download needed): runtime cost and savings, never quality.",
                "llama3-8b --dtype bfloat16 --prompt-len 128 --new-tokens 64",
                f"~10 min on an H100 (tiny {CPU}: ~7 min, compilation included)", "SHAPE [options]")
    g = p.add_argument_group("shape and configurations")
    g.add_argument("synthetic", choices=SHAPES, metavar="SHAPE",
                   help=f"architecture shape: {', '.join(SHAPES)}")
    g.add_argument("--synthetic-depth", type=positive_int, default=None, metavar="K",
                   help="the depth every token exits at, a checkpoint (default: half the shape's layers)")
    g.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=CONFIGS,
                   metavar="CONFIG",
                   help=f"configurations timed, stock always (default: all: {', '.join(CONFIGS)})")
    g.add_argument("--compile", nargs="+", default=["eager", "static"], choices=["eager", "static"], metavar="MODE",
                   help="eager, and/or static: cache_implementation='static', compiled by transformers")
    g.add_argument("--device", default=None, help="device (default: cuda when available)")
    g.add_argument("--dtype", default=DTYPES[0], choices=DTYPES, metavar="DTYPE",
                   help=f"dtype the model is built in: {', '.join(DTYPES)}")
    g = p.add_argument_group("prompts")
    g.add_argument("--prompt-len", type=positive_int, default=64, metavar="N", help="tokens per prompt")
    g.add_argument("--new-tokens", type=positive_int, default=32, metavar="N", help="tokens generated per prompt")
    g.add_argument("--reps", type=positive_int, default=3, metavar="N", help="timing repetitions")
    batch_sizes(g, "batch sizes measured")
    add_output(p, "synthetic.json and synthetic.md")


def check(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    check_decode_tokens(args)


def run(args: argparse.Namespace) -> dict:
    from ..bench import results_folder, write_result
    from ..synthetic import run_synthetic
    from ..tables import format_synthetic

    out = results_folder(args, reads_text=False)
    return write_result(out, "synthetic", run_synthetic(args), format_synthetic)
