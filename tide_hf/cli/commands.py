"""`tide-hf`: its parser, made of one module per command (`COMMANDS`), and `main`, which runs one. A command runs
from the room it belongs to (calibration, eval; bench: the benchmarks of a checkout), imported when it runs, so
torch loads only once the arguments are known to be good."""

from __future__ import annotations

import argparse
import io
import os
import shlex
import sys
import warnings
from contextlib import redirect_stderr, redirect_stdout

# each command's module by its own name: the package (whose __init__ imports this module) is not needed here
import tide_hf.cli.analyze as analyze
import tide_hf.cli.bench as bench
import tide_hf.cli.calibrate as calibrate
import tide_hf.cli.demo as demo
import tide_hf.cli.env as env

from .arguments import check_router_paths
from .checks import command_name
from .values import CPU, HelpFormatter

INTERRUPTED = 130  # a shell's status for a command stopped by SIGINT (128 + 2)
# one module per command: its parser (add_parser), the checks of its flags (check) and its run, which imports torch
COMMANDS = {c.NAME: c for c in (calibrate, demo, bench, env, analyze)}


def build_parser() -> argparse.ArgumentParser:
    """`tide-hf`'s parser: a subcommand per command of `COMMANDS` (bench's sections as its subcommands)."""
    parser = argparse.ArgumentParser(
        prog="tide-hf", formatter_class=HelpFormatter,
        description="TIDE early exit for HuggingFace causal LMs.\n\nStart with `tide-hf demo` (~4 min the first "
                    "time " + CPU + ")."
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in COMMANDS.values():
        command.add_parser(sub)
    return parser


def command_error(line: str) -> str | None:
    """Why the shell line `line` (`tide-hf ...`) would not parse with this CLI, without running it; None where it
    parses. The docs' commands are checked with it, and the results page marks recorded commands it refuses."""
    try:
        argv = shlex.split(line, comments=True)
    except ValueError as err:
        return f"not a shell command line: {err}"
    if not argv or argv[0] != "tide-hf":
        return "not a tide-hf command line"
    err = io.StringIO()
    try:
        with redirect_stderr(err), redirect_stdout(io.StringIO()):
            build_parser().parse_args(argv[1:])
    except SystemExit as exit_:
        if exit_.code:
            lines = err.getvalue().strip().splitlines()
            return lines[-1] if lines else str(exit_.code)
    return None


def main(argv: list[str] | None = None) -> None:
    """Run one subcommand. An error tide_hf raises on purpose (`TideError`: bad argument, bad file, refused
    overwrite...) or a file that cannot be read prints as one line on stderr and exits with status 1, Ctrl-C
    as one line with status 130 (what a shell reports for SIGINT); `TIDE_HF_TRACEBACK=1` shows the traceback
    instead. An interrupted save leaves the folder as it was (`atomic_save`)."""
    from ..errors import TideError

    parser = build_parser()
    args = parser.parse_args(argv)
    command = COMMANDS[args.command]
    name, args.func = command_name(args), command.run
    command.check(parser, args)  # before --router is looked at: "leave out --router" is the better answer
    check_router_paths(args)
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
