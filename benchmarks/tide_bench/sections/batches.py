"""`tide-hf bench batches`: skip mode in batches, rows exiting on their own. Its parser, checks and run (torch
imported when it runs)."""

from __future__ import annotations

import argparse
from typing import Any

from tide_hf.cli.values import CPU, positive_int

from .common import (
    add_model,
    add_output,
    add_prompts,
    batch_sizes,
    check_batches,
    check_decode_tokens,
    check_routers,
    section,
    targets,
)

NAME = "batches"


def add_parser(sub: Any) -> None:
    p = section(sub, NAME, "skip mode in batches, rows exiting on their own, vs stock and the ideal",
                "Skip mode in batches at each --batch-sizes: a stock decode step's cost by rows, then forced "
                "per-row exits (half the rows) and real router decisions at --targets, decode and prefill, with "
                "kv='propagate' and kv='recompute', vs stock and the ideals.",
                "--router router-smollm2 --batch-sizes 1 8 32 --num-prompts 32 --targets 0.95 --new-tokens 64",
                f"{CPU}: ~1 h with these flags (61 min measured with --num-chunks 8)", "--router DIR [options]")
    g = add_model(p, "one router folder / Hub id")
    targets(g, "min_agreement targets of the real-router rows (routers with exit paths)")
    g.add_argument("--forced-depth", type=positive_int, default=None, metavar="K",
                   help="the checkpoint forced rows exit at (default: the one nearest half the depth)")
    g = add_prompts(p, quality_batch=False)
    batch_sizes(g, "batch sizes measured (at most --num-prompts)")
    add_output(p, "batches.json and batches.md")


def check(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    check_routers(args, one=True)
    check_decode_tokens(args)
    check_batches(args)


def run(args: argparse.Namespace) -> dict:
    from ..batches import run_batches
    from ..bench import text_setup, write_result
    from ..measure import check_exit_depths
    from ..tables import format_batches

    s = text_setup(args)
    if args.forced_depth is not None:
        check_exit_depths([args.forced_depth], s.router.config.checkpoint_layers, "--forced-depth")
    s.result.update(run_batches(s.model, s.router, s.prompts, s.chunks, s.pad_id, args))
    return write_result(s.out, "batches", s.result, format_batches)
