"""`tide-hf bench SECTION`'s parsers: one subcommand per benchmark, each with the flags it reads and no other (so
none can be given to a section that would ignore it)."""

from __future__ import annotations

import argparse
from typing import Any

from tide_hf.assets import DEFAULT_MODEL
from tide_hf.cli.values import (
    CPU,
    DTYPE_HELP,
    DTYPES,
    MODEL_HELP,
    HelpFormatter,
    nonnegative_float,
    positive_float,
    positive_int,
    share,
    target_share,
)

OUTPUT = "bench-out"
# synthetic.SHAPES and CONFIGS, without importing torch (tests/test_cli.py checks they agree)
SYNTHETIC_SHAPES = ("llama3-8b", "qwen2-0.5b", "tiny")
SYNTHETIC_CONFIGS = ("stock", "exits-off", "select-scored", "select-exit", "skip-recompute", "skip-propagate",
                     "truncated")
TEXT = "text for prompts and perplexity (documents the routers never read)"


def section(sub: Any, name: str, summary: str, description: str, example: str, time: str,
            usage: str | None = "[options]") -> argparse.ArgumentParser:
    """One bench section's parser: its one-line summary, what it measures, an example, a time expectation and
    (`usage`: None for argparse's) its usage line."""
    prog = f"tide-hf bench {name}"
    return sub.add_parser(name, prog=prog, usage=usage and f"{prog} {usage}", formatter_class=HelpFormatter,
                          help=summary, description=f"{description}\n\nexample: {prog} {example}\ntime {time}")


def add_model(p: argparse.ArgumentParser, routers: str | None, required: bool = True) -> Any:
    """The model, its text and (`routers`: the --router help, None: no --router) the routers measured."""
    g = p.add_argument_group("model and routers")
    g.add_argument("--model", default=DEFAULT_MODEL, metavar="NAME", help=MODEL_HELP)
    g.add_argument("--dataset", default="sotu", metavar="NAME", help=TEXT)
    if routers is not None:
        g.add_argument("--router", nargs="+", required=required, default=None, metavar="DIR", help=routers)
    g.add_argument("--dtype", default=DTYPES[0], choices=DTYPES, metavar="DTYPE", help=DTYPE_HELP)
    return g


def add_prompts(p: argparse.ArgumentParser, *, reps: bool = True, chunks: bool = True,
                quality_batch: bool = True) -> Any:
    """The held-out prompts generated from (and the perplexity chunks, the timing repetitions, if read)."""
    g = p.add_argument_group("prompts and text")
    g.add_argument("--num-prompts", type=positive_int, default=16, metavar="N", help="held-out prompts")
    g.add_argument("--prompt-len", type=positive_int, default=64, metavar="N", help="tokens per prompt")
    g.add_argument("--new-tokens", type=positive_int, default=32, metavar="N", help="tokens generated per prompt")
    if reps:
        g.add_argument("--reps", type=positive_int, default=3, metavar="N", help="interleaved timing repetitions")
    if chunks:
        g.add_argument("--num-chunks", type=positive_int, default=16, metavar="N", help="chunks for perplexity")
        g.add_argument("--chunk-len", type=positive_int, default=256, metavar="N", help="tokens per chunk")
    if quality_batch:
        g.add_argument("--quality-batch-size", type=positive_int, default=8, metavar="N",
                       help="prompts / chunks per forward pass of the quality runs")
    return g


def add_output(p: argparse.ArgumentParser, files: str) -> None:
    p.add_argument_group("output").add_argument("--output", default=OUTPUT, metavar="DIR",
                                                help=f"folder for {files}")


def thresholds(g: Any, what: str) -> None:
    g.add_argument("--thresholds", nargs="+", type=share, default=[0.95, 0.85, 0.7, 0.5], metavar="X", help=what)


def targets(g: Any, what: str) -> None:
    g.add_argument("--targets", nargs="+", type=target_share, default=[0.99, 0.97, 0.95, 0.9], metavar="X", help=what)


def batch_sizes(g: Any, what: str) -> None:
    g.add_argument("--batch-sizes", nargs="+", type=positive_int, default=[1, 8], metavar="N", help=what)


def add_sections(bench: argparse.ArgumentParser) -> None:
    """`tide-hf bench`'s SECTION subcommands, added to its parser."""
    sections = bench.add_subparsers(dest="section", required=True, metavar="SECTION", help="the benchmark run")
    p = section(sections, "overhead", "overhead, exit rates, perplexity and agreement of TIDE vs stock",
                "Stock generate vs TIDE with the given routers: the overhead of attached routers with exits "
                "closed (interleaved), then per router and threshold exit rates, layers, perplexity and greedy "
                "agreement (a table row each).", "--router router-smollm2 --output bench-out",
                f"{CPU}: ~5-10 min with the defaults", "--router DIR [DIR ...] [options]")
    g = add_model(p, "router folders / Hub ids (e.g. one cosine, one top1: a row each)")
    thresholds(g, "exit thresholds TIDE is measured at")
    g = add_prompts(p)
    batch_sizes(g, "batch sizes of the overhead run (at most --num-prompts)")
    add_output(p, "bench.json and bench.md")
    p = section(sections, "modes", "skip mode vs stock and the ideal, speculative mode vs assistant_early_exit",
                "Skip mode at forced depths vs stock and the ideal truncated model, skip mode at real thresholds, and "
                "speculative mode vs stock, prompt lookup and assistant_early_exit. --near-identity-after K "
                "instead measures the speculative mode on an easy model (the layers after K made near-identity), "
                "with routers calibrated on it (modes-easy.json).", "--router router-smollm2 --output bench-out",
                f"{CPU}: ~10-20 min with the defaults", "(--router DIR | --near-identity-after K) [options]")
    g = add_model(p, "one router folder / Hub id (or --near-identity-after)", required=False)
    g.add_argument("--depths", nargs="+", type=positive_int, default=[8, 16, 24], metavar="K",
                   help="forced exit depths (checkpoints of the router)")
    thresholds(g, "exit thresholds of the mixed-exit rows")
    g = p.add_argument_group("an easy model instead of --router")
    g.add_argument("--near-identity-after", type=positive_int, default=None, metavar="K",
                   help="make the layers after K near-identity (o_proj / down_proj scaled)")
    g.add_argument("--near-identity-scale", type=positive_float, default=None, metavar="X",
                   help="their weights' factor (default: tide_bench.easy.NEAR_IDENTITY_SCALE, 0.02)")
    add_prompts(p)
    add_output(p, "modes(-easy).json and .md")
    p = section(sections, "batches", "skip mode in batches, rows exiting on their own, vs stock and the ideal",
                "Skip mode in batches at each --batch-sizes: a stock decode step's cost by rows, then forced "
                "per-row exits (half the rows) and real router decisions at --targets, decode and prefill, with "
                "kv='propagate', kv='recompute' and kv='recompute' with park_rows, vs stock and the ideals.",
                "--router router-smollm2 --batch-sizes 1 8 32 --num-prompts 32 --targets 0.95 --new-tokens 64",
                f"{CPU}: ~1 h with these flags (61 min measured with --num-chunks 8)", "--router DIR [options]")
    g = add_model(p, "one router folder / Hub id")
    targets(g, "min_agreement targets of the real-router rows (routers with exit paths)")
    g.add_argument("--forced-depth", type=positive_int, default=None, metavar="K",
                   help="the checkpoint forced rows exit at (default: the one nearest half the depth)")
    g = add_prompts(p, quality_batch=False)
    batch_sizes(g, "batch sizes measured (at most --num-prompts)")
    add_output(p, "batches.json and batches.md")
    p = section(sections, "continuous", "continuous batching (generate_batch) with TIDE vs stock",
                "All --num-prompts prompts in one model.generate_batch call (continuous batching), skip mode "
                "(kv='propagate') at each --targets against stock continuous batching: speed, layers executed per "
                "decode token and prompt position, top-1 agreement.",
                "--router router-smollm2 --num-prompts 32 --new-tokens 64", f"{CPU}: ~5 min with those flags",
                "--router DIR [options]")
    g = add_model(p, "one router folder / Hub id")
    targets(g, "min_agreement targets (routers with exit paths)")
    add_prompts(p, chunks=False, quality_batch=False)
    add_output(p, "continuous.json and continuous.md")
    p = section(sections, "baselines", "TIDE vs fixed depth, static layer skipping and softmax confidence",
                "TIDE vs fixed depth, static layer skipping and softmax-confidence exit: quality, layers and speed "
                "on the same prompts and text, with a Pareto plot.", "--router router-smollm2 --output bench-out",
                f"{CPU}: ~10-20 min with the defaults", "--router DIR [options]")
    g = add_model(p, "one router folder / Hub id")
    targets(g, "TIDE at these min_agreement targets (routers with exit paths)")
    g.add_argument("--ppl-targets", nargs="+", type=nonnegative_float, default=[0.05, 0.10, 0.25], metavar="X",
                   help="TIDE at these max_perplexity_increase targets (routers with exit paths)")
    thresholds(g, "TIDE at these exit thresholds (routers without exit paths)")
    g = p.add_argument_group("baselines")
    g.add_argument("--confidence-thresholds", nargs="+", type=share, default=[0.9, 0.8, 0.6, 0.4], metavar="X",
                   help="exit when the exit logits' top probability reaches this")
    g.add_argument("--drop-counts", nargs="+", type=positive_int, default=[1, 2, 3, 4, 6, 8], metavar="N",
                   help="how many layers static skipping drops")
    g.add_argument("--baseline-calib-samples", type=positive_int, default=8, metavar="N",
                   help="calibration-text samples static skipping chooses its layers on")
    g.add_argument("--baseline-calib-len", type=positive_int, default=128, metavar="N",
                   help="tokens per static-skipping calibration sample")
    add_prompts(p, reps=False)
    add_output(p, "baselines.json / .md, pareto.png")
    p = section(sections, "linears", "eager vs fast-path linear layers: forward cost by k, stock and TIDE modes",
                "Where the CPU speed comes from: a forward over 1-16 new tokens with eager nn.Linear and with the "
                "fast path (fast_linears: oneDNN on packed weights), per --dtypes; then batch-1 greedy generation, "
                "interleaved: stock on both paths, prompt lookup and each TIDE mode on the fast path, against stock "
                "on the same path and against stock eager.",
                "--router router-smollm2 --num-prompts 4 --new-tokens 64 --output bench-out",
                f"{CPU}: ~10 min with those flags", "--router DIR [options]")
    g = add_model(p, "one router folder / Hub id")
    g.add_argument("--dtypes", nargs="+", default=["float32"], choices=DTYPES, metavar="DTYPE",
                   help=f"dtypes of the forward-cost table: {', '.join(DTYPES)}")
    g.add_argument("--cache-len", type=positive_int, default=128, metavar="N",
                   help="tokens in the cache each costed forward reads")
    g.add_argument("--cost-repeats", type=positive_int, default=15, metavar="N",
                   help="timed forwards per cost (the median is kept)")
    add_prompts(p, chunks=False, quality_batch=False)
    add_output(p, "linears.json and linears.md")
    p = section(sections, "kernels", "the fused kernels vs the PyTorch path (no model or router)",
                "Microbenchmark of the fused kernels against the PyTorch path on this machine's device.",
                "--dtype bfloat16 --output bench-out", f"{CPU}: ~15 s", None)
    p.add_argument_group("kernels").add_argument("--dtype", default=DTYPES[0], choices=DTYPES, metavar="DTYPE",
                                                 help=f"dtype the kernels are timed in: {', '.join(DTYPES)}")
    add_output(p, "kernels.json and kernels.md")
    p = section(sections, "synthetic", "every mode on a random-weight architecture shape (GPU; no download)",
                "Speed of every mode on an architecture shape with random weights and forced exits (no router or "
                "download needed): runtime cost and savings, never quality.",
                "llama3-8b --dtype bfloat16 --prompt-len 128 --new-tokens 64",
                f"~10 min on an H100 (tiny {CPU}: ~7 min, compilation included)", "SHAPE [options]")
    g = p.add_argument_group("shape and configurations")
    g.add_argument("synthetic", choices=SYNTHETIC_SHAPES, metavar="SHAPE",
                   help=f"architecture shape: {', '.join(SYNTHETIC_SHAPES)}")
    g.add_argument("--synthetic-depth", type=positive_int, default=None, metavar="K",
                   help="the depth every token exits at, a checkpoint (default: half the shape's layers)")
    g.add_argument("--configs", nargs="+", default=list(SYNTHETIC_CONFIGS), choices=SYNTHETIC_CONFIGS,
                   metavar="CONFIG",
                   help=f"configurations timed, stock always (default: all: {', '.join(SYNTHETIC_CONFIGS)})")
    g.add_argument("--compile", nargs="+", default=["eager", "static"], choices=["eager", "static"], metavar="MODE",
                   help="eager, and/or static: cache_implementation='static', compiled by transformers")
    g.add_argument("--device", default=None, help="device (default: cuda when available)")
    g.add_argument("--dtype", default=DTYPES[0], choices=DTYPES, metavar="DTYPE",
help=f"dtype the model is built in: {', '.join(DTYPES)}")
    g = p.add_argument_group("prompts")
    g.add_argument("--prompt-len", type=positive_int, default=64, metavar="N", help="tokens per prompt")
    g.add_argument("--new-tokens", type=positive_int, default=32, metavar="N", help="tokens generated per prompt")
    g.add_argument("--reps", type=positive_int, default=3, metavar="N", help="timing repetitions")
    batch_sizes(g, "batch sizes measured")
    add_output(p, "synthetic.json and synthetic.md")
    p = section(sections, "gpu", "every GPU goal in one call (tide_bench.gpu; random weights, no download)",
                "The GPU suite: every GPU goal measured in one call on a random-weight Llama-3-8B shape, its plan "
                "fixed (tide_bench.gpu.GPU); writes gpu.json and gpu.md after every section.", "--output gpu-out",
                f"planned to fit 8 min on one H100 / H200, not yet run on one; --dry-run {CPU}: ~1 min", None)
    g = p.add_argument_group("suite")
    g.add_argument("--dry-run", action="store_true", help="the suite's code on tiny shapes on the CPU")
    g.add_argument("--output", default=OUTPUT, metavar="DIR", help="folder for gpu.json and gpu.md")
