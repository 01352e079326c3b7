"""`tide-hf analyze`: per-layer convergence, the oracle and a router's efficiency against it. Its parser, the checks
of its router flags and its run (tide_hf.eval.analyze, imported when it runs)."""

from __future__ import annotations

import argparse

from ..settings import CalibrationConfig
from .arguments import add_text_args
from .checks import changed, check_router_kind_flags
from .values import CPU, HelpFormatter, cosine, positive_int, share, target_share

NAME = "analyze"
ROUTER_FLAGS = ("targets", "thresholds", "num_prompts", "prompt_len", "new_tokens")  # read with --router only
# flags for one kind of router only (flag -> whether it needs exit paths): `--targets` pick thresholds from a
# router's exit paths
ROUTER_KIND_FLAGS = {"targets": True}


def add_parser(sub: argparse._SubParsersAction) -> None:
    d = CalibrationConfig()  # the convergence settings calibration uses by default
    p = sub.add_parser(
        NAME, formatter_class=HelpFormatter, usage="tide-hf analyze [--router DIR] [options]",
        help="per-layer convergence, the oracle, and router efficiency (tables, JSON, PNG)",
        description="Per-layer convergence of a model on real text, the oracle (the best any router could do at "
                    "each agreement) and, with --router, that router's efficiency against it.\n\n"
                    "example: tide-hf analyze --router router-smollm2 --output analyze-out\n"
                    f"time {CPU}: ~3-5 min with the defaults")
    g = p.add_argument_group("model and text")
    add_text_args(g, "real text: Hub dataset, .txt/.jsonl file or folder, or sotu")
    g.add_argument("--num-samples", type=positive_int, default=32, metavar="N",
                   help="text windows measured on, spread evenly over the documents")
    g.add_argument("--seq-len", type=positive_int, default=256, metavar="N", help="tokens per sample")
    g.add_argument("--batch-size", type=positive_int, default=4, metavar="N", help="samples per forward pass")
    g.add_argument("--seed", type=int, default=d.seed, metavar="N", help="seed of the sampling")
    g = p.add_argument_group("convergence and the oracle")
    g.add_argument("--checkpoint-interval", type=positive_int, default=d.checkpoint_interval, metavar="N",
                   help="checkpoints every this many layers")
    g.add_argument("--convergence-threshold", type=cosine, default=d.convergence_threshold, metavar="X",
                   help="cosine similarity that counts as converged")
    g.add_argument("--agreements", nargs="+", type=share, default=[1.0, 0.95, 0.9, 0.8, 0.7], metavar="X",
                   help="top-1 agreements the oracle is computed at")
    g.add_argument("--bins", type=positive_int, default=40, metavar="N", help="cosine bins of the heatmap")
    g = p.add_argument_group("a router's efficiency (the flags below go with --router)")
    g.add_argument("--router", default=None, metavar="DIR", help="measure this router against the oracle")
    g.add_argument("--targets", nargs="+", type=target_share, default=[0.99, 0.97, 0.95, 0.9], metavar="X",
                   help="min_agreement quality targets evaluated")
    g.add_argument("--thresholds", nargs="+", type=share, default=[0.95, 0.9, 0.85, 0.7, 0.5, 0.3], metavar="X",
                   help="global exit thresholds measured")
    g.add_argument("--num-prompts", type=positive_int, default=16, metavar="N",
                   help="held-out prompts the model continues greedily")
    g.add_argument("--prompt-len", type=positive_int, default=64, metavar="N", help="tokens per prompt")
    g.add_argument("--new-tokens", type=positive_int, default=64, metavar="N", help="tokens generated per prompt")
    g = p.add_argument_group("output")
    g.add_argument("--output", default="analyze-out", metavar="DIR",
                   help="folder for analyze.json / .md and the PNGs")


def check(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse a router flag given without --router, or one the --router's kind never reads: it would be ignored."""
    if not args.router and (given := changed(parser, args, ROUTER_FLAGS)):
        raise SystemExit(f"tide-hf analyze: {given[0]} goes with --router")
    check_router_kind_flags(parser, args, ROUTER_KIND_FLAGS)


def run(args: argparse.Namespace) -> None:
    from ..eval.analyze import run as analyze

    analyze(args)
