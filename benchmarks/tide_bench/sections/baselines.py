"""`tide-hf bench baselines`: TIDE vs fixed depth, static layer skipping and softmax confidence, with a Pareto plot.
Its parser, checks and run (torch imported when it runs)."""

from __future__ import annotations

import argparse
from typing import Any

from tide_hf.cli.checks import check_router_kind_flags
from tide_hf.cli.values import CPU, nonnegative_float, positive_int, share

from .common import add_model, add_output, add_prompts, check_decode_tokens, check_routers, section, targets, thresholds

NAME = "baselines"


def add_parser(sub: Any) -> None:
    p = section(sub, NAME, "TIDE vs fixed depth, static layer skipping and softmax confidence",
                "TIDE vs fixed depth, static layer skipping and softmax-confidence exit: quality, layers and speed "
                "on the same prompts and text, with a Pareto plot.", "--router router-smollm2 --output bench-out",
                f"{CPU}: ~10-20 min with the defaults", "--router DIR [options]")
    g = add_model(p, "one router folder / Hub id")
    targets(g, "TIDE at these min_agreement targets (routers with exit paths)")
    g.add_argument("--ppl-targets", nargs="+", type=nonnegative_float, default=[0.05, 0.10, 0.25], metavar="X",
                   help="TIDE at these max_perplexity_increase targets (routers with exit paths)")
    thresholds(g, "TIDE at these exit thresholds (routers without exit paths)")
    g = p.add_argument_group("baselines")
    g.add_argument("--confidence-thresholds", nargs="+", type=share, default=[0.9, 0.8, 0.6, 0.4], metavar="X",
                   help="exit when the exit logits' top probability reaches this")
    g.add_argument("--drop-counts", nargs="+", type=positive_int, default=[1, 2, 3, 4, 6, 8], metavar="N",
                   help="how many layers static skipping drops")
    g.add_argument("--baseline-calib-samples", type=positive_int, default=8, metavar="N",
                   help="calibration-text samples static skipping chooses its layers on")
    g.add_argument("--baseline-calib-len", type=positive_int, default=128, metavar="N",
                   help="tokens per static-skipping calibration sample")
    add_prompts(p, reps=False)
    add_output(p, "baselines.json / .md, pareto.png")


# flags for one kind of router only (flag -> whether it needs exit paths): `--targets` pick thresholds from a
# router's exit paths, `--thresholds` measure a router without them
ROUTER_KIND_FLAGS = {"targets": True, "ppl_targets": True, "thresholds": False}


def check(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    check_routers(args, one=True)
    check_decode_tokens(args)
    check_router_kind_flags(parser, args, ROUTER_KIND_FLAGS)


def run(args: argparse.Namespace) -> dict:
    from tide_hf.assets import default_dataset

    from ..baselines import run_baselines
    from ..bench import text_setup, write_result
    from ..plots import pareto
    from ..tables import format_baselines

    s = text_setup(args)
    s.result.update(run_baselines(s.model, s.tokenizer, s.router, default_dataset(args.dataset), s.prompts, s.chunks,
                                  s.pad_id, args))
    s.out.mkdir(parents=True, exist_ok=True)
    print("Pareto plot:", pareto(s.result, s.out / "pareto.png"))
    return write_result(s.out, "baselines", s.result, format_baselines)
