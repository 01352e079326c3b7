"""Which of `tide-hf bench`'s flags go together, where parsing alone cannot say it (checks that need no torch): a
flag the run would ignore is refused rather than ignored, and sizes that cannot be measured are named."""

from __future__ import annotations

import argparse
import os

from tide_hf.cli.checks import changed, check_router_kind_flags, command_name

# `bench modes --near-identity-after` measures the speculative mode on routers of its own, on prompts only
EASY_MODES_UNUSED = ("depths", "thresholds", "num_chunks", "chunk_len")
# `bench baselines`' flags for one kind of router only (flag -> whether it needs exit paths): `--thresholds`
# measure a router without them
BASELINES_ROUTER_KIND_FLAGS = {"targets": True, "ppl_targets": True, "thresholds": False}


def check(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """bench's flags go together (before its --router is looked at: "leave out --router" is the better answer),
    and none is given that the run would ignore."""
    if args.section == "modes" and args.near_identity_after is not None and \
            (given := changed(parser, args, EASY_MODES_UNUSED)):
        raise SystemExit(f"tide-hf bench modes: {given[0]} does not apply with --near-identity-after (it measures "
                         "the speculative mode only, on prompts)")
    check_bench_flags(args)
    if args.section == "baselines":
        check_router_kind_flags(parser, args, BASELINES_ROUTER_KIND_FLAGS)


ONE_ROUTER = ("modes", "batches", "continuous", "baselines", "linears")  # bench sections that measure one router
# sections timing decode tokens
DECODE_TOKENS = ("overhead", "modes", "batches", "continuous", "baselines", "synthetic", "linears")
BATCHED = ("overhead", "batches")  # sections whose batches are made of distinct prompts


def check_bench_flags(args: argparse.Namespace) -> None:
    """bench's flags go together (before its --router is looked at: "leave out --router" is the better answer)."""
    name, section = command_name(args), args.section
    routers = getattr(args, "router", None) or []
    if section == "modes":
        if routers and args.near_identity_after is not None:
            raise SystemExit(f"tide-hf {name}: --near-identity-after builds its own routers; leave out --router")
        if not routers and args.near_identity_after is None:
            raise SystemExit(f"tide-hf {name}: give --router DIR, or --near-identity-after K (an easy model with "
                             "routers of its own)")
        if args.near_identity_scale is not None and args.near_identity_after is None:
            raise SystemExit(f"tide-hf {name}: --near-identity-scale goes with --near-identity-after")
    if section in ONE_ROUTER and len(routers) > 1:
        raise SystemExit(f"tide-hf {name} measures one router; give one --router per command")
    folders = [os.path.realpath(os.path.expanduser(r)) if os.path.isdir(os.path.expanduser(r)) else r
               for r in routers]  # one folder spelled two ways ("r", "./r", a link) is one router
    if len(set(folders)) < len(folders):
        raise SystemExit(f"tide-hf {name}: a --router is given twice")
    if section in DECODE_TOKENS and args.new_tokens < 2:
        raise SystemExit(f"tide-hf {name}: --new-tokens {args.new_tokens}: decode tokens are the ones after the "
                         "first (the prefill's), so it needs at least 2")
    if section in BATCHED and max(args.batch_sizes) > args.num_prompts:
        raise SystemExit(f"tide-hf {name}: --batch-sizes {max(args.batch_sizes)} needs at least as many "
                         f"--num-prompts (got {args.num_prompts}): a batch is made of distinct prompts")
