"""`tide-hf bench`'s sections, one module each (its parser, its checks, its run), importable without torch: a
section is registered by being listed in `SECTIONS`."""

from __future__ import annotations

import argparse

from . import baselines, batches, continuous, gpu, kernels, linears, modes, overhead, synthetic

SECTIONS = {m.NAME: m for m in (overhead, modes, batches, continuous, baselines, linears, kernels, synthetic, gpu)}


def add_sections(bench: argparse.ArgumentParser) -> None:
    """`tide-hf bench`'s SECTION subcommands, added to its parser."""
    sub = bench.add_subparsers(dest="section", required=True, metavar="SECTION", help="the benchmark run")
    for section in SECTIONS.values():
        section.add_parser(sub)


def check(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """The section's flags go together (before its --router is looked at: "leave out --router" is the better
    answer)."""
    SECTIONS[args.section].check(parser, args)


def run(args: argparse.Namespace) -> dict:
    """Run the section: its JSON and Markdown go to --output."""
    return SECTIONS[args.section].run(args)
