"""`tide-hf bench overhead`: overhead of attached routers, then exit rates, perplexity and agreement per router and
threshold. Its parser, checks and run (torch imported when it runs)."""

from __future__ import annotations

import argparse
from typing import Any

from tide_hf.cli.values import CPU

from .common import (
    add_model,
    add_output,
    add_prompts,
    batch_sizes,
    check_batches,
    check_decode_tokens,
    check_routers,
    section,
    thresholds,
)

NAME = "overhead"


def add_parser(sub: Any) -> None:
    p = section(sub, NAME, "overhead, exit rates, perplexity and agreement of TIDE vs stock",
                "Stock generate vs TIDE with the given routers: the overhead of attached routers with exits "
                "closed (interleaved), then per router and threshold exit rates, layers, perplexity and greedy "
                "agreement (a table row each).", "--router router-smollm2 --output bench-out",
                f"{CPU}: ~5-10 min with the defaults", "--router DIR [DIR ...] [options]")
    g = add_model(p, "router folders / Hub ids (e.g. one cosine, one top1: a row each)")
    thresholds(g, "exit thresholds TIDE is measured at")
    g = add_prompts(p)
    batch_sizes(g, "batch sizes of the overhead run (at most --num-prompts)")
    add_output(p, "bench.json and bench.md")


def check(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    check_routers(args, one=False)
    check_decode_tokens(args)
    check_batches(args)


def run(args: argparse.Namespace) -> dict:
    from ..bench import overhead, quality, text_setup, write_result
    from ..tables import format_table

    s = text_setup(args)
    s.result["overhead"] = overhead(s.model, next(iter(s.routers.values())), s.prompts, s.pad_id, args.batch_sizes,
                                    args.new_tokens, args.reps)
    s.result["quality"] = quality(s.model, s.routers, args.thresholds, s.prompts, s.chunks, s.pad_id,
                                  args.quality_batch_size, args.new_tokens)
    return write_result(s.out, "bench", s.result, format_table)
