"""`tide-hf bench continuous`: skip mode in continuous batching (generate_batch) vs stock. Its parser, checks and
run (torch imported when it runs)."""

from __future__ import annotations

import argparse
from typing import Any

from tide_hf.cli.values import CPU

from .common import add_model, add_output, add_prompts, check_decode_tokens, check_routers, section, targets

NAME = "continuous"


def add_parser(sub: Any) -> None:
    p = section(sub, NAME, "continuous batching (generate_batch) with TIDE vs stock",
                "All --num-prompts prompts in one model.generate_batch call (continuous batching), skip mode "
                "(kv='propagate') at each --targets against stock continuous batching: speed, layers executed per "
                "decode token and prompt position, top-1 agreement.",
                "--router router-smollm2 --num-prompts 32 --new-tokens 64", f"{CPU}: ~5 min with those flags",
                "--router DIR [options]")
    g = add_model(p, "one router folder / Hub id")
    targets(g, "min_agreement targets (routers with exit paths)")
    add_prompts(p, chunks=False, quality_batch=False)
    add_output(p, "continuous.json and continuous.md")


def check(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    check_routers(args, one=True)
    check_decode_tokens(args)


def run(args: argparse.Namespace) -> dict:
    from ..bench import text_setup, write_result
    from ..continuous import run_continuous
    from ..tables import format_continuous

    s = text_setup(args)
    s.result.update(run_continuous(s.model, s.router, s.prompts, s.pad_id, args))
    return write_result(s.out, "continuous", s.result, format_continuous)
