"""`tide-hf bench gpu`: every GPU goal measured in one call, with one JSON and one Markdown file back.

GPU time is rare here (minutes, and a machine's start costs some of them), so one prepared command measures
everything on a random-weight Llama-3-8B shape in bf16 (no download): every mode's decode time against stock
and the truncated model, eager and compiled static cache, with forced exits for every row or half the rows;
the fused kernels against the device's copy bandwidth; calibration against a bare forward over the same
tokens; speculative mode on a model whose deep layers are near-identity, against stock, transformers'
`assistant_early_exit` and prompt lookup. Sections run in a fixed order (`SECTIONS`), the compiled one last, and
each is caught on its own: a failing section is recorded with its error, the others still run, and the files are
rewritten after every section, so a run cut short still brings back what it measured. The command exits non-zero
when a section failed.

`--dry-run` runs every section's code on a tiny shape on the CPU in about a minute (`DRY_RUN`), so the device
call can only fail on the device; `tests/test_gpu_suite.py` runs it in CI on the current and the floor versions.
"""

from __future__ import annotations

import gc
import json
import platform
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from tide_hf.compat import compile_anywhere
from tide_hf.config import KV_POLICIES
from tide_hf.errors import TideError
from tide_hf.eval.environment import versions

from .synthetic import (
    FIRST_TEXT_ID,
    ROWS_LABEL,
    SEED,
    SHAPES,
    build_model,
    configurations,
    measure,
    recompile_limit,
    row_configurations,
    with_ideal_ratios,
)

TRACEBACK_CHARS = 4000  # the end of a failed section's traceback kept in the JSON


@dataclass(frozen=True)
class SuitePlan:
    """What one run of the suite measures, and how much of it."""

    shape: str  # a `synthetic.SHAPES` key
    dtype: str
    device: str
    batch_sizes: tuple[int, ...]  # eager decoding; batches of 2 rows or more also time per-row exits
    compiled_batch_sizes: tuple[int, ...]  # compiled static cache (each configuration compiles per batch size)
    compiled_configs: tuple[str, ...]  # `synthetic.configurations` keys timed compiled, stock first
    compile_backend: str | None  # None: transformers' default compile (inductor, CUDA graphs)
    prompt_len: int
    new_tokens: int
    reps: int
    kernel_rows: tuple[int, ...]  # rows of the fused-kernel microbenchmark at the shape's hidden size
    calibration_samples: int
    calibration_len: int
    calibration_batch: int
    easy_calibration_samples: int  # the near-identity model's quick top-1 calibration
    speculative_prompts: int
    speculative_new_tokens: int
    speculative_reps: int
    lookup_tokens: int  # prompt_lookup_num_tokens of the prompt-lookup peer


GPU = SuitePlan(shape="llama3-8b", dtype="bfloat16", device="cuda", batch_sizes=(1, 8, 64), compiled_batch_sizes=(1,),
                compiled_configs=("stock", "select-scored", "truncated", "skip-propagate"),  # each compiles anew
                compile_backend=None, prompt_len=128, new_tokens=32, reps=3,
                kernel_rows=(1, 8, 64, 256, 4096, 32768), calibration_samples=2000, calibration_len=256,
                calibration_batch=8, easy_calibration_samples=32, speculative_prompts=3, speculative_new_tokens=64,
                speculative_reps=2, lookup_tokens=10)
DRY_RUN = SuitePlan(shape="tiny", dtype="float32", device="cpu", batch_sizes=(1, 2), compiled_batch_sizes=(1,),
                    compiled_configs=GPU.compiled_configs, compile_backend="eager", prompt_len=8, new_tokens=3,
                    reps=1, kernel_rows=(1, 8), calibration_samples=8, calibration_len=16, calibration_batch=4,
                    easy_calibration_samples=8, speculative_prompts=1, speculative_new_tokens=4, speculative_reps=1,
                    lookup_tokens=2)


@dataclass(frozen=True)
class Goal:
    """One GPU acceptance point: a figure read from the result, met when `at_least` (or `at_most`) holds."""

    name: str
    section: str
    read: Callable[[dict], float | None]
    at_least: float | None = None
    at_most: float | None = None
    fmt: str = ".3f"  # how the figure is written (a ratio; ".1f" for microseconds)


def _depth(plan: SuitePlan) -> int:
    return SHAPES[plan.shape]["num_hidden_layers"] // 2  # a checkpoint of every shape (interval 4)


def _random_ids(plan: SuitePlan, count: int, length: int, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return list(torch.randint(FIRST_TEXT_ID, SHAPES[plan.shape]["vocab_size"], (count, length), generator=gen))


def _compile_config(plan: SuitePlan) -> Any:
    """transformers' `CompileConfig` for the plan's backend (the dry run traces on the CPU without codegen)."""
    if plan.compile_backend is None:
        return None
    from transformers import CompileConfig

    return compile_anywhere(CompileConfig(backend=plan.compile_backend, mode=None))


def eager_section(plan: SuitePlan, model: Any, save: Callable[[dict], None]) -> dict:
    """Every configuration, eager, at each batch size; per-row exits at batches of 2 rows or more."""
    depth, rows = _depth(plan), []
    every = dict(configurations(model, depth).values())
    with torch.inference_mode():
        for bs in plan.batch_sizes:
            configs = every | ({} if bs < 2 else dict(row_configurations(model, depth, bs).values()))
            rows += measure(model, configs, bs, plan.prompt_len, plan.new_tokens, plan.reps, compiled=False)
            save({"depth": depth, "rows": with_ideal_ratios(list(rows), depth)})
    return {"depth": depth, "rows": with_ideal_ratios(rows, depth)}


def compiled_section(plan: SuitePlan, model: Any, save: Callable[[dict], None]) -> dict:
    """The plan's configurations with the static cache, compiled by transformers, one after another (each
    compiles its own graphs); stock is timed first, and the files are rewritten after each configuration."""
    depth, rows = _depth(plan), []
    every = configurations(model, depth)
    config = _compile_config(plan)
    with recompile_limit(), torch.inference_mode():
        for bs in plan.compiled_batch_sizes:
            stock = None
            for key in plan.compiled_configs:
                name, context = every[key]
                row = measure(model, {name: context}, bs, plan.prompt_len, plan.new_tokens, plan.reps,
                              compiled=True, compile_config=config)[0]
                stock = row["ms_per_token"] if key == "stock" else stock
                row["vs_stock"] = stock / row["ms_per_token"] if stock and row["ms_per_token"] > 0 else None
                rows.append(row)
                save({"depth": depth, "rows": with_ideal_ratios(list(rows), depth)})
    return {"depth": depth, "rows": with_ideal_ratios(rows, depth)}


def kernels_section(plan: SuitePlan, model: Any, save: Callable[[dict], None]) -> dict:
    """The fused kernel against the PyTorch path at the shape's hidden size (on a GPU: against the measured
    copy bandwidth and matrix throughput)."""
    from .kernels import GPU_BOTTLENECK, microbench

    hidden = SHAPES[plan.shape]["hidden_size"]
    shapes = [(n, hidden, GPU_BOTTLENECK) for n in plan.kernel_rows]
    return {"rows": microbench(shapes, getattr(torch, plan.dtype), plan.device)}


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


@torch.inference_mode()
def _bare_forward(model: Any, samples: list[torch.Tensor], batch_size: int, device: str) -> float:
    """Seconds of stock forwards (logits included) over `samples` in calibration's batches."""
    _sync(device)
    started = time.perf_counter()
    for i in range(0, len(samples), batch_size):
        ids = torch.stack(samples[i : i + batch_size]).to(device)
        model(input_ids=ids, use_cache=False)
    _sync(device)
    return time.perf_counter() - started


def calibration_section(plan: SuitePlan, model: Any, save: Callable[[dict], None]) -> dict:
    """Calibration with the default settings against bare forwards over the same tokens, timed before and
    after it (the mean is the reference)."""
    from tide_hf.calibration import calibrate_tokens

    samples = _random_ids(plan, plan.calibration_samples, plan.calibration_len, SEED)
    _bare_forward(model, samples[: plan.calibration_batch], plan.calibration_batch, plan.device)  # warm-up
    bare = [_bare_forward(model, samples, plan.calibration_batch, plan.device)]
    _sync(plan.device)
    started = time.perf_counter()
    router = calibrate_tokens(model, samples, batch_size=plan.calibration_batch, progress=False)
    _sync(plan.device)
    total = time.perf_counter() - started
    bare.append(_bare_forward(model, samples, plan.calibration_batch, plan.device))
    return {"label": router.config.label, "exit_head": router.config.exit_head, "samples": plan.calibration_samples,
            "seq_len": plan.calibration_len, "batch_size": plan.calibration_batch, "total_s": total,
            "seconds": router.config.calibration_seconds, "bare_forward_s": bare,
            "total_over_bare": total / (sum(bare) / len(bare))}


def speculative_section(plan: SuitePlan, model: Any, save: Callable[[dict], None]) -> dict:
    """Speculative mode on the model with its layers after half the depth made near-identity (in place: this
    section runs last on the model), against stock, `assistant_early_exit` there and prompt lookup."""
    from tide_hf.calibration import calibrate_tokens

    from .easy import EASY_CALIBRATION_LEN, NEAR_IDENTITY_SCALE, make_near_identity
    from .measure import left_pad
    from .modes import speculative

    keep = _depth(plan)
    make_near_identity(model, keep, NEAR_IDENTITY_SCALE)
    samples = _random_ids(plan, plan.easy_calibration_samples, EASY_CALIBRATION_LEN, SEED + 1)
    router = calibrate_tokens(model, samples, label="top1", progress=False)
    prompts = _random_ids(plan, plan.speculative_prompts, plan.prompt_len, SEED + 2)
    on_device = [{k: v.to(plan.device) for k, v in left_pad([p], 0).items()} for p in prompts]
    batched = {k: v.to(plan.device) for k, v in left_pad(prompts, 0).items()}
    spec = speculative(model, router, on_device, batched, plan.speculative_new_tokens, plan.speculative_reps,
                       assisted_layer=keep, lookup_tokens=plan.lookup_tokens)
    return {"near_identity_after": keep, "near_identity_scale": NEAR_IDENTITY_SCALE, "speculative": spec}


SECTIONS: dict[str, Callable[[SuitePlan, Any, Callable[[dict], None]], dict]] = {
    "kernels": kernels_section, "eager": eager_section, "calibration": calibration_section,
    "speculative": speculative_section, "compiled": compiled_section,
}  # in this order: cheap and certain first; speculative changes the weights, compiled needs none in particular


def _rows(result: dict, section: str, config: str, compiled: bool, batch_sizes: tuple[int, ...] | None = None
          ) -> list[dict]:
    return [r for r in result.get(section, {}).get("rows", []) if r["config"].startswith(config)
            and r["compiled"] == compiled and (batch_sizes is None or r["batch_size"] in batch_sizes)]


def _worst(rows: list[dict], key: str) -> float | None:
    values = [r[key] for r in rows if r.get(key) is not None]
    return min(values) if values else None


def _kernel(result: dict, key: str, rows_at_least: int = 0, rows_at_most: int | None = None) -> float | None:
    rows = [r for r in result.get("kernels", {}).get("rows", []) if key in r and r["rows"] >= rows_at_least
            and (rows_at_most is None or r["rows"] <= rows_at_most)]
    if not rows:
        return None
    values = [r[key] for r in rows]
    return max(values) if rows_at_most is not None else min(values)


def _depth_of(result: dict) -> int | None:
    return result.get("eager", {}).get("depth")


def _speculative(result: dict) -> dict:
    return result.get("speculative", {}).get("speculative", {})


def _lead_over_peers(result: dict) -> float | None:
    spec = _speculative(result)
    peers = [spec.get("assisted_speed_ratio"), spec.get("lookup_speed_ratio")]
    if spec.get("speed_ratio") is None or None in peers:
        return None
    return spec["speed_ratio"] / max(peers)


GOALS = (
    Goal("compiled static select (scored, no exits) vs stock", "compiled",
         lambda r: _worst(_rows(r, "compiled", "select, scored", True), "vs_stock"), at_least=0.97),
    Goal("compiled skip at half depth vs the compiled truncated model", "compiled",
         lambda r: _worst(_rows(r, "compiled", "skip, all exit", True), "vs_ideal"), at_least=0.9),
    *(Goal(f"eager skip at half depth, kv={kv}, of ideal (batch 1 and 8)", "eager",
           lambda r, kv=kv: _worst(_rows(r, "eager", f"skip, all exit at {_depth_of(r)}, kv={kv}", False, (1, 8)),
                                   "vs_ideal"), at_least=0.9) for kv in KV_POLICIES),
    Goal("eager skip, half the rows leave, of ideal (batch 2 to 8; propagate, recompute parking rows)", "eager",
         lambda r: _worst(_rows(r, "eager", ROWS_LABEL, False, tuple(range(2, 9))), "vs_ideal"), at_least=0.9),
    Goal("fused kernel: share of copy bandwidth at >= 4096 rows", "kernels",
         lambda r: _kernel(r, "copy_share", rows_at_least=4096), at_least=0.5),
    Goal("fused kernel: device us per call at <= 256 rows", "kernels",
         lambda r: _kernel(r, "kernel_us", rows_at_most=256), at_most=10.0, fmt=".1f"),
    Goal("calibration time / bare forward", "calibration",
         lambda r: r.get("calibration", {}).get("total_over_bare"), at_most=1.5),
    Goal("speculative vs stock on the easy model", "speculative",
         lambda r: _speculative(r).get("speed_ratio"), at_least=1.3),
    Goal("speculative over the faster peer (assistant_early_exit, prompt lookup)", "speculative",
         _lead_over_peers, at_least=1.0),
)


def goals(result: dict) -> list[dict]:
    """Each goal with its figure and whether it is met (None: its section did not measure it here)."""
    out = []
    for goal in GOALS:
        figure = goal.read(result)
        met = None if figure is None else ((goal.at_least is None or figure >= goal.at_least)
                                          and (goal.at_most is None or figure <= goal.at_most))
        out.append({"goal": goal.name, "section": goal.section, "figure": figure, "at_least": goal.at_least,
                    "at_most": goal.at_most, "met": met, "format": goal.fmt})
    return out


def run_suite(out: Path, dry_run: bool, command: str) -> dict:
    """Run every section of the plan (`DRY_RUN` on the CPU, else `GPU`), rewriting `out`/gpu.json and gpu.md
    after each; `TideError` at the end naming the sections that failed (their errors are in the JSON)."""
    from tide_hf.kernels import active_backend

    from .tables import format_gpu_suite

    plan = DRY_RUN if dry_run else GPU
    if not dry_run and not torch.cuda.is_available():
        raise TideError("tide-hf bench gpu: no CUDA device here; `--dry-run` runs the suite's code on the CPU")
    started = time.perf_counter()
    device = torch.cuda.get_device_name() if plan.device == "cuda" else platform.processor() or "cpu"
    result: dict[str, Any] = {"device": device, "dry_run": dry_run, "command": command, "versions": versions(),
                              "kernels_backend": active_backend(torch.device(plan.device)), "plan": asdict(plan),
                              "seconds": {}, "errors": {}}

    def write(name: str | None = None, partial: dict | None = None) -> None:
        if name is not None:
            result[name] = partial
        result["wall_s"] = time.perf_counter() - started
        result["goals"] = goals(result)
        out.mkdir(parents=True, exist_ok=True)
        (out / "gpu.json").write_text(json.dumps(result, indent=2))
        (out / "gpu.md").write_text(format_gpu_suite(result) + "\n")

    model = build_model(plan.shape, plan.device, getattr(torch, plan.dtype))
    for name, section in tqdm(SECTIONS.items(), desc="gpu suite"):
        section_started = time.perf_counter()
        try:
            if name == "compiled":  # the speculative section scaled the deep layers: compile the stock model
                del model
                gc.collect()
                model = build_model(plan.shape, plan.device, getattr(torch, plan.dtype))
            write(name, section(plan, model, lambda partial, name=name: write(name, partial)))
        except Exception as err:  # noqa: BLE001 - a section's failure must not lose the others' figures
            result["errors"][name] = "".join(traceback.format_exception(err))[-TRACEBACK_CHARS:]
            tqdm.write(f"gpu suite: section {name} failed: {type(err).__name__}: {err}")
        result["seconds"][name] = time.perf_counter() - section_started
        write()
    print(format_gpu_suite(result))
    if result["errors"]:
        raise TideError(f"gpu suite: section(s) {', '.join(result['errors'])} failed; their tracebacks are in "
                        f"{out / 'gpu.json'} (the other sections' figures are kept)")
    return result
