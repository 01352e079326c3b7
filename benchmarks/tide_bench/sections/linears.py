"""`tide-hf bench linears`: eager vs fast-path linear layers: forward cost by new tokens, stock and each TIDE mode.
Its parser, checks and run (torch imported when it runs)."""

from __future__ import annotations

import argparse
from typing import Any

from tide_hf.cli.values import CPU, DTYPES, positive_int

from .common import add_model, add_output, add_prompts, check_decode_tokens, check_routers, section

NAME = "linears"


def add_parser(sub: Any) -> None:
    p = section(sub, NAME, "eager vs fast-path linear layers: forward cost by k, stock and TIDE modes",
                "Where the CPU speed comes from: a forward over 1-16 new tokens with eager nn.Linear and with the "
                "fast path (fast_linears: oneDNN on packed weights), per --dtypes; then batch-1 greedy generation, "
                "interleaved: stock on both paths, prompt lookup and each TIDE mode on the fast path, against stock "
                "on the same path and against stock eager.",
                "--router router-smollm2 --num-prompts 4 --new-tokens 64 --output bench-out",
                f"{CPU}: ~10 min with those flags", "--router DIR [options]")
    g = add_model(p, "one router folder / Hub id")
    g.add_argument("--dtypes", nargs="+", default=["float32"], choices=DTYPES, metavar="DTYPE",
                   help=f"dtypes of the forward-cost table: {', '.join(DTYPES)}")
    g.add_argument("--cache-len", type=positive_int, default=128, metavar="N",
                   help="tokens in the cache each costed forward reads")
    g.add_argument("--cost-repeats", type=positive_int, default=15, metavar="N",
                   help="timed forwards per cost (the median is kept)")
    add_prompts(p, chunks=False, quality_batch=False)
    add_output(p, "linears.json and linears.md")


def check(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    check_routers(args, one=True)
    check_decode_tokens(args)


def run(args: argparse.Namespace) -> dict:
    from ..bench import text_setup, write_result
    from ..linears import run_linears
    from ..tables import format_linears

    s = text_setup(args)
    s.result.update(run_linears(s.model, s.router, s.prompts, s.pad_id, args))
    return write_result(s.out, "linears", s.result, format_linears)
