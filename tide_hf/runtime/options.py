"""What attach serves: `TideConfig` (what the user asks for) and `TideOptions` (that request resolved against the
router: per-checkpoint thresholds for its quality target), checked against the model before any hook is placed."""

from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass
from typing import Any

from ..config import (
    DEFAULT_EXIT_THRESHOLD,
    FIELD_NAME_CUTOFF,
    KV_POLICIES,
    MODES,
    check_int,
    check_min_layers,
    check_threshold,
)
from ..errors import TideArgumentError, TideArgumentTypeError
from ..modeling.targets import check_served, select

AUTO_MODE = "auto"  # attach's default: speculative mode (lossless) where the model allows it (`runtime/modes.py`)
# TideConfig fields that ask for exits at a quality target: given under mode "auto", they choose skip mode
EXIT_SETTINGS = ("min_agreement", "max_perplexity_increase", "confidence", "exit_threshold", "min_layers", "kv",
                 "pricing")
# options attach took once -> why they went and what to do instead (named, not "unknown option")
REMOVED_OPTIONS = {"park_rows": "batches ran slower with it on a router's own decisions (0.73x stock at batch 8, "
                                "against 0.98x without it); kv='recompute' gives the same tokens, so drop it"}
DEFAULT_KV = "recompute"  # the policy that keeps the quality target: skipped layers' K/V computed exactly, later


@dataclass(frozen=True)
class TideConfig:
    """What `attach` serves: which mode, and how eagerly tokens exit. Every field's None means the router's own
    setting (its default quality target, its `min_layers`).

    Args:
        mode: "auto" (the default): "speculative" where the model allows it, so the output is stock's; with an
            exit setting (a quality target, `exit_threshold`, `min_layers`, `kv`) "skip" instead.
            Where the chosen mode cannot serve the model, the next one that can ("skip", then "select"), warned.
            "skip": a token that exits stops computing; its later layers' cache follows `kv`. "select": every
            layer runs and the exit state feeds the head (the paper's system; saves no compute). "speculative":
            early-exit and context drafts, verified at full depth (the same tokens as stock).
        min_agreement: quality target, top-1 agreement with the full model (e.g. 0.97).
        max_perplexity_increase: quality target, relative perplexity increase (e.g. 0.05 for +5 %).
        confidence: probability with which the quality target holds (Learn-then-Test; None: the router's).
        exit_threshold: one global router score at which tokens exit, instead of a quality target.
        min_layers: no token exits before this many layers.
        kv: skip mode: how the skipped layers' cache is filled. "recompute" (the default): computed exactly, at
            the next step (in a batch whose other rows run on: at once), so the quality target holds.
            "propagate": the exit state's keys and values, cheaper, with no quality guarantee (agreement drops
            in batches).
        draft_layer: speculative mode: the checkpoint drafts are made at (None: chosen per call by what drafting
            measured on this model, by the router's calibration figures until then).
        pricing: skip mode at a quality target: close the checkpoints whose exits cost more than they save on this
            model and linear path (costs measured at the first attach on the model, then remembered), the
            thresholds of the others selected again for the target. With kv="recompute" it also takes exits only
            where they stop a step's layers, and on the CPU steps aside where plain steps run faster. None (the
            default): where the router keeps its held-out scores; True: refuse a router without them; False:
            serve every checkpoint the target opens, as skip mode did before pricing.

    Example:
        >>> import tide_hf
        >>> config = tide_hf.TideConfig(min_agreement=0.97)
        >>> config.mode
        'auto'
    """

    mode: str = AUTO_MODE
    min_agreement: float | None = None
    max_perplexity_increase: float | None = None
    confidence: float | None = None
    exit_threshold: float | None = None
    min_layers: int | None = None
    kv: str | None = None
    draft_layer: int | None = None
    pricing: bool | None = None

    @classmethod
    def merged(cls, config: TideConfig | None, options: dict[str, Any]) -> TideConfig:
        """`config` (None: the defaults) with the keyword shorthands `options` laid over it; an unknown keyword is
        named with the field it most resembles."""
        if config is not None and not isinstance(config, TideConfig):
            raise TideArgumentTypeError(f"config must be a TideConfig, got {type(config).__name__}")
        fields = [f.name for f in dataclasses.fields(cls)]
        for name in options:
            if name in REMOVED_OPTIONS:
                raise TideArgumentTypeError(f"attach() option {name!r} was removed: {REMOVED_OPTIONS[name]}")
            if name not in fields:
                close = difflib.get_close_matches(name, fields, n=1, cutoff=FIELD_NAME_CUTOFF)
                hint = f"; did you mean {close[0]!r}" if close else ""
                raise TideArgumentTypeError(f"attach() got an unknown option {name!r}{hint} (TideConfig's fields: "
                                            f"{', '.join(fields)})")
        return dataclasses.replace(config or cls(), **options)


def mode_kv(mode: Any, kv: str | None, draft_layer: int | None) -> str:
    """The cache policy of an attach (`kv=None`: `DEFAULT_KV`), refusing an option the mode never reads (it was
    accepted and ignored): `kv` says how skip mode fills the cache of the layers it skips, `draft_layer` where
    speculative mode drafts."""
    if kv is not None and mode not in ("skip", AUTO_MODE):
        raise TideArgumentError(f"kv={kv!r} applies to mode='skip' only (how the cache of the layers it skips is "
                                f"filled); mode={mode!r} runs them")
    if draft_layer is not None and mode != "speculative":
        raise TideArgumentError(f"draft_layer={draft_layer!r} applies to mode='speculative' only (the checkpoint it "
                                f"drafts at); mode={mode!r} does not draft")
    return DEFAULT_KV if kv is None else kv


def check_pricing(mode: Any, pricing: Any) -> None:
    """Refuse a `pricing` that is not None / True / False, or one given to a mode that never reads it (select mode
    saves nothing to price; speculative mode's output is stock's)."""
    if pricing is not None and not isinstance(pricing, bool):
        raise TideArgumentTypeError(f"pricing must be True, False or None, got {pricing!r}")
    if pricing is not None and mode not in ("skip", AUTO_MODE):
        raise TideArgumentError(f"pricing={pricing!r} applies to mode='skip' only (it closes checkpoints whose exits "
                                f"do not save time); mode={mode!r} skips no layer")


@dataclass(frozen=True)
class TideOptions:
    """Serving options of one attach: how eagerly tokens exit and what an exit saves.

    A row exits at the first checkpoint >= `min_layers` whose router score reaches that checkpoint's
    threshold: `thresholds[k]` when given (chosen for a quality target, see `tide_hf.modeling.targets`),
    else the global `exit_threshold` (1.0 closes a checkpoint; 1.0 everywhere disables exits). `target`
    records the quality target the thresholds were chosen for (None: an explicit threshold). `mode`:
    "select" runs every layer and feeds the exit state to the head (the paper's system); "skip" stops
    computing layers for the rows and positions that exited (`kv="recompute"`: once every row of a step has
    exited); "speculative" drafts with early exit while the routers say converged and
    verifies every draft at full depth (lossless). `kv`: how skip mode fills the cache of the layers it did
    not run. `draft_layer`: the checkpoint speculative mode drafts at (None: chosen per call, `resolve_draft_layer`).
    `auto`: the mode was chosen by attach's default (mode "auto"), not asked for; `reason`: why this mode
    serves, in words (`last_stats` repeats it). `pricing`: as `TideConfig.pricing`; `priced`: what pricing measured
    and decided (`runtime/pricing.py`; None where it did not run).
    """

    exit_threshold: float = DEFAULT_EXIT_THRESHOLD  # (`resolve` takes both from the router's config)
    min_layers: int = 1
    mode: str = "select"
    kv: str = DEFAULT_KV
    draft_layer: int | None = None
    thresholds: dict[int, float] | None = None
    target: dict[str, float] | None = None
    auto: bool = False
    reason: str = "asked for"
    pricing: bool | None = None
    priced: dict[str, Any] | None = None

    @classmethod
    def resolve(cls, cfg: Any, *, min_agreement: float | None = None, max_perplexity_increase: float | None = None,
                confidence: float | None = None, exit_threshold: float | None = None, min_layers: int | None = None,
                **rest: Any) -> TideOptions:
        """The options `attach` asks for on a router with config `cfg` (`rest`: mode, kv, draft_layer),
        thresholds chosen in order of precedence: an explicit global `exit_threshold`; else the quality target
        (per-checkpoint thresholds from the router's exit paths, `tide_hf.modeling.targets`); else the router's
        default target; else, for routers calibrated before exit paths existed, the router's global `exit_threshold`."""
        rest = {**rest, "kv": mode_kv(rest.get("mode", "select"), rest.get("kv"), rest.get("draft_layer"))}
        check_pricing(rest.get("mode", "select"), rest.get("pricing"))
        if exit_threshold is not None:  # any real number (a Fraction, a numpy float) is served as a float
            check_threshold(exit_threshold)
            exit_threshold = float(exit_threshold)
        targeted = min_agreement is not None or max_perplexity_increase is not None
        if exit_threshold is not None and (targeted or confidence is not None):
            raise TideArgumentError("give either exit_threshold (one global threshold) or a quality target "
                                    "(min_agreement / max_perplexity_increase / confidence), not both")
        if exit_threshold is None and not targeted and cfg.exit_paths and cfg.min_agreement is not None:
            min_agreement = cfg.min_agreement  # the router's default target
        thresholds, target = None, None
        if exit_threshold is None and (min_agreement is not None or max_perplexity_increase is not None):
            level = cfg.confidence if confidence is None else confidence
            thresholds = select(cfg.exit_paths, list(cfg.checkpoint_layers), min_agreement=min_agreement,
                                max_perplexity_increase=max_perplexity_increase, confidence=level)
            target = {k: float(v) for k, v in (("min_agreement", min_agreement), ("confidence", level),
                                               ("max_perplexity_increase", max_perplexity_increase)) if v is not None}
            check_served(thresholds, cfg.min_layers if min_layers is None else min_layers, cfg.min_layers)
        elif confidence is not None:
            raise TideArgumentError("confidence applies only with a quality target (min_agreement= or "
                                    "max_perplexity_increase=), and none is in effect for this router")
        return cls(exit_threshold=cfg.exit_threshold if exit_threshold is None else exit_threshold,
                   min_layers=cfg.min_layers if min_layers is None else min_layers,
                   thresholds=thresholds, target=target, **rest)

    def threshold(self, layer: int) -> float:
        """The exit threshold of checkpoint `layer`."""
        return self.thresholds[layer] if self.thresholds is not None else self.exit_threshold

    def validate(self, num_hidden_layers: int, checkpoints: list[int] | None = None) -> None:
        """Raise before any work is done when an option cannot apply to this model (and, given its router's
        `checkpoints`, when speculative mode would have no checkpoint to draft at)."""
        check_threshold(self.exit_threshold)
        for value in (self.thresholds or {}).values():
            check_threshold(value)
        check_min_layers(self.min_layers, num_hidden_layers)
        if not isinstance(self.mode, str) or self.mode not in MODES:
            raise TideArgumentError(f"mode must be one of {MODES}, got {self.mode!r}")
        if not isinstance(self.kv, str) or self.kv not in KV_POLICIES:
            raise TideArgumentError(f"kv must be one of {KV_POLICIES}, got {self.kv!r}")
        if self.draft_layer is not None:
            check_int("draft_layer", self.draft_layer)
            if not 1 <= self.draft_layer < num_hidden_layers:
                raise TideArgumentError(
                    f"draft_layer must be in [1, {num_hidden_layers - 1}], got {self.draft_layer}")
        if self.mode == "speculative" and checkpoints is not None:
            if self.draft_layer is not None and self.draft_layer not in checkpoints:
                raise TideArgumentError(f"draft_layer={self.draft_layer} has no router: speculative mode drafts at "
                                        f"a router checkpoint, one of {checkpoints}")
            if self.draft_layer is not None and self.draft_layer < self.min_layers:
                raise TideArgumentError(f"draft_layer={self.draft_layer} is below min_layers={self.min_layers}: no "
                                        "token may leave before min_layers, drafts included; lower min_layers or "
                                        "draft at a later checkpoint")
            if not any(k >= self.min_layers for k in checkpoints):
                raise TideArgumentError(f"no router checkpoint at or after min_layers={self.min_layers} to draft at "
                                        f"(checkpoints {checkpoints})")
