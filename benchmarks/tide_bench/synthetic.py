"""`tide-hf bench synthetic SHAPE`: TIDE's cost and savings on a real architecture shape, random weights.

Anyone with a GPU reproduces the speed table in minutes, with no download: the model is built from a
config (Llama-3-8B: 32 layers, hidden 4096, GQA 8, vocab 128256) with random weights directly on the
device. Random weights carry no signal for routers to read, so exits are forced: a router whose score is
constant (never / always above the threshold) exercises exactly the runtime work of real decisions
(scoring every checkpoint, or every token leaving at one depth) without claiming anything about quality.

Per decode token, eager and compiled (`cache_implementation="static"`, which transformers compiles):
stock, attached with exits off, select mode scoring every checkpoint with no exits, select and skip mode
with every token leaving at `depth`, and the ideal: the same model truncated to `depth` layers. The time
of one decode token is (T(prompt + n tokens) - T(prompt + 1 token)) / (n - 1), both timed in each
repetition, and the median over repetitions is reported. Eager configurations are interleaved repetition
by repetition; compiled ones are timed one after another, each staying attached through its compiling
warm-up and its repetitions (a re-attach would compile anew).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import torch
from tqdm.auto import tqdm

from tide_hf.config import TideRouterConfig, default_checkpoints
from tide_hf.errors import TideArgumentError
from tide_hf.integrations import attach, attach_with
from tide_hf.modeling import TideRouter
from tide_hf.modeling.fingerprint import model_fingerprint
from tide_hf.record import CLOSED

from .measure import check_exit_depths
from .modes import forced_rows, truncated

SHAPES: dict[str, dict[str, Any]] = {
    "llama3-8b": {"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                  "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
                  "rope_theta": 500000.0, "max_position_embeddings": 8192},
    "qwen2-0.5b": {"hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24, "num_attention_heads": 14,
                   "num_key_value_heads": 2, "vocab_size": 151936, "rope_theta": 1000000.0,
                   "max_position_embeddings": 32768, "tie_word_embeddings": True},  # a large vocabulary, a small body
    "tiny": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 8, "num_attention_heads": 4,
             "num_key_value_heads": 2, "vocab_size": 256, "max_position_embeddings": 512},  # CPU smoke test
}
CONSTANT_LOGIT = 30.0  # a router logit of +-30: score 1.0 / 0.0 in fp32, far from any threshold
THRESHOLD = 0.5
SEED = 0  # random weights and prompts: every run of one shape measures the same model on the same tokens
SPECIAL_IDS = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
FIRST_TEXT_ID = max(SPECIAL_IDS.values()) + 1  # random prompts draw from the ids after the special ones
ROWS_LABEL = "skip, half the rows leave at"  # forced per-row exits: the even rows leave, the odd run every layer
RECOMPILE_LIMIT = 64  # each configuration compiles graphs of its own; dynamo's default limit (8) is too low


def build_model(shape: str, device: str, dtype: torch.dtype) -> Any:
    """A Llama of `shape` with random weights, built directly on `device` in `dtype` (no fp32 copy)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(SEED)
    config = LlamaConfig(**SHAPES[shape], **SPECIAL_IDS)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    return model.eval()


def constant_router(model: Any, logit: float) -> TideRouter:
    """Routers whose score is sigmoid(`logit`) for every token (the fused kernel still runs in full)."""
    config = model.config
    router = TideRouter(TideRouterConfig(
        hidden_size=config.hidden_size, num_hidden_layers=config.num_hidden_layers,
        base_architecture=type(model).__name__,
        base_fingerprint=model_fingerprint(model), exit_head="lens"))
    with torch.no_grad():
        for mlp in router.routers.values():
            mlp.fc2.weight.zero_()
            mlp.fc2.bias.fill_(logit)
    return router.to(next(model.parameters()).device)


def configurations(model: Any, depth: int) -> dict[str, tuple[str, Callable[[], AbstractContextManager]]]:
    """Key (the CLI's `--configs` choices) -> (table name, a context in which `generate` runs that configuration)."""
    never, always = constant_router(model, -CONSTANT_LOGIT), constant_router(model, CONSTANT_LOGIT)

    def attached(router: TideRouter, **options: Any) -> Callable[[], AbstractContextManager]:
        return lambda: attach(model, router, **options)

    return {
        "stock": ("stock", nullcontext),
        "exits-off": ("exits off", attached(never, exit_threshold=CLOSED, mode="select")),
        "select-scored": ("select, scored, no exits", attached(never, exit_threshold=THRESHOLD, mode="select")),
        "select-exit": (f"select, all exit at {depth}", attached(always, exit_threshold=THRESHOLD, min_layers=depth,
                                                                  mode="select")),
        "skip-recompute": (f"skip, all exit at {depth}, kv=recompute",
                           attached(always, exit_threshold=THRESHOLD, min_layers=depth, mode="skip", kv="recompute")),
        "skip-propagate": (f"skip, all exit at {depth}, kv=propagate",
                           attached(always, exit_threshold=THRESHOLD, min_layers=depth, mode="skip", kv="propagate")),
        "truncated": (f"truncated to {depth} (ideal)", lambda: truncated(model, depth)),
    }


def row_configurations(model: Any, depth: int, batch_size: int
                       ) -> dict[str, tuple[str, Callable[[], AbstractContextManager]]]:
    """Skip mode with forced per-row exits, kv="propagate" (kv="recompute" runs the batch whole until every row
    has exited): at every step the even rows of a `batch_size` batch leave at
    `depth` and the odd ones run every layer (what a batch of unequal rows costs)."""
    handle_class = forced_rows(torch.arange(batch_size) % 2 == 0)
    router = constant_router(model, -CONSTANT_LOGIT)  # its scores are replaced by the forced ones
    policies = {"propagate": ("kv=propagate", {"kv": "propagate"})}
    return {f"rows-{key}": (f"{ROWS_LABEL} {depth}, {label}",
                            lambda options=options: attach_with(handle_class, model, router, exit_threshold=THRESHOLD,
                                                                min_layers=depth, mode="skip", **options))
            for key, (label, options) in policies.items()}


def _generate(model: Any, ids: torch.Tensor, new_tokens: int, compiled: bool, compile_config: Any = None) -> float:
    """Wall seconds of one greedy generate call (device synchronized before and after). `compile_config`:
    transformers' `CompileConfig` of a compiled call (None: generate's default)."""
    kwargs: dict[str, Any] = {"cache_implementation": "static"} if compiled else {}
    if compiled and compile_config is not None:
        kwargs["compile_config"] = compile_config
    sync = torch.cuda.synchronize if ids.is_cuda else (lambda: None)
    sync()
    start = time.perf_counter()
    model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                   min_new_tokens=new_tokens, do_sample=False, pad_token_id=SPECIAL_IDS["pad_token_id"], **kwargs)
    sync()
    return time.perf_counter() - start


@contextmanager
def recompile_limit() -> Iterator[None]:
    """Dynamo's recompile limit raised to RECOMPILE_LIMIT for the block: each configuration compiles its own."""
    import torch._dynamo

    previous = torch._dynamo.config.recompile_limit
    torch._dynamo.config.recompile_limit = max(previous, RECOMPILE_LIMIT)
    try:
        yield
    finally:
        torch._dynamo.config.recompile_limit = previous


def measure(model: Any, configs: dict[str, Callable[[], AbstractContextManager]], batch_size: int, prompt_len: int,
            new_tokens: int, reps: int, compiled: bool, compile_config: Any = None) -> list[dict]:
    """Median ms per decode token of each configuration, interleaved over `reps` repetitions; `vs_stock` where
    `configs` holds "stock".

    Compiled: each configuration stays attached through its own warm-up and timed runs, one after another
    (attaching anew would compile anew); eager: everything is interleaved repetition by repetition.
    `compile_config`: transformers' `CompileConfig` of the compiled calls (None: generate's default).
    """
    gen = torch.Generator().manual_seed(SEED)
    device = next(model.parameters()).device
    ids = torch.randint(FIRST_TEXT_ID, model.config.vocab_size, (batch_size, prompt_len), generator=gen).to(device)
    times: dict[str, list[float]] = {name: [] for name in configs}

    def one(name: str) -> None:
        full = _generate(model, ids, new_tokens, compiled, compile_config)
        first = _generate(model, ids, 1, compiled, compile_config)
        times[name].append((full - first) / (new_tokens - 1))

    if compiled:
        for name, context in tqdm(configs.items(), desc=f"compiled bs{batch_size}", leave=False):
            with context():
                _generate(model, ids, new_tokens, compiled, compile_config)  # compiles this configuration's graphs
                for _ in range(reps):
                    one(name)
            tqdm.write(f"{name} (bs{batch_size}, compiled): {1e3 * statistics.median(times[name]):.2f} ms/token")
    else:
        for context in configs.values():
            with context():
                _generate(model, ids, new_tokens, compiled)  # warm-up: caches, allocator, GPU clocks
        for _ in tqdm(range(reps), desc=f"eager bs{batch_size}", leave=False):
            for name, context in configs.items():
                with context():
                    one(name)
    median = {name: statistics.median(t) for name, t in times.items()}
    noisy = [name for name, m in median.items() if m <= 0]
    if noisy:  # the two calls' difference drowned in timing noise: no ratio is computed from it
        tqdm.write(f"warning: {', '.join(noisy)} (bs{batch_size}): decode time <= 0 ms per token, below the timing "
                   "noise; raise --new-tokens or --reps")
    stock = median.get("stock")
    return [{"config": name, "batch_size": batch_size, "compiled": compiled, "ms_per_token": 1e3 * m,
             "vs_stock": stock / m if stock is not None and m > 0 and stock > 0 else None,
             "ms_spread": 1e3 * (max(times[name]) - min(times[name]))} for name, m in median.items()]


def check_device(device: str) -> str:
    """`device` names a device torch can allocate on here: refused before a model is built on it."""
    try:
        torch.empty(0, device=device)
    except (RuntimeError, AssertionError) as err:  # an unknown name / no such device / torch built without CUDA
        raise TideArgumentError(f"--device {device!r} cannot be used here: {' '.join(str(err).split())}") from None
    return device


def run_synthetic(args: Any) -> dict:
    """The `bench synthetic` section: every configuration, eager and/or compiled static, at each batch size."""
    device = check_device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    layers = SHAPES[args.synthetic]["num_hidden_layers"]
    depth = layers // 2 if args.synthetic_depth is None else args.synthetic_depth  # half: a checkpoint of both
    check_exit_depths([depth], default_checkpoints(layers, TideRouterConfig( exit_head="lens").checkpoint_interval),
                      "--synthetic-depth")
    if args.new_tokens < 2:  # a decode token's time is a difference of two calls (module docstring)
        raise TideArgumentError(f"--new-tokens {args.new_tokens}: bench synthetic times decode tokens after the first, "
                                "so it needs at least 2")
    dtype = getattr(torch, args.dtype)
    model = build_model(args.synthetic, device, dtype)
    every = configurations(model, depth)
    configs = dict(every[key] for key in dict.fromkeys(["stock", *args.configs]))  # stock: the reference
    rows = []
    with recompile_limit(), torch.inference_mode():
        for compiled in [c == "static" for c in args.compile]:
            for bs in args.batch_sizes:
                rows += measure(model, configs, bs, args.prompt_len, args.new_tokens, args.reps, compiled)
    name = torch.cuda.get_device_name(device) if device.startswith("cuda") else "cpu"
    rows = with_ideal_ratios(rows, depth)
    return {"shape": args.synthetic, "config": SHAPES[args.synthetic], "device": name, "dtype": args.dtype,
            "torch": torch.__version__, "depth": depth, "prompt_len": args.prompt_len,
            "new_tokens": args.new_tokens, "reps": args.reps, "rows": rows}


def with_ideal_ratios(rows: list[dict], depth: int) -> list[dict]:
    """Add `vs_ideal` (the ideal's time / this one's) where the truncated model was timed too: for the rows that
    all exit at `depth`, the truncated model; for half the rows leaving there, the mean of the truncated model
    and stock (the time at the mean executed depth, on the line through the two, as layers cost alike)."""
    def timed(prefix: str) -> dict:
        return {(r["batch_size"], r["compiled"]): r["ms_per_token"] for r in rows if r["config"].startswith(prefix)}

    truncated_ms, stock_ms = timed("truncated"), timed("stock")
    for r in rows:
        key = (r["batch_size"], r["compiled"])
        ideal = truncated_ms.get(key)
        if r["config"].startswith(ROWS_LABEL):
            ideal = None if ideal is None or key not in stock_ms else (ideal + stock_ms[key]) / 2
        elif f"exit at {depth}" not in r["config"]:
            ideal = None
        if ideal is not None and min(ideal, r["ms_per_token"]) > 0:
            r["vs_ideal"] = ideal / r["ms_per_token"]
    return rows
