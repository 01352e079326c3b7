"""Every `tide-hf` command in README.md and docs/ is one this CLI takes: a command line of a shell block parses with
the CLI's own parser (without running: `--help` appended would exit before unknown flags are refused), and a
command named inline (`tide-hf bench continuous --targets`) names a real command and only its options. A line that
says "historical" (a command an older CLI ran, kept to say how old figures were made) is left out."""

from __future__ import annotations

import argparse
import re
import shlex
from pathlib import Path

import pytest

from tide_hf.cli import build_parser, command_error

ROOT = Path(__file__).resolve().parents[1]
FILES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
SHELL_BLOCK = re.compile(r"^```(?:bash|sh|console|shell)\n(.*?)^```", re.S | re.M)
INLINE = re.compile(r"`(tide-hf(?: [^`]*)?)`")
HISTORICAL = "historical"


def shell_commands(text: str) -> list[str]:
    """The `tide-hf` command lines of the shell blocks of `text`, continuation lines joined, each from `tide-hf`
    to the end of its command (a following `&&`, `|` or `;` ends it)."""
    found = []
    for block in SHELL_BLOCK.findall(text):
        for line in block.replace("\\\n", " ").splitlines():
            for part in re.split(r"&&|\|\||[|;]", line):
                part = part.strip()
                if part.startswith("tide-hf") and HISTORICAL not in line:
                    found.append(part)
    return found


def inline_commands(text: str) -> list[str]:
    """The `tide-hf ...` code spans outside shell blocks (a command named in prose), on lines not marked historical."""
    prose = SHELL_BLOCK.sub("", text)
    return [span for line in prose.splitlines() if HISTORICAL not in line for span in INLINE.findall(line)]


def subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    return {name: sub for action in parser._actions if isinstance(action, argparse._SubParsersAction)
            for name, sub in action.choices.items()}


def inline_error(span: str) -> str | None:
    """Why the inline span `span` names no command of this CLI, or an option its command lacks (None: it does)."""
    words = shlex.split(span)[1:]
    if any(word.rstrip(":").isupper() or word == "..." for word in words):  # a placeholder: COMMAND, SECTION, ...
        words = words[: next(i for i, w in enumerate(words) if w.rstrip(":").isupper() or w == "...")]
    parser = build_parser()
    while words and not words[0].startswith("-") and subparsers(parser):
        choices = subparsers(parser)
        if words[0] not in choices:
            return f"no command {words[0]!r} (commands: {sorted(choices)})"
        parser = choices[words.pop(0)]
    options = {option for action in parser._actions for option in action.option_strings}
    unknown = [w.split("=")[0] for w in words if w.startswith("-") and w.split("=")[0] not in options]
    return f"{parser.prog} has no option {unknown}" if unknown else None


CASES = [(path, line) for path in FILES for line in shell_commands(path.read_text())]
SPANS = [(path, span) for path in FILES for span in inline_commands(path.read_text())]


def test_the_docs_hold_commands() -> None:
    assert len(CASES) >= 10 and len(SPANS) >= 10
    assert any(line.startswith("tide-hf bench") for _, line in CASES)


@pytest.mark.parametrize(("path", "line"), CASES, ids=[f"{p.relative_to(ROOT)}:{line}" for p, line in CASES])
def test_every_shell_command_parses(path: Path, line: str) -> None:
    assert command_error(line) is None, f"{path.relative_to(ROOT)}: `{line}`: {command_error(line)}"


@pytest.mark.parametrize(("path", "span"), SPANS, ids=[f"{p.relative_to(ROOT)}:{s}" for p, s in SPANS])
def test_every_command_named_inline_exists(path: Path, span: str) -> None:
    assert inline_error(span) is None, f"{path.relative_to(ROOT)}: `{span}`: {inline_error(span)}"


def test_the_checks_refuse_what_the_cli_refuses() -> None:
    """The checks themselves: an unknown flag, a missing required option and an unknown section are refused; a
    full command and a command named inline pass."""
    assert "unrecognized arguments: --baselines" in command_error("tide-hf bench overhead --router r --baselines")
    assert "required: --router" in command_error("tide-hf bench batches")
    assert command_error("tide-hf bench kernels --dtype bfloat16") is None
    assert "no command 'speed'" in inline_error("tide-hf bench speed")
    assert "has no option ['--continuation']" in inline_error("tide-hf demo --continuation greedy")
    assert inline_error("tide-hf bench continuous --targets") is None


SCRIPT = re.compile(r"(?:python3?|bash) ((?:benchmarks|\.ci|notebooks)/[\w./-]+)")
SCRIPTS = sorted({(path, found) for path in [*FILES, ROOT / "benchmarks" / "README.md"]
                  for line in path.read_text().splitlines() if HISTORICAL not in line
                  for found in SCRIPT.findall(line)})


@pytest.mark.parametrize(("path", "script"), SCRIPTS, ids=[f"{p.relative_to(ROOT)}:{s}" for p, s in SCRIPTS])
def test_every_script_a_command_runs_exists(path: Path, script: str) -> None:
    """A `python benchmarks/...` or `bash .ci/...` command names a file of the repository."""
    assert (ROOT / script).is_file(), f"{path.relative_to(ROOT)}: `{script}` does not exist"


def test_the_docs_run_scripts() -> None:
    assert any(script.startswith("benchmarks/") for _, script in SCRIPTS)
    assert any(script.startswith(".ci/") for _, script in SCRIPTS)
