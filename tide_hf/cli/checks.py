"""What the commands' checks share (no torch): the subcommand's name and parser, the flags given away from their
default, and the refusal of a flag the --router's kind never reads (rather than ignoring it)."""

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


def check_router_kind_flags(parser: argparse.ArgumentParser, args: argparse.Namespace, flags: dict[str, bool]) -> None:
    """Refuse a flag set away from its default that the --router's kind never reads (`flags`: flag -> whether it
    needs exit paths; `--targets` pick thresholds from a router's exit paths): it was accepted and ignored. Read
    from a local router folder's config.json (a Hub id is looked at when it loads)."""
    name = command_name(args)
    routers = getattr(args, "router", None) or []
    routers = [routers] if isinstance(routers, str) else routers
    if len(routers) != 1:
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
    for flag, needs_paths in flags.items():
        if changed(parser, args, (flag,)) and needs_paths != has_paths:
            kind, use = ("without", "--thresholds") if needs_paths else ("with", "--targets / --ppl-targets")
            raise SystemExit(f"tide-hf {name}: --{flag.replace('_', '-')} does not apply to {routers[0]}, a router "
                             f"{kind} exit paths (quality targets): use {use}")
