"""Router training (`train_routers`, every checkpoint at once): the same routers as the per-checkpoint loop it
replaced (kept below as the reference), class balancing, best-epoch selection, early stopping per checkpoint,
and single-class labels that stop at once."""

from __future__ import annotations

import importlib
import math

import pytest
import torch
import torch.nn.functional as F

from tide_hf import TideRouter, TideRouterConfig
from tide_hf.calibration.labels import Collected
from tide_hf.calibration.training import SATURATED_LOGIT, train_routers
from tide_hf.errors import TideArgumentError

training_mod = importlib.import_module("tide_hf.calibration.training")
HIDDEN = 8
WEIGHT_TOL = 1e-4  # batched (bmm) and per-router (mm) float32 sums round differently; Adam carries it along
LOSS_TOL = 1e-5


def reference_train(router: TideRouter, data: Collected) -> dict[int, dict]:
    """The per-checkpoint loop `train_routers` replaced (torch.optim.Adam, one router after the other), except
    that each checkpoint's shuffle generator starts from the seed (the old loop shared one generator across
    checkpoints, so the first checkpoint's shuffles are the old ones). Returns per checkpoint the held-out
    loss of every epoch run and the best epoch."""
    cfg = router.config
    train, val = ~data.is_val, data.is_val & ~data.is_test
    out = {}
    for k in cfg.checkpoint_layers:
        gen = torch.Generator().manual_seed(cfg.seed)
        mlp = router.routers[str(k)]
        x, y = data.features[k], data.labels(k, cfg).float()
        x_tr, y_tr, x_va, y_va = x[train], y[train], x[val], y[val]
        pos = float(y_tr.sum())
        neg = len(y_tr) - pos
        pos_weight = torch.tensor(neg / pos if pos and neg else 1.0)
        opt = torch.optim.Adam(mlp.parameters(), lr=cfg.learning_rate)
        best_loss, best_epoch, best_state, losses = math.inf, -1, None, []
        for epoch in range(cfg.num_epochs):
            for idx in torch.randperm(len(y_tr), generator=gen).split(cfg.train_batch_size):
                loss = F.binary_cross_entropy_with_logits(mlp(x_tr[idx]), y_tr[idx], pos_weight=pos_weight)
                opt.zero_grad()
                loss.backward()
                opt.step()
            with torch.no_grad():
                losses.append(float(F.binary_cross_entropy_with_logits(mlp(x_va), y_va, pos_weight=pos_weight)))
            if losses[-1] < best_loss:
                best_loss, best_epoch = losses[-1], epoch
                best_state = {n: t.detach().clone() for n, t in mlp.state_dict().items()}
            if cfg.early_stopping_patience and epoch - best_epoch >= cfg.early_stopping_patience:
                break
        mlp.load_state_dict(best_state)
        out[k] = {"losses": losses, "best_epoch": best_epoch}
    return out


def collected(features: dict[int, torch.Tensor], labels: dict[int, torch.Tensor], is_val: torch.Tensor) -> Collected:
    """Synthetic collected tokens: `labels` as the top1 label of each checkpoint."""
    n = len(is_val)
    hidden = next(iter(features.values())).shape[1]
    return Collected(features=features, cosine={k: torch.zeros(n) for k in features},
                     final=torch.zeros(n, hidden), next_ids=torch.zeros(n, dtype=torch.long),
                     final_top1=torch.zeros(n, dtype=torch.long), top1=labels,
                     kl={k: torch.zeros(n) for k in features}, nll={k: torch.zeros(n) for k in features},
                     is_val=is_val, is_test=torch.zeros(n, dtype=torch.bool),
                     labelled={kind: torch.ones(n, dtype=torch.bool) for kind in ("top1", "kl", "top1_kl")},
                     seconds={})


def make_router(layers: int = 5, **kwargs) -> TideRouter:
    torch.manual_seed(0)
    return TideRouter(TideRouterConfig(hidden_size=HIDDEN, num_hidden_layers=layers, checkpoint_interval=4,
                                       router_bottleneck_dim=16, label="top1", **kwargs))


def drifting(n: int = 1000, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Validation labels follow x0 + x1, training labels x0: the held-out loss first falls, then rises as the
    router grows confident, so the best epoch is early and later epochs are clearly worse."""
    x = torch.randn(n, HIDDEN, generator=torch.Generator().manual_seed(seed))
    is_val = torch.arange(n) >= int(0.8 * n)
    return x, torch.where(is_val, x[:, 0] + x[:, 1] > 0, x[:, 0] > 0), is_val


def four_checkpoints() -> tuple[Collected, dict]:
    """Checkpoints 4, 8, 12, 16 of a 17-layer model: two that stop early at different epochs, one that keeps
    improving (separable), one whose label has no positive token."""
    x, y_drift, is_val = drifting()
    x2, y_drift2, _ = drifting(seed=1)
    x3 = torch.randn(1000, HIDDEN, generator=torch.Generator().manual_seed(2))
    features = {4: x, 8: x2, 12: x3, 16: x3 * 2}
    labels = {4: y_drift, 8: y_drift2, 12: x3[:, 2] > 0.5, 16: torch.zeros(1000, dtype=torch.bool)}
    return collected(features, labels, is_val), dict(layers=17, num_epochs=15, learning_rate=1e-2,
                                                     train_batch_size=64, early_stopping_patience=3)


def test_batched_training_gives_the_per_checkpoint_loops_routers(monkeypatch) -> None:
    data, settings = four_checkpoints()
    ref_router, router = make_router(**settings), make_router(**settings)
    assert all(torch.equal(a, b) for a, b in zip(ref_router.parameters(), router.parameters()))
    reference = reference_train(ref_router, data)
    stacks = []  # routers in the stack at every Adam step
    adam_step = training_mod.adam_step
    monkeypatch.setattr(training_mod, "adam_step", lambda params, *a: (stacks.append(len(params[0])),
                                                                        adam_step(params, *a)))
    train_routers(router, data, progress=False)
    metrics = router.config.metrics
    learnt = [4, 8, 12]
    epochs = {k: len(reference[k]["losses"]) for k in learnt}
    assert len(set(epochs.values())) >= 2 and max(epochs.values()) <= 15, epochs  # stops differ per checkpoint
    for k in learnt:
        a, b = ref_router.routers[str(k)].state_dict(), router.routers[str(k)].state_dict()
        for name in a:
            torch.testing.assert_close(b[name], a[name], atol=WEIGHT_TOL, rtol=WEIGHT_TOL)
        assert metrics[str(k)]["best_epoch"] == reference[k]["best_epoch"]
        assert metrics[str(k)]["epochs"] == epochs[k]
        assert metrics[str(k)]["val_loss"] == pytest.approx(min(reference[k]["losses"]), abs=LOSS_TOL)
    # each Adam step updates exactly the checkpoints still training: a finished one stops, the silent one never
    steps_per_epoch = math.ceil(800 / 64)
    expected = [sum(epochs[k] > epoch for k in learnt) for epoch in range(max(epochs.values()))]
    assert stacks == [n for n in expected for _ in range(steps_per_epoch)]


def test_single_class_label_stops_at_once() -> None:
    """No positive (or no negative) training token: no epoch, a constant router that never (always) fires."""
    data, settings = four_checkpoints()
    data.top1[12] = torch.ones(1000, dtype=torch.bool)
    router = make_router(**settings)
    train_routers(router, data, progress=False)
    for layer, sign in ((16, -1), (12, 1)):
        m = router.config.metrics[str(layer)]
        assert (m["epochs"], m["best_epoch"]) == (0, None)
        with torch.no_grad():
            logits = router.routers[str(layer)](data.features[layer])
        assert torch.equal(logits, torch.full_like(logits, sign * SATURATED_LOGIT))
    assert router.config.metrics["16"]["predicted_rate"] == 0.0 and router.config.metrics["16"]["recall"] is None
    assert router.config.metrics["12"]["predicted_rate"] == 1.0 and router.config.metrics["12"]["precision"] == 1.0
    assert router.config.metrics["4"]["epochs"] > 0


def test_train_routers_balances_rare_positives() -> None:
    """Linearly separable, ~5% positives: class-balanced BCE must reach high recall at exit threshold 0.85
    (plain BCE predicts no positive at all at 0.85 with these settings: recall 0)."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(6000, HIDDEN, generator=gen)
    x = x[(x[:, 0] - 1.5).abs() > 0.25][:3000]  # a margin around the boundary
    y = x[:, 0] > 1.5
    is_val = torch.arange(3000) >= 2400
    assert 0.03 < float(y.float().mean()) < 0.07 and int(y[is_val].sum()) >= 15
    router = make_router(num_epochs=10, learning_rate=1e-2, train_batch_size=256)
    train_routers(router, collected({4: x}, {4: y}, is_val), progress=False)
    m = router.config.metrics["4"]
    assert m["positive_rate"] == pytest.approx(float(y[is_val].float().mean()))
    assert m["recall"] >= 0.9 and m["precision"] >= 0.9 and m["auc"] > 0.99, m
    assert (m["n_train"], m["n_val"]) == (2400, 600)


def test_train_routers_keeps_best_epoch() -> None:
    x, y, is_val = drifting()
    epochs = 12
    losses = reference_train(make_router(num_epochs=epochs, learning_rate=1e-2, train_batch_size=64,
                                         early_stopping_patience=0), collected({4: x}, {4: y}, is_val))[4]["losses"]
    best = min(range(epochs), key=losses.__getitem__)
    assert 0 < best < epochs - 1 and losses[-1] > losses[best] + 0.1  # the data is built so this can fail
    router = make_router(num_epochs=epochs, learning_rate=1e-2, train_batch_size=64, early_stopping_patience=0)
    train_routers(router, collected({4: x}, {4: y}, is_val), progress=False)
    m = router.config.metrics["4"]
    assert (m["best_epoch"], m["epochs"]) == (best, epochs)
    # the weights returned are the best epoch's: recompute its held-out loss from them
    y_tr = y[~is_val].float()
    pos_weight = torch.tensor(float((1 - y_tr).sum() / y_tr.sum()))
    with torch.no_grad():
        again = F.binary_cross_entropy_with_logits(router.routers["4"](x[is_val]), y[is_val].float(),
                                                   pos_weight=pos_weight)
    assert float(again) == pytest.approx(losses[best], abs=LOSS_TOL) == m["val_loss"]


@pytest.mark.parametrize("patience", [1, 2, 4])
def test_train_routers_stops_early_after_patience(patience: int) -> None:
    """A router trains until `patience` epochs passed without a better held-out loss than its best (the losses
    of the full run tell when), and keeps the best epoch."""
    x, y, is_val = drifting()
    data = collected({4: x}, {4: y}, is_val)
    full = reference_train(make_router(num_epochs=12, learning_rate=1e-2, train_batch_size=64,
                                       early_stopping_patience=0), data)[4]["losses"]
    stop = next(e for e in range(12) if e - min(range(e + 1), key=full.__getitem__) >= patience)
    assert stop < 11
    router = make_router(num_epochs=12, learning_rate=1e-2, train_batch_size=64, early_stopping_patience=patience)
    train_routers(router, data, progress=False)
    m = router.config.metrics["4"]
    assert m["epochs"] == stop + 1
    assert m["best_epoch"] == min(range(stop + 1), key=full.__getitem__)
    assert m["val_loss"] == pytest.approx(min(full[: stop + 1]), abs=LOSS_TOL)


def test_train_routers_needs_held_out_and_training_tokens() -> None:
    x, y = torch.randn(50, HIDDEN), torch.rand(50) > 0.5
    with pytest.raises(TideArgumentError, match=r"no held-out validation tokens .*validation_fraction"):
        train_routers(make_router(num_epochs=1), collected({4: x}, {4: y}, torch.zeros(50, dtype=torch.bool)),
                      progress=False)
    with pytest.raises(TideArgumentError, match=r"no training tokens .*max_train_tokens"):
        train_routers(make_router(num_epochs=1), collected({4: x}, {4: y}, torch.ones(50, dtype=torch.bool)),
                      progress=False)
