"""`tide-hf demo`: routers for the embedded SmolLM2 (calibrated on SOTU once, then reused from the cache), one
prompt answered by stock generate and by TIDE, each on eager and on the fast linear path (`fast_linears`), timed
interleaved, and side by side: text, tokens/s (median and range), ratios against stock, what each step did,
agreement with stock. Its calibration settings come with `args` (fixed by the CLI:
`tide_hf.cli.demo.DEMO_CALIBRATION`).

The demo attaches with `attach`'s defaults (what a user gets with no options), or with `--mode`.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm
from transformers.generation.streamers import BaseStreamer

from ..assets import DEFAULT_MODEL, DEFAULT_TEXT, cache_dir, default_dataset, load_model
from ..calibration.command import calibrate_from_args, print_metrics
from ..calibration.distributed import is_main_process, process_device
from ..compat import cache_in, with_cache
from ..errors import PlottingUnavailable, TideArgumentError
from ..integrations import attach
from ..kernels import build_in_background
from ..modeling import TideRouter, get_adapter
from ..modeling.files import check_save_target
from ..runtime import fast_linears
from ..runtime.stats import aside_line, pricing_line
from .tables import percent

# Options that change what the demo shows, not the router it calibrates (left out of the cache key).
NOT_CALIBRATION = {"output", "recalibrate", "prompt", "max_new_tokens", "repeats", "mode", "func", "command"}
ROUTER_FILES = ("config.json", "model.safetensors")
CACHE_KEY_CHARS, MODEL_SLUG_CHARS = 12, 40  # the cache folder's name: a hash of the settings, the model's name
# Calibration settings (TideRouterConfig names) a reused `--output` router must have been made with.
COMPARED = ("label", "exit_head", "exit_head_rank", "exit_head_ridge", "num_samples", "seq_len", "continuation",
            "continuation_prompt_len", "checkpoint_interval", "convergence_threshold", "kl_threshold", "num_epochs",
            "early_stopping_patience", "max_train_tokens", "exit_threshold", "min_layers", "min_agreement",
            "confidence", "seed")


def local_files(name: Any) -> Any:
    """What a local model or text path stands for in the cache key: its absolute path and each file's name, size
    and modification time (a relative path named other text from another folder, and a folder given new weights
    kept its key); an alias or a Hub id stands for itself."""
    path = Path(os.path.expanduser(str(name)))
    if name in (None, DEFAULT_MODEL, DEFAULT_TEXT) or not path.exists():
        return name
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    return [os.path.abspath(path), *[(p.relative_to(path).as_posix(), p.stat().st_size, p.stat().st_mtime_ns)
                                     for p in files]]


def router_folder(args: argparse.Namespace) -> Path:
    """`--output`, else a folder under the tide_hf cache keyed by the model and every calibration setting."""
    if args.output:
        return Path(os.path.abspath(args.output))  # "." and ".." name a folder too
    settings = {k: local_files(v) if k in ("model", "dataset") else v
                for k, v in sorted(vars(args).items()) if k not in NOT_CALIBRATION}
    key = hashlib.sha256(json.dumps(settings, sort_keys=True, default=str).encode()).hexdigest()[:CACHE_KEY_CHARS]
    slug = "".join(c if c.isalnum() or c in "-_." else "-" for c in str(args.model))[-MODEL_SLUG_CHARS:]
    return cache_dir() / "demo" / f"router-{slug}-{key}"


def is_complete(folder: Path) -> bool:
    """A router folder written to the end (routers are moved into place only once complete)."""
    return all((folder / name).is_file() for name in ROUTER_FILES)


def differences(router: TideRouter, args: argparse.Namespace) -> list[str]:
    """The demo's calibration settings that the stored router was not calibrated with (its text
    included). A router may hold fewer samples than asked for (the text ran out, or held-out documents took
    them), never more; no min_layers means the first checkpoint; no continuation means the corpus as
    written."""
    cfg = router.config
    wanted = {name: getattr(args, name, None) for name in COMPARED}
    wanted["dataset"] = default_dataset(getattr(args, "dataset", None))  # as calibration records it
    if wanted["min_layers"] is None:
        wanted["min_layers"] = min(cfg.checkpoint_layers)
    changed = [name for name, value in wanted.items()
               if (value is not None or name == "continuation") and value != getattr(cfg, name)]
    if "num_samples" in changed and cfg.num_samples < args.num_samples:
        changed.remove("num_samples")
    return [f"{name}={wanted[name]} (router: {getattr(cfg, name)})" for name in changed]


def get_router(args: argparse.Namespace) -> tuple[Any, Any, TideRouter | None, bool]:
    """(model, tokenizer, router, reused): the cached router when its folder is complete, else a calibrated one
    (saved to the folder). The router is None on the non-main processes of `accelerate launch`. An `--output`
    folder is checked before calibration: a folder holding anything but a TIDE router is refused, and one
    holding a router made with other settings is neither reused nor replaced without `--recalibrate`."""
    folder = router_folder(args)
    recalibrate = getattr(args, "recalibrate", False)
    if is_complete(folder) and not recalibrate:
        router = TideRouter.from_pretrained(folder)
        changed = differences(router, args) if args.output else []
        if changed:
            raise TideArgumentError(f"{folder} holds a router calibrated with other settings: {', '.join(changed)}; "
                                    "pass --recalibrate to replace it, or choose another --output")
        print(f"tide_hf demo: reusing the router calibrated earlier in {folder} (--recalibrate to redo)")
        model, tokenizer = load_model(args.model, args.dtype)
        return model, tokenizer, router, True
    if not args.output and folder.exists() and not is_complete(folder):  # the cache's own, left by a killed run
        shutil.rmtree(folder)
    if not args.output:  # a histogram older versions drew into the cache folder, not a router file
        (folder / "exits.png").unlink(missing_ok=True)
    check_save_target(folder, overwrite=True)  # only a router may be replaced: refused before the work
    if is_main_process():  # the compiler runs beside calibration (the first attach waits for it)
        build_in_background(process_device())
    print(f"tide_hf demo: calibrating routers on {args.num_samples} samples x {args.seq_len} tokens "
          f"(once; cached in {folder})")
    model, tokenizer, router = calibrate_from_args(args)
    if not is_main_process():  # under `accelerate launch` the main process saves and generates
        return model, tokenizer, None, False
    router.save_pretrained(folder, overwrite=True)  # written next to the folder, then moved into place
    return model, tokenizer, router, False


class TokenBar(BaseStreamer):
    """A progress bar over generated tokens (the first `put` is the prompt)."""

    def __init__(self, total: int, desc: str) -> None:
        self.bar, self.prompt_seen = tqdm(total=total, desc=desc, unit="tok", leave=False), False

    def put(self, value: torch.Tensor) -> None:
        if self.prompt_seen:
            self.bar.update(value.numel())
        self.prompt_seen = True

    def end(self) -> None:
        self.bar.close()


def timed_generate(model: Any, inputs: dict, new_tokens: int, desc: str) -> tuple[torch.Tensor, float]:
    """Greedy new tokens of one prompt and the seconds they took."""
    started = time.perf_counter()
    out = model.generate(**inputs, max_new_tokens=new_tokens, do_sample=False,
                         streamer=TokenBar(new_tokens, desc))
    return out[0, inputs["input_ids"].shape[1]:], time.perf_counter() - started


def teacher_forced_top1(model: Any, inputs: dict, reference: torch.Tensor) -> float:
    """Share of stock's generated tokens that the attached model also ranks first, each given stock's prefix: the
    prompt, then stock's tokens fed one at a time, so each token is decided in a decode step of its own, as in
    generation (skip mode takes exits only where they stop a step: a whole sequence at once would exit none)."""
    agree = 0
    with torch.no_grad():
        out = model(input_ids=inputs["input_ids"][:1], use_cache=True)
        for position, token in enumerate(reference):
            agree += int(out.logits[0, -1].argmax() == token)
            if position + 1 < len(reference):
                out = model(**with_cache({"input_ids": token.reshape(1, 1), "use_cache": True}, cache_in(out)))
    return agree / max(len(reference), 1)


# The demo's runs, timed in this order in each repeat: (name, label, on the fast linear path, TIDE attached)
RUNS = (("stock", "stock", False, False), ("fast", "stock, fast linears", True, False),
        ("tide", "TIDE", False, True), ("tide_fast", "TIDE, fast linears", True, True))
SAME_PATH = {"stock": "stock", "fast": "fast", "tide": "stock", "tide_fast": "fast"}  # each run's stock


def mode_option(mode: str | None) -> dict[str, str]:
    """attach's keyword for the demo's `--mode` (None: attach's default)."""
    return {} if mode is None else {"mode": mode}


@contextmanager
def run_setup(model: Any, router: TideRouter, fast: bool, tide: bool, mode: str | None) -> Iterator[Any]:
    """The model as one of the demo's runs uses it: on the fast linear path or not, TIDE attached or not (the
    handle, else None); everything undone afterwards."""
    with ExitStack() as stack:
        if fast:  # (a LinearPathWarning for layers left eager shows once: Python's default filter)
            stack.enter_context(fast_linears(model))
        yield stack.enter_context(attach(model, router, **mode_option(mode))) if tide else None


def drafts(stats: Any) -> dict[str, Any] | None:
    """Speculative mode's drafting figures of one call (None in other modes): rounds per source, plain steps,
    drafted and accepted tokens, and why it ran stock generate instead (None: it drafted)."""
    spec = stats.speculative
    if spec is None:
        return None
    rounds = {name: source["rounds"] for name, source in spec["sources"].items()}
    return {"rounds": rounds, "plain_steps": spec["plain_steps"], "drafted": spec["drafted"],
            "accepted": spec["accepted"], "fallback": spec["fallback"]}


def compare(model: Any, tokenizer: Any, router: TideRouter, prompt: str, new_tokens: int, repeats: int,
            mode: str | None = None) -> dict[str, Any]:
    """Stock and TIDE (attached with `mode`; None: attach's default), each on eager and on the fast linear path,
    on the same prompt: their texts, tokens/s (each timed `repeats` times, interleaved in `RUNS` order after one
    warm-up each, so drifts of the machine's speed reach all alike), what each step did and agreement."""
    inputs = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                           return_tensors="pt", return_dict=True)
    num_layers = get_adapter(model).num_layers
    for *_, fast, tide in RUNS:  # warm-up: first-call costs (kernel builds, packing) out of the timing
        with run_setup(model, router, fast, tide, mode):
            model.generate(**inputs, max_new_tokens=2, do_sample=False)
    speeds: dict[str, list[float]] = {name: [] for name, *_ in RUNS}
    tokens, handles = {}, {}
    for i in range(repeats):
        for name, label, fast, tide in RUNS:
            with run_setup(model, router, fast, tide, mode) as handle:
                tokens[name], seconds = timed_generate(model, inputs, new_tokens, f"{label} {i + 1}/{repeats}")
                speeds[name].append(len(tokens[name]) / seconds)
                if handle is not None:
                    handles[name] = (handle.last_stats, handle.options)
    with attach(model, router, **mode_option(mode)):  # outside the timed runs
        top1 = teacher_forced_top1(model, inputs, tokens["stock"])
    stock = tokens["stock"]
    runs = {}
    for name, label, *_ in RUNS:
        n = min(len(stock), len(tokens[name]))
        same = (stock[:n] == tokens[name][:n]).tolist()
        runs[name] = {"label": label, "text": tokenizer.decode(tokens[name], skip_special_tokens=True),
                      "tokens": len(tokens[name]), "tok_s": statistics.median(speeds[name]),
                      "tok_s_runs": speeds[name], "layers": float(num_layers),
                      "same_tokens": sum(same) / max(len(stock), 1),
                      "first_difference": next((i for i, s in enumerate(same) if not s), None),
                      "vs_stock": [t / s for s, t in zip(speeds["stock"], speeds[name])],
                      "vs_same_path": [t / s for s, t in zip(speeds[SAME_PATH[name]], speeds[name])]}
        if name in handles:
            stats = handles[name][0]
            runs[name].update(layers=stats.decode.mean_executed, exit_rate=stats.decode.exit_rate,
                              drafts=drafts(stats))
    stats, options = handles["tide"]
    return {**runs, "pair_ratios": runs["tide"]["vs_stock"], "num_layers": num_layers,
            "same_tokens": runs["tide"]["same_tokens"], "first_difference": runs["tide"]["first_difference"],
            "top1": top1, "stats": stats, "pricing": stats.pricing, "aside": stats.aside,
            "target": options.target, "mode": options.mode,
            "reason": options.reason, "kv": options.kv, "calibration_text": router.config.dataset}


def describe_target(target: dict[str, float] | None, calibration_text: str | None) -> str:
    """The quality the attached thresholds were chosen to keep, in words."""
    if not target:
        return "quality target: none (the router's global exit threshold)"
    goals = []
    if "min_agreement" in target:
        goals.append(f">= {percent(target['min_agreement'])} top-1 agreement with stock")
    if "max_perplexity_increase" in target:
        goals.append(f"<= +{percent(target['max_perplexity_increase'])} perplexity")
    return (f"quality target: {' and '.join(goals)}, held with {percent(target['confidence'])} confidence on text like "
            f"the calibration text ({calibration_text or 'unnamed'}); other text may differ")


def why_slower(result: dict[str, Any]) -> str:
    """Why TIDE's median was below stock's on this machine, from what the run measured."""
    t, n = result["tide"], result["num_layers"]
    if result["mode"] == "speculative":
        d = t["drafts"]
        if d["fallback"] is not None:
            return f"why TIDE is slower here: it ran stock generate ({d['fallback']}), plus its own checks"
        rounds = sum(d["rounds"].values())
        return (f"why TIDE is slower here: it drafted in {rounds} rounds beside {d['plain_steps']} plain steps, and "
                f"{d['accepted']} of {d['drafted']} drafted tokens were accepted; a rejected draft still costs its "
                "verification, a forward over several tokens")
    saved = 1 - t["layers"] / n
    text = (f"why TIDE is slower here: {t['exit_rate']:.0%} of tokens exited, so at most {saved:.0%} of the layer "
            "runs were skipped in their own step")
    if result["mode"] == "skip" and result["kv"] == "recompute":
        text += ("; under kv='recompute' those layers still run at the next step, beside the new token, so what "
                 "is saved is only what running two tokens together costs less than running them apart")
    return text + (", which did not cover TIDE's own work per step here (router scores, exit decisions, cache "
                   "bookkeeping). Skip mode saves time where more tokens exit, or where a step's cost is reading "
                   "weights (a GPU).")


def ratio_range(ratios: list[float]) -> str:
    """A run's speed against another's, pair by pair: the lowest and highest ratio."""
    return f"{min(ratios):.2f}x - {max(ratios):.2f}x"


def work_row(run: dict[str, Any], result: dict[str, Any]) -> str:
    """What a run did per decode step: every layer (stock), exits (skip, select) or drafts (speculative)."""
    n = result["num_layers"]
    if "exit_rate" not in run:
        return f"{run['layers']:.2f}/{n} layers"
    d = run.get("drafts")
    if d is not None:
        if d["fallback"] is not None:
            return "stock generate ran (see below)"
        rounds = ", ".join(f"{name} {count}" for name, count in d["rounds"].items())
        return f"{d['accepted']}/{d['drafted']} drafts accepted; rounds: {rounds}"
    later = "; run later" if result["mode"] == "skip" and result["kv"] == "recompute" else ""
    return f"{run['layers']:.2f}/{n} layers, {run['exit_rate']:.0%} exited{later}"


def print_comparison(result: dict[str, Any]) -> None:
    """The runs' answers and figures, side by side: the table first, then the mode, the target and the texts."""
    names = [name for name, *_ in RUNS]
    runs = [result[name] for name in names]
    first = result["tide"]["first_difference"]
    rows = [
        ("", *[run["label"] for run in runs]),
        (f"tokens/s, median of {len(runs[0]['tok_s_runs'])}", *[f"{run['tok_s']:.1f}" for run in runs]),
        ("tokens/s, slowest - fastest", *[f"{min(run['tok_s_runs']):.1f} - {max(run['tok_s_runs']):.1f}"
                                          for run in runs]),
        ("vs stock, median of pairs", *[f"{statistics.median(run['vs_stock']):.2f}x" for run in runs]),
        ("vs stock, each pair", *[ratio_range(run["vs_stock"]) for run in runs]),
        ("vs stock on its path, median", *[f"{statistics.median(run['vs_same_path']):.2f}x" for run in runs]),
        ("per decode step", *[work_row(run, result) for run in runs]),
        ("tokens equal to stock's", *[f"{run['same_tokens']:.0%}" for run in runs]),
    ]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    print()
    for row in rows:
        print("  ".join(f"{cell:<{widths[i]}}" if i == 0 else f"{cell:>{widths[i]}}" for i, cell in enumerate(row)))
    print(f"\nTIDE: mode={result['mode']}" + (f", kv={result['kv']}" if result["mode"] == "skip" else "")
          + f" ({result['reason']})")
    if first is not None:
        print(f"TIDE's first token that differs from stock's: token {first + 1}")
    print(f"top-1 agreement of TIDE given stock's prefix: {result['top1']:.0%}")
    if result.get("pricing") is not None:  # skip mode at a quality target: what pricing and step aside did
        print(f"TIDE pricing: {pricing_line(result['pricing'])}")
    if result.get("aside") is not None:
        print(f"TIDE step aside: {aside_line(result['aside'])}")
    if result["tide"]["tok_s"] < result["stock"]["tok_s"]:
        print(f"\n{why_slower(result)}")
    if result["mode"] != "speculative":
        print(f"\n{describe_target(result['target'], result['calibration_text'])}")
    print(f"\nstock: {result['stock']['text']!r}\nTIDE:  {result['tide']['text']!r}")


def demo_record(result: dict[str, Any], seconds: dict[str, float], reused: bool, command: str) -> dict[str, Any]:
    """What the demo measured, as JSON: the comparison (without the stats object), the wall seconds of each phase
    and whether the router came from the cache (the docs cite the demo's figures from this file)."""
    record = {k: v for k, v in result.items() if k != "stats"}
    return {"command": command, "torch_threads": torch.get_num_threads(), "router_reused": reused,
            "seconds": seconds, **record}


def run(args: argparse.Namespace) -> None:
    """Routers (cached or calibrated), then stock and TIDE on one prompt, side by side; the exit histogram; the
    figures in a JSON beside the router (`<router folder>-demo.json`)."""
    started = time.perf_counter()
    model, tokenizer, router, reused = get_router(args)
    if router is None:
        return
    folder = router_folder(args)
    if not reused:
        print_metrics(router)
    print(f"router: {folder}")
    ready = time.perf_counter()
    result = compare(model, tokenizer, router, args.prompt, args.max_new_tokens, args.repeats, args.mode)
    seconds = {"model_and_router": ready - started, "timed_pairs": time.perf_counter() - ready}
    record = folder.with_name(f"{folder.name}-demo.json")
    record.parent.mkdir(parents=True, exist_ok=True)
    record.write_text(json.dumps(demo_record(result, seconds, reused, getattr(args, "command", "tide-hf demo")),
                                 indent=2))
    print_comparison(result)
    print(f"figures: {record}")
    png = folder.with_name(f"{folder.name}-exits.png")  # beside the router: its folder holds the router only
    try:
        print("exit histogram:", result["stats"].plot(png))
    except PlottingUnavailable as err:
        print(f"exit histogram skipped: {err}")
