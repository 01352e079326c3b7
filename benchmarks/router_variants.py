"""Offline router experiment, step 2: train router variants on the features `router_features.py` collected and
compare them on held-out documents the way users meet them.

Per variant: AUC of the top-1 label per checkpoint (held-out A), and router efficiency (layers saved / the
oracle's at the same top-1 agreement) on held-out A and B under the thresholds `attach(min_agreement=t)` would
pick: the exit path is ordered on the val split and its losses counted on the test split with the repo's own
code (`build_path`, `path_losses`, `select`).

    PYTHONPATH=. python benchmarks/router_variants.py /tmp/r12x/data.safetensors --variants base kl top1_kl extras
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass, field, replace

import torch
import torch.nn.functional as F

from router_features import load_features
from tide_hf.calibration.thresholds import build_path, path_losses
from tide_hf.calibration.training import auc
from tide_hf.eval.analyze import oracle
from tide_hf.modeling import TideRouter
from tide_hf.modeling.targets import select

TARGETS = (0.97, 0.95, 0.90)
EXTRAS = ("log_rms", "move1", "move")
EXIT_EXTRAS = ("conf", "margin", "stable")  # from the exit logits over the draft vocabulary (router_features.py)


@dataclass
class Variant:
    """One router recipe: label, extra inputs (a linear logit term, or concatenated into the MLP input),
    the previous checkpoint's logit as an input (cascade), and training choices."""

    label: str = "top1"
    extras: tuple[str, ...] = ()
    concat: bool = False
    cascade: bool = False
    bottleneck: int = 128
    balanced: bool = True
    lr: float = 1e-3
    patience: int = 10
    seed: int = 0
    weight_decay: float = 0.0
    kl_threshold: float | None = None  # None: the collection's (the config default)
    train_share: float = 1.0  # share of the train split's tokens used (how much more data would help)
    dropout: float = 0.0  # on the MLP's input and hidden layer while training
    focal: float = 0.0  # focal-loss exponent (0: plain BCE): weight on the tokens the head gets wrong
    linear: bool = False  # a logistic regression on the state instead of the MLP
    prev_state: bool = False  # also read the previous checkpoint's normed state (zeros at the first)
    seeds: int = 1  # an ensemble: the mean logit of heads trained with seeds seed .. seed + seeds - 1
    notes: dict = field(default_factory=dict)


VARIANTS = {
    "base": Variant(),
    "base_s1": Variant(seed=1),
    "base_s2": Variant(seed=2),
    "kl": Variant(label="kl"),
    "top1_kl": Variant(label="top1_kl"),
    "stable": Variant(label="stable"),
    "rms": Variant(extras=("log_rms",)),
    "move1": Variant(extras=("move1",)),
    "move": Variant(extras=("move",)),
    "extras": Variant(extras=EXTRAS),
    "conf": Variant(extras=("conf",)),
    "exit_extras": Variant(extras=EXIT_EXTRAS),
    "exit_extras_concat": Variant(extras=EXIT_EXTRAS, concat=True),
    "all_extras": Variant(extras=EXTRAS + EXIT_EXTRAS),
    "extras_concat": Variant(extras=EXTRAS, concat=True),
    "cascade": Variant(cascade=True),
    "extras_cascade": Variant(extras=EXTRAS, cascade=True),
    "b32": Variant(bottleneck=32),
    "b512": Variant(bottleneck=512),
    "unbalanced": Variant(balanced=False),
    "patience30": Variant(patience=30),
    "lr3e-4": Variant(lr=3e-4),
    "wd": Variant(weight_decay=1e-2),
    "top1_kl1": Variant(label="top1_kl", kl_threshold=1.0),
    "top1_kl3": Variant(label="top1_kl", kl_threshold=3.0),
    "half_data": Variant(train_share=0.5),
    "focal2": Variant(focal=2.0),
    "dropout02": Variant(dropout=0.2),
    "dropout05_b512": Variant(dropout=0.5, bottleneck=512),
    "linear": Variant(linear=True),
    "prev_state": Variant(prev_state=True),
    "ensemble5": Variant(seeds=5),
}


class Head(torch.nn.Module):
    """MLP on the normed state, plus an optional linear term on the extra inputs."""

    def __init__(self, hidden: int, n_extra: int, v: Variant) -> None:
        super().__init__()
        self.concat, self.linear, self.drop = v.concat, v.linear, torch.nn.Dropout(v.dropout)
        self.fc1 = torch.nn.Linear(hidden + (n_extra if v.concat else 0), 1 if v.linear else v.bottleneck)
        self.fc2 = torch.nn.Linear(v.bottleneck, 1)
        self.lin = torch.nn.Linear(n_extra, 1, bias=False) if n_extra and not v.concat else None

    def forward(self, x: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
        inp = self.drop(torch.cat([x, e], 1) if self.concat else x)
        out = (self.fc1(inp) if self.linear else self.fc2(self.drop(torch.relu(self.fc1(inp))))).squeeze(-1)
        return out + self.lin(e).squeeze(-1) if self.lin is not None else out


def labels_of(data: dict, kind: str, k: int, kl_threshold: float | None = None) -> torch.Tensor:
    """"stable": top-1 agreement at k and at every later checkpoint (a token that agrees at k by chance and
    disagrees again later is negative), a label that is monotone in depth."""
    if kind == "stable":
        return torch.stack([data["top1"][j] for j in data["layers"] if j >= k]).all(0)
    kl_ok = data["kl"][k] < (data["kl_threshold"] if kl_threshold is None else kl_threshold)
    return {"top1": data["top1"][k], "kl": kl_ok, "top1_kl": data["top1"][k] & kl_ok}[kind]


def train_head(x: torch.Tensor, e: torch.Tensor, y: torch.Tensor, tr: torch.Tensor, va: torch.Tensor,
               v: Variant) -> Head:
    """Adam on (class-balanced) BCE, the best val-loss epoch kept, early stopping: the repo trainer's recipe
    (a focal exponent weights each token's loss by (1 - p_true) ** focal)."""
    gen = torch.Generator().manual_seed(v.seed)
    torch.manual_seed(v.seed)
    head = Head(x.shape[1], e.shape[1], v)
    opt = torch.optim.Adam(head.parameters(), lr=v.lr, weight_decay=v.weight_decay)
    yt, yv = y[tr].float(), y[va].float()
    pos = max(float(yt.sum()), 1.0)
    pw = torch.tensor((len(yt) - pos) / pos if v.balanced else 1.0)
    xt, et, xv, ev = x[tr], e[tr], x[va], e[va]
    def loss_of(logit: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        loss = F.binary_cross_entropy_with_logits(logit, target, pos_weight=pw, reduction="none")
        p_true = torch.where(target > 0, torch.sigmoid(logit), 1 - torch.sigmoid(logit))
        return (loss * (1 - p_true) ** v.focal).mean()

    best, best_loss, best_epoch = None, math.inf, 0
    for epoch in range(100):
        head.train()
        for idx in torch.randperm(len(yt), generator=gen).split(1024):
            loss = loss_of(head(xt[idx], et[idx]), yt[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
        head.eval()
        with torch.no_grad():
            vl = float(loss_of(head(xv, ev), yv))
        if vl < best_loss:
            best_loss, best_epoch, best = vl, epoch, {n: p.clone() for n, p in head.state_dict().items()}
        if epoch - best_epoch >= v.patience:
            break
    head.load_state_dict(best)
    v.notes.setdefault("best_epoch", []).append(best_epoch)
    return head


@torch.no_grad()
def fit_variant(data: dict, v: Variant) -> torch.Tensor:
    """Train every checkpoint's head (in order, for the cascade); logits (tokens, checkpoints) of all tokens."""
    layers, split = data["layers"], data["split"]
    tr, va = split == 0, split == 1
    if v.train_share < 1.0:
        tr = tr & (torch.rand(len(split), generator=torch.Generator().manual_seed(v.seed)) < v.train_share)
    logits = []
    prev = torch.zeros(len(split))
    for i, k in enumerate(layers):
        cols = [data["extra"][n][k] for n in v.extras] + ([prev] if v.cascade else [])
        e = torch.stack(cols, 1) if cols else torch.zeros(len(split), 0)
        mean, std = e[tr].mean(0), e[tr].std(0).clamp(min=1e-6)
        e = (e - mean) / std
        x = data["features"][k]
        if v.prev_state:
            x = torch.cat([x, data["features"][layers[i - 1]] if i else torch.zeros_like(x)], 1)
        heads = []
        for seed in range(v.seed, v.seed + v.seeds):
            with torch.enable_grad():
                heads.append(train_head(x, e, labels_of(data, v.label, k, v.kl_threshold), tr, va,
                                        replace(v, seed=seed)))
        prev = torch.stack([head(x, e) for head in heads]).mean(0)
        logits.append(prev)
    return torch.stack(logits, 1)


def exits(match: torch.Tensor, score: torch.Tensor, thresholds: torch.Tensor, checkpoints: list[int], n: int) -> dict:
    """Agreement, layers saved, the oracle's at that agreement, and their ratio under per-checkpoint thresholds."""
    fires = (score >= thresholds) & (thresholds < 1.0)
    first = torch.where(fires.any(1), fires.int().argmax(1), len(checkpoints))
    correct = torch.cat([match, torch.ones(len(match), 1, dtype=torch.bool)], 1).gather(1, first[:, None])
    agreement = int(correct.sum()) / len(correct)
    saved = n - float(torch.tensor([*checkpoints, n], dtype=torch.float64)[first].mean())
    best = oracle(match, checkpoints, n, [agreement])[0]["layers_saved"]
    return {"agreement": agreement, "saved": saved, "oracle": best, "eff": saved / best if best > 0 else None}


def evaluate(data: dict, logits: torch.Tensor, grid: int = 40, confidence: float = 0.9) -> dict:
    """AUC per checkpoint (held-out A, top-1 label) and efficiency at each target on held-out A and B."""
    layers, split, n = data["layers"], data["split"], data["num_layers"]
    scores = torch.sigmoid(logits)
    match = torch.stack([data["top1"][k] for k in layers], 1)
    nll = torch.stack([data["nll"][k] for k in layers], 1)
    order, test = split == 1, split == 2
    saved = torch.tensor([n - k for k in layers], dtype=torch.float64)
    path = build_path(scores[order], (~match[order]).double(), saved, grid)
    paths = {"agreement": path_losses(path, scores[test], ~match[test], nll[test])}
    out = {"auc_a": [auc(scores[split == 3, j], match[split == 3, j]) for j in range(len(layers))]}
    for name, s in (("a", 3), ("b", 4)):
        rows = split == s
        out[name] = {}
        for t in TARGETS:
            chosen = select(paths, layers, min_agreement=t, confidence=confidence)
            vec = torch.tensor([chosen[k] for k in layers])
            out[name][t] = exits(match[rows], scores[rows], vec, layers, n)
        # the best path point whose agreement on this split reaches each target (no test-split slack)
        best = {t: 0.0 for t in TARGETS}
        for point in path:
            r = exits(match[rows], scores[rows], torch.tensor(point), layers, n)
            for t in TARGETS:
                if r["agreement"] >= t and r["eff"] is not None:
                    best[t] = max(best[t], r["eff"])
        out[name]["path_best"] = best
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("data")
    parser.add_argument("--variants", nargs="*", default=list(VARIANTS))
    parser.add_argument("--router", help="also score a saved TideRouter (row 'saved') on the same splits")
    parser.add_argument("--json")
    args = parser.parse_args()
    torch.set_num_threads(2)
    data = load_features(args.data)
    results = {}
    print("| variant | AUC per checkpoint (A) | A eff@97/95/90 (agr@97) | B eff@97/95/90 (agr@97) | "
          "best path point eff@97 A/B | best epochs |")
    print("|---|---|---|---|---|---|")
    names = [*args.variants, *(["saved"] if args.router else [])]
    for name in names:
        v = VARIANTS.get(name, Variant())
        if name == "saved":
            router = TideRouter.from_pretrained(args.router)
            with torch.no_grad():
                logits = torch.stack([router.logit(k, data["features"][k]) for k in data["layers"]], 1)
            v.notes["best_epoch"] = [router.config.metrics[str(k)]["best_epoch"] for k in data["layers"]]
        else:
            logits = fit_variant(data, v)
        r = evaluate(data, logits)
        results[name] = r
        cells = []
        for s in ("a", "b"):
            effs = "/".join(f"{r[s][t]['eff']:.2f}" if r[s][t]["eff"] is not None else "-" for t in TARGETS)
            cells.append(f"{effs} ({r[s][0.97]['agreement']:.3f})")
        aucs = " ".join(f"{x:.3f}" if x is not None else "-" for x in r["auc_a"])
        pb = f"{r['a']['path_best'][0.97]:.2f}/{r['b']['path_best'][0.97]:.2f}"
        print(f"| {name} | {aucs} | {cells[0]} | {cells[1]} | {pb} | {v.notes['best_epoch']} |", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({k: {s: {str(t): x for t, x in val.items()} if isinstance(val, dict) else val
                           for s, val in r.items()} for k, r in results.items()}, f, indent=1)


if __name__ == "__main__":
    main()
