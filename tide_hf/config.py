"""Configuration: the router sidecar's `TideRouterConfig` and the checks its fields (and attach's options) pass."""

from __future__ import annotations

import difflib
import inspect
import os
from collections.abc import Iterable
from typing import Any

from transformers import PretrainedConfig

from .errors import TideArgumentError, TideArgumentTypeError, TideRouterFileError
from .record import RECORD_KEY, check_coverage, check_exit_paths, flatten_record, nest_record
from .values import check_int, check_real, plain

LABEL_KINDS = ("cosine", "top1", "kl", "top1_kl")
# How an exited token's logits are made: "lens" runs the model's final norm and head on the checkpoint's state
# as is; "linear" first maps it with a per-checkpoint linear exit head fitted by least squares at calibration.
EXIT_HEADS = ("lens", "linear")
CALIBRATED_EXIT_HEAD = "linear"  # every router's exit head unless told otherwise (calibrate and the config agree)
LEGACY_EXIT_HEAD = "lens"  # what a router file without the field means: it predates exit heads
MODES = ("select", "skip", "speculative")
KV_POLICIES = ("propagate", "recompute")
# Calibration text after each sample's prompt: the corpus itself (None) or the model's own continuation.
CONTINUATIONS = ("greedy", "sample")
DEFAULT_EXIT_THRESHOLD = 0.85  # the global threshold of a router config (and of `TideOptions`) when none is given
SEED_BOUND = 2**63  # torch and the samplers take 64-bit seeds
FIELD_NAME_CUTOFF = 0.85  # difflib similarity above which an unknown key is taken for a misspelled field
TEXT_FIELDS = ("base_model_name_or_path", "base_model_revision", "base_architecture", "base_model_type",
               "base_fingerprint", "dataset", "continuation", "label", "exit_head")  # str or None (a path: its str)


def default_checkpoints(num_hidden_layers: int, interval: int) -> list[int]:
    """Checkpoints as counts of executed layers: every `interval`, never the final layer.

    A router after the last layer would compare the final state with itself, so its "converged"
    label is trivially true and only inflates exit rates.
    """
    return list(range(interval, num_hidden_layers, interval))


class TideRouterConfig(PretrainedConfig):
    """Everything needed to rebuild, pair and audit a TIDE router: the config of the `TideRouter` sidecar.

    config.json holds architecture, settings and serving defaults at its top level, and the calibration record
    (provenance and results) in its "calibration" section (`tide_hf.record`); this object holds every field.
    `calibrate` fills it: build one by hand only for tests or to load weights you trained yourself.

    Args:
        hidden_size: the base model's hidden size (each router's input).
        num_hidden_layers: the base model's decoder layers.
        checkpoint_interval: a checkpoint every this many layers (when `checkpoint_layers` is not given).
        checkpoint_layers: counts of executed layers a router scores after (1-based, increasing, never the last
            layer: a router there would compare the final state with itself).
        router_bottleneck_dim: each router MLP's hidden width.
        label: when a token counts as converged: "top1" (its exit logits' top-1 is the final one), "cosine",
            "kl" or "top1_kl" (see `CalibrationConfig`).
        exit_head: how an exited token's logits are made. "linear": `final_norm(E_k(final_norm(h_k)))` through
            the model's head, with `E_k` a ridge least-squares map to the last layer's state (a linear shortcut,
            Din et al., 2023). "lens": the model's head on `h_k` (what files without the field mean).
        exit_head_ridge: the ridge penalty of the linear exit heads.
        exit_head_rank: None (full rank) or r < hidden: each map stored as hidden x r and r x hidden factors.
        convergence_threshold: the cosine a "cosine" label needs.
        kl_threshold: the KL a "kl" / "top1_kl" label allows.
        exit_threshold: the global threshold on router scores, used when no quality target is served.
        min_layers: no exit before this many layers (None: the first checkpoint).
        base_model_name_or_path: the model the routers were calibrated on (its name or path).
        base_model_revision: its Hub commit, when it came from the Hub.
        base_architecture: its class name (`attach` refuses another).
        base_model_type: its config's model_type.
        base_fingerprint: a fingerprint of that model's weights (`attach` refuses other weights).
        dataset: the calibration text's name.
        unique_documents: calibration kept each repeated document once (`load_texts`), so evaluation on the same
            corpus finds the documents calibration never read (`held_out_texts`).
        num_samples: how many samples calibration read.
        seq_len: the tokens of each sample.
        continuation: None (the text as written), "greedy" or "sample" (the model writes each sample after its
            first `continuation_prompt_len` tokens).
        continuation_prompt_len: the tokens kept of each sample before a continuation.
        learning_rate: the routers' learning rate.
        num_epochs: at most this many epochs per router.
        early_stopping_patience: stop a router after this many epochs without a better held-out loss (0: never).
        train_batch_size: tokens per training step.
        max_train_tokens: tokens kept per checkpoint, on average.
        validation_fraction: the samples that pick each router's best epoch and order the exit paths.
        threshold_fraction: the samples the exit paths are tested on (nothing else saw them).
        path_grid: candidate thresholds per checkpoint when the exit paths are ordered.
        min_agreement: the top-1 agreement `attach` serves by default (None: the global `exit_threshold`).
        confidence: the probability with which a quality target holds (Learn-then-Test).
        exit_paths: the calibrated exit paths per kind ("agreement", "perplexity"): threshold vectors and the
            held-out losses quality targets are certified with (`tide_hf.modeling.targets`).
        draft_vocab_coverage: candidate sizes n (as strings) -> held-out share of tokens whose final top-1 is
            among the n tokens the model predicted most often (speculative drafts may score those only).
        seed: the seed of sampling, splits and training.
        metrics: per checkpoint (as a string), the held-out label rates, precision, recall and AUC.
        calibration_seconds: the seconds each stage took (continuations, forward, labels, training).
    """

    model_type = "tide_router"

    def __init__(
        self,
        hidden_size: int = 4096,
        num_hidden_layers: int = 32,
        checkpoint_interval: int = 4,
        checkpoint_layers: list[int] | None = None,
        router_bottleneck_dim: int = 128,
        label: str = "top1",
        exit_head: str = CALIBRATED_EXIT_HEAD,
        exit_head_ridge: float = 0.01,
        exit_head_rank: int | None = None,
        convergence_threshold: float = 0.98,
        kl_threshold: float = 0.1,
        exit_threshold: float = DEFAULT_EXIT_THRESHOLD,
        min_layers: int | None = None,
        base_model_name_or_path: str | None = None,
        base_model_revision: str | None = None,
        base_architecture: str | None = None,
        base_model_type: str | None = None,
        base_fingerprint: str | None = None,
        dataset: str | None = None,
        unique_documents: bool = False,
        num_samples: int | None = None,
        seq_len: int | None = None,
        continuation: str | None = None,
        continuation_prompt_len: int = 64,
        learning_rate: float = 1e-3,
        num_epochs: int = 100,
        early_stopping_patience: int = 10,
        train_batch_size: int = 1024,
        max_train_tokens: int = 65536,
        validation_fraction: float = 0.1,
        threshold_fraction: float = 0.1,
        path_grid: int = 40,
        min_agreement: float | None = 0.95,
        confidence: float = 0.9,
        exit_paths: dict[str, Any] | None = None,
        draft_vocab_coverage: dict[str, float] | None = None,
        seed: int = 0,
        metrics: dict[str, dict[str, Any]] | None = None,
        calibration_seconds: dict[str, float] | None = None,
        **kwargs: Any,
    ) -> None:
        self.hidden_size = hidden_size
        self.num_hidden_layers = num_hidden_layers
        self.checkpoint_interval = checkpoint_interval
        if checkpoint_layers is None:  # derived: the inputs are checked first
            check_int("num_hidden_layers", num_hidden_layers, minimum=1)
            check_int("checkpoint_interval", checkpoint_interval, minimum=1)
            checkpoint_layers = default_checkpoints(num_hidden_layers, checkpoint_interval)
        elif not isinstance(checkpoint_layers, (list, tuple)):
            raise TideArgumentTypeError(f"checkpoint_layers must be a list of ints, got {checkpoint_layers!r}")
        for k in checkpoint_layers:
            check_int("checkpoint_layers", k)
        self.checkpoint_layers = list(checkpoint_layers)
        self.router_bottleneck_dim = router_bottleneck_dim
        self.label = label
        self.exit_head = exit_head
        self.exit_head_ridge = exit_head_ridge
        self.exit_head_rank = exit_head_rank
        self.convergence_threshold = convergence_threshold
        self.kl_threshold = kl_threshold
        self.exit_threshold = exit_threshold
        self.min_layers = min_layers if min_layers is not None else min(self.checkpoint_layers, default=1)
        self.base_model_name_or_path = base_model_name_or_path
        self.base_model_revision = base_model_revision
        self.base_architecture = base_architecture
        self.base_model_type = base_model_type
        self.base_fingerprint = base_fingerprint
        self.dataset = dataset
        self.unique_documents = unique_documents
        self.num_samples = num_samples
        self.seq_len = seq_len
        self.continuation = continuation
        self.continuation_prompt_len = continuation_prompt_len
        self.learning_rate = learning_rate
        self.num_epochs = num_epochs
        self.early_stopping_patience = early_stopping_patience
        self.train_batch_size = train_batch_size
        self.max_train_tokens = max_train_tokens
        self.validation_fraction = validation_fraction
        self.threshold_fraction = threshold_fraction
        self.path_grid = path_grid
        self.min_agreement = min_agreement
        self.confidence = confidence
        self.exit_paths = exit_paths or {}
        self.draft_vocab_coverage = draft_vocab_coverage or {}
        self.seed = seed
        self.metrics = metrics or {}
        self.calibration_seconds = calibration_seconds or {}
        super().__init__(**kwargs)
        self.validate()

    def validate(self) -> None:
        """Raise a `TideArgumentError` (a `ValueError`) or `TideArgumentTypeError` (a `TypeError`) naming the
        first inconsistent field, a `TideRouterFileError` naming a key that misspells a field (transformers keeps
        it, leaving the field at its default, in AutoConfig too); then make paths and numpy numbers plain values."""
        for name in ("hidden_size", "num_hidden_layers", "checkpoint_interval", "router_bottleneck_dim",
                     "num_epochs", "train_batch_size", "max_train_tokens", "continuation_prompt_len"):
            check_int(name, getattr(self, name), minimum=1)
        check_int("early_stopping_patience", self.early_stopping_patience, minimum=0)
        check_int("seed", self.seed)
        if not isinstance(self.unique_documents, bool):
            raise TideArgumentTypeError(f"unique_documents must be True or False, got {self.unique_documents!r}")
        for name in ("num_samples", "seq_len"):  # provenance, set by calibrate()
            if getattr(self, name) is not None:
                check_int(name, getattr(self, name), minimum=1)
        check_real("learning_rate", self.learning_rate, low=0.0, low_open=True)
        check_real("convergence_threshold", self.convergence_threshold, low=-1.0, high=1.0)
        check_real("kl_threshold", self.kl_threshold, low=0.0)
        check_real("validation_fraction", self.validation_fraction, low=0.0, high=1.0, low_open=True, high_open=True)
        if self.label not in LABEL_KINDS:
            raise TideArgumentError(f"label must be one of {LABEL_KINDS}, got {self.label!r}")
        if self.continuation is not None and self.continuation not in CONTINUATIONS:
            raise TideArgumentError(f"continuation must be None or one of {CONTINUATIONS}, got {self.continuation!r}")
        if self.exit_head not in EXIT_HEADS:
            raise TideArgumentError(f"exit_head must be one of {EXIT_HEADS}, got {self.exit_head!r}")
        check_real("exit_head_ridge", self.exit_head_ridge, low=0.0)
        if self.exit_head_rank is not None:
            if self.exit_head != "linear":
                raise TideArgumentError(f"exit_head_rank={self.exit_head_rank} needs exit_head='linear' (the lens "
                                        f"has no head to factor), got exit_head={self.exit_head!r}")
            check_int("exit_head_rank", self.exit_head_rank, minimum=1)
            if self.exit_head_rank >= self.hidden_size:
                raise TideArgumentError(f"exit_head_rank must be below hidden_size={self.hidden_size} (None: full "
                                        f"rank), got {self.exit_head_rank}")
        if not isinstance(self.checkpoint_layers, (list, tuple)):
            raise TideArgumentTypeError(f"checkpoint_layers must be a list of ints, got {self.checkpoint_layers!r}")
        for k in self.checkpoint_layers:
            check_int("checkpoint_layers", k)
        if not self.checkpoint_layers:
            raise TideArgumentError(
                f"no checkpoint layers: a model with {self.num_hidden_layers} layers and checkpoint_interval="
                f"{self.checkpoint_interval} has no layer before the last to exit at"
            )
        bad = [k for k in self.checkpoint_layers if not 1 <= k < self.num_hidden_layers]
        if bad:
            raise TideArgumentError(
                f"checkpoint_layers {bad} out of range: each must be in [1, {self.num_hidden_layers - 1}] "
                "(the final layer gets no router)"
            )
        if sorted(set(self.checkpoint_layers)) != list(self.checkpoint_layers):
            raise TideArgumentError(f"checkpoint_layers must be strictly increasing, got {self.checkpoint_layers}")
        check_real("threshold_fraction", self.threshold_fraction, low=0.0, high=1.0, low_open=True, high_open=True)
        if self.validation_fraction + self.threshold_fraction >= 1.0:
            raise TideArgumentError(f"validation_fraction ({self.validation_fraction}) + threshold_fraction "
                                    f"({self.threshold_fraction}) must be below 1: training gets the other samples")
        check_int("path_grid", self.path_grid, minimum=1)
        if self.min_agreement is not None:
            check_real("min_agreement", self.min_agreement, low=0.0, high=1.0, low_open=True)
        check_real("confidence", self.confidence, low=0.0, high=1.0, low_open=True, high_open=True)
        check_threshold(self.exit_threshold)
        check_min_layers(self.min_layers, self.num_hidden_layers)
        check_coverage(self.draft_vocab_coverage)
        check_exit_paths(self.exit_paths, len(self.checkpoint_layers))
        if not -SEED_BOUND <= self.seed < 2 * SEED_BOUND:
            raise TideArgumentError(f"seed must be in [-2**63, 2**64), what torch.manual_seed takes, got {self.seed}")
        for name in ("metrics", "calibration_seconds"):
            if not isinstance(getattr(self, name), dict):
                raise TideArgumentTypeError(f"{name} must be a dict, got {type(getattr(self, name)).__name__}")
        for name in TEXT_FIELDS:
            value = getattr(self, name)
            if isinstance(value, os.PathLike):
                setattr(self, name, os.fspath(value))
            elif value is not None and not isinstance(value, str):
                raise TideArgumentTypeError(f"{name} must be a string or None, got {value!r} ({type(value).__name__})")
        for name in self.field_names():  # a numpy number passes the checks above but cannot go into config.json
            setattr(self, name, plain(getattr(self, name)))
        check_field_names(vars(self), self.field_names(), "TideRouterConfig")  # transformers keeps unknown keys
        if RECORD_KEY in vars(self):  # the fields inside would be lost to their defaults
            raise TideArgumentError(f"TideRouterConfig got a {RECORD_KEY!r} section, config.json's layout (to_dict); "
                                    "build it with TideRouterConfig.from_dict, which lays the section flat")

    @classmethod
    def from_dict(cls, config_dict: dict[str, Any], **kwargs: Any) -> Any:
        """transformers' `from_dict`, with its keywords checked like the file's keys: it sets them after `__init__`
        has validated (an out-of-range value was kept) and drops one that is no attribute (a misspelling)."""
        check_field_names(kwargs, cls.field_names(), "TideRouterConfig")
        config_dict = {"exit_head": LEGACY_EXIT_HEAD, **flatten_record(config_dict)}  # no exit_head: older file
        result = super().from_dict(config_dict, **kwargs)
        (result[0] if isinstance(result, tuple) else result).validate()
        return result

    def to_dict(self) -> dict[str, Any]:
        """transformers' dict, with provenance and results in their own section (`tide_hf.record`): what
        config.json holds."""
        return nest_record(super().to_dict())

    @classmethod
    def field_names(cls) -> frozenset[str]:
        """The fields `__init__` names explicitly (`calibrate(**config_kwargs)` may set these, less the fields it
        derives from the model)."""
        params = inspect.signature(cls.__init__).parameters
        return frozenset(n for n, p in params.items() if n != "self" and p.kind is p.POSITIONAL_OR_KEYWORD)


def check_field_names(keys: Iterable[str], fields: frozenset[str], where: str) -> None:
    """No key is a misspelling of a router field (transformers keeps unknown keys, so the field would silently
    keep its default); keys unlike every field are left alone (transformers' own, or the user's)."""
    for key in sorted(set(keys) - fields - set(dir(PretrainedConfig))):
        if close := difflib.get_close_matches(key, sorted(fields), n=1, cutoff=FIELD_NAME_CUTOFF):
            raise TideRouterFileError(f"{where}: {key!r} is not a TIDE router field; did you mean {close[0]!r}?")


def check_threshold(value: Any) -> None:
    check_real("exit_threshold", value, low=0.0, high=1.0)


def check_min_layers(value: Any, num_hidden_layers: int) -> None:
    check_int("min_layers", value)
    if not 1 <= value <= num_hidden_layers:
        raise TideArgumentError(f"min_layers must be in [1, {num_hidden_layers}] for this model, got {value}")
