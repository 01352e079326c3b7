"""Configuration: the router sidecar's `TideRouterConfig` and the checks its fields (and attach's options) pass."""

from __future__ import annotations

import difflib
import inspect
import math
import numbers
import os
from collections.abc import Iterable
from typing import Any

from transformers import PretrainedConfig

from .errors import TideArgumentError, TideArgumentTypeError, TideRouterFileError

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
# Exit paths for quality targets (see `tide_hf.modeling.targets`): top-1 agreement, perplexity change.
PATH_KINDS = ("agreement", "perplexity")
DEFAULT_EXIT_THRESHOLD = 0.85  # the global threshold of a router config (and of `TideOptions`) when none is given
SUMSQ_SLACK = 1e-9  # relative rounding a stored table's NLL sums may carry (fp64 sums written as JSON)
CLOSED = 1.0  # a per-checkpoint threshold that never exits
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
    """Everything needed to rebuild, pair and audit a TIDE router.

    Architecture: `hidden_size`, `router_bottleneck_dim`, `checkpoint_layers` (a checkpoint `k` scores
    the output of the `k`-th decoder layer, 1-based). Provenance (what the router belongs to and how it
    was made): the `base_*` fields, the label, the data and the training hyper-parameters. Training runs at
    most `num_epochs` per router and stops after `early_stopping_patience` epochs without a better loss on the
    validation samples (`validation_fraction`, in (0, 1): the ordering of the exit paths needs them too).

    `unique_documents`: calibration kept each repeated document of its text once (`load_texts`; routers made
    before it did have False): evaluation on the same corpus loads it the same way, so that `held_out_texts` finds
    the documents calibration never read.

    Exit heads: with `exit_head="linear"` a token exiting at checkpoint `k` reads its logits from
    `final_norm(E_k(final_norm(h_k)))` through the model's head, where `E_k` is a linear map fitted at calibration
    (ridge least squares, `exit_head_ridge`) to predict the last layer's state (its direction, where the final
    norm discards scale) from the checkpoint's: a "linear shortcut" (Din et al., 2023), far closer to the full
    model's distribution than the model's head on `h_k` alone (`"lens"`, what routers made before exit heads
    existed use). `exit_head_rank` r < hidden stores each map as hidden x r and r x hidden factors (the best
    rank-r map, reduced-rank regression), for models whose hidden x hidden maps would make the sidecar large.

    Quality targets: `exit_paths` holds the calibrated exit paths (see `tide_hf.modeling.targets`), ordered on
    the validation samples with `path_grid` candidate thresholds per checkpoint and tested on the threshold
    samples (`threshold_fraction`), which neither training nor the ordering saw. Serving defaults:
    `min_agreement` at `confidence` when the router has paths and `min_agreement` is not None, else the
    global `exit_threshold` (also what routers calibrated before paths existed use); `min_layers` always.
    Draft vocabulary: `draft_vocab_coverage` maps candidate sizes n (as strings) to the held-out share of
    tokens whose final top-1 is among the n tokens the model predicted most often on the training samples; the
    router then holds that ranking (`TideRouter.draft_vocab`), and speculative drafts may compute logits over the
    first n tokens only (see `tide_hf.calibration.vocab`). Empty: drafts use the whole vocabulary.
    Calibration text: with `continuation` None the routers read the corpus as written; with "greedy" or "sample"
    each sample keeps its first `continuation_prompt_len` tokens and the model writes the rest (see
    `tide_hf.calibration.continuations`), so routers, exit heads and thresholds are fitted on text the model
    wrote itself, as it does inside `generate()`.
    Results: `metrics`, one dict per checkpoint, and `calibration_seconds` (writing continuations when asked,
    model body, labelling, training).
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

    @classmethod
    def from_dict(cls, config_dict: dict[str, Any], **kwargs: Any) -> Any:
        """transformers' `from_dict`, with its keywords checked like the file's keys: it sets them after `__init__`
        has validated (an out-of-range value was kept) and drops one that is no attribute (a misspelling)."""
        check_field_names(kwargs, cls.field_names(), "TideRouterConfig")
        config_dict = {"exit_head": LEGACY_EXIT_HEAD, **config_dict}  # a file without it predates exit heads
        result = super().from_dict(config_dict, **kwargs)
        (result[0] if isinstance(result, tuple) else result).validate()
        return result

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


def check_int(name: str, value: Any, *, minimum: int | None = None) -> None:
    """`value` is an int (not a bool, not a float such as 2.5), at least `minimum`; else an error naming `name`."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TideArgumentTypeError(f"{name} must be an int, got {value!r} ({type(value).__name__})")
    if minimum is not None and value < minimum:
        raise TideArgumentError(f"{name} must be >= {minimum}, got {value}")


def check_real(name: str, value: Any, *, low: float | None = None, high: float | None = None,
               low_open: bool = False, high_open: bool = False) -> None:
    """`value` is a finite real number (not a bool or a string) in the given range; else an error naming `name`."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TideArgumentTypeError(f"{name} must be a number, got {value!r} ({type(value).__name__})")
    value = float(value)
    out = not math.isfinite(value)
    out |= low is not None and (value <= low if low_open else value < low)
    out |= high is not None and (value >= high if high_open else value > high)
    if out:
        lo = "(-inf" if low is None else f"{'(' if low_open else '['}{low}"
        hi = "inf)" if high is None else f"{high}{')' if high_open else ']'}"
        raise TideArgumentError(f"{name} must be a finite number in {lo}, {hi}, got {value}")


def check_coverage(coverage: Any) -> None:
    """`draft_vocab_coverage`: a dict of positive integer sizes (as strings, JSON keys) to shares in [0, 1]."""
    if not isinstance(coverage, dict):
        raise TideArgumentTypeError(f"draft_vocab_coverage must be a dict of size -> coverage, got {coverage!r}")
    for size, share in coverage.items():
        if not (isinstance(size, str) and size.isdigit() and int(size) >= 1):
            raise TideArgumentError(f"draft_vocab_coverage: sizes must be positive integers written as strings, "
                                    f"got {size!r}")
        check_real(f"draft_vocab_coverage[{size!r}]", share, low=0.0, high=1.0)


def plain(value: Any) -> Any:
    """`value` with every number inside (dicts, lists) a plain int / float / bool, as JSON writes them."""
    if isinstance(value, dict):
        return {key: plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(item) for item in value]
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return value
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    return value


def check_exit_paths(paths: Any, num_checkpoints: int) -> None:
    """`exit_paths`: per kind in `PATH_KINDS`, threshold vectors (one per checkpoint, in [0, 1], the first all
    closed: "no exit" is where a test starts) and, per vector, the held-out losses `select` tests."""
    if not isinstance(paths, dict):
        raise TideArgumentTypeError(f"exit_paths must be a dict of kind -> path, got {type(paths).__name__}")
    for kind, path in paths.items():
        name = f"exit_paths[{kind!r}]"
        if kind not in PATH_KINDS:
            raise TideArgumentError(f"exit_paths: kinds must be among {PATH_KINDS}, got {kind!r}")
        if not isinstance(path, dict):
            raise TideArgumentTypeError(f"{name} must be a dict, got {type(path).__name__}")
        missing = {"thresholds", "errors", "n", "nll_sum", "nll_sumsq", "n_next"} - set(path)
        if missing:
            raise TideArgumentError(f"{name} lacks {sorted(missing)}")
        points = path["thresholds"]
        if not isinstance(points, list) or not points:
            raise TideArgumentError(f"{name}['thresholds'] must be a non-empty list of threshold vectors")
        for point in points:
            if not isinstance(point, list) or len(point) != num_checkpoints:
                raise TideArgumentError(f"{name}: every threshold vector needs one value per checkpoint "
                                        f"({num_checkpoints}), got {point!r}")
            for value in point:
                check_real(f"{name} threshold", value, low=0.0, high=1.0)
        if any(value != CLOSED for value in points[0]):
            raise TideArgumentError(f"{name}: the first threshold vector must close every checkpoint (all "
                                    f"{CLOSED}), got {points[0]}")
        check_int(f"{name}['n']", path["n"], minimum=0)
        check_int(f"{name}['n_next']", path["n_next"], minimum=0)
        for key in ("errors", "nll_sum", "nll_sumsq"):
            if not isinstance(path[key], list) or len(path[key]) != len(points):
                raise TideArgumentError(f"{name}[{key!r}] must be a list with one entry per threshold vector "
                                        f"({len(points)})")
        for errors in path["errors"]:
            check_int(f"{name} errors", errors, minimum=0)
            if errors > path["n"]:
                raise TideArgumentError(f"{name}: {errors} errors out of n={path['n']} tokens")
        for value in path["nll_sum"] + path["nll_sumsq"]:
            check_real(f"{name} NLL sums", value)
        check_path_sizes(name, path)
    sizes = {(path["n"], path["n_next"]) for path in paths.values()}
    if len(sizes) > 1:
        raise TideArgumentError(f"exit_paths: every kind is tested on the same threshold split, but their (n, "
                                f"n_next) differ: {sorted(sizes)}")


def check_path_sizes(name: str, path: dict) -> None:
    """Losses a held-out test could have produced: at most `n` tokens with a next token, nothing lost where
    nothing exits (the first point), sums of squares that are non-negative and at least the square of the sum
    over `n_next` (Cauchy-Schwarz, up to rounding)."""
    if path["n_next"] > path["n"]:
        raise TideArgumentError(f"{name}: n_next={path['n_next']} tokens with a next token out of n={path['n']}")
    if path["errors"][0] or path["nll_sum"][0] or path["nll_sumsq"][0]:
        raise TideArgumentError(f"{name}: the first point closes every checkpoint, so its losses must be 0, got "
                                f"errors {path['errors'][0]}, NLL sums {path['nll_sum'][0]}, {path['nll_sumsq'][0]}")
    for total, squares in zip(path["nll_sum"], path["nll_sumsq"]):
        if squares < 0 or total * total > squares * max(path["n_next"], 1) * (1 + SUMSQ_SLACK) + SUMSQ_SLACK:
            raise TideArgumentError(f"{name}: NLL sum {total} and sum of squares {squares} over n_next="
                                    f"{path['n_next']} tokens are impossible (sum^2 > n_next * sum of squares)")


def check_threshold(value: Any) -> None:
    check_real("exit_threshold", value, low=0.0, high=1.0)


def check_min_layers(value: Any, num_hidden_layers: int) -> None:
    check_int("min_layers", value)
    if not 1 <= value <= num_hidden_layers:
        raise TideArgumentError(f"min_layers must be in [1, {num_hidden_layers}] for this model, got {value}")
