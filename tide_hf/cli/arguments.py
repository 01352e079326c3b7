"""`tide-hf`'s arguments: the parser (defaults, help, value types) and the checks that need no torch, so
`tide-hf --help` and a bad argument answer at once."""

from __future__ import annotations

import argparse
import os
import textwrap

from ..assets import DEFAULT_MODEL

# TideRouterConfig's defaults of the fields the CLI offers, known without importing transformers
# (tests/test_cli.py checks they agree)
ROUTER_DEFAULTS = {"checkpoint_interval": 4, "convergence_threshold": 0.98, "kl_threshold": 0.1, "num_epochs": 100,
                   "early_stopping_patience": 10, "max_train_tokens": 65536, "exit_threshold": 0.85, "seed": 0,
                   "label": "top1", "min_agreement": 0.95, "confidence": 0.9, "exit_head_ridge": 0.01,
                   "continuation_prompt_len": 64}
LABEL_KINDS = ("cosine", "top1", "kl", "top1_kl")  # config.LABEL_KINDS, without importing transformers
EXIT_HEADS, CALIBRATED_EXIT_HEAD = ("lens", "linear"), "linear"  # config's, without importing transformers
CONTINUATIONS = ("greedy", "sample")  # config's, without importing transformers
CPU = "on a 2-core CPU"
# eval.synthetic's SHAPES and CONFIGS, without importing torch (tests/test_cli.py checks they agree)
SYNTHETIC_SHAPES = ("llama3-8b", "qwen2-0.5b", "tiny")
SYNTHETIC_CONFIGS = ("stock", "exits-off", "select-scored", "select-exit", "skip-recompute", "skip-propagate",
                     "truncated")
# the demo's calibration: fast (labelling every kept token dominates, hence the token cap), its routers still exit
DEMO_SAMPLES, DEMO_SEQ_LEN, DEMO_TRAIN_TOKENS = 128, 128, 8192
# ... and with so few tokens, routers learn rank-64 exit heads' labels better than full-rank ones' (which agree
# more, benchmarks/exit_head_rank.py): rank 64 lets 11 % of SmolLM2's tokens exit at 96 % agreement, full rank none
# (measured with `tide-hf demo`)
DEMO_EXIT_HEAD_RANK = 64


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


def png_path(text: str) -> str:
    """argparse type: '' (no plot) or a file name ending in .png (what is written is what is printed)."""
    if text and not text.lower().endswith(".png"):
        raise argparse.ArgumentTypeError(f"must end in .png (or be '' for no plot), got {text!r}")
    return text


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Defaults shown after every option's help (a None default is said in words by the help itself); each
    line of a description is wrapped on its own."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        return action.help if action.default is None else super()._get_help_string(action)

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        return "\n".join(textwrap.fill(line, width, initial_indent=indent, subsequent_indent=indent)
                         for line in text.splitlines())


def add_calibration_args(p: argparse.ArgumentParser, rank_default: str) -> None:
    """The calibration options shared by calibrate and demo (`rank_default`: what no --exit-head-rank means)."""
    d = argparse.Namespace(**ROUTER_DEFAULTS)  # the library's defaults, so the CLI cannot drift from them
    p.add_argument("--model", default=DEFAULT_MODEL,
                   help="Hub id or folder of a causal LM ('smollm2' = embedded default)")
    p.add_argument("--dataset", default="sotu", help="Hub dataset name, local .txt/.jsonl file or folder (or a "
                   "folder written by datasets' save_to_disk), or 'sotu'")
    p.add_argument("--dataset-config", default=None,
                   help="Hub dataset config (e.g. wikitext-103-raw-v1; default: the dataset's default config)")
    p.add_argument("--split", default="train", help="dataset split to read (a Hub dataset's; local files: train)")
    p.add_argument("--text-field", default="text", help="column / jsonl field holding the text")
    p.add_argument("--label", default=d.label, choices=list(LABEL_KINDS),
                   help="what 'converged' means: cosine(h_k, h_final) > --convergence-threshold, top-1 agreement, "
                        "KL(final || exit) < --kl-threshold, or top-1 agreement and that KL (top1_kl)")
    p.add_argument("--exit-head", default=CALIBRATED_EXIT_HEAD, choices=list(EXIT_HEADS),
                   help="how an exited token's logits are made: linear (a per-checkpoint linear map to the last "
                        "layer's state, fitted by least squares, then the model's head) or lens (the model's head "
                        "on the checkpoint's state as is)")
    p.add_argument("--exit-head-ridge", type=float, default=d.exit_head_ridge,
                   help="--exit-head linear: ridge penalty, relative to the mean diagonal of the Gram matrix")
    p.add_argument("--exit-head-rank", type=int, default=None,
                   help=f"--exit-head linear: store each exit head as rank-r factors (default: {rank_default})")
    p.add_argument("--min-agreement", type=float, default=d.min_agreement,
                   help="the router's default quality target: top-1 agreement attach() keeps without arguments")
    p.add_argument("--confidence", type=float, default=d.confidence,
                   help="probability with which a quality target holds (Learn-then-Test)")
    p.add_argument("--num-samples", type=int, default=2000,
                   help="text windows to calibrate on (SmolLM2, 2 cores: ~0.7 s per 256-token sample)")
    p.add_argument("--seq-len", type=int, default=256, help="tokens per sample")
    p.add_argument("--batch-size", type=int, default=8, help="samples per forward pass")
    p.add_argument("--continuation", default=None, choices=list(CONTINUATIONS),
                   help="calibrate on the model's own text: keep each sample's first --continuation-prompt-len "
                        "tokens and let the model write the rest, greedy or sampled (default: the corpus as "
                        "written). Routers and quality targets are then fitted on continuations of the corpus "
                        "prompts; writing costs one generate() call per batch")
    p.add_argument("--continuation-prompt-len", type=int, default=d.continuation_prompt_len,
                   help="--continuation: corpus tokens each sample keeps as its prompt")
    p.add_argument("--checkpoint-interval", type=int, default=d.checkpoint_interval,
                   help="a router after every this many layers")
    p.add_argument("--convergence-threshold", type=cosine, default=d.convergence_threshold,
                   help="--label cosine: cosine similarity that counts as converged")
    p.add_argument("--kl-threshold", type=float, default=d.kl_threshold,
                   help="--label kl: KL divergence below which a token counts as converged")
    p.add_argument("--num-epochs", type=int, default=d.num_epochs,
                   help="most epochs per router (early stopping usually ends far sooner)")
    p.add_argument("--early-stopping-patience", type=int, default=d.early_stopping_patience,
                   help="stop a router after this many epochs without a better held-out loss (0: never)")
    p.add_argument("--max-train-tokens", type=int, default=d.max_train_tokens,
                   help="tokens kept per checkpoint, on average (each with probability max / total; sets memory)")
    p.add_argument("--exit-threshold", type=float, default=d.exit_threshold,
                   help="global router score at which a token exits, used only where no quality target is in "
                        "effect (a router loaded with min_agreement=None, or one without exit paths); "
                        "attach(exit_threshold=...) overrides it per attach; saved in the router, and the card's "
                        "validation table is taken at it")
    p.add_argument("--min-layers", type=int, default=None,
                   help="no exit before this many layers (default: the first checkpoint)")
    p.add_argument("--seed", type=int, default=d.seed, help="seed of sampling, the split and training")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="dtype the model is loaded in")


def check_router_paths(args: argparse.Namespace) -> None:
    """A --router named by a local path (absolute, starting with . or ~) or a bare name (no '/': no Hub repo id)
    must be a folder, said before torch loads (modeling.files.check_config_source's rule, without torch)."""
    routers = getattr(args, "router", None) or []
    command = args.command
    for name in [routers] if isinstance(routers, str) else routers:
        if (os.path.isabs(name) or name.startswith((".", "~"))) and not os.path.isdir(os.path.expanduser(name)):
            raise SystemExit(f"tide-hf {command}: error: no TIDE router folder at {name}")
        if "/" not in name and not os.path.isdir(name):
            raise SystemExit(f"tide-hf {command}: error: no TIDE router folder named {name!r} here ({os.getcwd()}), "
                             "and it is not a Hub repo id (those read 'owner/name')")


def build_parser() -> argparse.ArgumentParser:
    d = argparse.Namespace(**ROUTER_DEFAULTS)
    parser = argparse.ArgumentParser(
        prog="tide-hf", formatter_class=HelpFormatter,
        description="TIDE early exit for HuggingFace causal LMs.\n\nStart with `tide-hf demo` (~2 min " + CPU + ")."
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    p = sub.add_parser(
        "calibrate", formatter_class=HelpFormatter,
        help="calibrate routers for a model and save them (optionally push to the Hub)",
        description="Calibrate routers for a model on real text and save them (safetensors + model card).\n\n"
                    "example: tide-hf calibrate --num-samples 512 --output router-smollm2\n"
                    f"time: ~0.7 s per 256-token sample on SmolLM2-135M {CPU} (800: ~10 min, the default 2000: "
                    "~24 min)")
    add_calibration_args(p, "full rank, hidden x hidden per checkpoint")
    p.add_argument("--output", required=True, help="folder to save the router in (new or empty; never a model's)")
    p.add_argument("--overwrite", action="store_true", help="replace the TIDE router already in --output "
                   "(a folder holding anything else is always refused)")
    p.add_argument("--push-to-hub", default=None, metavar="REPO", help="also push the router to this Hub repo")
    p.add_argument("--results", default=None, metavar="JSON", help="also write the run's figures to this JSON file")
    p.add_argument("--compare-bare-forward", action="store_true",
                   help="first time stock forward passes over the same tokens, and report calibration's overhead")
    p = sub.add_parser(
        "demo", formatter_class=HelpFormatter,
        help="calibrate the embedded SmolLM2 on SOTU (cached), generate with TIDE and stock side by side",
        description="Calibrate routers for the embedded SmolLM2-135M on State of the Union text (a small, fast "
                    "set; cached, so a second run reuses them), then answer one prompt with stock generate and "
                    "with TIDE (skip mode: exited tokens skip the remaining layers) and print both side by side: "
                    "text, tokens/s, layers executed per token, agreement with stock.\n\n"
                    "example: tide-hf demo --prompt 'What should Congress do about taxes?'\n"
                    f"time {CPU}: ~2 min the first time (calibration), ~11 s once the router is cached")
    add_calibration_args(p, f"{DEMO_EXIT_HEAD_RANK}: a small sidecar, and heads few tokens can fit")
    p.set_defaults(num_samples=DEMO_SAMPLES, seq_len=DEMO_SEQ_LEN, max_train_tokens=DEMO_TRAIN_TOKENS)
    p.add_argument("--output", default=None, help="folder to save the router in (default: a folder under the "
                   "tide_hf cache keyed by model and calibration settings, printed)")
    p.add_argument("--recalibrate", action="store_true", help="calibrate again even if a cached router exists")
    p.add_argument("--prompt", default="What should Congress do about the economy?", help="the user message")
    p.add_argument("--max-new-tokens", type=positive_int, default=48, help="tokens generated per answer")
    p.add_argument("--stats-png", default=None, type=png_path, help="where to draw the exit histogram, a .png "
                   "file ('' = none; default: next to the router folder, printed)")
    p = sub.add_parser(
        "bench", formatter_class=HelpFormatter,
        usage="tide-hf bench (--router DIR [DIR ...] | --kernels | --synthetic SHAPE | "
              "--modes --near-identity-after K) [options]\n       tide-hf bench gpu [--dry-run] [--output DIR]",
        help="stock generate vs TIDE in one run: overhead, exit rates, quality",
        description="Stock generate vs TIDE with the given routers in one run: overhead, exit rates, perplexity "
                    "and agreement. --modes, --baselines, --kernels and --synthetic each run their own section "
                    "instead (one per command). --router is required, except with --kernels, --synthetic or "
                    "--near-identity-after.\n\n"
                    "example: tide-hf bench --router router-smollm2 --output bench-out\n"
                    "every GPU goal in one call (planned to fit 8 min on one H100 / H200, not yet run on one; random "
                    "weights, no download): "
                    "tide-hf bench gpu --output gpu-out\n"
                    "GPU speed table, no download (~10 min on an H100): tide-hf bench --synthetic llama3-8b "
                    "--dtype bfloat16 --prompt-len 128 --new-tokens 64\n"
                    f"time {CPU}: ~5-10 min with the defaults (--modes / --baselines: add ~10-20 min each)")
    p.add_argument("suite", nargs="?", default=None, choices=["gpu"],
                   help="'gpu': the GPU suite, every GPU goal in one call (tide_hf.eval.gpu; takes only --dry-run "
                        "and --output; writes gpu.json and gpu.md)")
    p.add_argument("--dry-run", action="store_true", help="gpu: the suite's code on tiny shapes on the CPU (~1 min)")
    p.add_argument("--model", default=DEFAULT_MODEL, help="Hub id or folder of the causal LM ('smollm2' = embedded)")
    p.add_argument("--dataset", default="sotu", help="text for prompts and perplexity (documents the router never saw)")
    p.add_argument("--router", nargs="+", default=[], metavar="DIR",
                   help="REQUIRED except with --kernels, --synthetic or --near-identity-after: router folders / Hub "
                        "ids (e.g. one cosine, one top1: a table row per router and threshold); --modes and "
                        "--baselines take one")
    p.add_argument("--modes", action="store_true", help="skip mode vs stock and vs the ideal truncated model, and "
                        "speculative mode vs stock and assistant_early_exit")
    p.add_argument("--depths", nargs="+", type=positive_int, default=[8, 16, 24], help="--modes: forced exit depths")
    p.add_argument("--batches", action="store_true", help="skip mode in batches at each --batch-sizes: forced "
                   "per-row exits (half the rows) and real router decisions at --targets, decode and prefill, vs "
                   "stock and the ideal")
    p.add_argument("--forced-depth", type=positive_int, default=None,
                   help="--batches: the checkpoint forced rows exit at (default: the one nearest half the depth)")
    p.add_argument("--near-identity-after", type=positive_int, default=None, metavar="K",
                   help="--modes on an easy model: layers after K made near-identity (o_proj / down_proj scaled), "
                        "routers calibrated on it quickly; measures the speculative mode only (modes-easy.json)")
    p.add_argument("--near-identity-scale", type=positive_float, default=None,
                   help="--near-identity-after: the factor on the deep layers' o_proj / down_proj weights "
                        "(default: tide_hf.eval.easy.NEAR_IDENTITY_SCALE, 0.02)")
    p.add_argument("--kernels", action="store_true", help="microbenchmark the fused kernels vs the PyTorch path")
    p.add_argument("--synthetic", default=None, choices=SYNTHETIC_SHAPES, help="speed of every mode on this "
                   "architecture shape with random weights and forced exits (no router or download needed; GPU)")
    p.add_argument("--synthetic-depth", type=positive_int, default=None,
                   help="--synthetic: the depth every token exits at, a checkpoint (default: half the shape's "
                        "layers: 16 for llama3-8b, 4 for tiny)")
    p.add_argument("--compile", nargs="+", default=["eager", "static"], choices=["eager", "static"],
                   help="--synthetic: eager decoding and/or cache_implementation='static' (compiled by transformers)")
    p.add_argument("--configs", nargs="+", default=list(SYNTHETIC_CONFIGS), choices=SYNTHETIC_CONFIGS,
                   help="--synthetic: configurations to time (stock always runs)")
    p.add_argument("--device", default=None, help="--synthetic: device (default: cuda when available)")
    p.add_argument("--baselines", action="store_true", help="TIDE vs fixed depth, static layer skipping and "
                   "softmax-confidence exit: quality, layers and speed, with a Pareto plot")
    p.add_argument("--confidence-thresholds", nargs="+", type=share, default=[0.9, 0.8, 0.6, 0.4],
                   help="--baselines: exit when the exit logits' top probability reaches this")
    p.add_argument("--targets", nargs="+", type=target_share, default=[0.99, 0.97, 0.95, 0.9],
                   help="--baselines / --batches: TIDE at these min_agreement targets (routers with exit paths)")
    p.add_argument("--ppl-targets", nargs="+", type=nonnegative_float, default=[0.05, 0.10, 0.25],
                   help="--baselines: TIDE at these max_perplexity_increase targets (routers with exit paths)")
    p.add_argument("--drop-counts", nargs="+", type=positive_int, default=[1, 2, 3, 4, 6, 8],
                   help="--baselines: how many layers static skipping drops")
    p.add_argument("--baseline-calib-samples", type=positive_int, default=8,
                   help="--baselines: calibration-text samples static skipping chooses its layers on")
    p.add_argument("--baseline-calib-len", type=positive_int, default=128,
                   help="--baselines: tokens per static-skipping calibration sample")
    p.add_argument("--thresholds", nargs="+", type=share, default=[0.95, 0.85, 0.7, 0.5],
                   help="exit thresholds to measure TIDE at")
    p.add_argument("--num-prompts", type=positive_int, default=16, help="held-out prompts generated from")
    p.add_argument("--prompt-len", type=positive_int, default=64, help="tokens per prompt")
    p.add_argument("--new-tokens", type=positive_int, default=32, help="tokens generated per prompt")
    p.add_argument("--batch-sizes", nargs="+", type=positive_int, default=[1, 8],
                   help="batch sizes of the overhead run and of --batches (at most --num-prompts)")
    p.add_argument("--reps", type=positive_int, default=3, help="interleaved repetitions of the overhead run")
    p.add_argument("--num-chunks", type=positive_int, default=16, help="held-out chunks for perplexity")
    p.add_argument("--chunk-len", type=positive_int, default=256, help="tokens per perplexity chunk")
    p.add_argument("--quality-batch-size", type=positive_int, default=8,
                   help="chunks per forward pass of the quality run")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="dtype the model is loaded in")
    p.add_argument("--output", default="bench-out", help="folder for the run's JSON and Markdown (bench, modes, "
                   "modes-easy, baselines, kernels or synthetic) and its plots")
    sub.add_parser("env", formatter_class=HelpFormatter, help="versions, devices, kernel backends and cache folders "
                   "(what a bug report needs)", description="Print the versions of Python, torch, transformers, "
                   "accelerate and tide_hf, the devices torch sees, the kernel backend of each (building the kernels "
                   "if needed) and the cache folders, one `name: value` per line.\n\nexample: tide-hf env\n"
                   f"time {CPU}: ~10 s (torch's import and the kernels' load)")
    p = sub.add_parser(
        "analyze", formatter_class=HelpFormatter,
        help="per-layer convergence, the oracle, and router efficiency (tables, JSON, PNG)",
        description="Per-layer convergence of a model on real text, the oracle (the best any router could do at "
                    "each agreement) and, with --router, that router's efficiency against it.\n\n"
                    "example: tide-hf analyze --router router-smollm2 --output analyze-out\n"
                    f"time {CPU}: ~3-5 min with the defaults")
    p.add_argument("--model", default=DEFAULT_MODEL, help="Hub id or folder of the causal LM ('smollm2' = embedded)")
    p.add_argument("--dataset", default="sotu", help="real text: Hub dataset, local .txt/.jsonl file or folder, 'sotu'")
    p.add_argument("--router", default=None, help="also measure this router's efficiency against the oracle")
    p.add_argument("--num-samples", type=positive_int, default=32,
                   help="text windows the convergence (and, with --router, the quality targets on held-out text) is "
                   "measured on, spread over the documents: at most ceil(n / documents) each, evenly spaced through it")
    p.add_argument("--seq-len", type=positive_int, default=256, help="tokens per sample")
    p.add_argument("--batch-size", type=positive_int, default=4, help="samples per forward pass")
    p.add_argument("--checkpoint-interval", type=positive_int, default=d.checkpoint_interval,
                   help="checkpoints every this many layers")
    p.add_argument("--convergence-threshold", type=cosine, default=d.convergence_threshold,
                   help="cosine similarity that counts as converged")
    p.add_argument("--agreements", nargs="+", type=share, default=[1.0, 0.95, 0.9, 0.8, 0.7],
                   help="top-1 agreements the oracle is computed at")
    p.add_argument("--bins", type=positive_int, default=40, help="cosine bins of the heatmap")
    p.add_argument("--targets", nargs="+", type=target_share, default=[0.99, 0.97, 0.95, 0.9],
                   help="--router: min_agreement quality targets whose per-checkpoint thresholds are evaluated")
    p.add_argument("--thresholds", nargs="+", type=share, default=[0.95, 0.9, 0.85, 0.7, 0.5, 0.3],
                   help="--router: global exit thresholds its efficiency is measured at")
    p.add_argument("--num-prompts", type=positive_int, default=16,
                   help="--router: held-out prompts the model continues greedily")
    p.add_argument("--prompt-len", type=positive_int, default=64, help="--router: tokens per prompt")
    p.add_argument("--new-tokens", type=positive_int, default=64, help="--router: tokens generated per prompt")
    p.add_argument("--seed", type=int, default=d.seed, help="seed of the sampling")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="dtype the model is loaded in")
    p.add_argument("--output", default="analyze-out", help="folder for analyze.json, analyze.md and the PNGs")
    return parser
