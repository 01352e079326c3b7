"""Router training: class-balanced BCE with Adam, the best held-out epoch kept, and validation metrics."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from ..config import LABEL_KINDS
from ..modeling import TideRouter
from .labels import Collected


def auc(scores: torch.Tensor, labels: torch.Tensor) -> float | None:
    """Area under the ROC curve via the rank-sum statistic (None when only one class is present).

    Tied scores (e.g. sigmoids saturated at exactly 1.0) get their average rank, so a tie counts 1/2.
    """
    pos, neg = int(labels.sum()), int((~labels).sum())
    if pos == 0 or neg == 0:
        return None
    _, inverse, counts = torch.unique(scores, return_inverse=True, return_counts=True)
    ends = counts.cumsum(0).to(torch.float64)
    ranks = (ends - (counts.to(torch.float64) - 1) / 2)[inverse]  # mid-rank of each group of equal scores
    return float((ranks[labels].sum() - pos * (pos + 1) / 2) / (pos * neg))


def evaluate(scores: torch.Tensor, labels: torch.Tensor, threshold: float) -> dict[str, float | None]:
    """Validation metrics of one router at the serving threshold."""
    pred = scores >= threshold
    tp = int((pred & labels).sum())
    return {
        "positive_rate": float(labels.float().mean()) if len(labels) else None,
        "predicted_rate": float(pred.float().mean()) if len(pred) else None,
        "precision": tp / int(pred.sum()) if pred.any() else None,
        "recall": tp / int(labels.sum()) if labels.any() else None,
        "auc": auc(scores, labels),
    }


def train_routers(router: TideRouter, data: Collected, *, progress: bool = True) -> None:
    """Fit each checkpoint's MLP with class-balanced BCE and Adam; keep the epoch with the best held-out loss.

    A router stops after `early_stopping_patience` epochs without a better held-out loss: on SmolLM2 (2000
    SOTU samples) the best epoch was 2-8 of 100, and the epochs after it only overfit.
    """
    cfg = router.config
    gen = torch.Generator().manual_seed(cfg.seed)
    train, val = ~data.is_val, data.is_val & ~data.is_test  # the threshold split stays unseen
    if not train.any() or not val.any():
        raise ValueError(
            f"calibration kept {int(train.sum())} training and {int(val.sum())} held-out tokens; both must be > 0 "
            f"(raise max_train_tokens={cfg.max_train_tokens}, num_samples or "
            f"validation_fraction={cfg.validation_fraction})"
        )
    # one step per router; the postfix counts its epochs, which early stopping usually ends long before num_epochs
    bar = tqdm(total=len(cfg.checkpoint_layers), desc="tide_hf: training routers", disable=not progress,
               unit="router")
    for k in cfg.checkpoint_layers:
        mlp = router.routers[str(k)]
        x, y = data.features[k], data.labels(k, cfg).float()
        x_tr, y_tr, x_va, y_va = x[train], y[train], x[val], y[val]
        pos = float(y_tr.sum())
        neg = len(y_tr) - pos
        pos_weight = torch.tensor(neg / pos if pos and neg else 1.0)
        opt = torch.optim.Adam(mlp.parameters(), lr=cfg.learning_rate)
        best_loss, best_epoch, best_state = math.inf, -1, None
        for epoch in range(cfg.num_epochs):
            for idx in torch.randperm(len(y_tr), generator=gen).split(cfg.train_batch_size):
                loss = F.binary_cross_entropy_with_logits(mlp(x_tr[idx]), y_tr[idx], pos_weight=pos_weight)
                opt.zero_grad()
                loss.backward()
                opt.step()
            with torch.no_grad():
                val_loss = float(F.binary_cross_entropy_with_logits(mlp(x_va), y_va, pos_weight=pos_weight))
            if val_loss < best_loss:
                best_loss, best_epoch = val_loss, epoch
                best_state = {n: t.detach().clone() for n, t in mlp.state_dict().items()}
            bar.set_postfix_str(f"layer {k}: epoch {epoch + 1}, best {best_epoch + 1}")
            if cfg.early_stopping_patience and epoch - best_epoch >= cfg.early_stopping_patience:
                break
        bar.update()
        mlp.load_state_dict(best_state)
        with torch.no_grad():
            scores = torch.sigmoid(mlp(x_va))
        cfg.metrics[str(k)] = {
            **evaluate(scores, y_va.bool(), cfg.exit_threshold),
            "best_epoch": best_epoch,
            "val_loss": best_loss,
            "n_train": int(len(y_tr)),
            "n_val": int(len(y_va)),
            "label_rates": {kind: data.label_rate(kind, k, cfg) for kind in LABEL_KINDS},
        }
    bar.close()

