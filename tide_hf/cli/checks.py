"""Which of `tide-hf`'s flags go together: a flag of a section the command does not run, or one the router's kind
never reads, is refused rather than ignored (checks that need no torch)."""

from __future__ import annotations

import argparse
import json
import os

# Flags read by one section of a command only (their help starts "--SECTION:"): given away from their default
# without it, they were accepted and ignored.
SECTION_FLAGS = {
    "bench": {"depths": "modes", "confidence_thresholds": "baselines", "targets": ("baselines", "batches"),
              "forced_depth": "batches",
              "ppl_targets": "baselines", "drop_counts": "baselines", "baseline_calib_samples": "baselines",
              "baseline_calib_len": "baselines", "synthetic_depth": "synthetic", "compile": "synthetic",
              "configs": "synthetic", "device": "synthetic"},
    "analyze": {"targets": "router", "thresholds": "router", "num_prompts": "router", "prompt_len": "router",
                "new_tokens": "router"},
}


def check_section_flags(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse a flag of a section the command does not run (`SECTION_FLAGS`), set away from its default (what
    `parser` gives the command without flags)."""
    sections = SECTION_FLAGS.get(args.command)
    if not sections:
        return
    defaults = vars(parser.parse_args([args.command]))
    for name, section in sections.items():
        owners = (section,) if isinstance(section, str) else section
        if getattr(args, name) != defaults[name] and not any(getattr(args, s) for s in owners):
            raise SystemExit(f"tide-hf {args.command}: --{name.replace('_', '-')} goes with "
                             + " or ".join(f"--{s}" for s in owners))


# Flags that apply to one kind of router only (command, section -> flag -> whether it needs exit paths): `--targets`
# pick thresholds from a router's exit paths, `--thresholds` (bench --baselines) measure a router without them.
ROUTER_KIND_FLAGS = {("analyze", "router"): {"targets": True},
                     ("bench", "baselines"): {"targets": True, "ppl_targets": True, "thresholds": False}}


def check_router_kind_flags(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse a flag set away from its default that the --router's kind never reads (`ROUTER_KIND_FLAGS`): it was
    accepted and ignored. Read from a local router folder's config.json (a Hub id is looked at when it loads)."""
    routers = getattr(args, "router", None) or []
    routers = [routers] if isinstance(routers, str) else routers
    for (command, section), flags in ROUTER_KIND_FLAGS.items():
        if args.command != command or not getattr(args, section) or len(routers) != 1:
            continue
        try:
            with open(os.path.join(os.path.expanduser(routers[0]), "config.json"), encoding="utf-8") as f:
                has_paths = bool(json.load(f).get("exit_paths"))
        except (OSError, ValueError, AttributeError):  # not a local router: loading it will say what is wrong
            continue
        defaults = vars(parser.parse_args([command]))
        for name, needs_paths in flags.items():
            if getattr(args, name) != defaults[name] and needs_paths != has_paths:
                kind, use = ("without", "--thresholds") if needs_paths else ("with", "--targets / --ppl-targets")
                raise SystemExit(f"tide-hf {command}: --{name.replace('_', '-')} does not apply to {routers[0]}, a "
                                 f"router {kind} exit paths (quality targets): use {use}")


SUITE_FLAGS = ("command", "func", "suite", "dry_run", "output")  # what `bench gpu` reads; its plan is fixed


def check_suite_flags(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """`bench gpu` takes --dry-run and --output only (its plan is `tide_hf.eval.gpu.GPU`): any other bench flag
    given is refused, and --dry-run without `gpu` too."""
    if args.command != "bench":
        return
    if args.suite is None:
        if args.dry_run:
            raise SystemExit("tide-hf bench: --dry-run goes with `tide-hf bench gpu`")
        return
    defaults = vars(parser.parse_args([args.command]))
    given = [name for name, value in vars(args).items() if name not in SUITE_FLAGS and value != defaults[name]]
    if given:
        raise SystemExit(f"tide-hf bench gpu: --{given[0].replace('_', '-')} does not apply: the suite's plan is "
                         "fixed (tide_hf.eval.gpu.GPU); it takes --dry-run and --output only")


def check_bench_flags(args: argparse.Namespace) -> None:
    """bench's flags go together (before its --router is looked at: "leave out --router" is the better answer)."""
    sections = [f"--{name}" for name in ("synthetic", "kernels", "baselines", "modes", "batches")
                if getattr(args, name)]
    if len(sections) > 1:
        raise SystemExit(f"tide-hf bench: {' and '.join(sections)} are separate runs; give one per command")
    if args.near_identity_after is not None and not args.modes:
        raise SystemExit("tide-hf bench: --near-identity-after goes with --modes")
    if args.router and (args.synthetic or args.kernels or args.near_identity_after is not None):
        flag = sections[0] if args.synthetic or args.kernels else "--near-identity-after"
        raise SystemExit(f"tide-hf bench: {flag} builds its own routers; leave out --router")
    if len(args.router) > 1 and (args.modes or args.baselines or args.batches):
        raise SystemExit(f"tide-hf bench: {sections[0]} measures one router; give one --router per command")
    folders = [os.path.realpath(os.path.expanduser(r)) if os.path.isdir(os.path.expanduser(r)) else r
               for r in args.router]  # one folder spelled two ways ("r", "./r", a link) is one router
    if len(set(folders)) < len(folders):
        raise SystemExit("tide-hf bench: a --router is given twice")
    if args.near_identity_scale is not None and args.near_identity_after is None:
        raise SystemExit("tide-hf bench: --near-identity-scale goes with --near-identity-after")
    if args.new_tokens < 2 and not args.kernels:
        raise SystemExit(f"tide-hf bench: --new-tokens {args.new_tokens}: decode tokens are the ones after the first "
                         "(the prefill's), so it needs at least 2")
    if (not sections or args.batches) and max(args.batch_sizes) > args.num_prompts:
        raise SystemExit(f"tide-hf bench: --batch-sizes {max(args.batch_sizes)} needs at least as many "
                         f"--num-prompts (got {args.num_prompts}): a batch is made of distinct prompts")
    if not args.kernels and not args.synthetic and not args.router and args.near_identity_after is None:
        raise SystemExit("tide-hf bench: --router is required (except with --kernels, --synthetic or "
                         "--near-identity-after)")
