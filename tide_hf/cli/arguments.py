"""`tide-hf`'s arguments: the parser (defaults, help, value types, one argument group per concern) and the checks
that need no torch, so `tide-hf --help` and a bad argument answer at once."""

from __future__ import annotations

import argparse
import dataclasses
import io
import os
import shlex
import typing
from contextlib import redirect_stderr, redirect_stdout

from ..assets import DEFAULT_MODEL
from ..settings import MODES, CalibrationConfig
from . import bench
from .values import (
    CALIBRATE_FLAGS,
    CPU,
    DTYPE_HELP,
    DTYPES,
    MODEL_HELP,
    HelpFormatter,
    SetFields,
    cosine,
    positive_int,
    share,
    target_share,
)

NUMBER_METAVARS = {int: "N", float: "X"}  # a number flag's placeholder in --help
# The demo's calibration, fixed (`tide-hf calibrate` is the command that tunes one): fast (labelling every kept
# token dominates, hence the token cap), its routers still exit. With so few tokens, routers learn rank-64 exit
# heads' labels better than full-rank ones' (which agree more, benchmarks/exit_head_rank.py): rank 64 lets 11 % of
# SmolLM2's tokens exit at 96 % agreement, full rank none (measured with `tide-hf demo`). The other settings are
# CalibrationConfig's defaults; all of them key the demo's router cache.
DEMO_SAMPLES, DEMO_SEQ_LEN, DEMO_TRAIN_TOKENS, DEMO_EXIT_HEAD_RANK = 128, 128, 8192, 64
DEMO_CALIBRATION = {"model": DEFAULT_MODEL, "dataset": "sotu", "dataset_config": None, "split": "train",
                    "text_field": "text", "dtype": DTYPES[0], **dataclasses.asdict(CalibrationConfig(
                        num_samples=DEMO_SAMPLES, seq_len=DEMO_SEQ_LEN, exit_head_rank=DEMO_EXIT_HEAD_RANK,
                        max_train_tokens=DEMO_TRAIN_TOKENS))}
DEMO_REPEATS = 3  # timed (stock, TIDE) pairs of the demo, after one warm-up each (their median and range)


def demo_settings(args: argparse.Namespace) -> argparse.Namespace:
    """The demo's command line with its fixed calibration (`DEMO_CALIBRATION`): everything `tide_hf.eval.demo`
    reads."""
    return argparse.Namespace(**{**DEMO_CALIBRATION, **vars(args)})


def add_text_args(group: argparse._ArgumentGroup, what: str, required: bool = False) -> None:
    """--model, --dataset (`required`: no default text, as `calibrate()` has none) and --dtype (`what`: the text
    --dataset is read for)."""
    group.add_argument("--model", default=DEFAULT_MODEL, metavar="NAME",
                       help=MODEL_HELP)
    group.add_argument("--dataset", metavar="NAME", help=what,
                       **({"required": True} if required else {"default": "sotu"}))
    group.add_argument("--dtype", default=DTYPES[0], choices=DTYPES, metavar="DTYPE", help=DTYPE_HELP)


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


def add_calibrate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "calibrate", formatter_class=HelpFormatter, usage="tide-hf calibrate --dataset NAME --output DIR [options]",
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


def add_demo(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "demo", formatter_class=HelpFormatter,
        help="calibrate the embedded SmolLM2 on SOTU (cached), generate with TIDE and stock side by side",
        description="Calibrate routers for the embedded SmolLM2-135M on State of the Union text (a small, fast, "
                    f"fixed set: {DEMO_SAMPLES} samples x {DEMO_SEQ_LEN} tokens; cached, so a second run reuses "
                    "them), then answer one prompt with stock generate and with TIDE (attach's default: speculative "
                    "mode, the same tokens as stock; --mode skip for exits at a quality target), each on eager and "
                    "on the fast linear path, timed interleaved, and print them side by side: text, tokens/s, "
                    "ratios against stock, what each step did, agreement with stock. Other settings: tide-hf "
                    "calibrate.\n\n"
                    "example: tide-hf demo --prompt 'What should Congress do about taxes?'\n"
                    f"time {CPU}: ~4 min the first time (model conversion, calibration), then ~50 s")
    g = p.add_argument_group("generation")
    g.add_argument("--prompt", default="What should Congress do about the economy?", help="the user message")
    g.add_argument("--max-new-tokens", type=positive_int, default=48, metavar="N", help="tokens generated per answer")
    g.add_argument("--repeats", type=positive_int, default=DEMO_REPEATS, metavar="N",
                   help="timed rounds of the four runs: medians and their range are reported")
    g.add_argument("--mode", choices=MODES, default=None,
                   help="the mode TIDE is attached with (default: attach's own, speculative where the model allows)")
    g = p.add_argument_group("router")
    g.add_argument("--output", default=None, metavar="DIR", help="folder to save the router in (default: a folder "
                   "under the tide_hf cache keyed by the calibration settings, printed)")
    g.add_argument("--recalibrate", action="store_true", help="calibrate again even if a cached router exists")


def add_analyze(sub: argparse._SubParsersAction) -> None:
    d = CalibrationConfig()  # the convergence settings calibration uses by default
    p = sub.add_parser(
        "analyze", formatter_class=HelpFormatter, usage="tide-hf analyze [--router DIR] [options]",
        help="per-layer convergence, the oracle, and router efficiency (tables, JSON, PNG)",
        description="Per-layer convergence of a model on real text, the oracle (the best any router could do at "
                    "each agreement) and, with --router, that router's efficiency against it.\n\n"
                    "example: tide-hf analyze --router router-smollm2 --output analyze-out\n"
                    f"time {CPU}: ~3-5 min with the defaults")
    g = p.add_argument_group("model and text")
    add_text_args(g, "real text: Hub dataset, .txt/.jsonl file or folder, or sotu")
    g.add_argument("--num-samples", type=positive_int, default=32, metavar="N",
                   help="text windows measured on, spread evenly over the documents")
    g.add_argument("--seq-len", type=positive_int, default=256, metavar="N", help="tokens per sample")
    g.add_argument("--batch-size", type=positive_int, default=4, metavar="N", help="samples per forward pass")
    g.add_argument("--seed", type=int, default=d.seed, metavar="N", help="seed of the sampling")
    g = p.add_argument_group("convergence and the oracle")
    g.add_argument("--checkpoint-interval", type=positive_int, default=d.checkpoint_interval, metavar="N",
                   help="checkpoints every this many layers")
    g.add_argument("--convergence-threshold", type=cosine, default=d.convergence_threshold, metavar="X",
                   help="cosine similarity that counts as converged")
    g.add_argument("--agreements", nargs="+", type=share, default=[1.0, 0.95, 0.9, 0.8, 0.7], metavar="X",
                   help="top-1 agreements the oracle is computed at")
    g.add_argument("--bins", type=positive_int, default=40, metavar="N", help="cosine bins of the heatmap")
    g = p.add_argument_group("a router's efficiency (the flags below go with --router)")
    g.add_argument("--router", default=None, metavar="DIR", help="measure this router against the oracle")
    g.add_argument("--targets", nargs="+", type=target_share, default=[0.99, 0.97, 0.95, 0.9], metavar="X",
                   help="min_agreement quality targets evaluated")
    g.add_argument("--thresholds", nargs="+", type=share, default=[0.95, 0.9, 0.85, 0.7, 0.5, 0.3], metavar="X",
                   help="global exit thresholds measured")
    g.add_argument("--num-prompts", type=positive_int, default=16, metavar="N",
                   help="held-out prompts the model continues greedily")
    g.add_argument("--prompt-len", type=positive_int, default=64, metavar="N", help="tokens per prompt")
    g.add_argument("--new-tokens", type=positive_int, default=64, metavar="N", help="tokens generated per prompt")
    g = p.add_argument_group("output")
    g.add_argument("--output", default="analyze-out", metavar="DIR",
                   help="folder for analyze.json / .md and the PNGs")


def check_router_paths(args: argparse.Namespace) -> None:
    """A --router named by a local path (absolute, starting with . or ~) or a bare name (no '/': no Hub repo id)
    must be a folder, said before torch loads (modeling.files.check_config_source's rule, without torch)."""
    routers = getattr(args, "router", None) or []
    command = " ".join(filter(None, (args.command, getattr(args, "section", None))))
    for name in [routers] if isinstance(routers, str) else routers:
        if (os.path.isabs(name) or name.startswith((".", "~"))) and not os.path.isdir(os.path.expanduser(name)):
            raise SystemExit(f"tide-hf {command}: error: no TIDE router folder at {name}")
        if "/" not in name and not os.path.isdir(name):
            raise SystemExit(f"tide-hf {command}: error: no TIDE router folder named {name!r} here ({os.getcwd()}), "
                             "and it is not a Hub repo id (those read 'owner/name')")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tide-hf", formatter_class=HelpFormatter,
        description="TIDE early exit for HuggingFace causal LMs.\n\nStart with `tide-hf demo` (~4 min the first "
                    "time " + CPU + ")."
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    add_calibrate(sub)
    add_demo(sub)
    bench.add_parser(sub)
    sub.add_parser("env", formatter_class=HelpFormatter, help="versions, devices, kernel backends and cache folders "
                   "(what a bug report needs)", description="Print the versions of Python, torch, transformers, "
                   "accelerate and tide_hf, the devices torch sees, the kernel backend of each (building the kernels "
                   "if needed) and the cache folders, one `name: value` per line.\n\nexample: tide-hf env\n"
                   f"time {CPU}: ~10 s (torch's import and the kernels' load)")
    add_analyze(sub)
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
