"""`tide-hf calibrate`: calibrate routers for a model on real text and save them. Its parser (a flag per
CalibrationConfig field, with the field's default and help) and its run (the calibration room's command, imported
when it runs)."""

from __future__ import annotations

import argparse
import dataclasses
import typing

from ..settings import CalibrationConfig
from .arguments import add_text_args
from .values import CALIBRATE_FLAGS, CPU, HelpFormatter, SetFields

NAME = "calibrate"
NUMBER_METAVARS = {int: "N", float: "X"}  # a number flag's placeholder in --help


def add_settings(group: argparse._ArgumentGroup, title: str) -> None:
    """The group's `CALIBRATE_FLAGS`: a flag per CalibrationConfig field, with the field's type, default, choices
    and help (a number's placeholder is N or X, a text's its name)."""
    fields = {f.name: f for f in dataclasses.fields(CalibrationConfig)}
    hints = typing.get_type_hints(CalibrationConfig)
    for name in CALIBRATE_FLAGS[title]:
        kind = next(t for t in typing.get_args(hints[name]) or (hints[name],) if t is not type(None))
        field = fields[name]
        group.add_argument(f"--{name.replace('_', '-')}", type=kind, default=field.default,
                           choices=field.metadata["choices"], metavar=NUMBER_METAVARS.get(kind, name.upper()),
                           help=field.metadata["help"])


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        NAME, formatter_class=HelpFormatter, usage="tide-hf calibrate --dataset NAME --output DIR [options]",
        help="calibrate routers for a model and save them (optionally push to the Hub)",
        description="Calibrate routers for a model on real text and save them (safetensors + model card).\n\n"
                    "example: tide-hf calibrate --dataset sotu --output router-smollm2\n"
                    f"time {CPU}: ~0.7 s per 256-token sample of SmolLM2-135M (the default 256: ~3 min)")
    title = "model and text"
    g = p.add_argument_group(title)
    add_text_args(g, "REQUIRED: Hub dataset, .txt/.jsonl file or folder, or sotu", required=True)
    g.add_argument("--dataset-config", default=None, metavar="NAME",
                   help="Hub dataset config (e.g. wikitext-103-raw-v1)")
    g.add_argument("--split", default="train", metavar="NAME", help="dataset split (local files: train)")
    g.add_argument("--text-field", default="text", metavar="NAME", help="column / jsonl field holding the text")
    add_settings(g, title)
    title = "labels and exit heads"
    add_settings(p.add_argument_group(title), title)
    title = "training"
    g = p.add_argument_group(
        title, "--set: any other TideRouterConfig field calibration reads (exit_head_rank, max_train_tokens, "
        "min_layers, exit_threshold, ...; documented in docs/reference/api.md)")
    add_settings(g, title)
    g.add_argument("--set", nargs="+", action=SetFields, default=argparse.SUPPRESS, metavar="KEY=VALUE",
                   help="value as JSON, e.g. --set max_train_tokens=131072 min_layers=8")
    title = "quality target (what attach() keeps without arguments)"
    add_settings(p.add_argument_group(title), title)
    g = p.add_argument_group("output")
    g.add_argument("--output", required=True, metavar="DIR", help="folder to save the router in (new or empty)")
    g.add_argument("--overwrite", action="store_true", help="replace the TIDE router already in --output")
    g.add_argument("--push-to-hub", default=None, metavar="REPO", help="also push the router to this Hub repo")
    g.add_argument("--results", default=None, metavar="JSON", help="also write the run's figures to this file")
    g.add_argument("--compare-bare-forward", action="store_true",
                   help="time stock forwards over the same tokens first: the overhead")


def check(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Nothing beyond parsing (calibration checks its settings against CalibrationConfig before loading)."""


def run(args: argparse.Namespace) -> None:
    from ..calibration.command import run as calibrate

    calibrate(args)
