"""Exits priced by what they save: skip mode at a quality target closes the checkpoints whose exits do not pay.

An exit at checkpoint k saves the time `costs.py` measured for it on this model and path (the layers after k,
less its exit state, K/V upkeep and catch-up); the checkpoint costs one scoring for every token that reaches it.
Per token, on the calibration's held-out validation scores (`HeldOut.order_scores`, which the exit path was
ordered on, never the split that certifies it):

    value(k) = share exiting at k x saving(k) - share reaching k x scoring

While a checkpoint's value is below zero, the one of lowest value is closed and the thresholds of the others are
selected again for the target with that checkpoint held closed (`reselect`: Learn-then-Test on the held-out
threshold split, so the target keeps its guarantee). Values are for a step of one position. Under
kv="recompute" a step of several (a batch, a prompt) skips layers only where every position exits: `pays_at`
prices that, and the handle runs a step plain where nothing can pay at its width.
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import Any

from ..errors import TideTargetError
from ..modeling import TideRouter
from ..modeling.targets import check_served, exit_shares, reselect
from ..record import CLOSED
from .costs import StepCosts
from .options import TideOptions

NO_HELD_OUT = "the router keeps no held-out scores (calibrated before they were kept)"


# router -> (request, costs) -> the priced options: attaching again re-selects nothing
_PRICED: weakref.WeakKeyDictionary[TideRouter, dict[tuple, tuple[StepCosts, TideOptions]]] = \
    weakref.WeakKeyDictionary()


def applies(options: TideOptions) -> bool:
    """Pricing runs for skip mode at a quality target that opens a checkpoint, with `pricing` not False (an
    explicit `exit_threshold` is served as given)."""
    return options.mode == "skip" and options.target is not None and options.pricing is not False \
        and any(t < CLOSED for t in (options.thresholds or {}).values())


def unpriced(options: TideOptions, router: TideRouter) -> TideOptions | None:
    """`options` with the reason pricing cannot run recorded, where the router keeps no held-out scores (None when
    it does); `pricing=True` refuses such a router instead."""
    if router.held_out is not None:
        return None
    if options.pricing:
        raise TideTargetError(f"pricing=True: {NO_HELD_OUT}; recalibrate it, or attach with pricing=False")
    note = f"{NO_HELD_OUT}: every checkpoint the target opens serves; recalibrate to price them"
    return dataclasses.replace(options, priced={"closed": [], "note": note})


def timed_checkpoints(router: TideRouter, options: TideOptions) -> list[int]:
    """The checkpoints whose exits `costs.measure` times: the first and last a token may exit at."""
    eligible = [k for k in router.checkpoint_layers if k >= options.min_layers]
    return sorted({eligible[0], eligible[-1]})


def values(thresholds: dict[int, float], shares: tuple[dict[int, float], dict[int, float]], costs: StepCosts
           ) -> dict[int, float]:
    """Seconds per token each open checkpoint saves, its scoring paid (`value(k)` above)."""
    exits, reach = shares
    return {k: exits[k] * costs.saving(k) - reach[k] * costs.score_s for k, t in thresholds.items() if t < CLOSED}


def price(options: TideOptions, router: TideRouter, costs: StepCosts) -> TideOptions:
    """`options` with the checkpoints that do not pay closed and the others' thresholds selected again; what was
    measured and decided is in `priced` (for `last_stats`). Remembered per router, request and costs."""
    key = (tuple(sorted((options.thresholds or {}).items())), tuple(sorted((options.target or {}).items())),
           options.min_layers, id(costs))
    memo = _PRICED.setdefault(router, {})
    if key in memo and memo[key][0] is costs:  # (the same costs object: an id reused by another is not a hit)
        return dataclasses.replace(options, thresholds=memo[key][1].thresholds, priced=memo[key][1].priced)
    priced = decide(options, router, costs)
    memo[key] = (costs, priced)
    return priced


def decide(options: TideOptions, router: TideRouter, costs: StepCosts) -> TideOptions:
    """`price`'s work: close the checkpoint of lowest negative value and select the thresholds again, until every
    open checkpoint pays."""
    held, cfg = router.held_out, router.config
    checkpoints = list(router.checkpoint_layers)
    target = options.target or {}
    thresholds, closed = dict(options.thresholds or {}), []
    shares = exit_shares(held.order_scores, thresholds, checkpoints)
    first = current = values(thresholds, shares, costs)
    while losing := [k for k, v in current.items() if v < 0.0]:
        closed.append(min(losing, key=current.__getitem__))
        thresholds = reselect(cfg.exit_paths, held, checkpoints, set(closed),
                              min_agreement=target.get("min_agreement"),
                              max_perplexity_increase=target.get("max_perplexity_increase"),
                              confidence=target["confidence"])
        check_served(thresholds, options.min_layers, cfg.min_layers)
        shares = exit_shares(held.order_scores, thresholds, checkpoints)
        current = values(thresholds, shares, costs)
    exits, reach = shares
    record: dict[str, Any] = {
        "closed": sorted(closed), "costs": costs.as_dict(),
        "value_ms_per_token": {k: 1e3 * v for k, v in sorted(first.items())},
        "thresholds_before": dict(sorted((options.thresholds or {}).items())),
        "exit_shares": {k: exits[k] for k, t in sorted(thresholds.items()) if t < CLOSED},
        "reach_shares": {k: reach[k] for k, t in sorted(thresholds.items()) if t < CLOSED},
    }
    return dataclasses.replace(options, thresholds=thresholds, priced=record)


def pays_at(priced: dict[str, Any], positions: int) -> bool:
    """Whether exits can pay in a step of `positions` (rows x tokens) under kv="recompute", where a step skips
    layers only when every position exits at one checkpoint: with positions taken as independent, an open
    checkpoint's exit share to that power times its saving must beat its reach share to that power times a
    scoring (one position: the values `price` kept open)."""
    costs = priced["costs"]  # (milliseconds: only their ratios matter here)
    step = StepCosts(plain_step_s=costs["plain_step_ms"], score_s=costs["score_ms"], measure_s=costs["measure_ms"],
                     saving_s={int(k): v for k, v in costs["exit_saves_ms"].items()})
    return any(share ** positions * step.saving(k) - priced["reach_shares"][k] ** positions * step.score_s > 0.0
               for k, share in priced["exit_shares"].items())
