"""Held-out scores kept with the router: calibration stores the matrices its exit paths were ordered and tested on,
they round-trip through the router's files, `exit_shares` prices thresholds with them, and `reselect` re-selects
thresholds with checkpoints closed, with the same Learn-then-Test guarantee (checked by hand on the test split)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from helpers import make_model, new_router

import tide_hf
from tide_hf.errors import TideArgumentError, TideArgumentTypeError, TideTargetError
from tide_hf.modeling.targets import HeldOut, exit_shares, path_losses, reselect, select
from tide_hf.record import CLOSED

FIXTURE = Path(__file__).parent / "fixtures" / "router-0.1.0"
CONFIDENCE = 0.9
AGREEMENTS = (0.5, 0.7, 0.8, 0.9, 0.95)
PERPLEXITY_INCREASES = (0.05, 0.2, 1.0)


@pytest.fixture
def calibrated(near_identity_calibration) -> tide_hf.TideRouter:
    """The router of `near_identity_calibration`: exits certify at every one of its four checkpoints, 2, 4, 6, 8."""
    return near_identity_calibration[1]


def by_hand_exits(scores: torch.Tensor, thresholds: list[float]) -> list[int]:
    """Per token, the column it exits at under the serving rule (the first open checkpoint whose score reaches its
    threshold), len(thresholds) when none: a plain loop, independent of `exit_index`."""
    exits = []
    for row in scores.tolist():
        exits.append(next((j for j, (s, t) in enumerate(zip(row, thresholds)) if t < CLOSED and s >= t),
                          len(thresholds)))
    return exits


def binomial_tail(errors: int, n: int, alpha: float) -> float:
    """P(Binomial(n, alpha) <= errors), summed term by term in logs."""
    return sum(math.exp(math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1) + k * math.log(alpha)
                        + (n - k) * math.log1p(-alpha)) for k in range(errors + 1))


def targets() -> list[dict[str, float]]:
    return [{"min_agreement": a} for a in AGREEMENTS] + [{"max_perplexity_increase": e} for e in PERPLEXITY_INCREASES]


def test_calibration_keeps_the_matrices_its_paths_were_counted_on(calibrated) -> None:
    held_out, cfg = calibrated.held_out, calibrated.config
    assert isinstance(held_out, HeldOut) and cfg.held_out_tokens == [len(held_out.order_scores),
                                                                     len(held_out.test_scores)]
    assert held_out.order_scores.shape[1] == len(cfg.checkpoint_layers) and held_out.test_mismatch.dtype == torch.bool
    assert held_out.test_nll.isnan().any() and not held_out.test_nll.isnan().all()  # the samples' last tokens
    for kind, path in cfg.exit_paths.items():
        assert path_losses(path["thresholds"], held_out.test_scores, held_out.test_mismatch,
                           held_out.test_nll) == path, kind
    assert path["n"] == len(held_out.test_scores)
    assert not any(name.startswith("held_out") for name, _ in calibrated.named_parameters())  # never trained


@pytest.mark.parametrize("target", targets(), ids=str)
def test_nothing_closed_gives_select(calibrated, target) -> None:
    cfg = calibrated.config
    want = select(cfg.exit_paths, cfg.checkpoint_layers, confidence=CONFIDENCE, **target)
    assert reselect(cfg.exit_paths, calibrated.held_out, cfg.checkpoint_layers, set(), confidence=CONFIDENCE,
                    **target) == want


def test_closed_checkpoints_are_closed_and_the_agreement_target_still_holds(calibrated) -> None:
    cfg, held_out = calibrated.config, calibrated.held_out
    layers = cfg.checkpoint_layers
    n = len(held_out.test_scores)
    tested, reselected = 0, 0
    for agreement in AGREEMENTS:
        plain = select(cfg.exit_paths, layers, min_agreement=agreement, confidence=CONFIDENCE)
        for shut in [{k} for k in layers] + [set(layers[:2])]:
            chosen = reselect(cfg.exit_paths, held_out, layers, shut, min_agreement=agreement,
                              confidence=CONFIDENCE)
            assert set(chosen) == set(layers) and all(chosen[k] == CLOSED for k in shut)
            vector = [chosen[k] for k in layers]
            if all(t == CLOSED for t in vector):
                continue
            first = by_hand_exits(held_out.test_scores, vector)
            errors = sum(bool(held_out.test_mismatch[i, j]) for i, j in enumerate(first) if j < len(layers))
            assert binomial_tail(errors, n, 1.0 - agreement) <= 1.0 - CONFIDENCE, (agreement, shut, errors)
            tested += 1
            reselected += any(chosen[k] != plain[k] for k in layers if k not in shut)
    assert tested, "no closed set left an open checkpoint: nothing was checked"
    assert reselected, "closing checkpoints never changed the others' thresholds: nothing was re-selected"


def test_perplexity_reselection_keeps_closed_checkpoints_closed(calibrated) -> None:
    cfg, layers = calibrated.config, calibrated.config.checkpoint_layers
    for increase in PERPLEXITY_INCREASES:
        for k in layers:
            chosen = reselect(cfg.exit_paths, calibrated.held_out, layers, frozenset({k}),
                              max_perplexity_increase=increase, confidence=CONFIDENCE)
            assert chosen[k] == CLOSED


def test_exit_shares_count_the_serving_rule() -> None:
    scores = torch.tensor([[0.9, 0.1, 0.1], [0.2, 0.8, 0.1], [0.2, 0.3, 0.95], [0.1, 0.1, 0.1], [0.95, 0.95, 0.95]])
    exits, reached = exit_shares(scores, {2: 0.5, 4: 0.7, 6: CLOSED}, [2, 4, 6])
    assert exits == {2: 0.4, 4: 0.2, 6: 0.0} and reached == pytest.approx({2: 1.0, 4: 0.6, 6: 0.4})


def test_exit_shares_match_a_count_on_the_calibrated_scores(calibrated) -> None:
    cfg, held_out = calibrated.config, calibrated.held_out
    layers = cfg.checkpoint_layers
    thresholds = select(cfg.exit_paths, layers, min_agreement=0.8, confidence=CONFIDENCE)
    first = by_hand_exits(held_out.order_scores, [thresholds[k] for k in layers])
    n = len(first)
    exits, reached = exit_shares(held_out.order_scores, thresholds, layers)
    assert any(exits.values())
    for j, k in enumerate(layers):
        assert exits[k] == pytest.approx(sum(f == j for f in first) / n)
        assert reached[k] == pytest.approx(sum(f >= j for f in first) / n)


def test_exit_shares_and_reselect_refuse_bad_input(calibrated) -> None:
    cfg, held_out = calibrated.config, calibrated.held_out
    layers = cfg.checkpoint_layers
    with pytest.raises(TideArgumentError, match="checkpoint columns"):
        exit_shares(held_out.order_scores, dict.fromkeys(layers[:2], 0.5), layers[:2])
    with pytest.raises(TideArgumentError, match="missing \\[8\\]"):
        exit_shares(held_out.order_scores, dict.fromkeys(layers[:3], 0.5), layers)
    with pytest.raises(TideArgumentError, match="checkpoint columns"):
        reselect(cfg.exit_paths, held_out, layers[:2], set(), min_agreement=0.9, confidence=CONFIDENCE)
    with pytest.raises(TideArgumentError, match="not among the router's checkpoints"):
        reselect(cfg.exit_paths, held_out, layers, {3}, min_agreement=0.9, confidence=CONFIDENCE)
    with pytest.raises(TideArgumentTypeError, match="test_mismatch must be a bool tensor"):
        HeldOut(held_out.order_scores, held_out.test_scores, held_out.test_mismatch.int(), held_out.test_nll)
    with pytest.raises(TideArgumentError, match="one row per threshold token"):
        HeldOut(held_out.order_scores, held_out.test_scores, held_out.test_mismatch[1:], held_out.test_nll)


def test_held_out_survives_save_and_load(calibrated, tmp_path: Path) -> None:
    calibrated.save_pretrained(tmp_path / "r")
    loaded = tide_hf.TideRouter.from_pretrained(tmp_path / "r")
    want, got = calibrated.held_out, loaded.held_out
    assert loaded.config.held_out_tokens == calibrated.config.held_out_tokens
    for name in ("order_scores", "test_scores", "test_mismatch"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    assert torch.equal(got.test_nll.isnan(), want.test_nll.isnan())
    assert torch.equal(got.test_nll.nan_to_num(), want.test_nll.nan_to_num())
    features = {k: torch.randn(3, calibrated.config.hidden_size) for k in calibrated.checkpoint_layers}
    outputs, reloaded = calibrated(features), loaded(features)
    assert all(torch.equal(outputs[k], reloaded[k]) for k in outputs)


def test_routers_without_held_out_scores_load_and_refuse_to_reselect(tmp_path: Path) -> None:
    model = make_model()
    router = new_router(model)
    assert router.held_out is None and router.config.held_out_tokens is None
    router.save_pretrained(tmp_path / "r")
    assert tide_hf.TideRouter.from_pretrained(tmp_path / "r").held_out is None
    old = tide_hf.TideRouter.from_pretrained(FIXTURE)  # release 0.1.0's files
    assert old.held_out is None
    paths = {"agreement": {"thresholds": [[1.0, 1.0], [0.9, 1.0]], "errors": [0, 2], "n": 100,
                           "nll_sum": [0.0, 0.5], "nll_sumsq": [0.0, 0.5], "n_next": 90}}
    with pytest.raises(TideTargetError, match="pricing=False"):
        reselect(paths, router.held_out, router.checkpoint_layers, {4}, min_agreement=0.9, confidence=CONFIDENCE)


def test_held_out_tokens_are_checked() -> None:
    for value, error in (([5], TideArgumentTypeError), ("5,6", TideArgumentTypeError), ([5, -1], TideArgumentError),
                         ([5, 2.5], TideArgumentTypeError)):
        with pytest.raises(error, match="held_out_tokens"):
            new_router(make_model(), held_out_tokens=value)
    router = new_router(make_model(), held_out_tokens=(3, 4))
    assert router.config.held_out_tokens == [3, 4] and router.held_out.test_scores.shape == (4, 2)
