"""`CalibrationConfig`: everything `calibrate` reads, in one documented config (peft's `LoraConfig` pattern).

The router it makes records these settings in its `TideRouterConfig`, beside what calibration derives from the model
(architecture, fingerprint) and what it measures (metrics, exit paths). The defaults here are the library's only
ones: `TideRouterConfig` reads the same values when a router file lacks a field (`tests/test_calibrate_config.py`
checks they agree), and the CLI shows them.
"""

from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass
from typing import Any

from ..config import CALIBRATED_EXIT_HEAD, DEFAULT_EXIT_THRESHOLD
from ..errors import TideArgumentTypeError

# What `calibrate` itself reads (the sampling of the text); every other field goes into the router's config.
SAMPLING_FIELDS = ("num_samples", "seq_len", "batch_size")


@dataclass(frozen=True)
class CalibrationConfig:
    """What `calibrate` reads: the text's sampling, the labels, the exit heads, router training and the router's
    default quality target.

    Args:
        num_samples: text windows to calibrate on (SmolLM2-135M on a 2-core CPU: about 0.7 s per 256-token
            window). More samples give routers that let more tokens exit at the same quality.
        seq_len: tokens per window.
        batch_size: windows per forward pass.
        label: what "converged" means for a token at a checkpoint: "top1" (its exit prediction's top-1 is the
            full model's), "cosine" (cosine to the last layer's state above `convergence_threshold`), "kl"
            (KL(full || exit) below `kl_threshold`) or "top1_kl" (top-1 agreement and that KL).
        exit_head: how an exited token's logits are made: "linear" (a per-checkpoint linear map to the last
            layer's state, fitted by ridge least squares) or "lens" (the model's head on the checkpoint's state).
        exit_head_ridge: ridge penalty of the linear exit heads, relative to the Gram matrix's mean diagonal.
        exit_head_rank: store each linear exit head as rank-r factors (None: full rank, hidden x hidden).
        convergence_threshold: `label="cosine"`: the cosine that counts as converged.
        kl_threshold: `label="kl"` / `"top1_kl"`: the KL divergence below which a token counts as converged.
        checkpoint_interval: a router after every this many layers.
        checkpoint_layers: explicit checkpoints (1-based layer counts), instead of `checkpoint_interval`.
        router_bottleneck_dim: hidden width of each router's two-layer MLP.
        learning_rate: router training's learning rate.
        num_epochs: most epochs per router (early stopping usually ends far sooner).
        early_stopping_patience: stop a router after this many epochs without a better held-out loss (0: never).
        train_batch_size: tokens per router training step.
        max_train_tokens: tokens kept per checkpoint, on average (sets memory and labelling time).
        validation_fraction: share of the samples that orders the exit paths and stops training early.
        threshold_fraction: share of the samples that certifies the quality targets (seen by nothing else).
        path_grid: candidate thresholds per checkpoint on the exit paths.
        min_agreement: the router's default quality target (top-1 agreement `attach` keeps with no options;
            None: the global `exit_threshold`).
        confidence: probability with which a quality target holds (Learn-then-Test).
        exit_threshold: the global router score at which a token exits where no quality target is in effect.
        min_layers: no exit before this many layers (None: the first checkpoint).
        continuation: None (the text as written), or "greedy" / "sample": the model writes each window after
            its first `continuation_prompt_len` tokens, so routers are fitted on text it wrote itself.
        continuation_prompt_len: `continuation`: tokens of the text each window keeps as its prompt.
        seed: seed of the sampling, the split and training.

    Example:
        >>> from tide_hf import CalibrationConfig
        >>> CalibrationConfig(num_samples=64, label="cosine").exit_head
        'linear'
    """

    num_samples: int = 256
    seq_len: int = 256
    batch_size: int = 8
    label: str = "top1"
    exit_head: str = CALIBRATED_EXIT_HEAD
    exit_head_ridge: float = 0.01
    exit_head_rank: int | None = None
    convergence_threshold: float = 0.98
    kl_threshold: float = 0.1
    checkpoint_interval: int = 4
    checkpoint_layers: list[int] | None = None
    router_bottleneck_dim: int = 128
    learning_rate: float = 1e-3
    num_epochs: int = 100
    early_stopping_patience: int = 10
    train_batch_size: int = 1024
    max_train_tokens: int = 65536
    validation_fraction: float = 0.1
    threshold_fraction: float = 0.1
    path_grid: int = 40
    min_agreement: float | None = 0.95
    confidence: float = 0.9
    exit_threshold: float = DEFAULT_EXIT_THRESHOLD
    min_layers: int | None = None
    continuation: str | None = None
    continuation_prompt_len: int = 64
    seed: int = 0

    @classmethod
    def merged(cls, config: CalibrationConfig | None, options: dict[str, Any], where: str) -> CalibrationConfig:
        """`config` (None: the defaults) with the keyword shorthands `options` laid over it; an unknown keyword
        is named, with the field it most resembles, as `where` ("calibrate()") received it."""
        if config is not None and not isinstance(config, CalibrationConfig):
            raise TideArgumentTypeError(f"config must be a CalibrationConfig, got {type(config).__name__}")
        fields = [f.name for f in dataclasses.fields(cls)]
        for key in options:
            if key not in fields:
                close = difflib.get_close_matches(key, fields, n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else f" (CalibrationConfig fields: {fields})"
                raise TideArgumentTypeError(f"{where} got an unexpected keyword argument {key!r}{hint}")
        return dataclasses.replace(config or cls(), **options)

    @classmethod
    def of_router(cls, config: Any) -> CalibrationConfig:
        """The settings a router (its `TideRouterConfig`) was calibrated with, to calibrate again the same way."""
        names = [f.name for f in dataclasses.fields(cls)]
        recorded = {name: getattr(config, name) for name in names if getattr(config, name, None) is not None}
        return cls(**recorded)

    def router_fields(self) -> dict[str, Any]:
        """The fields the router's `TideRouterConfig` records (all but the sampling, which `calibrate` reads)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in SAMPLING_FIELDS}
