"""Quality targets: per-checkpoint exit thresholds chosen from the router's calibrated exit path, with a
Learn-then-Test guarantee (Angelopoulos et al. 2021; the risk control of CALM, Schuster et al. 2022).

Calibration stores an *exit path*: a sequence of per-checkpoint threshold vectors, from "no exit" to
ever more aggressive settings, built on one held-out split (the validation samples), and, for each point,
the losses it incurs on a second held-out split the path never saw (the threshold samples): how many
tokens' exit argmax differs from the full model's, and the sum / sum of squares of each token's change in
next-token NLL. At attach time `select` walks the path in order and keeps a point while its risk is
certified below the target (fixed-sequence testing, family-wise error at most 1 - `confidence`):

- `min_agreement=a`: top-1 agreement with the full model >= a. Exact binomial p-value per point: with
  probability >= `confidence` over the draw of the calibration text, the chosen thresholds' true agreement
  on text from the same distribution is >= a (treating tokens as exchangeable).
- `max_perplexity_increase=e`: mean NLL change <= log(1 + e), i.e. perplexity at most (1 + e) x stock's.
  Normal-approximation p-value (asymptotic: the NLL change is unbounded, so no finite-sample bound).

Both together: a point must pass both (the larger p-value), on the agreement path.

Calibration also keeps, with the router's weights, the held-out per-token scores and losses the paths were made
from (`HeldOut`). With them attach can price thresholds (`exit_shares`: how often tokens exit at each checkpoint)
and re-select thresholds with the same guarantee when some checkpoints are closed (`reselect`): closing a
checkpoint on every point of the stored path changes no point's order, which never saw the threshold samples,
so testing along the edited path, with its losses recounted on those samples, stays valid.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import TideArgumentError, TideArgumentTypeError, TideTargetError
from ..record import CLOSED, PATH_KINDS
from ..values import check_real


@dataclass(frozen=True, eq=False)
class HeldOut:
    """Calibration's held-out per-token scores and losses, kept with the router's weights so attach can price
    exits (`exit_shares`) and re-select thresholds with a guarantee when it closes checkpoints (`reselect`),
    without the calibration data. K = the router's checkpoints, columns in `checkpoint_layers` order.

    Args:
        order_scores: (n_o, K) float32, router scores (sigmoid) of the validation tokens the paths were ordered on.
        test_scores: (n_t, K) float32, router scores of the threshold tokens the paths were tested on.
        test_mismatch: (n_t, K) bool, where an exit's top-1 differs from the full model's, on those tokens.
        test_nll: (n_t, K) float32, the next-token NLL change of an exit there (a NaN row: no next token).
    """

    order_scores: torch.Tensor
    test_scores: torch.Tensor
    test_mismatch: torch.Tensor
    test_nll: torch.Tensor

    def __post_init__(self) -> None:
        for name in ("order_scores", "test_scores", "test_mismatch", "test_nll"):
            value = getattr(self, name)
            if not isinstance(value, torch.Tensor) or value.dim() != 2:
                raise TideArgumentTypeError(f"HeldOut.{name} must be a 2-D tensor (tokens x checkpoints), got "
                                            f"{getattr(value, 'shape', type(value).__name__)}")
        if self.test_mismatch.dtype != torch.bool:
            raise TideArgumentTypeError(f"HeldOut.test_mismatch must be a bool tensor, got {self.test_mismatch.dtype}")
        for name in ("order_scores", "test_scores", "test_nll"):
            if not getattr(self, name).is_floating_point():
                raise TideArgumentTypeError(f"HeldOut.{name} must be a floating tensor, got "
                                            f"{getattr(self, name).dtype}")
            object.__setattr__(self, name, getattr(self, name).detach().to("cpu", torch.float32))
        object.__setattr__(self, "test_mismatch", self.test_mismatch.detach().cpu())
        columns = {name: getattr(self, name).shape[1] for name in ("order_scores", "test_scores", "test_mismatch",
                                                                    "test_nll")}
        if len(set(columns.values())) != 1:
            raise TideArgumentError(f"HeldOut: every matrix needs one column per checkpoint, got {columns}")
        rows = {name: getattr(self, name).shape[0] for name in ("test_scores", "test_mismatch", "test_nll")}
        if len(set(rows.values())) != 1:
            raise TideArgumentError(f"HeldOut: the test matrices need one row per threshold token each, got {rows}")
        for name in ("order_scores", "test_scores"):
            scores = getattr(self, name)
            if scores.numel() and not bool(((scores >= 0) & (scores <= 1)).all()):
                raise TideArgumentError(f"HeldOut.{name}: router scores must be in [0, 1] (no NaN)")
        nan = self.test_nll.isnan()
        if bool((nan.any(1) & ~nan.all(1)).any()) or bool(self.test_nll.isinf().any()):
            raise TideArgumentError("HeldOut.test_nll: NLL changes must be finite, NaN only in whole rows (tokens "
                                    "without a next token)")

    @property
    def num_checkpoints(self) -> int:
        """K: the columns of every matrix."""
        return self.order_scores.shape[1]

    def check_checkpoints(self, checkpoints: list[int]) -> None:
        """Raise unless the matrices have one column per checkpoint of `checkpoints`."""
        if self.num_checkpoints != len(checkpoints):
            raise TideArgumentError(f"held-out scores have {self.num_checkpoints} checkpoint columns, but the router "
                                    f"has {len(checkpoints)} checkpoints {list(checkpoints)}")


def exit_index(scores: torch.Tensor, thresholds: torch.Tensor) -> torch.Tensor:
    """Per token, the first checkpoint (column) whose score reaches its threshold; K (columns) for none. This is
    the serving rule: a `CLOSED` threshold never fires."""
    fires = (scores >= thresholds) & (thresholds < CLOSED)
    return torch.where(fires.any(1), fires.int().argmax(1), scores.shape[1])


def path_losses(path: list[list[float]], scores: torch.Tensor, mismatch: torch.Tensor, nll: torch.Tensor
                ) -> dict[str, Any]:
    """Losses of every path point on held-out tokens: top-1 mismatches and the NLL change's sum and sum of
    squares (tokens without a next token count for agreement only)."""
    n = scores.shape[0]
    mismatch = torch.cat([mismatch.float(), mismatch.new_zeros(n, 1).float()], 1)
    has_next = ~nll.isnan().any(1)
    change = torch.cat([torch.nan_to_num(nll.double()), nll.new_zeros(n, 1).double()], 1)[has_next]
    errors, sums, squares = [], [], []
    for point in path:
        first = exit_index(scores, torch.tensor(point, dtype=scores.dtype))
        errors.append(int(mismatch.gather(1, first[:, None]).sum()))
        taken = change.gather(1, first[has_next][:, None]).squeeze(1)
        sums.append(float(taken.sum()))
        squares.append(float((taken * taken).sum()))
    return {"thresholds": path, "errors": errors, "n": n, "nll_sum": sums, "nll_sumsq": squares,
            "n_next": int(has_next.sum())}


def threshold_vector(thresholds: dict[int, float], checkpoints: list[int]) -> list[float]:
    """`thresholds` as one value per checkpoint, in `checkpoints` order; a missing or unknown checkpoint or a value
    outside [0, 1] is an error naming it."""
    if not isinstance(thresholds, dict):
        raise TideArgumentTypeError(f"thresholds must be a dict of checkpoint -> threshold, got "
                                    f"{type(thresholds).__name__}")
    missing, unknown = sorted(set(checkpoints) - set(thresholds)), sorted(set(thresholds) - set(checkpoints))
    if missing or unknown:
        raise TideArgumentError(f"thresholds need exactly the checkpoints {list(checkpoints)}: missing {missing}, "
                                f"unknown {unknown}")
    for k in checkpoints:
        check_real(f"thresholds[{k}]", thresholds[k], low=0.0, high=1.0)
    return [float(thresholds[k]) for k in checkpoints]


def exit_shares(scores: torch.Tensor, thresholds: dict[int, float], checkpoints: list[int]
                ) -> tuple[dict[int, float], dict[int, float]]:
    """Per checkpoint, the share of the tokens of `scores` (n x K, columns in `checkpoints` order) that exit there
    under `thresholds` and the serving rule (the first checkpoint whose score reaches its threshold; `CLOSED`
    never fires), and the share that reach it still running: what exits at those thresholds cost and save.
    Attach calls it with `HeldOut.order_scores`."""
    if not isinstance(scores, torch.Tensor) or scores.dim() != 2 or not scores.is_floating_point():
        raise TideArgumentTypeError(f"scores must be a 2-D floating tensor (tokens x checkpoints), got "
                                    f"{getattr(scores, 'shape', type(scores).__name__)}")
    if scores.shape[1] != len(checkpoints):
        raise TideArgumentError(f"scores have {scores.shape[1]} checkpoint columns, but there are "
                                f"{len(checkpoints)} checkpoints {list(checkpoints)}")
    if scores.shape[0] == 0:
        raise TideArgumentError("exit shares need at least one token's scores, got none")
    scores = scores.detach().cpu()
    first = exit_index(scores, torch.tensor(threshold_vector(thresholds, checkpoints), dtype=scores.dtype))
    exits = torch.bincount(first, minlength=len(checkpoints) + 1)[:len(checkpoints)].double() / scores.shape[0]
    reached = 1.0 - torch.cat([exits.new_zeros(1), exits.cumsum(0)[:-1]])
    return ({k: float(s) for k, s in zip(checkpoints, exits)},
            {k: float(s) for k, s in zip(checkpoints, reached)})


def binomial_pvalue(errors: int, n: int, alpha: float) -> float:
    """P(Binomial(n, alpha) <= errors): a valid p-value for H0 "error rate > alpha" given `errors` of `n`."""
    if n == 0 or alpha <= 0.0:  # no data, or H0 "error rate > 0", which no finite sample can reject
        return 1.0
    k = torch.arange(errors + 1, dtype=torch.float64)
    dist = torch.distributions.Binomial(total_count=n, probs=torch.tensor(alpha, dtype=torch.float64))
    return float(torch.logsumexp(dist.log_prob(k), 0).exp().clamp(max=1.0))


def normal_pvalue(total: float, total_sq: float, n: int, bound: float) -> float:
    """Asymptotic p-value for H0 "mean > bound" from the sum and sum of squares of n losses."""
    if n < 2:
        return 1.0
    mean = total / n
    var = max(total_sq / n - mean * mean, 0.0) * n / (n - 1)
    if var == 0.0:  # no spread seen (typically no token exited on the split): no evidence about the mean
        return 1.0
    z = (mean - bound) / math.sqrt(var / n)
    return 0.5 * math.erfc(-z / math.sqrt(2.0))


def target_path(paths: dict[str, Any], *, min_agreement: float | None, max_perplexity_increase: float | None,
                confidence: float) -> str:
    """The kind of path the target(s) are tested on (agreement when `min_agreement` is given), once the targets
    are checked and that path is known to be calibrated."""
    if min_agreement is None and max_perplexity_increase is None:
        raise TideTargetError("give min_agreement and/or max_perplexity_increase")
    for name, value in (("min_agreement", min_agreement), ("max_perplexity_increase", max_perplexity_increase),
                        ("confidence", confidence)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, numbers.Real)):
            raise TideArgumentTypeError(f"{name} must be a number, got {value!r} ({type(value).__name__})")
    if min_agreement is not None and not 0.0 < float(min_agreement) <= 1.0:
        raise TideTargetError(f"min_agreement must be in (0, 1], got {min_agreement}")
    if max_perplexity_increase is not None and not 0.0 <= float(max_perplexity_increase) < math.inf:
        raise TideTargetError(f"max_perplexity_increase must be a finite number >= 0, got {max_perplexity_increase}")
    if not 0.0 < float(confidence) < 1.0:
        raise TideTargetError(f"confidence must be in (0, 1), got {confidence}")
    kind = PATH_KINDS[0] if min_agreement is not None else PATH_KINDS[1]
    path = paths.get(kind)
    if not path:
        raise TideTargetError(f"this router has no calibrated {kind} path: recalibrate it with this tide_hf "
                              "version, or pass exit_threshold=")
    return kind


def select(paths: dict[str, Any], checkpoints: list[int], *, min_agreement: float | None = None,
           max_perplexity_increase: float | None = None, confidence: float) -> dict[int, float]:
    """Per-checkpoint thresholds (`CLOSED` = that checkpoint never exits) of the last path point whose risk is
    certified within the target(s) by fixed-sequence testing at level 1 - `confidence`."""
    kind = target_path(paths, min_agreement=min_agreement, max_perplexity_increase=max_perplexity_increase,
                       confidence=confidence)
    path = paths[kind]
    delta = 1.0 - float(confidence)
    chosen, tested = None, False
    for j in range(len(path["thresholds"])):
        if all(float(t) >= CLOSED for t in path["thresholds"][j]):  # every checkpoint closed (the path's start):
            chosen = j  # nothing exits, so the risk is 0 by construction, not a hypothesis to test
            continue
        pvalues, silent = [], False
        if min_agreement is not None:
            pvalues.append(binomial_pvalue(int(path["errors"][j]), int(path["n"]), 1.0 - float(min_agreement)))
        if max_perplexity_increase is not None:
            # Each point lets exit every token the one before did, so points where no threshold-split NLL changed
            # (no token exited there) come first: they carry no evidence, so they are passed over, never chosen.
            silent = not tested and path["nll_sumsq"][j] == 0.0
            if not silent:
                pvalues.append(normal_pvalue(path["nll_sum"][j], path["nll_sumsq"][j], int(path["n_next"]),
                                             math.log1p(float(max_perplexity_increase))))
        if pvalues and max(pvalues) > delta:
            break
        if not silent:
            chosen, tested = j, True
    if chosen is None:  # not even the first point: every checkpoint stays closed
        return dict.fromkeys(checkpoints, CLOSED)
    return {k: float(t) for k, t in zip(checkpoints, path["thresholds"][chosen])}


def reselect(paths: dict[str, Any], held_out: HeldOut | None, checkpoints: list[int],
             closed: set[int] | frozenset[int], *,
             min_agreement: float | None = None, max_perplexity_increase: float | None = None,
             confidence: float) -> dict[int, float]:
    """`select` on the stored path with every checkpoint of `closed` held `CLOSED`: the path's threshold vectors in
    order (the one `select` would test), those checkpoints closed on each, consecutive repeats dropped, losses
    counted again on the threshold tokens (`held_out`'s test split). The order never depended on that split, so
    fixed-sequence testing along the edited path keeps the guarantee; with nothing closed it gives `select`'s
    thresholds."""
    kind = target_path(paths, min_agreement=min_agreement, max_perplexity_increase=max_perplexity_increase,
                       confidence=confidence)
    if held_out is None:
        raise TideTargetError("this router keeps no held-out scores (calibrated before they were kept): recalibrate "
                              "it, or attach with pricing=False")
    if not isinstance(held_out, HeldOut):
        raise TideArgumentTypeError(f"held_out must be a HeldOut or None, got {type(held_out).__name__}")
    held_out.check_checkpoints(checkpoints)
    closed = set(closed)
    unknown = sorted(closed - set(checkpoints), key=str)
    if unknown:
        raise TideArgumentError(f"closed names {unknown}, not among the router's checkpoints {list(checkpoints)}")
    shut = [j for j, k in enumerate(checkpoints) if k in closed]
    points: list[list[float]] = []
    for point in paths[kind]["thresholds"]:
        edited = [CLOSED if j in shut else float(t) for j, t in enumerate(point)]
        if not points or edited != points[-1]:
            points.append(edited)
    losses = path_losses(points, held_out.test_scores, held_out.test_mismatch, held_out.test_nll)
    return select({kind: losses}, checkpoints, min_agreement=min_agreement,
                  max_perplexity_increase=max_perplexity_increase, confidence=confidence)


def check_served(thresholds: dict[int, float], min_layers: int, calibrated_min_layers: int) -> None:
    """Refuse thresholds that open a checkpoint below the `min_layers` served with: the exit path was tested
    with exits from `calibrated_min_layers` on, and closing an open checkpoint moves its tokens to later exits
    that the test never counted."""
    dropped = [k for k, t in thresholds.items() if t < CLOSED and k < min_layers]
    if dropped and min_layers == calibrated_min_layers:
        raise TideTargetError(
            f"this router's exit paths open checkpoints {dropped}, below its config's min_layers={min_layers}: the "
            "paths were fitted with them open (the config's min_layers was raised after calibration, e.g. by "
            "from_pretrained(..., min_layers=), or a tide_hf older than the fix that keeps them closed calibrated "
            "it), so its targets are not certified for the exits it would serve; keep the min_layers it was "
            "calibrated with, recalibrate, or pass exit_threshold=")
    if dropped:
        raise TideTargetError(
            f"the thresholds for this target open checkpoints {dropped}, below min_layers={min_layers}: the target "
            f"is certified for the router's min_layers={calibrated_min_layers}, and closing them changes which "
            "tokens exit where; keep the router's min_layers, recalibrate with this one, or pass exit_threshold=")
