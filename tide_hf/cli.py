"""`tide-hf`: calibrate routers, run the demo on the embedded default model, benchmark."""

from __future__ import annotations

import argparse
import resource
import shlex
import sys
import time
from typing import Any

DEFAULT_MODEL = "smollm2"  # alias of the embedded SmolLM2-135M-Instruct (see tide_hf.assets)


def load_model(name: str, dtype: str = "float32"):
    """Model and tokenizer by Hub id / local folder, or the embedded default for "smollm2"."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .assets import smollm2_path

    path = smollm2_path() if name == DEFAULT_MODEL else name
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype))
    tokenizer = AutoTokenizer.from_pretrained(path, padding_side="left")
    return model.eval(), tokenizer


def default_dataset(name: str | None) -> str | None:
    """The SOTU folder for the embedded default model, else what the user gave (None = WikiText)."""
    from .assets import sotu_path

    return str(sotu_path()) if name in (None, "sotu") else name


def _add_calibration_args(p: argparse.ArgumentParser) -> None:
    from .config import TideRouterConfig

    d = TideRouterConfig()  # the library's defaults, so the CLI cannot drift from them
    p.add_argument("--model", default=DEFAULT_MODEL, help="Hub id or folder of a causal LM ('smollm2' = embedded default)")
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
    p.add_argument("--max-train-tokens", type=int, default=d.max_train_tokens, help="kept tokens per checkpoint (bounds memory)")
    p.add_argument("--exit-threshold", type=float, default=d.exit_threshold)
    p.add_argument("--min-layers", type=int, default=None)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])


def _calibrate(args: argparse.Namespace):
    from .calibrate import calibrate
    from .distributed import to_process_device

    model, tokenizer = load_model(args.model, args.dtype)
    model = to_process_device(model)  # under `accelerate launch`: this process's GPU
    router = calibrate(
        model, tokenizer, default_dataset(args.dataset),
        dataset_config=args.dataset_config, split=args.split, text_field=args.text_field,
        num_samples=args.num_samples, seq_len=args.seq_len, batch_size=args.batch_size, label=args.label,
        checkpoint_interval=args.checkpoint_interval, convergence_threshold=args.convergence_threshold,
        kl_threshold=args.kl_threshold, num_epochs=args.num_epochs,
        early_stopping_patience=args.early_stopping_patience, max_train_tokens=args.max_train_tokens,
        exit_threshold=args.exit_threshold, min_layers=args.min_layers, seed=args.seed,
    )
    return model, tokenizer, router


def print_metrics(router) -> None:
    cfg = router.config
    print(f"\nrouter: label={cfg.label}, checkpoints={cfg.checkpoint_layers}, threshold={cfg.exit_threshold}")
    print(f"{'layer':>5} {'pos.rate':>8} {'precision':>9} {'recall':>7} {'AUC':>6} {'pred.rate':>9}")
    for k in cfg.checkpoint_layers:
        m = cfg.metrics[str(k)]
        cells = [m.get(f) for f in ("positive_rate", "precision", "recall", "auc", "predicted_rate")]
        print(f"{k:>5} " + " ".join(f"{'n/a' if v is None else f'{v:.3f}':>8}" for v in cells))
    print("seconds:", {k: round(v, 1) for k, v in cfg.calibration_seconds.items()})


def bare_forward_seconds(args: argparse.Namespace) -> float:
    """Wall time of stock forward passes (logits included) over exactly the tokens calibration will see."""
    import torch
    from tqdm.auto import tqdm

    from .calibrate import _pad, make_samples
    from .data import load_texts

    model, tokenizer = load_model(args.model, args.dtype)
    texts = load_texts(default_dataset(args.dataset), dataset_config=args.dataset_config, split=args.split,
                       text_field=args.text_field)
    samples = make_samples(tokenizer, texts, args.num_samples, args.seq_len, args.seed)
    started = time.perf_counter()
    with torch.no_grad():
        for i in tqdm(range(0, len(samples), args.batch_size), desc="bare forward", unit="batch"):
            ids, mask = _pad(samples[i : i + args.batch_size], 0)
            model(input_ids=ids, attention_mask=mask, use_cache=False)
    return time.perf_counter() - started


def _write_calibration_results(args: argparse.Namespace, router: Any, wall: float, peak_gb: float,
                               bare: float | None) -> None:
    """The run's figures as JSON (the README's calibration table is generated from it)."""
    import json
    from pathlib import Path

    cfg = router.config
    secs = cfg.calibration_seconds
    Path(args.results).parent.mkdir(parents=True, exist_ok=True)
    Path(args.results).write_text(json.dumps({
        "command": args.command, "model": args.model, "label": cfg.label, "num_samples": cfg.num_samples,
        "seq_len": cfg.seq_len, "checkpoint_layers": cfg.checkpoint_layers, "exit_threshold": cfg.exit_threshold,
        "wall_s": wall, "peak_rss_gb": peak_gb, "bare_forward_s": bare, "seconds": secs,
        "overhead_vs_bare": (secs["label"] + secs["train"]) / bare if bare else None, "metrics": cfg.metrics,
    }, indent=2))


def cmd_calibrate(args: argparse.Namespace) -> None:
    from .distributed import is_main_process

    bare = bare_forward_seconds(args) if args.compare_bare_forward else None
    started = time.perf_counter()
    _, _, router = _calibrate(args)
    wall = time.perf_counter() - started
    if not is_main_process():  # under `accelerate launch` the main process reports, saves and pushes
        return
    router.save_pretrained(args.output)
    print_metrics(router)
    peak_gb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    print(f"calibration wall time {wall:.1f} s, peak RSS {peak_gb:.2f} GB")
    if bare is not None:
        secs = router.config.calibration_seconds
        extra = secs["label"] + secs["train"]
        print(f"bare forward over the same tokens {bare:.1f} s; labelling + training add {extra:.1f} s "
              f"= {extra / bare:.1%} of it (model body inside calibration: {secs['forward']:.1f} s)")
    print(f"saved to {args.output}")
    if args.results:
        _write_calibration_results(args, router, wall, peak_gb, bare)
    if args.push_to_hub:
        info = router.push_to_hub(args.push_to_hub)
        print(f"pushed to {info.commit_url}")


def cmd_demo(args: argparse.Namespace) -> None:
    from .attach import attach
    from .distributed import is_main_process

    model, tokenizer, router = _calibrate(args)
    if not is_main_process():  # under `accelerate launch` the main process saves and generates
        return
    router.save_pretrained(args.output)
    print_metrics(router)
    print(f"router saved to {args.output}")
    handle = attach(model, router)
    messages = [{"role": "user", "content": args.prompt}]
    inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    out = model.generate(**inputs, max_new_tokens=args.max_new_tokens, do_sample=False)
    print("\nTIDE generation:", tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True))
    print(handle.last_stats.summary())
    if args.stats_png:
        print("exit histogram:", handle.last_stats.plot(args.stats_png))


def cmd_bench(args: argparse.Namespace) -> None:
    from .bench import run

    if not args.kernels and not args.router:
        raise SystemExit("tide-hf bench: --router is required (except with --kernels)")
    run(args)


def cmd_analyze(args: argparse.Namespace) -> None:
    from .analyze import run

    run(args)


def build_parser() -> argparse.ArgumentParser:
    from .config import TideRouterConfig

    parser = argparse.ArgumentParser(prog="tide-hf", description="TIDE early exit for HuggingFace causal LMs")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("calibrate", help="calibrate routers for a model and save them (optionally push to the Hub)")
    _add_calibration_args(p)
    p.add_argument("--output", required=True, help="folder to save the router in")
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
    from .distributed import finish

    args = build_parser().parse_args(argv)
    args.command = shlex.join(["tide-hf", *(sys.argv[1:] if argv is None else argv)])  # recorded in result JSON
    args.func(args)
    finish()  # under `accelerate launch`: every process waits for the others before it exits


if __name__ == "__main__":
    main(sys.argv[1:])
