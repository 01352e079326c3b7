"""Router training: every checkpoint's router at once, as one batched model over the checkpoints (stacked
weights, batched matmuls) on the device the model runs on; class-balanced BCE, Adam, the best held-out epoch
kept, early stopping per checkpoint; and validation metrics.

Each checkpoint's router follows exactly the update rule of a loop training it alone: its own loss and
positive weight, its own Adam moments, and it stops updating when its own early stopping ends it. Every
checkpoint sees the same mini-batch order (one seeded shuffle per epoch). A checkpoint whose training label
has a single class gets a constant router at once (never fires for no positives, always for no negatives):
nothing can be learned from it, and calibration warns about a silent label (see `pipeline.warn_if_silent`).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from ..config import TideRouterConfig
from ..errors import TideArgumentError
from ..modeling import TideRouter
from ..settings import LABEL_KINDS
from .labels import Collected

ADAM_BETAS = (0.9, 0.999)  # torch.optim.Adam's defaults, which the routers were always trained with
ADAM_EPS = 1e-8
SATURATED_LOGIT = 10.0  # a single-class label's constant router: sigmoid(-10) < 5e-5; sigmoid(10) = 1 - 4.5e-5 stays
# below 1.0 (a closed threshold) in fp32 and after the exit paths' rounding, so an always-right checkpoint can open
DEVICE_MEMORY_SHARE = 0.5  # at most this share of the free accelerator memory holds training features at once


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
    """Validation metrics of one router at `threshold` (the config's global `exit_threshold`: the router card's
    table; a quality target serves per-checkpoint thresholds instead)."""
    pred = scores >= threshold
    tp = int((pred & labels).sum())
    return {
        "positive_rate": float(labels.float().mean()) if len(labels) else None,
        "predicted_rate": float(pred.float().mean()) if len(pred) else None,
        "precision": tp / int(pred.sum()) if pred.any() else None,
        "recall": tp / int(labels.sum()) if labels.any() else None,
        "auc": auc(scores, labels),
    }


def batched_logits(params: list[torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """Logits (A, n) of A stacked `RouterMLP`s (w1 (A, D, H), b1 (A, D), w2 (A, D), b2 (A,)) on x (A, n, H)."""
    w1, b1, w2, b2 = params
    hidden = torch.relu(torch.baddbmm(b1[:, None, :], x, w1.transpose(1, 2)))
    return torch.bmm(hidden, w2[:, :, None]).squeeze(-1) + b2[:, None]


def balanced_bce(logits: torch.Tensor, targets: torch.Tensor, pos_weight: torch.Tensor) -> torch.Tensor:
    """Each router's (row's) mean class-balanced BCE: positives weighted by its negatives / positives."""
    return F.binary_cross_entropy_with_logits(logits, targets, pos_weight=pos_weight[:, None],
                                              reduction="none").mean(1)


def adam_step(params: list[torch.Tensor], grads: tuple[torch.Tensor, ...],
              moments: list[tuple[torch.Tensor, torch.Tensor]], step: int, lr: float) -> None:
    """One step of torch.optim.Adam's rule (default betas and eps), elementwise, so stacking changes nothing."""
    beta1, beta2 = ADAM_BETAS
    step_size, root2 = lr / (1 - beta1**step), math.sqrt(1 - beta2**step)
    with torch.no_grad():
        for p, g, (m, v) in zip(params, grads, moments):
            m.lerp_(g, 1 - beta1)
            v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
            p.addcdiv_(m, (v.sqrt() / root2).add_(ADAM_EPS), value=-step_size)


def feature_groups(layers: list[int], data: Collected, device: torch.device) -> list[list[int]]:
    """Checkpoints trained together: all of them, unless their features would not fit on the accelerator."""
    if device.type != "cuda" or not layers:
        return [layers] if layers else []
    need = data.features[layers[0]].numel() * data.features[layers[0]].element_size() * 2  # features + held-out
    per = max(1, int(torch.cuda.mem_get_info(device)[0] * DEVICE_MEMORY_SHARE // need))
    return [layers[i : i + per] for i in range(0, len(layers), per)]


def fit_group(router: TideRouter, data: Collected, group: list[int], labels: dict[int, torch.Tensor],
              device: torch.device, bar: tqdm) -> dict[int, dict]:
    """Train the routers of checkpoints `group` at once on `device`; load each one's best epoch into `router`.
    Returns, per checkpoint, its best epoch and loss, the epochs it ran and its held-out scores."""
    cfg = router.config
    gen = torch.Generator().manual_seed(cfg.seed)
    train, val = ~data.is_val, data.is_val & ~data.is_test
    rows_tr, rows_va = train.nonzero().squeeze(1).to(device), val.nonzero().squeeze(1).to(device)
    xs = [data.features[k].to(device) for k in group]  # no copy when the features are there already
    x_va = torch.stack([x[rows_va] for x in xs])
    y_tr = torch.stack([labels[k][train] for k in group]).float().to(device)
    y_va = torch.stack([labels[k][val] for k in group]).float().to(device)
    pos = y_tr.sum(1)
    pos_weight = (y_tr.shape[1] - pos) / pos
    mlps = [router.routers[str(k)] for k in group]
    params = [torch.stack([m.fc1.weight for m in mlps]), torch.stack([m.fc1.bias for m in mlps]),
              torch.stack([m.fc2.weight[0] for m in mlps]), torch.stack([m.fc2.bias[0] for m in mlps])]
    params = [p.detach().to(device, torch.float32).requires_grad_() for p in params]
    moments = [(torch.zeros_like(p), torch.zeros_like(p)) for p in params]
    best = [[p[i].detach().clone() for p in params] for i in range(len(group))]  # until a better epoch
    best_loss, best_epoch, epochs = [math.inf] * len(group), [-1] * len(group), [0] * len(group)
    active = list(range(len(group)))  # positions in `group` still training, in the order of the stacks
    step = 0
    for epoch in range(cfg.num_epochs):
        order = torch.randperm(len(rows_tr), generator=gen).to(device)
        for idx in order.split(cfg.train_batch_size):
            rows = rows_tr[idx]
            loss = balanced_bce(batched_logits(params, torch.stack([xs[a][rows] for a in active])),
                                y_tr[:, idx], pos_weight)
            step += 1
            adam_step(params, torch.autograd.grad(loss.sum(), params), moments, step, cfg.learning_rate)
        with torch.no_grad():
            val_loss = balanced_bce(batched_logits(params, x_va), y_va, pos_weight).tolist()
        done = []
        for i, a in enumerate(active):
            epochs[a] = epoch + 1
            if val_loss[i] < best_loss[a]:
                best_loss[a], best_epoch[a] = val_loss[i], epoch
                best[a] = [p[i].detach().clone() for p in params]
            if cfg.early_stopping_patience and epoch - best_epoch[a] >= cfg.early_stopping_patience:
                done.append(i)
        bar.update()
        bar.set_postfix_str(f"{len(active) - len(done)} of {len(group)} routers training")
        if done:  # finished routers leave the stacks: they stop updating and cost nothing more
            keep = torch.tensor([i for i in range(len(active)) if i not in done], dtype=torch.long, device=device)
            active = [a for i, a in enumerate(active) if i not in done]
            params = [p.detach()[keep].requires_grad_() for p in params]
            moments = [(m[keep], v[keep]) for m, v in moments]
            x_va, y_tr, y_va, pos_weight = x_va[keep], y_tr[keep], y_va[keep], pos_weight[keep]
            if not active:
                bar.update(cfg.num_epochs - epoch - 1)
                break
    out = {}
    with torch.no_grad():
        x_va = torch.stack([x[rows_va] for x in xs])
        stacked = [torch.stack([best[a][j] for a in range(len(group))]) for j in range(len(params))]
        scores = torch.sigmoid(batched_logits(stacked, x_va)).cpu()
        for a, (k, mlp) in enumerate(zip(group, mlps)):
            w1, b1, w2, b2 = best[a]
            mlp.fc1.weight.copy_(w1)
            mlp.fc1.bias.copy_(b1)
            mlp.fc2.weight.copy_(w2[None])
            mlp.fc2.bias.copy_(b2[None])
            out[k] = {"best_epoch": best_epoch[a], "val_loss": best_loss[a], "epochs": epochs[a], "scores": scores[a]}
    return out


def constant_router(router: TideRouter, data: Collected, layer: int, label: torch.Tensor) -> dict:
    """Make `layer`'s router a constant that always says what its single-class training label says."""
    mlp = router.routers[str(layer)]
    logit = SATURATED_LOGIT if bool(label[~data.is_val].all()) else -SATURATED_LOGIT
    with torch.no_grad():
        mlp.fc2.weight.zero_()
        mlp.fc2.bias.fill_(logit)
    y_va = label[data.is_val & ~data.is_test].float()
    val_loss = float(F.binary_cross_entropy_with_logits(torch.full_like(y_va, logit), y_va))
    return {"best_epoch": None, "val_loss": val_loss, "epochs": 0,
            "scores": torch.full_like(y_va, torch.sigmoid(torch.tensor(logit)).item())}


def check_splits(data: Collected, cfg: TideRouterConfig) -> None:
    """Raise unless calibration kept training tokens and validation tokens (the threshold split stays unseen)."""
    train, val = ~data.is_val, data.is_val & ~data.is_test
    if not train.any():
        raise TideArgumentError(f"calibration kept no training tokens from its {cfg.num_samples} samples: give it "
                                "more text (the samples are all the text held) or a larger num_samples, raise "
                                f"max_train_tokens={cfg.max_train_tokens}, or lower validation_fraction="
                                f"{cfg.validation_fraction} / threshold_fraction={cfg.threshold_fraction} (each holds "
                                "out at least one whole sample)")
    if not val.any():
        raise TideArgumentError(f"calibration kept no held-out validation tokens from its {cfg.num_samples} samples: "
                                "give it more text (the samples are all the text held) or a larger num_samples, or "
                                f"raise validation_fraction={cfg.validation_fraction}")


def train_routers(router: TideRouter, data: Collected, *, device: torch.device | str | None = None,
                  progress: bool = True) -> None:
    """Fit every checkpoint's MLP with class-balanced BCE and Adam at once on `device` (default: where the
    features are); keep each one's epoch with the best held-out loss.

    A router stops after `early_stopping_patience` epochs without a better held-out loss: on SmolLM2 (2000
    SOTU samples) the best epoch was 2-8 of 100, and the epochs after it only overfit.
    """
    cfg = router.config
    check_splits(data, cfg)
    train, val = ~data.is_val, data.is_val & ~data.is_test  # the threshold split stays unseen
    layers = list(cfg.checkpoint_layers)
    device = torch.device(device) if device is not None else data.features[layers[0]].device
    labels = {k: data.labels(k, cfg) for k in layers}
    learnable = [k for k in layers if 0 < int(labels[k][train].sum()) < int(train.sum())]
    results = {k: constant_router(router, data, k, labels[k]) for k in layers if k not in learnable}
    groups = feature_groups(learnable, data, device)
    bar = tqdm(total=cfg.num_epochs * len(groups), desc="tide_hf: training routers", disable=not progress,
               unit="epoch")
    for group in groups:
        results.update(fit_group(router, data, group, labels, device, bar))
    bar.close()
    for k in layers:
        result = results[k]
        cfg.metrics[str(k)] = {
            **evaluate(result.pop("scores"), labels[k][val], cfg.exit_threshold),
            **result,
            "n_train": int(train.sum()),
            "n_val": int(val.sum()),
            "label_rates": {kind: data.label_rate(kind, k, cfg) for kind in LABEL_KINDS},
        }
