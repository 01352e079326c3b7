"""Which of `tide-hf`'s flags go together, where parsing alone cannot say it (checks that need no torch): a flag the
run would ignore (analyze's router flags without --router, `bench modes`' flags on the easy model, a flag the
router's kind never reads) is refused rather than ignored, and sizes that cannot be measured are named."""

from __future__ import annotations

import argparse
import os


def command_name(args: argparse.Namespace) -> str:
    """The subcommand as typed: `calibrate`, `bench modes`."""
    return " ".join(filter(None, (args.command, getattr(args, "section", None))))


def command_parser(parser: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.ArgumentParser:
    """The parser of `args`' subcommand (its defaults are what no flag means)."""
    for name in command_name(args).split():
        action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        parser = action.choices[name]
    return parser


def changed(parser: argparse.ArgumentParser, args: argparse.Namespace, names: tuple[str, ...]) -> list[str]:
    """Those of `names` given away from their default, as flags (`--prompt-len`)."""
    defaults = command_parser(parser, args)
    return [f"--{name.replace('_', '-')}" for name in names if getattr(args, name) != defaults.get_default(name)]


ANALYZE_ROUTER_FLAGS = ("targets", "thresholds", "num_prompts", "prompt_len", "new_tokens")  # read with --router only
# `bench modes --near-identity-after` measures the speculative mode on routers of its own, on prompts only
EASY_MODES_UNUSED = ("depths", "thresholds", "num_chunks", "chunk_len")


def check_unread_flags(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse a flag, set away from its default, that this run never reads: analyze's router flags without
    --router, and `bench modes`' skip-mode flags with --near-identity-after."""
    name = command_name(args)
    if name == "analyze" and not args.router and (given := changed(parser, args, ANALYZE_ROUTER_FLAGS)):
        raise SystemExit(f"tide-hf analyze: {given[0]} goes with --router")
    if name == "bench modes" and args.near_identity_after is not None and \
            (given := changed(parser, args, EASY_MODES_UNUSED)):
        raise SystemExit(f"tide-hf bench modes: {given[0]} does not apply with --near-identity-after (it measures "
                         "the speculative mode only, on prompts)")


# Flags that apply to one kind of router only (command -> flag -> whether it needs exit paths): `--targets` pick
# thresholds from a router's exit paths, `--thresholds` (bench baselines) measure a router without them.
ROUTER_KIND_FLAGS = {"analyze": {"targets": True},
                     "bench baselines": {"targets": True, "ppl_targets": True, "thresholds": False}}


def check_router_kind_flags(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse a flag set away from its default that the --router's kind never reads (`ROUTER_KIND_FLAGS`): it was
    accepted and ignored. Read from a local router folder's config.json (a Hub id is looked at when it loads)."""
    name = command_name(args)
    routers = getattr(args, "router", None) or []
    routers = [routers] if isinstance(routers, str) else routers
    if name not in ROUTER_KIND_FLAGS or len(routers) != 1:
        return
    folder = os.path.expanduser(routers[0])
    if not os.path.isdir(folder):  # a Hub id, or nothing: loading it will say what is wrong
        return
    from ..config import TideRouterConfig  # transformers: imported when a router is named, not for --help
    from ..errors import TideError

    try:
        has_paths = bool(TideRouterConfig.from_pretrained(folder).exit_paths)
    except (TideError, OSError, ValueError):  # not a router: loading it will say what is wrong
        return
    for flag, needs_paths in ROUTER_KIND_FLAGS[name].items():
        if changed(parser, args, (flag,)) and needs_paths != has_paths:
            kind, use = ("without", "--thresholds") if needs_paths else ("with", "--targets / --ppl-targets")
            raise SystemExit(f"tide-hf {name}: --{flag.replace('_', '-')} does not apply to {routers[0]}, a router "
                             f"{kind} exit paths (quality targets): use {use}")


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
