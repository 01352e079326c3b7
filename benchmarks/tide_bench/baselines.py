"""`tide-hf bench baselines`: TIDE against the simple alternatives a critic would name.

All methods run on the same held-out prompts and text, in one process, against stock in the same run:
- fixed depth: every token leaves after layer d (the model run as if it had d layers);
- static layer skipping: one fixed set of layers dropped for every token, chosen greedily on calibration
  text (each round drops the layer whose removal keeps the highest top-1 agreement with the full model);
- softmax confidence (CALM-style): a token exits at the first checkpoint where the exit logits' top
  probability reaches a threshold; it runs through TIDE's own exit machinery (the router's exit heads
  included, so both exit with the same logits), only the score differs;
- TIDE: the router's scores, at several thresholds.
TIDE and confidence run in skip mode with `kv="recompute"`, so their wall clock includes real skipping.
Each point reports perplexity change, greedy continuation match vs stock, mean layers and speed vs stock.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager as ContextManager
from contextlib import contextmanager
from typing import Any

import torch
from tqdm.auto import tqdm

from tide_hf.calibration import load_texts, make_samples, pad_right
from tide_hf.eval.tables import percent
from tide_hf.integrations import attach_with
from tide_hf.modeling import ModelAdapter, TideRouter, check_head, get_adapter
from tide_hf.runtime import Patches, TideHandle

from .measure import generate, left_pad, match_rate, perplexity
from .modes import truncated

_TUPLE_LAYERS: weakref.WeakKeyDictionary[Any, bool] = weakref.WeakKeyDictionary()
PPL_LEVELS = (0.05, 0.10, 0.25)  # perplexity changes at which methods are compared


class ConfidenceHandle(TideHandle):
    """Scores a checkpoint by the top softmax probability of its exit logits (no router MLP involved; the exit
    logits are the ones an exit there would produce, through the router's exit heads when it has them)."""

    @torch.no_grad()
    def score(self, layer: int, hidden: torch.Tensor) -> torch.Tensor:
        return torch.softmax(self.adapter.logits(self.exit_state(layer, hidden)).float(), dim=-1).amax(-1)


def _returns_tuple(model: Any, adapter: ModelAdapter) -> bool:
    """Whether this model's decoder layers return a tuple (older layouts) or the hidden state alone
    (probed once per model: the greedy layer choice enters `dropped` hundreds of times)."""
    if model in _TUPLE_LAYERS:
        return _TUPLE_LAYERS[model]
    seen: list[bool] = []
    handle = adapter.layers[0].register_forward_hook(lambda _m, _a, out: seen.append(isinstance(out, tuple)))
    try:
        with torch.no_grad():
            model(input_ids=torch.zeros(1, 1, dtype=torch.long, device=model.device), use_cache=False)
    finally:
        handle.remove()
    _TUPLE_LAYERS[model] = seen[0]
    return seen[0]


@contextmanager
def dropped(model: Any, layers: list[int]) -> Iterator[None]:
    """Run `model` with the decoder layers numbered `layers` (1-based) replaced by the identity.

    Layer 1 is never dropped: the cache length that sizes the attention mask is read from it.
    """
    if 1 in layers:
        raise ValueError("static skipping cannot drop layer 1 (the cache length is read from it)")
    adapter = get_adapter(model)
    identity = (lambda h, *a, **k: (h,)) if _returns_tuple(model, adapter) else (lambda h, *a, **k: h)
    with Patches() as patches:
        for number in layers:
            patches.replace_forward(adapter.layers[number - 1], lambda _original: identity)
        yield


@torch.no_grad()
def greedy_drop_order(model: Any, samples: list[torch.Tensor], max_drop: int, pad_id: int,
                      progress: bool = True) -> list[dict]:
    """Layers in the order static skipping drops them, each with the top-1 agreement left after dropping it."""
    adapter = get_adapter(model)
    ids, mask = (t.to(model.device) for t in pad_right(samples, pad_id))
    keep = mask.bool()

    def argmax() -> torch.Tensor:
        return model(input_ids=ids, attention_mask=mask, use_cache=False).logits.argmax(-1)[keep]

    reference, order = argmax(), []
    candidates = list(range(2, adapter.num_layers + 1))
    for _ in tqdm(range(max_drop), desc="static skipping: greedy layer choice", disable=not progress):
        scores = {}
        for c in candidates:
            with dropped(model, [o["layer"] for o in order] + [c]):
                scores[c] = float((argmax() == reference).float().mean())
        best = max(candidates, key=scores.__getitem__)
        order.append({"layer": best, "agreement": scores[best]})
        candidates.remove(best)
    return order


def _point(model: Any, method: str, param: Any, setup: Callable[[], ContextManager], batches: list[dict],
           chunks: list[torch.Tensor], stock: dict, args: Any, fixed_layers: float | None) -> dict:
    """Quality, depth and speed of one method at one setting, against the stock run `stock`."""
    with setup() as handle:
        generate(model, batches[0], 2)  # warm-up (first use of a code path, e.g. building the kernels)
        tokens, seconds, layers, count = [], 0.0, 0.0, 0
        for b in batches:
            t, s = generate(model, b, args.new_tokens)
            tokens.append(t)
            seconds += s
            if handle is not None:
                d = handle.last_stats.decode
                layers, count = layers + d.mean_layers * d.tokens, count + d.tokens
        ppl, prefill = perplexity(model, chunks, args.quality_batch_size)
    exact, prefix = match_rate(torch.cat(tokens), stock["tokens"])
    return {"method": method, "param": param,
            "decode_mean_layers": layers / count if handle is not None else fixed_layers,
            "text_mean_layers": prefill.mean_layers if handle is not None else fixed_layers,
            "greedy_exact_match": exact, "greedy_prefix_match": prefix,
            "perplexity_change": ppl / stock["perplexity"] - 1.0, "seconds": seconds}


def _stock(model: Any, batches: list[dict], new_tokens: int) -> tuple[torch.Tensor, float]:
    runs = [generate(model, b, new_tokens) for b in batches]
    return torch.cat([t for t, _ in runs]), sum(s for _, s in runs)


def run_baselines(model: Any, tokenizer: Any, router: TideRouter, dataset: str, prompts: list[torch.Tensor],
                  chunks: list[torch.Tensor], pad_id: int, args: Any) -> dict:
    """Every method at every setting (the `baselines` bench JSON), plus which side wins at equal quality (the
    confidence baseline scores with the adapter's head: `check_head` first)."""
    if args.confidence_thresholds:
        check_head(model)
    num_layers = router.config.num_hidden_layers
    calib = make_samples(tokenizer, load_texts(dataset), args.baseline_calib_samples, args.baseline_calib_len,
                         router.config.seed)
    order = greedy_drop_order(model, calib, max(args.drop_counts), pad_id)
    batches = [left_pad(prompts[i : i + 1], pad_id) for i in range(len(prompts))]
    generate(model, batches[0], 2)  # warm-up
    tokens, first = _stock(model, batches, args.new_tokens)
    stock = {"tokens": tokens, "perplexity": perplexity(model, chunks, args.quality_batch_size)[0]}

    def exits(cls: type[TideHandle], **options: Any) -> Callable[[], ContextManager]:
        return lambda: _attached(model, router, cls, **options)

    plan: list[tuple[str, Any, Callable[[], ContextManager], float | None]] = []
    if router.config.exit_paths:  # quality targets: per-checkpoint thresholds chosen by the router's calibration
        plan += [("tide", f"agreement {a}", exits(TideHandle, min_agreement=a), None) for a in args.targets]
        plan += [("tide", f"ppl +{percent(e)}", exits(TideHandle, max_perplexity_increase=e), None)
                 for e in args.ppl_targets]
    else:  # a router calibrated before exit paths existed: one global threshold
        plan += [("tide", t, exits(TideHandle, exit_threshold=t), None) for t in args.thresholds]
    plan += [("confidence", t, exits(ConfidenceHandle, exit_threshold=t), None) for t in args.confidence_thresholds]
    plan += [("fixed_depth", d, lambda d=d: _no_handle(truncated(model, d)), float(d))
             for d in router.config.checkpoint_layers if d >= num_layers // 2]
    plan += [("static_skip", n, lambda n=n: _no_handle(dropped(model, [o["layer"] for o in order[:n]])),
              float(num_layers - n)) for n in args.drop_counts]
    rows = [_point(model, m, p, setup, batches, chunks, stock, args, fixed)
            for m, p, setup, fixed in tqdm(plan, desc="baselines")]
    _, last = _stock(model, batches, args.new_tokens)  # stock again: the machine's drift over the run shows here
    for r in rows:
        r["speed_ratio"] = (first + last) / 2 / r["seconds"]
    return {"num_layers": num_layers, "static_skip_order": order,
            "stock": {"perplexity": stock["perplexity"], "seconds_first": first, "seconds_last": last},
            "rows": rows, "verdict": verdict(rows), "at_perplexity": at_perplexity(rows, num_layers, PPL_LEVELS)}


@contextmanager
def _attached(model: Any, router: TideRouter, cls: type[TideHandle], **options: Any) -> Iterator[TideHandle]:
    handle = attach_with(cls, model, router, mode="skip", kv="recompute", **options)
    try:
        yield handle
    finally:
        handle.detach()


@contextmanager
def _no_handle(ctx: ContextManager) -> Iterator[None]:
    with ctx:
        yield None


def verdict(rows: list[dict]) -> list[dict]:
    """For each TIDE point and each quality measure (greedy continuation match on generated tokens,
    perplexity on held-out text): the baseline with the fewest layers at equal or better quality."""
    measures = (("greedy_prefix_match", "decode_mean_layers", 1), ("perplexity_change", "text_mean_layers", -1))
    out = []
    for t in (r for r in rows if r["method"] == "tide"):
        for quality, layers, sign in measures:
            rivals = [r for r in rows if r["method"] != "tide" and sign * r[quality] >= sign * t[quality]]
            best = min(rivals, key=lambda r: r[layers], default=None)
            out.append({"threshold": t["param"], "quality": quality, "tide_quality": t[quality],
                        "tide_layers": t[layers],
                        "best_baseline": None if best is None else f"{best['method']}={best['param']}",
                        "baseline_quality": None if best is None else best[quality],
                        "baseline_layers": None if best is None else best[layers],
                        "tide_saves_more": best is None or t[layers] < best[layers]})
    return out


def at_perplexity(rows: list[dict], num_layers: int, levels: tuple[float, ...]) -> list[dict]:
    """Per perplexity-change level: the most layers each method saves (on held-out text) at or under it, and
    TIDE's savings over the best baseline's."""
    out = []
    for level in levels:
        best: dict[str, dict] = {}
        for r in rows:
            if r["perplexity_change"] <= level and (r["method"] not in best or r["text_mean_layers"]
                                                     < best[r["method"]]["text_mean_layers"]):
                best[r["method"]] = r
        saved = {m: num_layers - r["text_mean_layers"] for m, r in best.items()}
        rivals = {m: s for m, s in saved.items() if m != "tide"}
        rival = max(rivals, key=rivals.__getitem__, default=None)
        out.append({"level": level, "tide": saved.get("tide"), "tide_setting": best.get("tide", {}).get("param"),
                    "best_baseline": None if rival is None else f"{rival}={best[rival]['param']}",
                    "baseline_saved": rivals.get(rival), "ratio": saved["tide"] / rivals[rival]
                    if "tide" in saved and rival is not None and rivals[rival] > 0 else None})
    return out
