"""Exit paths for quality targets: per-checkpoint threshold vectors ordered from "no exit" to aggressive on
the validation samples, with their losses counted on the threshold samples (see `tide_hf.modeling.targets`
for how attach picks a point with a guarantee).

Ordering: greedy. From every checkpoint closed (threshold 1.0), each step lowers one checkpoint's threshold
to its next candidate (score quantiles on the validation tokens, finest near "no exit"), choosing the move
that saves the most layers per unit of added loss under the serving rule (a token exits at the first
checkpoint whose score reaches its threshold). The agreement path counts top-1 mismatches as loss. The
perplexity path is ordered by KL(final || exit), the expected change in next-token NLL (the observed change is
heavy-tailed, and ordering by it follows the validation samples' noise), and tested with the observed change.
Because the ordering never sees the threshold samples, testing along it is valid.

The scores and losses both splits give (`HeldOut`, `held_out_scores`) are kept with the router, so attach can
price exits and re-select thresholds without the calibration data (`tide_hf.modeling.targets.reselect`).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ..config import TideRouterConfig
from ..modeling import TideRouter
from ..modeling.targets import HeldOut, exit_index, path_losses
from ..record import CLOSED
from .labels import Collected

DECIMALS = 6  # thresholds are rounded before they are evaluated, so the stored values are the tested ones


def down(value: float) -> float:
    """`value` rounded down to DECIMALS: a threshold at a score quantile keeps the tokens at that score."""
    return math.floor(value * 10**DECIMALS) / 10**DECIMALS


def _totals(scores: torch.Tensor, loss: torch.Tensor, saved: torch.Tensor, thresholds: torch.Tensor
            ) -> tuple[float, float]:
    """(layers saved, loss) summed over tokens under `thresholds`; `loss` / `saved` have a no-exit column."""
    first = exit_index(scores, thresholds)
    return float(saved[first].sum()), float(loss.gather(1, first[:, None]).sum())


def build_path(scores: torch.Tensor, loss: torch.Tensor, saved: torch.Tensor, grid: int,
               served: list[bool] | None = None) -> list[list[float]]:
    """Threshold vectors from all closed to all at their lowest candidate (scores / loss: tokens x checkpoints).
    Checkpoints not `served` (below the router's `min_layers`) stay closed on the whole path, so its losses are
    counted under the rule the runtime applies."""
    n, k = scores.shape
    served = [True] * k if served is None else served
    loss = torch.cat([loss, loss.new_zeros(n, 1)], 1)
    saved = torch.cat([saved, saved.new_zeros(1)])
    # Quadratic spacing: the first candidates exit a handful of tokens each (1/grid^2, 3/grid^2, ...), so the
    # first path points add little loss and fixed-sequence testing is not stopped by one coarse first step.
    levels = 1.0 - (torch.arange(1, grid + 1, dtype=torch.float64) / grid) ** 2
    candidates = [[CLOSED] + sorted({down(float(v)) for v in torch.quantile(scores[:, j].double(), levels)
                                     if down(float(v)) < CLOSED}, reverse=True) if served[j] else [CLOSED]
                  for j in range(k)]
    position = [0] * k
    current = torch.tensor([c[0] for c in candidates], dtype=scores.dtype)
    path = [current.tolist()]
    base_saved, base_loss = _totals(scores, loss, saved, current)
    while True:
        best, best_gain, best_totals = None, -math.inf, None
        for j in range(k):
            if position[j] + 1 >= len(candidates[j]):
                continue
            trial = current.clone()
            trial[j] = candidates[j][position[j] + 1]
            s, l_ = _totals(scores, loss, saved, trial)
            added = l_ - base_loss
            gain = math.inf if added <= 0 else (s - base_saved) / added
            if gain > best_gain:
                best, best_gain, best_totals = j, gain, (s, l_)
        if best is None:
            return path
        position[best] += 1
        current[best] = candidates[best][position[best]]
        base_saved, base_loss = best_totals
        path.append(current.tolist())


def splits(data: Collected) -> tuple[torch.Tensor, torch.Tensor]:
    """(order, test) token masks: the validation tokens the paths are ordered on, the threshold tokens they are
    tested on."""
    return data.is_val & ~data.is_test, data.is_test


@torch.no_grad()
def held_out_scores(router: TideRouter, data: Collected) -> HeldOut:
    """`router`'s scores on the ordering split and its scores, top-1 mismatches and NLL changes on the test split,
    as the paths use them and the router keeps them (`TideRouter.set_held_out`)."""
    layers = list(router.config.checkpoint_layers)
    order, test = splits(data)

    def scores(rows: torch.Tensor) -> torch.Tensor:
        return torch.stack([torch.sigmoid(router.logit(k, data.features[k][rows])).float().cpu() for k in layers], 1)

    nll = torch.stack([data.nll[k][test] for k in layers], 1).float().cpu()
    # as `path_losses` reads them: a row with a NaN has no next token; an infinite change is the largest finite one
    nll = torch.nan_to_num(nll, nan=math.nan, posinf=torch.finfo(nll.dtype).max, neginf=torch.finfo(nll.dtype).min)
    nll[nll.isnan().any(1)] = math.nan
    return HeldOut(order_scores=scores(order), test_scores=scores(test),
                   test_mismatch=torch.stack([~data.top1[k][test] for k in layers], 1).cpu(), test_nll=nll)


@torch.no_grad()
def fit_exit_paths(router: TideRouter, data: Collected, held_out: HeldOut | None = None) -> dict[str, Any]:
    """The agreement and perplexity paths of `router` (ordered on validation tokens, tested on threshold ones);
    checkpoints below `min_layers` or with a never-firing router stay closed on both. `held_out`: the router's
    `held_out_scores(router, data)` when the caller has them (the losses are counted on exactly those)."""
    cfg: TideRouterConfig = router.config
    layers = list(cfg.checkpoint_layers)
    order, _ = splits(data)
    held_out = held_out_scores(router, data) if held_out is None else held_out
    saved = torch.tensor([cfg.num_hidden_layers - k for k in layers], dtype=torch.float64)
    # A checkpoint whose training label had no positive gets a never-firing constant router (`training.py`): it
    # stays closed (its constant score as a threshold would exit every token there, a fixed depth, not a router)
    train = ~data.is_val
    silent = {k for k in layers if bool(train.any()) and not bool(data.labels(k, cfg)[train].any())}
    served = [k >= cfg.min_layers and k not in silent for k in layers]
    scores_o = held_out.order_scores
    mismatch_o = torch.stack([~data.top1[k][order] for k in layers], 1)
    kl_order = torch.stack([data.kl[k][order] for k in layers], 1).double()  # computed for every held-out token
    tested = (held_out.test_scores, held_out.test_mismatch, held_out.test_nll)
    return {
        "agreement": path_losses(build_path(scores_o, mismatch_o.double(), saved, cfg.path_grid, served), *tested),
        "perplexity": path_losses(build_path(scores_o, kl_order, saved, cfg.path_grid, served), *tested),
    }
