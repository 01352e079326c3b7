"""Calibration: hidden states at the checkpoints of real text -> convergence labels -> one router each.

What is compared: each checkpoint's pre-norm layer output with the pre-norm output of the last layer, in
fp32 (cosine label), or the logits both produce through the model's own head (top1 / kl labels). Routers
are trained and scored on the same representation, `final_norm(h_k)`. Peak memory is bounded by
`max_train_tokens` per checkpoint, not by the number of samples: tokens are subsampled before anything
is kept, and labels are computed only for the kept tokens.
"""

from __future__ import annotations

import logging
import math
import time
import warnings
from dataclasses import dataclass
from typing import Any, Iterator

import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm

from .adapters import ModelAdapter, get_adapter, layer_output
from .config import LABEL_KINDS, TideRouterConfig
from . import distributed
from .data import DEFAULT_DATASET, load_texts
from .devices import execution_device
from .router import TideRouter, model_fingerprint

logger = logging.getLogger(__name__)

LABEL_CHUNK_ROWS = 256  # tokens whose vocab-sized exit logits are held at once while labelling


@dataclass
class Collected:
    """Kept tokens of every checkpoint: router inputs and the raw quantities labels are made from."""

    features: dict[int, torch.Tensor]  # layer -> (n, hidden) fp32, final-normed
    cosine: dict[int, torch.Tensor]  # layer -> (n,) cos(h_k, h_final), pre-norm, fp32
    top1: dict[int, torch.Tensor]  # layer -> (n,) bool, exit argmax == final argmax
    kl: dict[int, torch.Tensor]  # layer -> (n,) KL(final || exit) in nats
    is_val: torch.Tensor  # (n,) bool, token comes from a held-out sample
    labelled: dict[str, torch.Tensor]  # "top1" / "kl" -> (n,) bool, computed for this token
    seconds: dict[str, float]  # wall time of the model body ("forward") and of labelling ("label")

    def labels(self, layer: int, cfg: TideRouterConfig) -> torch.Tensor:
        """The positive ("converged") label of each kept token under `cfg.label`."""
        return self.labels_of(cfg.label, layer, cfg)

    def label_rate(self, kind: str, layer: int, cfg: TideRouterConfig) -> float:
        """Positive rate of label `kind`, over the tokens where it was computed."""
        rows = self.labelled.get(kind, slice(None))
        return float(self.labels_of(kind, layer, cfg)[rows].float().mean())

    def labels_of(self, kind: str, layer: int, cfg: TideRouterConfig) -> torch.Tensor:
        if kind == "cosine":
            return self.cosine[layer] > cfg.convergence_threshold
        if kind == "top1":
            return self.top1[layer]
        return self.kl[layer] < cfg.kl_threshold


def _rowdot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Row-wise dot product as one batched matmul (no vocab-sized temporaries)."""
    return torch.bmm(a.unsqueeze(1), b.unsqueeze(2)).view(-1)


class _FinalDistribution:
    """The final layer's next-token distribution, to measure KL(final || exit) against."""

    def __init__(self, final_logits: torch.Tensor) -> None:
        self.prob = F.softmax(final_logits.float(), dim=-1)
        self.neg_entropy = _rowdot(self.prob, F.log_softmax(final_logits.float(), dim=-1))

    def kl(self, exit_logits: torch.Tensor) -> torch.Tensor:
        """KL(final || exit) per row, as a batched dot (no vocab-sized temporaries beyond log q)."""
        return self.neg_entropy - _rowdot(self.prob, F.log_softmax(exit_logits.float(), dim=-1))


def _document_chunks(tokenizer: Any, texts: list[str], seq_len: int, seed: int) -> Iterator[tuple[int, list[torch.Tensor]]]:
    """Documents in a seeded order, each split into chunks of at most `seq_len` tokens."""
    for i in torch.randperm(len(texts), generator=torch.Generator().manual_seed(seed)).tolist():
        ids = tokenizer(texts[i], add_special_tokens=False)["input_ids"]
        yield i, [torch.tensor(ids[s : s + seq_len]) for s in range(0, len(ids), seq_len)]


def make_samples(tokenizer: Any, texts: list[str], num_samples: int, seq_len: int, seed: int) -> list[torch.Tensor]:
    """Split documents (in a seeded order) into chunks of at most `seq_len` tokens; take `num_samples`."""
    chunks: list[torch.Tensor] = []
    for _, doc in _document_chunks(tokenizer, texts, seq_len, seed):
        chunks.extend(doc)
        if len(chunks) >= num_samples:
            break
    if len(chunks) < num_samples:
        warnings.warn(f"the dataset yields only {len(chunks)} samples of <= {seq_len} tokens, fewer than the "
                      f"{num_samples} asked for; calibrating on all {len(chunks)}", stacklevel=3)
    return chunks[:num_samples]


def held_out_texts(tokenizer: Any, texts: list[str], cfg: TideRouterConfig) -> list[str]:
    """The documents a calibration with `cfg` never read (for honest evaluation on the same corpus)."""
    seen, used = 0, set()
    for i, doc in _document_chunks(tokenizer, texts, cfg.seq_len, cfg.seed):
        if seen >= cfg.num_samples:
            break
        used.add(i)
        seen += len(doc)
    return [t for i, t in enumerate(texts) if i not in used]


def _pad(batch: list[torch.Tensor], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(s) for s in batch)
    ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for row, s in enumerate(batch):
        ids[row, : len(s)], mask[row, : len(s)] = s, 1
    return ids, mask


@torch.no_grad()
def collect(
    model: nn.Module,
    adapter: ModelAdapter,
    samples: list[torch.Tensor],
    cfg: TideRouterConfig,
    *,
    batch_size: int,
    pad_id: int,
    progress: bool = True,
) -> Collected:
    """Run the model body over `samples` with hooks at the checkpoints and the last layer; keep a
    seeded random subset of real (non-padding) tokens and compute their features and label inputs.

    Under `accelerate launch` each process runs its own block of batches and every process returns the
    gathered tokens of all of them, equal to a single process's (see `tide_hf.distributed`)."""
    gen = torch.Generator().manual_seed(cfg.seed)
    total = sum(len(s) for s in samples)
    keep_p = min(1.0, cfg.max_train_tokens / max(total, 1))
    keep = [torch.rand(len(s), generator=gen) < keep_p for s in samples]
    n_val_samples = max(1, math.ceil(cfg.validation_fraction * len(samples)))
    is_val = torch.cat([k.new_full((int(k.sum()),), i >= len(samples) - n_val_samples) for i, k in enumerate(keep)])
    starts, local_rows = distributed.local_batches(keep, batch_size)  # all batches, unless launched (accelerate)
    is_val = is_val[local_rows]
    n = int(is_val.numel())
    layers = list(cfg.checkpoint_layers)
    out = Collected(
        features={k: torch.empty(n, cfg.hidden_size) for k in layers},
        cosine={k: torch.empty(n) for k in layers},
        top1={k: torch.zeros(n, dtype=torch.bool) for k in layers},
        kl={k: torch.full((n,), math.nan) for k in layers},
        is_val=is_val,
        labelled={kind: torch.zeros(n, dtype=torch.bool) for kind in ("top1", "kl")},
        seconds={"forward": 0.0, "label": 0.0},
    )
    final_layer = adapter.num_layers
    device, in_device = execution_device(adapter.lm_head), execution_device(adapter.embeddings)
    captured: dict[int, torch.Tensor] = {}
    selection: list[torch.Tensor] = []

    def hook_for(k: int):
        def hook(_module: nn.Module, _args: Any, output: Any) -> None:
            hidden = layer_output(output)  # on its layer's device when the model is split over devices
            captured[k] = hidden[selection[0].to(hidden.device)].to(device)
        return hook

    handles = [adapter.layers[k - 1].register_forward_hook(hook_for(k)) for k in (*layers, final_layer)]
    cursor = 0
    try:
        for start in tqdm(starts, desc="tide_hf: collecting hidden states",
                          disable=not progress, unit="batch"):
            ids, mask = _pad(samples[start : start + batch_size], pad_id)
            sel, _ = _pad(keep[start : start + batch_size], 0)
            selection[:] = [sel.bool().to(device)]
            t0 = time.perf_counter()
            model.base_model(input_ids=ids.to(in_device), attention_mask=mask.to(in_device), use_cache=False)
            t1 = time.perf_counter()
            h_final = captured[final_layer]
            m = h_final.shape[0]
            rows = torch.arange(cursor, cursor + m)
            # Head-based labels cost a vocab-sized matmul per token and checkpoint: compute them for every
            # kept token only when they are the training label, else on held-out tokens for the report.
            # The KL also needs two vocab-sized softmaxes per row, so unless it is the label it is held-out only.
            head = rows if cfg.label != "cosine" else rows[is_val[rows]]
            for k in layers:
                h = captured[k]
                out.features[k][rows] = adapter.normed(h).float().cpu()
                out.cosine[k][rows] = F.cosine_similarity(h.float(), h_final.float(), dim=-1).cpu()
            # vocab-sized logits in row chunks, so their memory does not grow with the batch
            for part in head.split(LABEL_CHUNK_ROWS):
                local = (part - cursor).to(device)
                with_kl = torch.ones_like(part, dtype=torch.bool) if cfg.label == "kl" else is_val[part]
                final_logits = adapter.logits(h_final[local])
                final_argmax = final_logits.argmax(-1)
                final = _FinalDistribution(final_logits[with_kl.to(device)])
                for k in layers:
                    exit_logits = adapter.logits(captured[k][local])
                    out.top1[k][part] = (exit_logits.argmax(-1) == final_argmax).cpu()
                    out.kl[k][part[with_kl]] = final.kl(exit_logits[with_kl.to(device)]).cpu()
                out.labelled["top1"][part] = True
                out.labelled["kl"][part[with_kl]] = True
            cursor += m
            captured.clear()
            out.seconds["forward"] += t1 - t0
            out.seconds["label"] += time.perf_counter() - t1
    finally:
        for handle in handles:
            handle.remove()
    return distributed.gather_collected(out)


def _auc(scores: torch.Tensor, labels: torch.Tensor) -> float | None:
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
        "auc": _auc(scores, labels),
    }


def train_routers(router: TideRouter, data: Collected, *, progress: bool = True) -> None:
    """Fit each checkpoint's MLP with class-balanced BCE and Adam; keep the epoch with the best held-out loss.

    A router stops after `early_stopping_patience` epochs without a better held-out loss: on SmolLM2 (2000
    SOTU samples) the best epoch was 2-8 of 100, and the epochs after it only overfit.
    """
    cfg = router.config
    gen = torch.Generator().manual_seed(cfg.seed)
    train, val = ~data.is_val, data.is_val
    if not train.any() or not val.any():
        raise ValueError(
            f"calibration kept {int(train.sum())} training and {int(val.sum())} held-out tokens; both must be > 0 "
            f"(raise max_train_tokens={cfg.max_train_tokens}, num_samples or validation_fraction={cfg.validation_fraction})"
        )
    bar = tqdm(total=len(cfg.checkpoint_layers) * cfg.num_epochs, desc="tide_hf: training routers",
               disable=not progress, unit="epoch")
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
            bar.update()
            if cfg.early_stopping_patience and epoch - best_epoch >= cfg.early_stopping_patience:
                bar.update(cfg.num_epochs - 1 - epoch)
                break
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


def _warn_if_silent(cfg: TideRouterConfig) -> None:
    """Say loudly when the chosen label (almost) never fires, and which label kind would."""
    rates = {k: cfg.metrics[str(k)]["label_rates"] for k in cfg.checkpoint_layers}
    silent = [k for k in cfg.checkpoint_layers if rates[k][cfg.label] == 0.0]
    if not silent:
        return
    best = {kind: max(r[kind] for r in rates.values()) for kind in LABEL_KINDS if kind != cfg.label}
    hint = ", ".join(f"label={kind!r} fires for up to {rate:.1%}" for kind, rate in best.items())
    scope = "at EVERY checkpoint: these routers will never let a token exit" if len(silent) == len(rates) \
        else f"at checkpoints {silent}: routers there will not fire"
    message = (f"TIDE calibration: label {cfg.label!r} (threshold {cfg.convergence_threshold if cfg.label == 'cosine' else cfg.kl_threshold}) "
               f"has 0% positive tokens {scope}. On this model {hint}; recalibrate with one of those.")
    logger.warning(message)
    warnings.warn(message, stacklevel=3)


def calibrate(
    model: nn.Module,
    tokenizer: Any,
    dataset: str | None = None,
    *,
    dataset_config: str | None = None,
    split: str = "train",
    text_field: str = "text",
    num_samples: int = 2000,
    seq_len: int = 256,
    batch_size: int = 8,
    progress: bool = True,
    **config_kwargs: Any,
) -> TideRouter:
    """Calibrate TIDE routers for `model` on `dataset` and return them as a `TideRouter`.

    `config_kwargs` are `TideRouterConfig` fields (label, checkpoint_interval, convergence_threshold,
    kl_threshold, router_bottleneck_dim, learning_rate, num_epochs, max_train_tokens, seed, ...).
    Under `accelerate launch`, call it in every process with the same arguments: the processes share the
    forward passes, the main one trains, and every process returns the same router.
    """
    adapter = get_adapter(model)
    text_cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    cfg = TideRouterConfig(
        hidden_size=text_cfg.hidden_size,
        num_hidden_layers=adapter.num_layers,
        base_model_name_or_path=getattr(model.config, "name_or_path", None) or None,
        base_model_revision=getattr(model.config, "_commit_hash", None),
        base_architecture=type(model).__name__,
        base_model_type=model.config.model_type,
        base_fingerprint=model_fingerprint(model),
        seq_len=seq_len,
        **config_kwargs,
    )
    torch.manual_seed(cfg.seed)
    with distributed.main_process_first():  # under a launcher, datasets builds its cache once
        texts = load_texts(dataset, dataset_config=dataset_config, split=split, text_field=text_field)
    cfg.dataset = dataset or DEFAULT_DATASET
    samples = make_samples(tokenizer, texts, num_samples, seq_len, cfg.seed)
    cfg.num_samples = len(samples)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0  # masked out; any id works
    progress = progress and distributed.is_main_process()
    was_training = model.training
    model.eval()
    try:
        data = collect(model, adapter, samples, cfg, batch_size=batch_size, pad_id=pad_id, progress=progress)
    finally:
        model.train(was_training)
    started = time.perf_counter()
    router = TideRouter(cfg)
    distributed.train_on_main(train_routers, router, data, progress=progress)  # every process gets its result
    cfg.calibration_seconds = {**data.seconds, "train": time.perf_counter() - started}
    if distributed.is_main_process():
        _warn_if_silent(cfg)
    return router
