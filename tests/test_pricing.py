"""Skip mode prices its exits: the costs it measures once per model, the checkpoints it closes (the others'
thresholds selected again, the quality target still held on held-out text), stepping aside where plain steps
are faster, and pricing off serving exactly the target's thresholds."""

from __future__ import annotations

import copy

import pytest
import torch

import tide_hf
import tide_hf.runtime.aside as aside
import tide_hf.runtime.costs as costs
from tide_hf.compat import cache_in, with_cache
from tide_hf.errors import TideArgumentError, TideArgumentTypeError, TideTargetError
from tide_hf.modeling.targets import exit_shares, reselect, select
from tide_hf.record import CLOSED
from tide_hf.runtime.costs import StepCosts

CONFIDENCE = 0.9
TARGET = 0.8  # an agreement the near-identity model certifies at several checkpoints
HELD_OUT_ROWS = 10  # held-out samples decoded token by token (320 positions)
# An exit saves 1 ms at checkpoint 2 and loses 1 ms at 8 (interpolated: it stops paying past 5); scoring is cheap.
FIXED = StepCosts(plain_step_s=1e-3, saving_s={2: 1e-3, 8: -1e-3}, score_s=1e-6, measure_s=0.0)


@pytest.fixture
def calibrated(near_identity_calibration):
    """(model, router, held-out samples) of `near_identity_calibration`; tests attach to copies of the model."""
    return near_identity_calibration


@pytest.fixture
def fixed_costs(monkeypatch):
    """Measuring returns `FIXED` (and counts its calls): pricing's decisions no longer depend on the machine."""
    calls = []
    monkeypatch.setattr(costs, "measure", lambda model, handle, layers, timed: calls.append(timed) or FIXED)
    return calls


def test_pricing_off_serves_the_targets_thresholds_exactly(calibrated) -> None:
    model, router, _ = calibrated
    cfg = router.config
    with tide_hf.attach(copy.deepcopy(model), router, mode="skip", min_agreement=TARGET, pricing=False) as handle:
        assert handle.options.thresholds == select(cfg.exit_paths, cfg.checkpoint_layers, min_agreement=TARGET,
                                                   confidence=cfg.confidence)
        assert handle.thresholds == handle.options.thresholds and handle.options.priced is None
        handle.model(input_ids=torch.tensor([[5, 6, 7]]))
        assert handle.last_stats.pricing is None and handle.last_stats.aside is None


def test_closing_checkpoints_reselects_the_others_and_every_open_one_pays(calibrated, fixed_costs) -> None:
    model, router, _ = calibrated
    cfg, held = router.config, router.held_out
    before = select(cfg.exit_paths, cfg.checkpoint_layers, min_agreement=TARGET, confidence=cfg.confidence)
    with tide_hf.attach(copy.deepcopy(model), router, mode="skip", min_agreement=TARGET) as handle:
        priced, thresholds = handle.options.priced, handle.options.thresholds
    assert fixed_costs == [[2, 8]]  # the first and last checkpoint a token may exit at
    closed = priced["closed"]
    assert closed and all(thresholds[k] == CLOSED for k in closed)
    assert priced["thresholds_before"] == before
    assert thresholds == reselect(cfg.exit_paths, held, cfg.checkpoint_layers, set(closed), min_agreement=TARGET,
                                  confidence=cfg.confidence)
    assert thresholds != {k: CLOSED if k in closed else t for k, t in before.items()}  # selected again
    exits, reach = exit_shares(held.order_scores, thresholds, cfg.checkpoint_layers)
    for k, t in thresholds.items():  # by hand: each open checkpoint saves more than its scoring costs
        if t < CLOSED:
            saving = 1e-3 - (k - 2) * (2e-3 / 6)
            assert exits[k] * saving - reach[k] * FIXED.score_s >= 0, k


def test_the_target_holds_on_held_out_text_with_pricing_on(calibrated, fixed_costs) -> None:
    """Held-out samples fed one token at a time (decode steps, batch 1, given the samples as the prefix): skip
    mode's top-1 (exits at the priced, re-selected thresholds) agrees with the model's own on at least the
    target's share of positions, and some positions exited."""
    model, router, held_out = calibrated
    model = copy.deepcopy(model)
    agree = total = exited = 0
    with torch.no_grad():
        stock = model(input_ids=held_out).logits.argmax(-1)
        with tide_hf.attach(model, router, mode="skip", min_agreement=TARGET) as handle:
            for row in range(HELD_OUT_ROWS):
                cache = None
                for position in range(held_out.shape[1]):
                    token = held_out[row : row + 1, position : position + 1]
                    out = model(**with_cache({"input_ids": token, "use_cache": True}, cache))
                    cache = cache_in(out)
                    agree += int(out.logits[0, -1].argmax() == stock[row, position])
                    exited += handle.last_stats.prefill.exit_rate > 0
                    total += 1
    assert handle.options.priced["closed"] and exited > 0
    assert agree / total >= TARGET, (agree, total, exited)


def test_costs_are_measured_once_per_model_on_the_real_model(calibrated) -> None:
    model, router, _ = calibrated
    model = copy.deepcopy(model)
    first = tide_hf.attach(model, router, mode="skip", min_agreement=TARGET)
    measured = first.options.priced["costs"]
    first.detach()
    assert measured["plain_step_ms"] > 0 and measured["score_ms"] > 0 and sorted(measured["exit_saves_ms"]) == [2, 8]
    with tide_hf.attach(model, router, mode="skip", min_agreement=TARGET) as again:
        assert again.options.priced["costs"] == measured  # remembered, not measured again
    assert tide_hf.last_stats(model) is None  # measuring left no stats of its own


def test_stepping_aside_is_reported_and_its_steps_exit_nowhere(calibrated, fixed_costs, monkeypatch) -> None:
    """TIDE's steps timed as slower than plain ones: after a window and a probe, the call steps aside; its plain
    steps decide no exits, and `last_stats` counts them."""
    model, router, _ = calibrated
    monkeypatch.setattr(aside, "WINDOW", 2)
    monkeypatch.setattr(aside, "PROBES", 1)
    monkeypatch.setattr(aside, "ASIDE", 100)
    monkeypatch.setattr(aside, "MAX_DEFER", 0)  # (this model exits at nearly every step: probes would wait)
    real = aside.StepAside.record
    monkeypatch.setattr(aside.StepAside, "record", lambda self, seconds, plain, report:
                        real(self, seconds if plain else seconds + 1.0, plain, report))  # TIDE "1 s slower"
    model = copy.deepcopy(model)
    with tide_hf.attach(model, router, mode="skip", min_agreement=TARGET) as handle:
        model.generate(input_ids=torch.tensor([[5, 6, 7, 8]]), max_new_tokens=12, do_sample=False)
        stats = handle.last_stats
    report = stats.aside
    assert report["stepped_aside"] == 1 and report["probes"] == 1
    assert report["tide_steps"] == 2 and report["plain_steps"] == 9  # 11 decode steps: 2 timed, 1 probe, 8 aside
    assert sum(n for k, n in stats.decode.exits.items() if k < stats.num_layers) <= report["tide_steps"]
    assert "stepped aside 1 time(s)" in stats.summary()


def test_pricing_reports_and_refuses_what_it_cannot_do(calibrated, fixed_costs) -> None:
    model, router, _ = calibrated
    model = copy.deepcopy(model)
    with tide_hf.attach(model, router, mode="skip", min_agreement=TARGET) as handle:
        model(input_ids=torch.tensor([[5, 6, 7]]))
        assert handle.last_stats.summary().splitlines()[1].startswith("pricing closed L")
        assert handle.last_stats.as_dict()["pricing"]["closed"] == handle.options.priced["closed"]
    config = copy.deepcopy(router.config)  # the same router as one calibrated before held-out scores were kept
    config.held_out_tokens = None
    older = tide_hf.TideRouter(config)
    older.load_state_dict({k: v for k, v in router.state_dict().items() if not k.startswith("held_out")})
    with pytest.raises(TideTargetError, match="pricing=False"):
        tide_hf.attach(model, older, mode="skip", min_agreement=TARGET, pricing=True)
    with tide_hf.attach(model, older, mode="skip", min_agreement=TARGET) as unpriced:  # the default: said, served
        assert unpriced.options.priced["closed"] == [] and "no held-out scores" in unpriced.options.priced["note"]
        assert unpriced.thresholds == select(config.exit_paths, config.checkpoint_layers, min_agreement=TARGET,
                                             confidence=config.confidence)
    with pytest.raises(TideArgumentError, match="mode='skip' only"):
        tide_hf.attach(model, router, mode="select", pricing=True)
    with pytest.raises(TideArgumentTypeError, match="pricing must be True, False or None"):
        tide_hf.attach(model, router, mode="skip", pricing="yes")
    with tide_hf.attach(model, router, mode="skip", exit_threshold=0.9) as explicit:  # a threshold given: as given
        assert explicit.options.priced is None and explicit.thresholds == dict.fromkeys([2, 4, 6, 8], 0.9)


def test_a_step_too_wide_for_an_exit_to_pay_runs_plain(calibrated, fixed_costs) -> None:
    """kv="recompute" skips a step's layers only where every position exits: a prefill of 4 rows x 8 tokens cannot
    pay (`pricing.pays_at`), so it runs as stock (the same logits, no exit); one-token steps still exit."""
    model, router, held_out = calibrated
    model = copy.deepcopy(model)
    wide = held_out[:4, :8]
    with torch.no_grad():
        stock = model(input_ids=wide).logits
        with tide_hf.attach(model, router, mode="skip", min_agreement=TARGET) as handle:
            assert handle.whole_steps
            served = model(input_ids=wide).logits
            assert handle.last_stats.prefill.exit_rate == 0.0
            exited = 0
            for token in held_out[0, :16]:
                model(input_ids=token.reshape(1, 1))
                exited += handle.last_stats.prefill.exit_rate > 0
    assert torch.equal(served, stock) and exited > 0
