"""What `tide-hf bench`'s sections share, without torch: their parsers' parts (each section takes the flags it
reads and no other, so none can be given to a section that would ignore it) and the checks of flags that go
together."""

from __future__ import annotations

import argparse
import os
from typing import Any

from tide_hf.assets import DEFAULT_MODEL
from tide_hf.cli.values import (
    DTYPE_HELP,
    DTYPES,
    MODEL_HELP,
    HelpFormatter,
    positive_int,
    share,
    target_share,
)

OUTPUT = "bench-out"
TEXT = "text for prompts and perplexity (documents the routers never read)"


def section(sub: Any, name: str, summary: str, description: str, example: str, time: str,
            usage: str | None = "[options]") -> argparse.ArgumentParser:
    """One bench section's parser: its one-line summary, what it measures, an example, a time expectation and
    (`usage`: None for argparse's) its usage line."""
    prog = f"tide-hf bench {name}"
    return sub.add_parser(name, prog=prog, usage=usage and f"{prog} {usage}", formatter_class=HelpFormatter,
                          help=summary, description=f"{description}\n\nexample: {prog} {example}\ntime {time}")


def add_model(p: argparse.ArgumentParser, routers: str | None, required: bool = True) -> Any:
    """The model, its text and (`routers`: the --router help, None: no --router) the routers measured."""
    g = p.add_argument_group("model and routers")
    g.add_argument("--model", default=DEFAULT_MODEL, metavar="NAME", help=MODEL_HELP)
    g.add_argument("--dataset", default="sotu", metavar="NAME", help=TEXT)
    if routers is not None:
        g.add_argument("--router", nargs="+", required=required, default=None, metavar="DIR", help=routers)
    g.add_argument("--dtype", default=DTYPES[0], choices=DTYPES, metavar="DTYPE", help=DTYPE_HELP)
    return g


def add_prompts(p: argparse.ArgumentParser, *, reps: bool = True, chunks: bool = True,
                quality_batch: bool = True) -> Any:
    """The held-out prompts generated from (and the perplexity chunks, the timing repetitions, if read)."""
    g = p.add_argument_group("prompts and text")
    g.add_argument("--num-prompts", type=positive_int, default=16, metavar="N", help="held-out prompts")
    g.add_argument("--prompt-len", type=positive_int, default=64, metavar="N", help="tokens per prompt")
    g.add_argument("--new-tokens", type=positive_int, default=32, metavar="N", help="tokens generated per prompt")
    if reps:
        g.add_argument("--reps", type=positive_int, default=3, metavar="N", help="interleaved timing repetitions")
    if chunks:
        g.add_argument("--num-chunks", type=positive_int, default=16, metavar="N", help="chunks for perplexity")
        g.add_argument("--chunk-len", type=positive_int, default=256, metavar="N", help="tokens per chunk")
    if quality_batch:
        g.add_argument("--quality-batch-size", type=positive_int, default=8, metavar="N",
                       help="prompts / chunks per forward pass of the quality runs")
    return g


def add_output(p: argparse.ArgumentParser, files: str) -> None:
    p.add_argument_group("output").add_argument("--output", default=OUTPUT, metavar="DIR",
                                                help=f"folder for {files}")


def thresholds(g: Any, what: str) -> None:
    g.add_argument("--thresholds", nargs="+", type=share, default=[0.95, 0.85, 0.7, 0.5], metavar="X", help=what)


def targets(g: Any, what: str) -> None:
    g.add_argument("--targets", nargs="+", type=target_share, default=[0.99, 0.97, 0.95, 0.9], metavar="X", help=what)


def batch_sizes(g: Any, what: str) -> None:
    g.add_argument("--batch-sizes", nargs="+", type=positive_int, default=[1, 8], metavar="N", help=what)


def routers_of(args: argparse.Namespace) -> list[str]:
    return getattr(args, "router", None) or []


def check_routers(args: argparse.Namespace, one: bool) -> None:
    """One --router where the section measures `one`, and none given twice (one folder spelled two ways, "r",
    "./r" or a link, is one router)."""
    routers = routers_of(args)
    if one and len(routers) > 1:
        raise SystemExit(f"tide-hf bench {args.section} measures one router; give one --router per command")
    folders = [os.path.realpath(os.path.expanduser(r)) if os.path.isdir(os.path.expanduser(r)) else r
               for r in routers]
    if len(set(folders)) < len(folders):
        raise SystemExit(f"tide-hf bench {args.section}: a --router is given twice")


def check_decode_tokens(args: argparse.Namespace) -> None:
    """A section timing decode tokens generates at least 2 per prompt."""
    if args.new_tokens < 2:
        raise SystemExit(f"tide-hf bench {args.section}: --new-tokens {args.new_tokens}: decode tokens are the ones "
                         "after the first (the prefill's), so it needs at least 2")


def check_batches(args: argparse.Namespace) -> None:
    """A section whose batches are made of distinct prompts has as many prompts as its largest batch."""
    if max(args.batch_sizes) > args.num_prompts:
        raise SystemExit(f"tide-hf bench {args.section}: --batch-sizes {max(args.batch_sizes)} needs at least as "
                         f"many --num-prompts (got {args.num_prompts}): a batch is made of distinct prompts")
