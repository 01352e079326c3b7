"""Collecting what routers learn from: each checkpoint's final-normed state (the router input) and the raw
quantities labels are made of (cosine to the final state, top-1 agreement and KL of the exit logits).

What is compared: each checkpoint's pre-norm layer output with the pre-norm output of the last layer, in
fp32 (cosine label), or the exit logits (the router's exit heads, `TideRouter.exit_logits`) with the final
logits (top1 / kl labels). Two passes: `collect` runs the model and keeps, per kept token, the features, the
cosine, the last layer's state and the next token; `label` computes the head-based quantities once the exit
heads are fitted (they are fitted on the kept tokens themselves). Peak memory is bounded by
`max_train_tokens` per checkpoint, not by the number of samples: tokens are subsampled before anything is
kept, and labels are computed only for the kept tokens.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm

from ..config import TideRouterConfig
from ..modeling import ModelAdapter, TideRouter, layer_output
from ..modeling.devices import execution_device
from .distributed import gather_collected, local_batches
from .samples import pad_right

# exit logits of kept tokens: (layer, their rows in `Collected`, their final-normed features, the model's dtype)
ExitLogits = Callable[[int, torch.Tensor, torch.Tensor, torch.dtype], torch.Tensor]
LABEL_CHUNK_ROWS = 256  # tokens whose vocab-sized exit logits are held at once while labelling
KL_LABELS = ("kl", "top1_kl")  # labels that need the KL of every kept token, not only held-out ones


@dataclass
class Collected:
    """Kept tokens of every checkpoint: router inputs and the raw quantities labels are made from."""

    features: dict[int, torch.Tensor]  # layer -> (n, hidden) fp32, final-normed
    cosine: dict[int, torch.Tensor]  # layer -> (n,) cos(h_k, h_final), pre-norm, fp32
    final: torch.Tensor  # (n, hidden) fp32, the last layer's pre-norm output
    next_ids: torch.Tensor  # (n,) the token that follows (-1: none)
    final_top1: torch.Tensor  # (n,) the final layer's argmax (-1 until `label`)
    top1: dict[int, torch.Tensor]  # layer -> (n,) bool, exit argmax == final argmax
    kl: dict[int, torch.Tensor]  # layer -> (n,) KL(final || exit) in nats
    nll: dict[int, torch.Tensor]  # layer -> (n,) NLL(next token | exit) - NLL(next token | final); NaN: not computed
    is_val: torch.Tensor  # (n,) bool, token comes from a held-out sample (validation or threshold split)
    is_test: torch.Tensor  # (n,) bool, token comes from the threshold split (never used to train or to order)
    labelled: dict[str, torch.Tensor]  # "top1" / "kl" / "top1_kl" -> (n,) bool, computed for this token
    seconds: dict[str, float]  # wall time of the model body ("forward") and of labelling ("label", in `label`)

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
        if kind == "top1_kl":  # the argmax agrees and the distribution is close: protects perplexity too
            return self.top1[layer] & (self.kl[layer] < cfg.kl_threshold)
        return self.kl[layer] < cfg.kl_threshold


def rowdot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Row-wise dot product as one batched matmul (no vocab-sized temporaries)."""
    return torch.bmm(a.unsqueeze(1), b.unsqueeze(2)).view(-1)


class FinalDistribution:
    """The final layer's next-token distribution, to measure KL(final || exit) against."""

    def __init__(self, final_logits: torch.Tensor) -> None:
        self.logp = F.log_softmax(final_logits.float(), dim=-1)
        self.prob = F.softmax(final_logits.float(), dim=-1)
        self.neg_entropy = rowdot(self.prob, self.logp)

    def kl(self, exit_logits: torch.Tensor) -> torch.Tensor:
        """KL(final || exit) per row, as a batched dot (no vocab-sized temporaries beyond log q)."""
        return self.kl_logq(F.log_softmax(exit_logits.float(), dim=-1))

    def kl_logq(self, logq: torch.Tensor) -> torch.Tensor:
        """KL(final || exit) per row from the exit log-probabilities."""
        return self.neg_entropy - rowdot(self.prob, logq)

    def nll_change(self, logq: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """NLL of `targets` under the exit distribution minus under the final one; NaN where a target is < 0."""
        index = targets.clamp(min=0)[:, None]
        change = (self.logp.gather(1, index) - logq.gather(1, index)).squeeze(1)
        return torch.where(targets >= 0, change, torch.full_like(change, math.nan))


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
    seeded random subset of real (non-padding) tokens, their features, cosines, last-layer states and next
    tokens. Head-based labels are left empty for `label`.

    Under `accelerate launch` each process runs its own block of batches and every process returns the
    gathered tokens of all of them, equal to a single process's (see `tide_hf.calibration.distributed`)."""
    gen = torch.Generator().manual_seed(cfg.seed)
    total = sum(len(s) for s in samples)
    keep_p = min(1.0, cfg.max_train_tokens / max(total, 1))
    keep = [torch.rand(len(s), generator=gen) < keep_p for s in samples]
    n_test_samples = max(1, math.ceil(cfg.threshold_fraction * len(samples)))
    n_val_samples = max(1, math.ceil(cfg.validation_fraction * len(samples))) + n_test_samples
    is_val = torch.cat([k.new_full((int(k.sum()),), i >= len(samples) - n_val_samples) for i, k in enumerate(keep)])
    is_test = torch.cat([k.new_full((int(k.sum()),), i >= len(samples) - n_test_samples) for i, k in enumerate(keep)])
    starts, local_rows = local_batches(keep, batch_size)  # all batches, unless launched (accelerate)
    is_val, is_test = is_val[local_rows], is_test[local_rows]
    n = int(is_val.numel())
    layers = list(cfg.checkpoint_layers)
    out = Collected(
        features={k: torch.empty(n, cfg.hidden_size) for k in layers},
        cosine={k: torch.empty(n) for k in layers},
        final=torch.empty(n, cfg.hidden_size),
        next_ids=torch.full((n,), -1, dtype=torch.long),
        final_top1=torch.full((n,), -1, dtype=torch.long),
        top1={k: torch.zeros(n, dtype=torch.bool) for k in layers},
        kl={k: torch.full((n,), math.nan) for k in layers},
        nll={k: torch.full((n,), math.nan) for k in layers},
        is_val=is_val,
        is_test=is_test,
        labelled={kind: torch.zeros(n, dtype=torch.bool) for kind in ("top1", "kl", "top1_kl")},
        seconds={"forward": 0.0, "label": 0.0},
    )
    final_layer = adapter.num_layers
    device, in_device = execution_device(adapter.lm_head), execution_device(adapter.embeddings)
    captured: dict[int, torch.Tensor] = {}
    selection: list[torch.Tensor] = []

    def hook_for(k: int) -> Callable[[nn.Module, Any, Any], None]:
        def hook(_module: nn.Module, _args: Any, output: Any) -> None:
            hidden = layer_output(output)  # on its layer's device when the model is split over devices
            captured[k] = hidden[selection[0].to(hidden.device)].to(device)
        return hook

    handles = [adapter.layers[k - 1].register_forward_hook(hook_for(k)) for k in (*layers, final_layer)]
    cursor = 0
    try:
        bar = tqdm(total=sum(len(s) for i in starts for s in samples[i : i + batch_size]), unit="tok",
                   unit_scale=True, desc="tide_hf: collecting hidden states (1 forward pass per token)",
                   disable=not progress)
        for start in starts:
            ids, mask = pad_right(samples[start : start + batch_size], pad_id)
            sel, _ = pad_right(keep[start : start + batch_size], 0)
            selection[:] = [sel.bool().to(device)]
            following = torch.where(mask[:, 1:].bool(), ids[:, 1:], -1)  # each position's next token (-1: none)
            next_ids = torch.cat([following, following.new_full((len(ids), 1), -1)], 1)[sel.bool()]
            t0 = time.perf_counter()
            model.base_model(input_ids=ids.to(in_device), attention_mask=mask.to(in_device), use_cache=False)
            h_final = captured[final_layer]
            m = h_final.shape[0]
            rows = torch.arange(cursor, cursor + m)
            out.final[rows] = h_final.float().cpu()
            out.next_ids[rows] = next_ids
            for k in layers:
                h = captured[k]
                out.features[k][rows] = adapter.normed(h).float().cpu()
                out.cosine[k][rows] = F.cosine_similarity(h.float(), h_final.float(), dim=-1).cpu()
            cursor += m
            captured.clear()
            out.seconds["forward"] += time.perf_counter() - t0
            bar.update(sum(len(s) for s in samples[start : start + batch_size]))
        bar.close()
    finally:
        for handle in handles:
            handle.remove()
    return gather_collected(out)


@torch.no_grad()
def label(data: Collected, adapter: ModelAdapter, router: TideRouter, *, device: torch.device,
          exit_logits: ExitLogits | None = None, progress: bool = True) -> None:
    """Fill the final top-1 of every kept token and the head-based label inputs of `data` (top-1 agreement, KL,
    NLL change) with the router's exit heads, or with `exit_logits(layer, rows, normed, dtype)` when given
    (out-of-fold heads, `heads.CrossFit`).

    Head-based labels cost a vocab-sized matmul per token and checkpoint: they are computed for every kept
    token only when they are the training label, else on held-out tokens for the report. The KL and the NLL
    change also need vocab-sized softmaxes per row, so unless the label needs the KL they are held-out only
    (the threshold fit and the report use held-out tokens only)."""
    cfg = router.config
    started = time.perf_counter()
    dtype = next(adapter.lm_head.parameters()).dtype
    rows = torch.arange(data.is_val.numel())
    head = rows if cfg.label != "cosine" else rows[data.is_val]
    if cfg.label == "cosine":  # the draft vocabulary ranks the final top-1 of the training tokens too
        for part in rows[~data.is_val].split(LABEL_CHUNK_ROWS):
            data.final_top1[part] = adapter.logits(data.final[part].to(device, dtype)).argmax(-1).cpu()
    # vocab-sized logits in row chunks, so their memory does not grow with the number of tokens
    for part in tqdm(head.split(LABEL_CHUNK_ROWS), desc="tide_hf: labelling", disable=not progress):
        with_kl = torch.ones_like(part, dtype=torch.bool) if cfg.label in KL_LABELS else data.is_val[part]
        kl_rows = with_kl.to(device)
        final_logits = adapter.logits(data.final[part].to(device, dtype))
        final_argmax = final_logits.argmax(-1)
        data.final_top1[part] = final_argmax.cpu()
        final = FinalDistribution(final_logits[kl_rows])
        targets = data.next_ids[part].to(device)[kl_rows]
        for k in cfg.checkpoint_layers:
            normed = data.features[k][part].to(device)
            logits = router.exit_logits(adapter, k, normed, dtype) if exit_logits is None \
                else exit_logits(k, part, normed, dtype)
            data.top1[k][part] = (logits.argmax(-1) == final_argmax).cpu()
            logq = F.log_softmax(logits[kl_rows].float(), dim=-1)
            data.kl[k][part[with_kl]] = final.kl_logq(logq).cpu()
            data.nll[k][part[with_kl]] = final.nll_change(logq, targets).cpu()
        data.labelled["top1"][part] = True
        data.labelled["kl"][part[with_kl]] = True
        data.labelled["top1_kl"][part[with_kl]] = True
    data.seconds["label"] = time.perf_counter() - started
