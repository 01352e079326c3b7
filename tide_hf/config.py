"""Configuration: the router sidecar's `TideRouterConfig` and the checks its fields (and attach's options) pass."""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import os
from collections.abc import Iterable
from dataclasses import MISSING
from typing import Any

from transformers import PretrainedConfig

from .errors import TideArgumentError, TideArgumentTypeError, TideRouterFileError
from .record import RECORD_KEY, check_coverage, check_exit_paths, check_held_out_tokens, flatten_record, nest_record
from .settings import (
    CONTINUATIONS,
    EXIT_HEADS,
    LABEL_KINDS,
    SAMPLING_FIELDS,
    CalibrationConfig,
    RouterFields,
    with_args,
)
from .settings import DEFAULT_EXIT_THRESHOLD as DEFAULT_EXIT_THRESHOLD  # runtime.options reads these here
from .settings import KV_POLICIES as KV_POLICIES
from .settings import MODES as MODES
from .values import check_int, check_real, plain

LEGACY_EXIT_HEAD = "lens"  # what a router file without the field means: it predates exit heads
SEED_BOUND = 2**63  # torch and the samplers take 64-bit seeds
FIELD_NAME_CUTOFF = 0.85  # difflib similarity above which an unknown key is taken for a misspelled field
TEXT_FIELDS = ("base_model_name_or_path", "base_model_revision", "base_architecture", "base_model_type",
               "base_fingerprint", "dataset", "continuation", "label", "exit_head")  # str or None (a path: its str)
# TideRouterConfig's fields, each with its default and help: the base model's and calibration's record, then the
# settings (CalibrationConfig's, less the sampling that calibrate reads itself)
ROUTER_FIELDS = {f.name: f for f in dataclasses.fields(RouterFields)} | {
    f.name: f for f in dataclasses.fields(CalibrationConfig) if f.name not in SAMPLING_FIELDS}


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
    `calibrate` fills it: build one by hand only for tests or to load weights you trained yourself. What the
    labels and exit heads mean: `CalibrationConfig`; a file without `exit_head` reads as "lens" (it predates exit
    heads).
    """

    model_type = "tide_router"

    def __init__(self, **kwargs: Any) -> None:
        for name, field in ROUTER_FIELDS.items():  # a dict field given None is empty
            value = kwargs.pop(name, MISSING)
            if value is MISSING or (value is None and field.default_factory is dict):
                value = field.default if field.default_factory is MISSING else field.default_factory()
            setattr(self, name, value)
        if self.checkpoint_layers is None:  # derived: the inputs are checked first
            check_int("num_hidden_layers", self.num_hidden_layers, minimum=1)
            check_int("checkpoint_interval", self.checkpoint_interval, minimum=1)
            self.checkpoint_layers = default_checkpoints(self.num_hidden_layers, self.checkpoint_interval)
        elif not isinstance(self.checkpoint_layers, (list, tuple)):
            raise TideArgumentTypeError(f"checkpoint_layers must be a list of ints, got {self.checkpoint_layers!r}")
        for k in self.checkpoint_layers:
            check_int("checkpoint_layers", k)
        self.checkpoint_layers = list(self.checkpoint_layers)
        if self.min_layers is None:
            self.min_layers = min(self.checkpoint_layers, default=1)
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
        check_held_out_tokens(self.held_out_tokens)
        if self.held_out_tokens is not None:
            self.held_out_tokens = list(self.held_out_tokens)
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
        """The fields of a router config (`calibrate(**config_kwargs)` may set these, less the fields it derives
        from the model); other keywords go to transformers' `PretrainedConfig`."""
        return frozenset(ROUTER_FIELDS)


def init_signature() -> inspect.Signature:
    """`TideRouterConfig(...)`'s keywords, one per field with its type and default, as `help()` and the API page
    read them (`__init__` itself takes `**kwargs`; a dict field's None is empty)."""
    keyword = inspect.Parameter.KEYWORD_ONLY
    return inspect.Signature([
        inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD),
        *(inspect.Parameter(name, keyword, annotation=field.type,
                            default=None if field.default is MISSING else field.default)
          for name, field in ROUTER_FIELDS.items()),
        inspect.Parameter("kwargs", inspect.Parameter.VAR_KEYWORD, annotation="Any"),
    ])


TideRouterConfig.__doc__ = with_args(TideRouterConfig.__doc__, ROUTER_FIELDS.values())
TideRouterConfig.__init__.__signature__ = init_signature()


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
