"""The `tide-hf calibrate` command: load, calibrate, save, report (and optionally time stock forwards over the
same tokens, write the figures as JSON, push to the Hub)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import time
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from ..assets import default_dataset, load_model
from ..errors import TideArgumentError
from ..modeling import TideRouter
from ..modeling.files import check_save_target, check_writable
from ..modeling.hub import check_repo_id
from ..settings import SAMPLING_FIELDS, CalibrationConfig
from .data import load_texts
from .distributed import is_main_process, to_process_device
from .pipeline import calibrate, check_calibrate_args, model_config
from .samples import make_samples, pad_right

# The `CalibrationConfig` fields past the sampling that the command line's arguments may hold (a flag of the same
# name, or `calibrate --set KEY=VALUE`); those not held keep CalibrationConfig's defaults.
CONFIG_OPTIONS = tuple(f.name for f in dataclasses.fields(CalibrationConfig) if f.name not in SAMPLING_FIELDS)


def config_options(args: argparse.Namespace) -> dict[str, Any]:
    """The router fields `args` sets (`CONFIG_OPTIONS` it holds: calibrate's flags and --set's keys, or every
    setting of the demo)."""
    return {name: value for name, value in vars(args).items() if name in CONFIG_OPTIONS}


def calibrate_from_args(args: argparse.Namespace) -> tuple[Any, Any, TideRouter]:
    """Load the model named by `args` and calibrate routers for it as the arguments say."""
    model, tokenizer = load_model(args.model, args.dtype)
    model = to_process_device(model)  # under `accelerate launch`: this process's GPU
    router = calibrate(
        model, tokenizer, default_dataset(args.dataset),
        dataset_config=args.dataset_config, split=args.split, text_field=args.text_field,
        num_samples=args.num_samples, seq_len=args.seq_len, batch_size=args.batch_size,
        **config_options(args),
    )
    return model, tokenizer, router


def print_metrics(router: TideRouter) -> None:
    """The per-checkpoint validation table, the draft vocabulary's coverage and the calibration's timings."""
    cfg = router.config
    served = (f"attach() serves its default target min_agreement={cfg.min_agreement} at confidence "
              f"{cfg.confidence}" if cfg.exit_paths and cfg.min_agreement is not None
              else f"attach() serves exit_threshold={cfg.exit_threshold}")
    print(f"\nrouter: label={cfg.label}, exit_head={cfg.exit_head}, checkpoints={cfg.checkpoint_layers}; {served}; "
          f"precision and recall below at exit_threshold={cfg.exit_threshold}")
    print(f"{'layer':>5} {'pos.rate':>8} {'precision':>9} {'recall':>7} {'AUC':>6} {'pred.rate':>9}")
    for k in cfg.checkpoint_layers:
        m = cfg.metrics[str(k)]
        cells = [m.get(f) for f in ("positive_rate", "precision", "recall", "auc", "predicted_rate")]
        print(f"{k:>5} " + " ".join(f"{'n/a' if v is None else f'{v:.3f}':>8}" for v in cells))
    if cfg.draft_vocab_coverage:
        print("draft vocabulary, held-out coverage by size:",
              ", ".join(f"{n} {share:.1%}" for n, share in cfg.draft_vocab_coverage.items()))
    print("seconds:", {k: round(v, 1) for k, v in cfg.calibration_seconds.items()})


def bare_forward_seconds(args: argparse.Namespace) -> float:
    """Wall time of stock forward passes (logits included) over exactly the tokens calibration will see (the
    calibration options are checked against the model first, so a bad one fails before this pass)."""
    model, tokenizer = load_model(args.model, args.dtype)
    model_config(model, args.seq_len, config_options(args))
    texts = load_texts(default_dataset(args.dataset), dataset_config=args.dataset_config, split=args.split,
                       text_field=args.text_field)
    samples = make_samples(tokenizer, texts, args.num_samples, args.seq_len, args.seed)
    started = time.perf_counter()
    with torch.no_grad():
        for i in tqdm(range(0, len(samples), args.batch_size), desc="bare forward", unit="batch"):
            ids, mask = pad_right(samples[i : i + args.batch_size], 0)
            model(input_ids=ids, attention_mask=mask, use_cache=False)
    return time.perf_counter() - started


def write_calibration_results(args: argparse.Namespace, router: Any, wall: float, peak_gb: float,
                               bare: float | None) -> None:
    """The run's figures as JSON (the results page's calibration table is generated from it)."""
    cfg = router.config
    secs = cfg.calibration_seconds
    Path(args.results).parent.mkdir(parents=True, exist_ok=True)
    Path(args.results).write_text(json.dumps({
        "command": args.command, "model": args.model, "label": cfg.label, "num_samples": cfg.num_samples,
        "seq_len": cfg.seq_len, "checkpoint_layers": cfg.checkpoint_layers, "exit_threshold": cfg.exit_threshold,
        "wall_s": wall, "peak_rss_gb": peak_gb, "bare_forward_s": bare, "seconds": secs,
        "overhead_vs_bare": (secs["label"] + secs["train"]) / bare if bare else None, "metrics": cfg.metrics,
        "draft_vocab_coverage": cfg.draft_vocab_coverage, "continuation": cfg.continuation,
        "continuation_prompt_len": cfg.continuation_prompt_len if cfg.continuation else None,
    }, indent=2))


def check_apart(results: Path, output: Path) -> None:
    """--results lies outside --output: the router folder holds the router only (a results file there would
    overwrite its config.json, or make a later --overwrite refuse the folder)."""
    res, out = Path(os.path.realpath(results)), Path(os.path.realpath(output))
    if out == res or out in res.parents or res in out.parents:
        raise TideArgumentError(f"--results {results} and --output {output} overlap: the output folder holds the "
                                "router and nothing else; write the results file outside it")


def run(args: argparse.Namespace) -> None:
    """The `tide-hf calibrate` command: calibrate, save, print metrics; optionally results JSON and push."""
    overwrite = getattr(args, "overwrite", False)
    # before loading anything or hours of calibration, not after
    check_calibrate_args(num_samples=args.num_samples, seq_len=args.seq_len, batch_size=args.batch_size,
                         config_kwargs=config_options(args))
    check_save_target(Path(args.output), overwrite)
    check_writable(Path(args.output), "--output", folder=True)
    if args.results:
        check_writable(Path(args.results), "--results", folder=False)
        check_apart(Path(args.results), Path(args.output))
    if args.push_to_hub:
        check_repo_id(args.push_to_hub, "--push-to-hub")
    bare = bare_forward_seconds(args) if args.compare_bare_forward else None
    started = time.perf_counter()
    _, _, router = calibrate_from_args(args)
    wall = time.perf_counter() - started
    if not is_main_process():  # under `accelerate launch` the main process reports, saves and pushes
        return
    router.save_pretrained(args.output, overwrite=overwrite)
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
        write_calibration_results(args, router, wall, peak_gb, bare)
    if args.push_to_hub:
        info = router.push_to_hub(args.push_to_hub)
        print(f"pushed to {info.commit_url}")
