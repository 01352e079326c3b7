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
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import torch

from ..errors import TideArgumentTypeError, TideTargetError
from ..record import CLOSED, PATH_KINDS


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


def select(paths: dict[str, Any], checkpoints: list[int], *, min_agreement: float | None = None,
           max_perplexity_increase: float | None = None, confidence: float) -> dict[int, float]:
    """Per-checkpoint thresholds (`CLOSED` = that checkpoint never exits) of the last path point whose risk is
    certified within the target(s) by fixed-sequence testing at level 1 - `confidence`."""
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
