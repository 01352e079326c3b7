"""What `tide-hf`'s arguments may hold, known without importing torch: value types, which settings `calibrate`
offers as flags and which it takes with `--set` (their defaults and help: `tide_hf.settings`), and the help
layout."""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
import textwrap
from typing import Any

from ..settings import CalibrationConfig

DTYPES = ("float32", "bfloat16", "float16")
DTYPE_HELP = f"model dtype: {', '.join(DTYPES)}"
MODEL_HELP = "causal LM: Hub id or folder (smollm2: embedded)"
# `calibrate`'s argument groups and the CalibrationConfig fields each offers as a flag of its own (the flag's help,
# default and choices are the field's)
CALIBRATE_FLAGS = {
    "model and text": ("num_samples", "seq_len"),
    "labels and exit heads": ("label", "exit_head", "continuation", "continuation_prompt_len", "checkpoint_interval"),
    "training": ("batch_size", "num_epochs", "seed"),
    "quality target (what attach() keeps without arguments)": ("min_agreement", "confidence"),
}
# The settings `calibrate` has a flag of its own for (`--set` names the flag instead); dataset: calibrate()'s argument
OWN_FLAGS = ("dataset", *(name for names in CALIBRATE_FLAGS.values() for name in names))
# The other CalibrationConfig fields: `--set KEY=VALUE` sets them
SET_FIELDS = tuple(f.name for f in dataclasses.fields(CalibrationConfig) if f.name not in OWN_FLAGS)
CLOSE_MATCHES = 3  # names an unknown --set key is compared with, at most
CPU = "on a 2-core CPU"
HELP_POSITION = 32  # column the options' help starts at (argparse's 24 put most of it on a second line)


def positive_int(text: str) -> int:
    """argparse type: an int >= 1 (a size, a count)."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def share(text: str) -> float:
    """argparse type: a number in [0, 1] (an agreement, a threshold, a probability)."""
    value = float(text)
    if not 0.0 <= value <= 1.0:  # NaN fails too
        raise argparse.ArgumentTypeError(f"must be a number in [0, 1], got {text}")
    return value


def target_share(text: str) -> float:
    """argparse type: a quality target, a share in (0, 1] (as `attach(min_agreement=...)` takes it)."""
    value = float(text)
    if not 0.0 < value <= 1.0:  # NaN fails too
        raise argparse.ArgumentTypeError(f"must be a number in (0, 1], got {text}")
    return value


def cosine(text: str) -> float:
    """argparse type: a cosine similarity, a number in [-1, 1]."""
    value = float(text)
    if not -1.0 <= value <= 1.0:  # NaN fails too
        raise argparse.ArgumentTypeError(f"must be a cosine similarity in [-1, 1], got {text}")
    return value


def positive_float(text: str) -> float:
    """argparse type: a finite number > 0 (a scale)."""
    value = float(text)
    if not 0.0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value


def nonnegative_float(text: str) -> float:
    """argparse type: a finite number >= 0 (a perplexity increase)."""
    value = float(text)
    if not 0.0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
    return value


def json_or_text(text: str) -> Any:
    """A `--set` value: JSON (8, 0.5, null, [4, 8]), else the text itself (greedy)."""
    try:
        return json.loads(text)
    except ValueError:
        return text


class SetFields(argparse.Action):
    """`--set KEY=VALUE [KEY=VALUE ...]`: each KEY, a field of `SET_FIELDS`, becomes an attribute of the parsed
    arguments, so the command reads it as it reads its flags' values (TideRouterConfig checks the value when
    calibration builds the config). A KEY that is no such field is refused while parsing, before torch loads."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        for item in values:
            key, equals, text = item.partition("=")
            if not equals or not key:
                raise argparse.ArgumentError(self, f"{item!r} is not KEY=VALUE (e.g. max_train_tokens=131072)")
            if key in OWN_FLAGS:
                raise argparse.ArgumentError(self, f"{key} has a flag of its own: --{key.replace('_', '-')}")
            if key not in SET_FIELDS:
                close = difflib.get_close_matches(key, SET_FIELDS + OWN_FLAGS, n=CLOSE_MATCHES)
                hint = f"did you mean {' or '.join(close)}?" if close else f"fields: {', '.join(SET_FIELDS)}"
                raise argparse.ArgumentError(self, f"{key!r} is no TideRouterConfig field calibration reads ({hint})")
            setattr(namespace, key, json_or_text(text))


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Defaults shown after every option's help (unless the help says it, or it is None, which the help says in
    words); each line of a description is wrapped on its own; the options' help in a column wide enough for
    most to fit one line."""

    def __init__(self, prog: str, **kwargs: Any) -> None:
        super().__init__(prog, **{"max_help_position": HELP_POSITION, **kwargs})

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.nargs == 0 or "(default:" in (action.help or ""):
            return action.help  # None: said in words by the help; a switch's goes without saying
        return super()._get_help_string(action)

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        return "\n".join(textwrap.fill(line, width, initial_indent=indent, subsequent_indent=indent)
                         for line in text.splitlines())
