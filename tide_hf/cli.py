"""`tide-hf`: argument parsing; each subcommand runs from the room it belongs to (calibration, eval)."""

from __future__ import annotations

import argparse
import os
import shlex
import sys

from .assets import DEFAULT_MODEL


def _add_calibration_args(p: argparse.ArgumentParser) -> None:
    from .config import TideRouterConfig

    d = TideRouterConfig()  # the library's defaults, so the CLI cannot drift from them
    p.add_argument("--model", default=DEFAULT_MODEL,
                   help="Hub id or folder of a causal LM ('smollm2' = embedded default)")
    p.add_argument("--dataset", default="sotu", help="Hub dataset name, local .txt/.jsonl file or folder, or 'sotu'")
    p.add_argument("--dataset-config", default=None, help="Hub dataset config (e.g. wikitext-103-raw-v1)")
    p.add_argument("--split", default="train")
    p.add_argument("--text-field", default="text")
    p.add_argument("--label", default="top1", choices=["cosine", "top1", "kl"],
                   help="what 'converged' means: cosine(h_k, h_final) > --convergence-threshold, top-1 agreement, "
                        "or KL(final || exit) < --kl-threshold")
    p.add_argument("--num-samples", type=int, default=2000)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--checkpoint-interval", type=int, default=d.checkpoint_interval)
    p.add_argument("--convergence-threshold", type=float, default=d.convergence_threshold)
    p.add_argument("--kl-threshold", type=float, default=d.kl_threshold)
    p.add_argument("--num-epochs", type=int, default=d.num_epochs)
    p.add_argument("--early-stopping-patience", type=int, default=d.early_stopping_patience,
                   help="stop a router after this many epochs without a better held-out loss (0: never)")
    p.add_argument("--max-train-tokens", type=int, default=d.max_train_tokens,
                   help="kept tokens per checkpoint (bounds memory)")
    p.add_argument("--exit-threshold", type=float, default=d.exit_threshold)
    p.add_argument("--min-layers", type=int, default=None)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])


def cmd_calibrate(args: argparse.Namespace) -> None:
    from .calibration.command import run

    run(args)


def cmd_demo(args: argparse.Namespace) -> None:
    from .eval.demo import run

    run(args)


def cmd_bench(args: argparse.Namespace) -> None:
    from .eval.bench import run

    if not args.kernels and not args.router:
        raise SystemExit("tide-hf bench: --router is required (except with --kernels)")
    run(args)


def cmd_analyze(args: argparse.Namespace) -> None:
    from .eval.analyze import run

    run(args)


def build_parser() -> argparse.ArgumentParser:
    from .config import TideRouterConfig

    parser = argparse.ArgumentParser(prog="tide-hf", description="TIDE early exit for HuggingFace causal LMs")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("calibrate", help="calibrate routers for a model and save them (optionally push to the Hub)")
    _add_calibration_args(p)
    p.add_argument("--output", required=True, help="folder to save the router in (new or empty; never a model's)")
    p.add_argument("--overwrite", action="store_true", help="replace the TIDE router already in --output "
                   "(a folder holding anything else is always refused)")
    p.add_argument("--push-to-hub", default=None, metavar="REPO", help="also push the router to this Hub repo")
    p.add_argument("--results", default=None, metavar="JSON", help="also write the run's figures to this JSON file")
    p.add_argument("--compare-bare-forward", action="store_true",
                   help="first time stock forward passes over the same tokens, and report calibration's overhead")
    p.set_defaults(func=cmd_calibrate)
    p = sub.add_parser("demo", help="calibrate the embedded SmolLM2 on SOTU, print metrics, generate with TIDE")
    _add_calibration_args(p)
    p.set_defaults(num_samples=512)
    p.add_argument("--output", default="tide-router-smollm2", help="folder to save the router in")
    p.add_argument("--prompt", default="What should Congress do about the economy?")
    p.add_argument("--max-new-tokens", type=int, default=40)
    p.add_argument("--stats-png", default="tide-exits.png", help="where to draw the exit histogram ('' = none)")
    p.set_defaults(func=cmd_demo)
    p = sub.add_parser("bench", help="stock generate vs TIDE in one run: overhead, exit rates, quality")
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--dataset", default="sotu", help="text for prompts and perplexity (documents the router never saw)")
    p.add_argument("--router", nargs="+", default=[], help="router folders / Hub ids (e.g. one cosine, one top1); "
                   "--modes uses the last one")
    p.add_argument("--modes", action="store_true", help="skip mode vs stock and vs the ideal truncated model")
    p.add_argument("--depths", nargs="+", type=int, default=[8, 16, 24], help="--modes: forced exit depths")
    p.add_argument("--kernels", action="store_true", help="microbenchmark the fused kernels vs the PyTorch path")
    p.add_argument("--baselines", action="store_true", help="TIDE vs fixed depth, static layer skipping and "
                   "softmax-confidence exit: quality, layers and speed, with a Pareto plot")
    p.add_argument("--confidence-thresholds", nargs="+", type=float, default=[0.9, 0.8, 0.6, 0.4],
                   help="--baselines: exit when the exit logits' top probability reaches this")
    p.add_argument("--drop-counts", nargs="+", type=int, default=[2, 4, 6, 8],
                   help="--baselines: how many layers static skipping drops")
    p.add_argument("--baseline-calib-samples", type=int, default=8,
                   help="--baselines: calibration-text samples static skipping chooses its layers on")
    p.add_argument("--baseline-calib-len", type=int, default=128)
    p.add_argument("--thresholds", nargs="+", type=float, default=[0.95, 0.85, 0.7, 0.5])
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 8], help="batch sizes of the overhead run")
    p.add_argument("--reps", type=int, default=3, help="interleaved repetitions of the overhead run")
    p.add_argument("--num-chunks", type=int, default=16, help="held-out chunks for perplexity")
    p.add_argument("--chunk-len", type=int, default=256)
    p.add_argument("--quality-batch-size", type=int, default=8)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--output", default="bench-out", help="folder for bench.json and bench.md")
    p.set_defaults(func=cmd_bench)
    p = sub.add_parser("analyze", help="per-layer convergence, the oracle, and router efficiency (tables, JSON, PNG)")
    d = TideRouterConfig()
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--dataset", default="sotu", help="real text: Hub dataset, local .txt/.jsonl file or folder, 'sotu'")
    p.add_argument("--router", default=None, help="also measure this router's efficiency against the oracle")
    p.add_argument("--num-samples", type=int, default=32)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--checkpoint-interval", type=int, default=d.checkpoint_interval)
    p.add_argument("--convergence-threshold", type=float, default=d.convergence_threshold)
    p.add_argument("--agreements", nargs="+", type=float, default=[1.0, 0.95, 0.9, 0.8, 0.7],
                   help="top-1 agreements the oracle is computed at")
    p.add_argument("--bins", type=int, default=40, help="cosine bins of the heatmap")
    p.add_argument("--thresholds", nargs="+", type=float, default=[0.95, 0.9, 0.85, 0.7, 0.5, 0.3])
    p.add_argument("--num-prompts", type=int, default=16, help="held-out prompts the model continues greedily")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--output", default="analyze-out", help="folder for analyze.json, analyze.md and the PNGs")
    p.set_defaults(func=cmd_analyze)
    return parser


def main(argv: list[str] | None = None) -> None:
    """Run one subcommand. An error tide_hf raises on purpose (`TideError`: bad argument, bad file, refused
    overwrite...) or a file that cannot be read prints as one line on stderr and exits with status 1;
    `TIDE_HF_TRACEBACK=1` shows the traceback instead."""
    from .calibration.distributed import finish
    from .errors import TideError

    args = build_parser().parse_args(argv)
    args.command = shlex.join(["tide-hf", *(sys.argv[1:] if argv is None else argv)])  # recorded in result JSON
    try:
        args.func(args)
    except (TideError, OSError) as err:
        if os.environ.get("TIDE_HF_TRACEBACK") == "1":
            raise
        message = " ".join(str(err).split()) or type(err).__name__
        print(f"tide-hf {args.func.__name__.removeprefix('cmd_')}: error: {message}", file=sys.stderr)
        raise SystemExit(1) from None
    finish()  # under `accelerate launch`: every process waits for the others before it exits


if __name__ == "__main__":
    main(sys.argv[1:])
