"""`tide-hf bench modes`: skip mode vs stock and the ideal, speculative mode vs assistant_early_exit (or on an easy
model). Its parser, checks and run (torch imported when it runs)."""

from __future__ import annotations

import argparse
from typing import Any

from tide_hf.cli.checks import changed
from tide_hf.cli.values import CPU, positive_float, positive_int

from .common import (
    add_model,
    add_output,
    add_prompts,
    check_decode_tokens,
    check_routers,
    routers_of,
    section,
    thresholds,
)

NAME = "modes"


def add_parser(sub: Any) -> None:
    p = section(sub, NAME, "skip mode vs stock and the ideal, speculative mode vs assistant_early_exit",
                "Skip mode at forced depths vs stock and the ideal truncated model, skip mode at real thresholds, and "
                "speculative mode vs stock, prompt lookup and assistant_early_exit. --near-identity-after K "
                "instead measures the speculative mode on an easy model (the layers after K made near-identity), "
                "with routers calibrated on it (modes-easy.json).", "--router router-smollm2 --output bench-out",
                f"{CPU}: ~10-20 min with the defaults", "(--router DIR | --near-identity-after K) [options]")
    g = add_model(p, "one router folder / Hub id (or --near-identity-after)", required=False)
    g.add_argument("--depths", nargs="+", type=positive_int, default=[8, 16, 24], metavar="K",
                   help="forced exit depths (checkpoints of the router)")
    thresholds(g, "exit thresholds of the mixed-exit rows")
    g = p.add_argument_group("an easy model instead of --router")
    g.add_argument("--near-identity-after", type=positive_int, default=None, metavar="K",
                   help="make the layers after K near-identity (o_proj / down_proj scaled)")
    g.add_argument("--near-identity-scale", type=positive_float, default=None, metavar="X",
                   help="their weights' factor (default: tide_bench.easy.NEAR_IDENTITY_SCALE, 0.02)")
    add_prompts(p)
    add_output(p, "modes(-easy).json and .md")


# `--near-identity-after` measures the speculative mode on routers of its own, on prompts only
EASY_MODES_UNUSED = ("depths", "thresholds", "num_chunks", "chunk_len")


def check(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """--router or --near-identity-after (an easy model with routers of its own), and no flag the easy run
    ignores."""
    easy = args.near_identity_after is not None
    if easy and (given := changed(parser, args, EASY_MODES_UNUSED)):
        raise SystemExit(f"tide-hf bench modes: {given[0]} does not apply with --near-identity-after (it measures "
                         "the speculative mode only, on prompts)")
    if routers_of(args) and easy:
        raise SystemExit("tide-hf bench modes: --near-identity-after builds its own routers; leave out --router")
    if not routers_of(args) and not easy:
        raise SystemExit("tide-hf bench modes: give --router DIR, or --near-identity-after K (an easy model with "
                         "routers of its own)")
    if args.near_identity_scale is not None and not easy:
        raise SystemExit("tide-hf bench modes: --near-identity-scale goes with --near-identity-after")
    check_routers(args, one=True)
    check_decode_tokens(args)


def run(args: argparse.Namespace) -> dict:
    from tide_hf.assets import load_model

    from ..bench import easy_modes, load_routers, results_folder, text_run, write_result
    from ..measure import check_exit_depths
    from ..modes import run_modes
    from ..tables import format_modes

    out, routers = results_folder(args), load_routers(args)
    router = next(iter(routers.values()), None)
    if router is not None:
        check_exit_depths(args.depths, router.config.checkpoint_layers, "--depths")
    model, tokenizer = load_model(args.model, args.dtype)
    if router is None:
        return easy_modes(model, tokenizer, args, out)
    pad_id, prompts, chunks, result = text_run(args, tokenizer, routers, model)
    result.update(run_modes(model, tokenizer, router, prompts, chunks, pad_id, args))
    return write_result(out, "modes", result, format_modes)
