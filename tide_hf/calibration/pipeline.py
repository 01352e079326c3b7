"""`calibrate()`: real text -> hidden states at the checkpoints -> exit heads -> convergence labels -> one router
each -> exit paths for quality targets.

Routers are trained and scored on the same representation, `final_norm(h_k)`; see `labels.py` for what is
collected, `heads.py` for the exit heads the labels are made with, and `training.py` for how routers are fitted.
"""

from __future__ import annotations

import difflib
import os
import time
import warnings
from collections.abc import Iterable
from contextlib import AbstractContextManager
from functools import partial
from typing import Any

import torch
from torch import nn

from ..compat import model_revision
from ..config import TideRouterConfig
from ..errors import TideArgumentError, TideArgumentTypeError
from ..modeling import ModelAdapter, TideRouter, check_head, get_adapter, model_fingerprint, text_config
from ..modeling.devices import execution_device
from ..modeling.targets import select
from ..record import CLOSED
from ..settings import LABEL_KINDS, CalibrationConfig
from ..values import check_int
from .continuations import continue_samples
from .data import dataset_label, load_texts
from .distributed import is_main_process, main_process_first, train_on_main
from .heads import fit_exit_heads
from .labels import Collected, collect, label
from .samples import make_samples, pad_token_id
from .thresholds import fit_exit_paths, held_out_scores
from .training import check_splits, train_routers
from .vocab import fit_draft_vocab


def loud(message: str) -> None:
    """A calibration warning, printed once, through `warnings` (a service routes it to its logs with
    `logging.captureWarnings(True)`)."""
    warnings.warn(message, stacklevel=5)  # loud <- warn_if_* <- calibrate_config <- calibrate*: the caller


def warn_if_silent(cfg: TideRouterConfig) -> None:
    """Say loudly where the chosen label had no positive training token, so the router there is a constant that
    never fires (`training.constant_router`: no trained epoch, no token predicted), and which label kind fires."""
    rates = {k: cfg.metrics[str(k)]["label_rates"] for k in cfg.checkpoint_layers}
    silent = [k for k in cfg.checkpoint_layers if cfg.metrics[str(k)]["best_epoch"] is None
              and not cfg.metrics[str(k)]["predicted_rate"]]  # (label_rates count held-out tokens too)
    if not silent:
        return
    best = {kind: max(r[kind] for r in rates.values()) for kind in LABEL_KINDS if kind != cfg.label}
    hint = ", ".join(f"label={kind!r} fires for up to {rate:.1%}" for kind, rate in best.items())
    scope = "at EVERY checkpoint: these routers will never let a token exit" if len(silent) == len(rates) \
        else f"at checkpoints {silent}: routers there will not fire"
    message = (f"TIDE calibration: label {cfg.label!r} "
               f"(threshold {cfg.convergence_threshold if cfg.label == 'cosine' else cfg.kl_threshold}) "
               f"has no positive training token {scope}. On this model {hint}; recalibrate with one of those.")
    loud(message)


def warn_if_closed(cfg: TideRouterConfig) -> None:
    """Say when the router's default target opens no checkpoint: `attach(model, router)` would never exit."""
    if not cfg.exit_paths or cfg.min_agreement is None:
        return
    chosen = select(cfg.exit_paths, list(cfg.checkpoint_layers), min_agreement=cfg.min_agreement,
                    confidence=cfg.confidence)
    if all(t == CLOSED for t in chosen.values()):
        message = (f"TIDE calibration: at its default target (top-1 agreement >= {cfg.min_agreement} at confidence "
                   f"{cfg.confidence}) this router lets no token exit: {cfg.exit_paths['agreement']['n']} "
                   "threshold-split tokens certify no exit. Calibrate on more samples, or attach with a lower "
                   "min_agreement.")
        loud(message)


# Where text configs keep their context length (positions the model was built for), most common first.
CONTEXT_FIELDS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length", "n_ctx")


def check_context(model: nn.Module, seq_len: int, what: str | None = None) -> None:
    """Samples of `seq_len` tokens (`what`, for the message) fit the model's context: longer ones crash mid-forward
    (learned positions) or calibrate on positions the model never had (rotary ones), so they are refused first."""
    text_cfg = text_config(model)
    for name in CONTEXT_FIELDS:
        context = getattr(text_cfg, name, None)
        if isinstance(context, int) and not isinstance(context, bool) and context > 0:
            if seq_len > context:
                raise TideArgumentError(f"{what or f'seq_len={seq_len}'} is longer than the model's context ({name}="
                                        f"{context} positions): give at most {context} tokens per sample")
            return


# Set by calibrate() itself from the model (passing them is an error, not an override).
_DERIVED_FIELDS = frozenset({"hidden_size", "num_hidden_layers", "base_model_name_or_path", "base_model_revision",
                             "unique_documents",
                             "base_architecture", "base_model_type", "base_fingerprint", "seq_len",
                             "draft_vocab_coverage", "metrics", "exit_paths", "held_out_tokens",
                             "calibration_seconds"})


def check_calibrate_args(*, num_samples: Any, seq_len: Any, batch_size: Any, config_kwargs: dict[str, Any]) -> None:
    """Raise before any work naming the first bad argument: sizes must be positive ints, and every keyword of
    `config_kwargs` a `TideRouterConfig` field (a misspelling would otherwise be silently ignored)."""
    for name, value in (("num_samples", num_samples), ("seq_len", seq_len), ("batch_size", batch_size)):
        check_int(name, value, minimum=1)
    known = TideRouterConfig.field_names() - _DERIVED_FIELDS
    for key in config_kwargs:
        if key not in known:
            close = difflib.get_close_matches(key, sorted(known), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else f" (TideRouterConfig fields: {sorted(known)})"
            raise TideArgumentTypeError(f"calibrate() got an unexpected keyword argument {key!r}{hint}")


def fit(router: TideRouter, data: Collected, *, adapter: ModelAdapter, device: torch.device | None = None,
        progress: bool = True) -> None:
    """Fit the exit heads, label the kept tokens with them (the model's head, `adapter`, on `device`), rank the
    draft vocabulary, train the routers on `device` (default: where the features are), then calibrate their exit
    paths for quality targets (`config.exit_paths`), scoring the held-out tokens there too, and keep those scores
    with the router (`TideRouter.held_out`); the router ends where it was."""
    check_splits(data, router.config)
    home = router.device
    work = torch.device(device) if device is not None else home
    router.to(work)
    try:
        crossfit = fit_exit_heads(router, data, device=work, scale_free=adapter.scale_free)
        exit_logits = None if crossfit is None else partial(crossfit.exit_logits, router, adapter)
        label(data, adapter, router, device=work, exit_logits=exit_logits, progress=progress)
        vocab_size = adapter.logits(data.final[:1].to(work, next(adapter.lm_head.parameters()).dtype)).shape[-1]
        fit_draft_vocab(router, data, vocab_size)
        train_routers(router, data, device=device, progress=progress)
        held_out = held_out_scores(router, data)
        router.config.exit_paths = fit_exit_paths(router, data, held_out)
        router.set_held_out(held_out)
    finally:
        router.to(home)


def calibrate(
    model: nn.Module,
    tokenizer: Any,
    dataset: str | os.PathLike | Iterable[str] | Any,
    config: CalibrationConfig | None = None,
    *,
    dataset_config: str | None = None,
    split: str = "train",
    text_field: str = "text",
    progress: bool = True,
    **options: Any,
) -> TideRouter:
    """Calibrate TIDE routers for `model` on `dataset` and return them as a `TideRouter`.

    Under `accelerate launch`, call it in every process with the same arguments: the processes share the
    forward passes, the main one trains, and every process returns the same router.

    Args:
        model: a transformers causal LM, in eval mode.
        tokenizer: its tokenizer.
        dataset: the text, required (there is no default corpus): a local .txt / .jsonl file or folder, "sotu"
            (the embedded corpus), a Hub dataset name, or documents in memory (a list of strings, a `datasets`
            Dataset / IterableDataset / DatasetDict, a pandas DataFrame with a `text_field` column); see
            `tide_hf.calibration.load_texts`.
        config: what calibration reads (`CalibrationConfig`; None: its defaults).
        dataset_config: a Hub dataset's configuration.
        split: the split read from a Hub dataset or a DatasetDict.
        text_field: the column / JSON field holding the text.
        progress: show progress bars.
        **options: `CalibrationConfig` fields as keywords, laid over `config`.

    Returns:
        The router, with its quality targets' exit paths and its calibration figures in `router.config`.

    Raises:
        TideArgumentError: a setting out of range, or text too short for the samples asked for.
        TideDataError: the text cannot be read.

    Example:
        >>> router = tide_hf.calibrate(model, tokenizer, "sotu", num_samples=64)  # doctest: +SKIP
        >>> router.save_pretrained("my-router")  # doctest: +SKIP
    """
    settings = CalibrationConfig.merged(config, options, "calibrate()")
    num_samples, seq_len, batch_size = settings.num_samples, settings.seq_len, settings.batch_size
    config_kwargs = settings.router_fields()
    check_tokenizer(tokenizer)
    check_calibrate_args(num_samples=num_samples, seq_len=seq_len, batch_size=batch_size, config_kwargs=config_kwargs)
    with caller_rng_kept(model):
        cfg = model_config(model, seq_len, config_kwargs)
        with main_process_first():  # under a launcher, datasets builds its cache once
            texts = load_texts(dataset, dataset_config=dataset_config, split=split, text_field=text_field)
        cfg.dataset, cfg.unique_documents = dataset_label(dataset, split), True
        samples = make_samples(tokenizer, texts, num_samples, seq_len, cfg.seed)
        pad_id = pad_token_id(tokenizer)
        check_token_ids(model, samples, pad_id, "the tokenizer's ids in the samples are", "its pad id",
                        " (a token added to the tokenizer without model.resize_token_embeddings, or the tokenizer "
                        "of another model?)")
        return calibrate_config(model, cfg, samples, batch_size=batch_size, pad_id=pad_id, progress=progress)


def calibrate_tokens(model: nn.Module, samples: list[torch.Tensor], *, batch_size: int = 8, pad_id: int = 0,
                     progress: bool = True, **config_kwargs: Any) -> TideRouter:
    """`calibrate` on token ids already made: `samples` are 1-D integer tensors (each one sequence, no longer
    than the model's context); padding uses `pad_id` and is masked out. `config.dataset` stays None unless
    given as a keyword."""
    if not isinstance(samples, (list, tuple)) or not samples or not all(
            isinstance(s, torch.Tensor) and s.dim() == 1 and len(s) > 0 and not s.is_floating_point()
            and s.dtype != torch.bool for s in samples):
        raise TideArgumentTypeError("samples must be a non-empty list of non-empty 1-D integer token tensors")
    check_int("pad_id", pad_id, minimum=0)
    check_token_ids(model, samples, pad_id, "samples hold", "pad_id")
    if "num_samples" in config_kwargs:
        raise TideArgumentTypeError("calibrate_tokens() takes num_samples from len(samples); do not pass it")
    seq_len = max(len(s) for s in samples)
    check_context(model, seq_len, f"a sample of {seq_len} tokens")
    check_calibrate_args(num_samples=len(samples), seq_len=seq_len, batch_size=batch_size, config_kwargs=config_kwargs)
    with caller_rng_kept(model):
        cfg = model_config(model, seq_len, config_kwargs)
        return calibrate_config(model, cfg, [s.cpu() for s in samples], batch_size=batch_size, pad_id=pad_id,
                                progress=progress)


def caller_rng_kept(model: nn.Module) -> AbstractContextManager:
    """Calibration seeds torch's global RNG with the config's seed (the routers' initial weights): the caller's
    random state (CPU, and the CUDA devices the model is on) is put back when it ends."""
    devices = sorted({p.device.index or 0 for p in model.parameters() if p.device.type == "cuda"})
    return torch.random.fork_rng(devices=devices)


def check_token_ids(model: nn.Module, samples: list[torch.Tensor], pad_id: int, source: str, pad_name: str,
                    hint: str = "") -> None:
    """Refuse token ids (samples' or the pad id) outside the model's embeddings, before any forward (one is an
    IndexError deep in the embedding lookup)."""
    rows = model.get_input_embeddings().num_embeddings
    low, high = min(int(s.min()) for s in samples), max(int(s.max()) for s in samples)
    if low < 0 or high >= rows or not 0 <= pad_id < rows:
        raise TideArgumentError(f"token ids must be in [0, {rows}) for this model's embeddings: {source} "
                                f"{low}..{high}, {pad_name} is {pad_id}{hint}")


def check_tokenizer(tokenizer: Any) -> None:
    """Refuse a tokenizer that cannot be called on text (a model id, None), before any text is read."""
    if not callable(tokenizer):
        hint = ": load it with AutoTokenizer.from_pretrained(...)" if isinstance(tokenizer, str) else ""
        raise TideArgumentTypeError(f"tokenizer must be a tokenizer (called on text, like the ones AutoTokenizer "
                                    f"loads), got {type(tokenizer).__name__}{hint}")


def model_config(model: nn.Module, seq_len: int, config_kwargs: dict[str, Any]) -> TideRouterConfig:
    """The router config of `model` (its shape and provenance) with `config_kwargs`, once `seq_len` is known to fit
    its context and the adapter's head to give the model's own logits (labels are made with it: `check_head`);
    seeds torch's global RNG with its seed, which the routers' initial weights are drawn from."""
    check_context(model, seq_len)
    adapter = get_adapter(model)
    check_head(model, adapter)
    text_cfg = text_config(model)
    cfg = TideRouterConfig(
        hidden_size=text_cfg.hidden_size,
        num_hidden_layers=adapter.num_layers,
        base_model_name_or_path=getattr(model.config, "name_or_path", None) or None,
        base_model_revision=model_revision(model.config),
        base_architecture=type(model).__name__,
        base_model_type=model.config.model_type,
        base_fingerprint=model_fingerprint(model, adapter),
        seq_len=seq_len,
        **config_kwargs,
    )
    if cfg.min_layers > max(cfg.checkpoint_layers):
        raise TideArgumentError(f"min_layers={cfg.min_layers} is past the last checkpoint ({max(cfg.checkpoint_layers)}"
                                "): routers calibrated so would never let a token exit")
    torch.manual_seed(cfg.seed)
    return cfg


def calibrate_config(model: nn.Module, cfg: TideRouterConfig, samples: list[torch.Tensor], *, batch_size: int,
                     pad_id: int, progress: bool) -> TideRouter:
    """Collect states and labels over `samples` (the model's continuations of them when `cfg.continuation` asks),
    train the routers on the model's head device, time each part."""
    adapter = get_adapter(model)
    cfg.num_samples = len(samples)
    progress = progress and is_main_process()
    training = [(module, module.training) for module in model.modules()]  # each module's flag, put back after
    model.eval()
    writing: dict[str, float] = {}
    try:
        if cfg.continuation is not None:
            samples, writing["generate"] = continue_samples(model, samples, cfg, batch_size=batch_size,
                                                            pad_id=pad_id, progress=progress)
        data = collect(model, adapter, samples, cfg, batch_size=batch_size, pad_id=pad_id, progress=progress)
    finally:
        for module, mode in training:
            module.training = mode
    started = time.perf_counter()
    router = TideRouter(cfg)
    device = execution_device(adapter.lm_head)  # where the forward ran: the routers train there too
    # every process gets the main process's result
    train_on_main(partial(fit, adapter=adapter, device=device), router, data, progress=progress)
    labelling = data.seconds["label"]  # the main process's; 0 in the others, which do not label
    cfg.calibration_seconds = {**writing, **data.seconds, "train": time.perf_counter() - started - labelling}
    if is_main_process():
        warn_if_silent(cfg)
        warn_if_closed(cfg)
    return router
