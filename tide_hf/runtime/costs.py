"""What a decode step's parts cost on this model and linear path: the price list skip mode's pricing
(`pricing.py`) closes checkpoints by. Measured once per attach, cached per model state, so a call's tokens never
depend on the machine's load while it runs.

Measured in place, in real decode steps of a short random prompt (one row), with TIDE's own hooks at work:
- a plain pair: two decode steps with TIDE stepped aside (`TideHandle.disabled`);
- an exit pair at checkpoint k: a step whose token exits at k (forced: threshold 0), then a plain step, which runs
  the exited token through the layers it skipped beside its own (kv="recompute"; kv="propagate" writes their K/V
  in the first step);
- a checkpoint's scoring: `TideHandle.score` on the state a checkpoint layer has just returned, timed inside the
  plain pairs (its weights come from wherever the forward left them, as in serving) and taken out of their time.
The plain pair's time less the exit pair's is what one exit at k saves: its exit state, the K/V upkeep and the
catch-up are paid inside the exit pair. Savings between the two checkpoints timed are interpolated by depth.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..compat import cache_in, with_cache
from ..modeling import layer_output
from ..modeling.devices import execution_device
from ..record import CLOSED

PROMPT_TOKENS = 16  # the random prompt the timed steps decode after
REPEATS = 3  # pairs per variant, interleaved (plain, exit at each timed checkpoint); the median is kept
SEED = 0  # of the random prompt
FORCED = 0.0  # a threshold every finite score reaches: the timed exit happens whatever the router says


@dataclass(frozen=True)
class StepCosts:
    """Seconds of a decode step's parts (one row) on the model and path they were measured on.

    Args:
        plain_step_s: one plain decode step (half a plain pair).
        saving_s: checkpoint -> seconds one exit there saves over its step and the next (scoring aside), at the
            checkpoints timed.
        score_s: one checkpoint's scoring of one row, in a step.
        measure_s: what measuring took.
    """

    plain_step_s: float
    saving_s: dict[int, float]
    score_s: float
    measure_s: float

    def saving(self, layer: int) -> float:
        """Seconds an exit at checkpoint `layer` saves: measured, or interpolated by depth between the checkpoints
        timed (the nearest one's figure outside them)."""
        timed = sorted(self.saving_s)
        if layer <= timed[0] or len(timed) == 1:
            return self.saving_s[timed[0]]
        if layer >= timed[-1]:
            return self.saving_s[timed[-1]]
        lo, hi = max(k for k in timed if k <= layer), min(k for k in timed if k >= layer)
        share = 0.0 if hi == lo else (layer - lo) / (hi - lo)
        return self.saving_s[lo] + share * (self.saving_s[hi] - self.saving_s[lo])

    def as_dict(self) -> dict[str, Any]:
        """Milliseconds, for `last_stats` and JSON."""
        return {"plain_step_ms": 1e3 * self.plain_step_s, "score_ms": 1e3 * self.score_s,
                "exit_saves_ms": {k: 1e3 * v for k, v in sorted(self.saving_s.items())},
                "measure_ms": 1e3 * self.measure_s}


def synchronize(device: torch.device) -> None:
    """Wait for `device`'s queued work, so the clock reads what it did (a no-op on the CPU)."""
    backend = getattr(torch, device.type, None)
    if device.type != "cpu" and hasattr(backend, "synchronize"):
        backend.synchronize(device)


@contextmanager
def timed_scores(handle: Any, layers: nn.ModuleList, checkpoints: list[int], spent: list[float]) -> Iterator[None]:
    """While open, each of `checkpoints` scores the state its layer returns, its seconds appended to `spent`."""
    device = execution_device(layers[0])

    def timer(layer: int) -> Callable[[nn.Module, tuple, Any], None]:
        def hook(_module: nn.Module, _args: tuple, output: Any) -> None:
            hidden = layer_output(output)
            synchronize(device)
            started = time.perf_counter()
            handle.score(layer, hidden[:, -1:])
            synchronize(device)
            spent.append(time.perf_counter() - started)
        return hook

    hooks = [layers[k - 1].register_forward_hook(timer(k)) for k in checkpoints]
    try:
        yield
    finally:
        for hook in hooks:
            hook.remove()


@torch.no_grad()
def measure(model: nn.Module, handle: Any, layers: nn.ModuleList, timed: list[int]) -> StepCosts:
    """Time plain pairs and exit pairs at each checkpoint of `timed` (`handle`: a `TideHandle` on `model` in skip
    mode whose `thresholds` this sets and puts back; it must run in this thread only)."""
    started = time.perf_counter()
    embeddings = model.get_input_embeddings()
    device = execution_device(embeddings)
    steps = 2 * REPEATS * (1 + len(timed))
    generator = torch.Generator().manual_seed(SEED)
    ids = torch.randint(0, embeddings.num_embeddings, (1, PROMPT_TOKENS + steps), generator=generator).to(device)
    kept = dict(handle.thresholds)
    with handle.disabled():
        cache = cache_in(model(input_ids=ids[:, :PROMPT_TOKENS], use_cache=True))
    fed = PROMPT_TOKENS

    def step(tide: bool) -> None:
        nonlocal fed
        token = ids[:, fed : fed + 1]
        fed += 1
        if tide:
            with handle.session(generating=False):
                model(**with_cache({"input_ids": token, "use_cache": True}, cache))
        else:
            with handle.disabled():
                model(**with_cache({"input_ids": token, "use_cache": True}, cache))

    def pair(exit_at: int | None) -> float:
        handle.thresholds.update({k: FORCED if k == exit_at else CLOSED for k in handle.thresholds})
        synchronize(device)
        begun = time.perf_counter()
        step(exit_at is not None)
        step(False)  # (kv="recompute": the exited token catches up here)
        synchronize(device)
        return time.perf_counter() - begun

    plain, exits, scoring = [], {k: [] for k in timed}, []
    try:
        for _ in range(REPEATS):
            spent: list[float] = []
            with timed_scores(handle, layers, timed, spent):
                total = pair(None)
            plain.append(total - sum(spent))
            scoring.extend(spent)
            for k in timed:
                exits[k].append(pair(k))
    finally:
        handle.thresholds.update(kept)
    plain_s = statistics.median(plain)
    score_s = statistics.median(scoring)
    return StepCosts(plain_step_s=plain_s / 2, score_s=score_s,
                     saving_s={k: plain_s - statistics.median(v) + score_s for k, v in exits.items()},
                     measure_s=time.perf_counter() - started)
