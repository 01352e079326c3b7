"""`tide-hf`'s commands: each runs from the room it belongs to (calibration, eval), imported when it runs, so
torch loads only once the arguments are known to be good."""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import warnings

from . import bench
from .arguments import build_parser, check_router_paths, demo_settings
from .checks import check_router_kind_flags, check_unread_flags, command_name


def cmd_calibrate(args: argparse.Namespace) -> None:
    from ..calibration.command import run

    run(args)


def cmd_demo(args: argparse.Namespace) -> None:
    from ..eval.demo import run

    run(demo_settings(args))


def cmd_env(args: argparse.Namespace) -> None:
    from ..eval.environment import run

    run(args)


def cmd_analyze(args: argparse.Namespace) -> None:
    from ..eval.analyze import run

    run(args)


# analyze's flags for one kind of router only (flag -> whether it needs exit paths)
ANALYZE_ROUTER_KIND_FLAGS = {"targets": True}
INTERRUPTED = 130  # a shell's status for a command stopped by SIGINT (128 + 2)
COMMANDS = {"calibrate": cmd_calibrate, "demo": cmd_demo, "bench": bench.run, "analyze": cmd_analyze, "env": cmd_env}


def main(argv: list[str] | None = None) -> None:
    """Run one subcommand. An error tide_hf raises on purpose (`TideError`: bad argument, bad file, refused
    overwrite...) or a file that cannot be read prints as one line on stderr and exits with status 1, Ctrl-C
    as one line with status 130 (what a shell reports for SIGINT); `TIDE_HF_TRACEBACK=1` shows the traceback
    instead. An interrupted save leaves the folder as it was (`atomic_save`)."""
    from ..errors import TideError

    parser = build_parser()
    args = parser.parse_args(argv)
    name, args.func = command_name(args), COMMANDS[args.command]
    check_unread_flags(parser, args)
    if args.command == "bench":
        bench.check(parser, args)
    check_router_paths(args)
    if args.command == "analyze":
        check_router_kind_flags(parser, args, ANALYZE_ROUTER_KIND_FLAGS)
    from ..calibration.distributed import finish  # torch: only once the arguments are known to be good

    args.command = shlex.join(["tide-hf", *(sys.argv[1:] if argv is None else argv)])  # recorded in result JSON
    try:
        with warnings.catch_warnings():  # a warning prints as one line, like an error, not as a source excerpt
            warnings.showwarning = lambda message, *_, **__: print(f"tide-hf {name}: warning: {message}",
                                                                   file=sys.stderr)
            args.func(args)
    except (TideError, OSError) as err:
        if os.environ.get("TIDE_HF_TRACEBACK") == "1":
            raise
        message = " ".join(str(err).split()) or type(err).__name__
        print(f"tide-hf {name}: error: {message}", file=sys.stderr)
        raise SystemExit(1) from None
    except KeyboardInterrupt:
        if os.environ.get("TIDE_HF_TRACEBACK") == "1":
            raise
        print(f"tide-hf {name}: interrupted", file=sys.stderr)
        raise SystemExit(INTERRUPTED) from None
    finish()  # under `accelerate launch`: every process waits for the others before it exits
