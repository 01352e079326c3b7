"""Every setting of a TIDE router, each with its default and help written once, importable without torch.

`CalibrationConfig` holds what `calibrate` reads; `RouterFields` holds what calibration derives from the model
and measures. `TideRouterConfig` (`tide_hf.config`) takes its fields from both, and `tide-hf calibrate` makes its
flags and `--set` keys from `CalibrationConfig`, so the defaults and help cannot drift apart.
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from .errors import TideArgumentTypeError

LABEL_KINDS = ("cosine", "top1", "kl", "top1_kl")
# How an exited token's logits are made: "lens" runs the model's final norm and head on the checkpoint's state
# as is; "linear" first maps it with a per-checkpoint linear exit head fitted by least squares at calibration.
EXIT_HEADS = ("lens", "linear")
# Calibration text after each sample's prompt: the corpus itself (None) or the model's own continuation.
CONTINUATIONS = ("greedy", "sample")
MODES = ("select", "skip", "speculative")  # what `attach` serves (`tide_hf.runtime.options.TideConfig.mode`)
KV_POLICIES = ("propagate", "recompute")  # how skip mode fills the cache of the layers it skips
DEFAULT_EXIT_THRESHOLD = 0.85  # the global threshold of a router config (and of `TideOptions`) when none is given
# What `calibrate` itself reads (the sampling of the text); every other field goes into the router's config.
SAMPLING_FIELDS = ("num_samples", "seq_len", "batch_size")


def setting(default: Any = None, *, help: str, choices: tuple[str, ...] | None = None,
            factory: Callable[[], Any] | None = None) -> Any:
    """A dataclass field with its help (and choices, for a text field) in its metadata, peft's pattern: the
    docstring's `Args:` and the CLI's `--help` read them from there. `factory` makes a mutable default."""
    metadata = {"help": help, "choices": choices}
    if factory is not None:
        return field(default_factory=factory, metadata=metadata)
    return field(default=default, metadata=metadata)


def with_args(doc: str | None, fields: Iterable[dataclasses.Field]) -> str:
    """`doc` with an `Args:` section made of the fields' help, so the help is written once: in the field."""
    args = "\n".join(f"        {f.name}: {f.metadata['help']}" for f in fields)
    return f"{(doc or '').rstrip()}\n\n    Args:\n{args}\n"


def document(cls: type) -> type:
    """Class decorator: the dataclass `cls` with its fields' help as its docstring's `Args:` section."""
    cls.__doc__ = with_args(cls.__doc__, dataclasses.fields(cls))
    return cls


@document
@dataclass(frozen=True)
class CalibrationConfig:
    """What `calibrate` reads: the text's sampling, the labels, the exit heads, router training and the router's
    default quality target (peft's `LoraConfig` pattern). The router records all but the sampling.

    Labels say when a token counts as converged at a checkpoint: "top1" (its exit prediction's top-1 is the
    full model's), "cosine" (cosine to the last layer's state above `convergence_threshold`), "kl"
    (KL(full || exit) below `kl_threshold`) or "top1_kl" (both top-1 agreement and that KL). Exit heads say how
    an exited token's logits are made: "linear" maps the checkpoint's normed state with `E_k`, a ridge
    least-squares map to the last layer's state (a linear shortcut, Din et al., 2023), then runs the model's
    final norm and head; "lens" runs the model's head on the checkpoint's state as is.

    Example:
        >>> from tide_hf import CalibrationConfig
        >>> CalibrationConfig(num_samples=64, label="cosine").exit_head
        'linear'
    """

    num_samples: int = setting(256, help="text windows to calibrate on (more: more exits)")
    seq_len: int = setting(256, help="tokens per sample")
    batch_size: int = setting(8, help="samples per forward pass")
    label: str = setting("top1", choices=LABEL_KINDS, help=f"what 'converged' means: {', '.join(LABEL_KINDS)}")
    exit_head: str = setting("linear", choices=EXIT_HEADS, help="linear (a map fitted to the last layer) or lens")
    exit_head_ridge: float = setting(0.01, help="ridge penalty of the linear exit heads, relative to the Gram "
                                     "matrix's mean diagonal")
    exit_head_rank: int | None = setting(None, help="store each linear exit head as rank-r factors, hidden x r "
                                         "and r x hidden, r below hidden_size (None: full rank)")
    convergence_threshold: float = setting(0.98, help="label 'cosine': the cosine that counts as converged")
    kl_threshold: float = setting(0.1, help="labels 'kl' / 'top1_kl': the KL divergence a converged token stays "
                                  "below")
    checkpoint_interval: int = setting(4, help="a router after every this many layers")
    checkpoint_layers: list[int] | None = setting(None, help="explicit checkpoints instead of checkpoint_interval: "
                                                  "counts of executed layers (1-based, increasing, never the last "
                                                  "layer: a router there would compare the final state with itself)")
    router_bottleneck_dim: int = setting(128, help="hidden width of each router's two-layer MLP")
    learning_rate: float = setting(1e-3, help="router training's learning rate")
    num_epochs: int = setting(100, help="most epochs per router; early stopping ends sooner")
    early_stopping_patience: int = setting(10, help="stop a router after this many epochs without a better "
                                           "held-out loss (0: never)")
    train_batch_size: int = setting(1024, help="tokens per router training step")
    max_train_tokens: int = setting(65536, help="tokens kept per checkpoint, on average (sets memory and "
                                    "labelling time)")
    validation_fraction: float = setting(0.1, help="share of the samples that picks each router's best epoch and "
                                         "orders the exit paths")
    threshold_fraction: float = setting(0.1, help="share of the samples that certifies the quality targets (seen "
                                        "by nothing else)")
    path_grid: int = setting(40, help="candidate thresholds per checkpoint on the exit paths")
    min_agreement: float | None = setting(0.95, help="top-1 agreement with the full model "
                                          "served by default (None: exit_threshold)")
    confidence: float = setting(0.9, help="probability the target holds with (Learn-then-Test)")
    exit_threshold: float = setting(DEFAULT_EXIT_THRESHOLD, help="the global router score at which a token exits "
                                    "where no quality target is in effect")
    min_layers: int | None = setting(None, help="no exit before this many layers (None: the first checkpoint)")
    continuation: str | None = setting(None, choices=CONTINUATIONS, help="the model's own continuations, greedy "
                                       "or sample (None: the text)")
    continuation_prompt_len: int = setting(64, help="with a continuation: text tokens each sample keeps as "
                                          "its prompt")
    seed: int = setting(0, help="seed of sampling, the split and training")

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


@document
@dataclass(frozen=True)
class RouterFields:
    """The fields of a router's `TideRouterConfig` that are no setting: the base model's shape (at config.json's
    top level), and what the router was made from and what calibration measured (its provenance and results, in
    config.json's "calibration" section: `tide_hf.record`)."""

    hidden_size: int = setting(4096, help="the base model's hidden size (each router's input)")
    num_hidden_layers: int = setting(32, help="the base model's decoder layers")
    base_model_name_or_path: str | None = setting(help="the model the routers were calibrated on (name or path)")
    base_model_revision: str | None = setting(help="its Hub commit, when it came from the Hub")
    base_architecture: str | None = setting(help="its class name (attach refuses another)")
    base_model_type: str | None = setting(help="its config's model_type")
    base_fingerprint: str | None = setting(help="a fingerprint of its weights (attach refuses other weights)")
    dataset: str | None = setting(help="the calibration text's name")
    unique_documents: bool = setting(False, help="calibration kept each repeated document once (load_texts), so "
                                     "evaluation on the same corpus finds the documents it never read "
                                     "(held_out_texts)")
    num_samples: int | None = setting(help="how many samples calibration read")
    seq_len: int | None = setting(help="the tokens of each sample")
    exit_paths: dict[str, Any] = setting(factory=dict, help="the calibrated exit paths per kind ('agreement', "
                                         "'perplexity'): threshold vectors and the held-out losses quality targets "
                                         "are certified with (tide_hf.modeling.targets)")
    held_out_tokens: list[int] | None = setting(help="[validation, threshold] tokens whose router scores and losses "
                                                "the weights keep (held_out_*), to price exits and re-select "
                                                "thresholds at attach (None: none kept)")
    draft_vocab_coverage: dict[str, float] = setting(factory=dict, help="candidate sizes n (as strings) -> "
                                                     "held-out share of tokens whose final top-1 is among the n "
                                                     "tokens the model predicted most often (speculative drafts "
                                                     "may score those only)")
    metrics: dict[str, dict[str, Any]] = setting(factory=dict, help="per checkpoint (as a string), the held-out "
                                                 "label rates, precision, recall and AUC")
    calibration_seconds: dict[str, float] = setting(factory=dict, help="the seconds each stage took "
                                                    "(continuations, forward, labels, training)")
