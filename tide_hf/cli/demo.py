"""`tide-hf demo`: calibrate the embedded SmolLM2 on SOTU with a fixed, fast calibration (cached), then generate
with TIDE and stock side by side. Its parser, its calibration settings and its run (tide_hf.eval.demo, imported when
it runs)."""

from __future__ import annotations

import argparse
import dataclasses

from ..assets import DEFAULT_MODEL
from ..settings import MODES, CalibrationConfig
from .values import CPU, DTYPES, HelpFormatter, positive_int

NAME = "demo"
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


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        NAME, formatter_class=HelpFormatter,
        help="calibrate the embedded SmolLM2 on SOTU (cached), generate with TIDE and stock side by side",
        description="Calibrate routers for the embedded SmolLM2-135M on State of the Union text (a small, fast, "
                    f"fixed set: {DEMO_SAMPLES} samples x {DEMO_SEQ_LEN} tokens; cached, so a second run reuses "
                    "them), then answer one prompt with stock generate and with TIDE (attach's default: speculative "
                    "mode, the same tokens as stock; --mode skip for exits at a quality target), each on eager and "
                    "on the fast linear path, timed interleaved, and print them side by side: text, tokens/s, "
                    "ratios against stock, what each step did, agreement with stock. Other settings: tide-hf "
                    "calibrate.\n\n"
                    "example: tide-hf demo --prompt 'What should Congress do about taxes?'\n"
                    f"time {CPU}: ~4 min the first time (model conversion, calibration), then ~30 s")
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


def check(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Nothing beyond parsing."""


def run(args: argparse.Namespace) -> None:
    from ..eval.demo import run as demo

    demo(demo_settings(args))
