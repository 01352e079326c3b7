"""A router's Hub model card: metadata (library, base model, tags), how to load the base model at the revision the
routers were calibrated on, and the per-router validation table."""

from __future__ import annotations

import os
from typing import Any

from huggingface_hub import ModelCard, ModelCardData
from huggingface_hub.utils import HFValidationError, validate_repo_id

from ..config import TideRouterConfig


def model_card(cfg: TideRouterConfig) -> ModelCard:
    """The card `TideRouter.save_pretrained` writes as README.md."""
    data = ModelCardData(
        library_name="tide_hf",
        base_model=cfg.base_model_name_or_path if hub_id(cfg.base_model_name_or_path) else None,
        tags=["tide", "early-exit", "router", cfg.label],
        datasets=[cfg.dataset] if hub_id(cfg.dataset) and "/" in cfg.dataset else None,
    )
    rows = ["| layer | positive rate | precision | recall | AUC | predicted exit rate |",
            "|---|---|---|---|---|---|"]
    for k in cfg.checkpoint_layers:
        m = cfg.metrics.get(str(k), {})
        cells = [fmt(m.get(f)) for f in ("positive_rate", "precision", "recall", "auc", "predicted_rate")]
        rows.append(f"| {k} | " + " | ".join(cells) + " |")
    body = (
        f"# TIDE router for {cfg.base_model_name_or_path or 'a causal LM'}\n\n"
        f"Early-exit routers ([TIDE](https://arxiv.org/abs/2603.21365)) made with `tide_hf` for "
        f"{cfg.base_architecture} ("
        + (f"model type `{cfg.base_model_type}`, " if cfg.base_model_type else "")
        + f"{cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}). "
        f"Checkpoints after layers {cfg.checkpoint_layers}; label `{cfg.label}`; exit head `{cfg.exit_head}`; "
        "calibrated on "
        f"{cfg.num_samples} samples of {cfg.seq_len} tokens from `{cfg.dataset}`"
        + (f" (the model's own {cfg.continuation} continuations of each sample's first "
           f"{cfg.continuation_prompt_len} tokens)" if cfg.continuation else "") + ".\n\n"
        "```python\nimport tide_hf\nfrom transformers import AutoModelForCausalLM\n"
        f"model = AutoModelForCausalLM.from_pretrained({cfg.base_model_name_or_path or '<base model>'!r}"
        # the Hub commit of the weights it was calibrated on (their fingerprint is checked at attach)
        + (f", revision={cfg.base_model_revision!r}" if cfg.base_model_revision else "") + ")\n"
        "router = tide_hf.TideRouter.from_pretrained('<this repo>')\n"
        + (f"handle = tide_hf.attach(model, router)  # top-1 agreement >= {cfg.min_agreement} at confidence "
           f"{cfg.confidence}; or min_agreement=, max_perplexity_increase=\n```\n\n"
           if cfg.exit_paths and cfg.min_agreement is not None else
           f"handle = tide_hf.attach(model, router, exit_threshold={cfg.exit_threshold})\n```\n\n")
        +
        f"## Validation (held-out {cfg.validation_fraction:.0%} of samples, threshold {cfg.exit_threshold})\n\n"
        + "\n".join(rows) + "\n"
    )
    if cfg.draft_vocab_coverage:
        body += ("\n## Draft vocabulary\n\nSpeculative drafts may compute logits over the n tokens the model "
                 "predicted most often in calibration; held-out coverage of its top-1 by size: "
                 + ", ".join(f"{n}: {share:.1%}" for n, share in cfg.draft_vocab_coverage.items()) + ".\n")
    return ModelCard(f"---\n{data.to_yaml()}\n---\n\n{body}")


def hub_id(name: str | None) -> bool:
    """`name` reads as a Hub repo id, not a local path (the card's metadata must not name a local folder)."""
    if not name or os.path.isabs(name) or os.path.exists(name):
        return False
    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def fmt(value: Any) -> str:
    return "n/a" if value is None else f"{value:.3f}"
