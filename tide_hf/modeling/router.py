"""`TideRouter`: the calibrated routers as a Hub model sidecar (safetensors only, Auto-registered)."""

from __future__ import annotations

import copy
import os
import tempfile
import weakref
from typing import Any

import torch
from huggingface_hub import CommitInfo, ModelCard
from safetensors import SafetensorError
from torch import nn
from transformers import AutoConfig, AutoModel, PreTrainedModel

from ..config import TideRouterConfig, check_field_names
from ..errors import TideArgumentError, TideArgumentTypeError, TideCompatibilityError, TideRouterFileError
from ..record import check_coverage
from ..values import plain
from .adapters import ModelAdapter, get_adapter, text_config
from .card import model_card
from .devices import check_materialized
from .files import (
    atomic_save,
    check_config_source,
    check_finite,
    check_loading_info,
    check_local_weights,
    refuse_variant,
)
from .fingerprint import fingerprint_version, model_fingerprint
from .hub import check_repo_id, push_folder
from .quiet import quiet_hf
from .targets import HeldOut

# router -> (its config's fields, its weights' shapes) at the last `check_consistent(reuse=True)` that passed
_CONSISTENT: weakref.WeakKeyDictionary[nn.Module, tuple[dict, dict]] = weakref.WeakKeyDictionary()

# The held-out matrices' buffers (model.safetensors keys), rows first: the ordering split's, then the test split's.
# The NLL changes are stored with 0 where a token has no next token (`held_out_test_has_next` says where), so the file
# holds finite values only; `TideRouter.held_out` puts the NaN rows back.
HELD_OUT_BUFFERS = ("held_out_order_scores", "held_out_test_scores", "held_out_test_mismatch", "held_out_test_nll",
                    "held_out_test_has_next")

# save_pretrained(push_to_hub=True)'s keywords that go to the push, not to the save (as in transformers)
PUSH_KEYWORDS = ("repo_id", "commit_message", "commit_description", "private", "token", "revision", "create_pr")


class RouterMLP(nn.Module):
    """hidden -> bottleneck -> 1: one checkpoint's convergence predictor (a logit; sigmoid gives the score)."""

    def __init__(self, hidden_size: int, bottleneck: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(hidden_size, bottleneck)
        self.act = nn.ReLU()
        self.fc2 = nn.Linear(bottleneck, 1)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(features))).squeeze(-1)


class ExitHead(nn.Module):
    """hidden -> hidden, affine: one checkpoint's exit head. Full rank (`rank` None): `down` is the whole map and
    `up` the identity; rank r: `down` (hidden -> r, with the bias) then `up` (r -> hidden)."""

    def __init__(self, hidden_size: int, rank: int | None) -> None:
        super().__init__()
        self.down = nn.Linear(hidden_size, rank or hidden_size)
        self.up = nn.Linear(rank, hidden_size, bias=False) if rank else nn.Identity()

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.up(self.down(features))


class TideRouter(PreTrainedModel):
    """One `RouterMLP` per checkpoint layer, scoring the final-normed hidden state of that layer.

    Routers read `final_norm(h_k)` (the model's own final norm on the k-th layer's output), the same
    representation in calibration and at serving time. With `config.exit_head == "linear"` the router also holds
    one exit head (`ExitHead`, an affine hidden -> hidden map) per checkpoint: what an exited token's logits
    are made from (`exit_state`, `exit_logits`). With a calibrated `config.draft_vocab_coverage` it holds the
    draft vocabulary too: `draft_vocab`, token ids in order of how often they were the final top-1. With
    `config.held_out_tokens` it keeps calibration's held-out scores and losses as buffers (`held_out`).

    Args:
        config: the routers' architecture, settings and calibration record (`TideRouterConfig`).

    Example:
        >>> router = tide_hf.calibrate(model, tok, "sotu")  # doctest: +SKIP
        >>> router.save_pretrained("my-router")  # doctest: +SKIP
        >>> router = tide_hf.TideRouter.from_pretrained("my-router")  # or a Hub id  # doctest: +SKIP
    """

    config_class = TideRouterConfig
    base_model_prefix = "tide_router"
    main_input_name = "hidden_states"

    def __init__(self, config: TideRouterConfig) -> None:
        check_field_names(config.to_dict(), config.field_names(), "TideRouterConfig")  # else saved, refused at load
        super().__init__(config)
        self.routers = nn.ModuleDict(
            {str(k): RouterMLP(config.hidden_size, config.router_bottleneck_dim) for k in config.checkpoint_layers}
        )
        self.exit_heads = nn.ModuleDict(
            {str(k): ExitHead(config.hidden_size, config.exit_head_rank) for k in config.checkpoint_layers}
            if config.exit_head == "linear" else {})
        if config.draft_vocab_coverage:
            length = self.draft_vocab_length(config.draft_vocab_coverage)
            self.register_buffer("draft_vocab", torch.zeros(length, dtype=torch.long))
        if config.held_out_tokens is not None:  # zeros of the stored sizes: from_pretrained fills them
            n_order, n_test = config.held_out_tokens
            k = len(config.checkpoint_layers)
            self.register_held_out(torch.zeros(n_order, k), torch.zeros(n_test, k),
                                   torch.zeros(n_test, k, dtype=torch.bool), torch.zeros(n_test, k),
                                   torch.zeros(n_test, dtype=torch.bool))
        self.post_init()

    def register_held_out(self, order_scores: torch.Tensor, test_scores: torch.Tensor, test_mismatch: torch.Tensor,
                          test_nll: torch.Tensor, test_has_next: torch.Tensor) -> None:
        """Register the held-out matrices as persistent buffers (saved in model.safetensors, never trained); NaN-free
        `test_nll` with `test_has_next` saying which rows have a next token."""
        tensors = (order_scores, test_scores, test_mismatch, test_nll, test_has_next)
        for name, tensor in zip(HELD_OUT_BUFFERS, tensors, strict=True):
            self.register_buffer(name, tensor)

    def set_held_out(self, held_out: HeldOut) -> None:
        """Keep calibration's held-out scores and losses with the router (`held_out`), sized in its config
        (`held_out_tokens`), so attach can price exits and re-select thresholds."""
        if not isinstance(held_out, HeldOut):
            raise TideArgumentTypeError(f"held_out must be a HeldOut, got {type(held_out).__name__}")
        held_out.check_checkpoints(self.checkpoint_layers)
        device = next(self.parameters()).device
        nll = held_out.test_nll
        self.register_held_out(*(t.to(device).clone() for t in (
            held_out.order_scores, held_out.test_scores, held_out.test_mismatch, torch.nan_to_num(nll, nan=0.0),
            ~nll.isnan().any(1))))
        self.config.held_out_tokens = [held_out.order_scores.shape[0], held_out.test_scores.shape[0]]

    @property
    def held_out(self) -> HeldOut | None:
        """Calibration's held-out scores and losses (CPU, float32; `tide_hf.modeling.targets.HeldOut`), what exits
        are priced and thresholds re-selected with at attach; None for a router calibrated before they were kept."""
        if self.config.held_out_tokens is None:
            return None
        nll = self.held_out_test_nll.detach().to("cpu", torch.float32).clone()
        nll[~self.held_out_test_has_next.cpu()] = float("nan")
        return HeldOut(order_scores=self.held_out_order_scores.detach().cpu().clone(),  # copies: the buffers stay
                       test_scores=self.held_out_test_scores.detach().cpu().clone(),  # as calibration wrote them
                       test_mismatch=self.held_out_test_mismatch.detach().cpu().bool().clone(), test_nll=nll)

    @staticmethod
    def draft_vocab_length(coverage: dict[str, float]) -> int:
        """Tokens of the stored ranking: the largest candidate size in `coverage` (0 without a draft vocabulary)."""
        return max((int(n) for n in coverage), default=0)

    def set_draft_vocab(self, ranking: torch.Tensor, coverage: dict[str, float]) -> None:
        """Store a draft vocabulary (`ranking`: token ids, most frequent first, as long as the largest size)."""
        check_coverage(coverage)  # checked before anything changes
        if len(ranking) != self.draft_vocab_length(coverage):
            raise TideArgumentError(f"draft vocabulary of {len(ranking)} tokens, but its largest size is "
                                    f"{self.draft_vocab_length(coverage)}")
        self.config.draft_vocab_coverage = dict(coverage)
        self.register_buffer("draft_vocab", ranking.to(self.device, torch.long).clone())

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            module.reset_parameters()

    @property
    def checkpoint_layers(self) -> list[int]:
        return list(self.config.checkpoint_layers)

    def logit(self, layer: int, features: torch.Tensor) -> torch.Tensor:
        """Pre-sigmoid score of checkpoint `layer` for normed features of shape (..., hidden)."""
        mlp = self.routers[str(layer)]
        return mlp(features.to(mlp.fc1.weight.device, mlp.fc1.weight.dtype))

    def exit_state(self, adapter: ModelAdapter, layer: int, hidden: torch.Tensor) -> torch.Tensor:
        """The last-layer state that stands in for `hidden` (checkpoint `layer`'s output) when a token exits there:
        the model's final norm and head turn it into the exit logits. `hidden` itself without exit heads."""
        if not self.exit_heads:
            return hidden
        return self.mapped(layer, adapter.normed(hidden)).to(hidden.dtype)

    def mapped(self, layer: int, normed: torch.Tensor) -> torch.Tensor:
        """Exit head of checkpoint `layer` on final-normed features (fp32 out; linear exit heads only)."""
        head = self.exit_heads[str(layer)]
        return head(normed.to(head.down.weight.device, head.down.weight.dtype))

    def exit_logits(self, adapter: ModelAdapter, layer: int, normed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Logits of tokens exiting at `layer` from their final-normed features (`dtype`: the model's), as the
        runtime makes them: the model's head on them, or on the final norm of the exit head's output."""
        if not self.exit_heads:
            return adapter.head(normed.to(dtype))
        return adapter.logits(self.mapped(layer, normed).to(dtype))

    def forward(self, hidden_states: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
        """Scores in [0, 1] for each checkpoint present in `hidden_states` (layer -> normed features)."""
        return {k: torch.sigmoid(self.logit(k, h)) for k, h in hidden_states.items()}

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path: str | os.PathLike, *args: Any, **kwargs: Any
                        ) -> TideRouter | tuple[TideRouter, dict]:
        """Load from a local folder or Hub repo, from safetensors only (never a pickle).

        Checked (`TideRouterFileError` otherwise): a config.json of a TIDE router (unless `config=` is
        given), and readable weights that match it exactly: every configured checkpoint's tensors, of the
        configured shapes, and no others, with finite values only; draft-vocabulary ids >= 0. Config values
        given as keywords are checked like the file's.

        Args:
            pretrained_model_name_or_path: a local router folder or a Hub repo id.
            *args: passed to transformers' `from_pretrained`.
            **kwargs: transformers' loading keywords (`revision`, `cache_dir`, `token`, `local_files_only`,
                `subfolder`, ...) and config fields to set.

        Returns:
            The router (with `output_loading_info=True`: the router and transformers' loading info).

        Raises:
            TideRouterFileError: no router config, weights that do not match it, non-finite values, a pickle.
        """
        if kwargs.get("use_safetensors") is False:
            raise TideRouterFileError("TideRouter loads safetensors only; use_safetensors=False is not supported")
        if isinstance(pretrained_model_name_or_path, (str, os.PathLike)):  # "~/r": transformers reads a Hub id
            pretrained_model_name_or_path = os.path.expanduser(pretrained_model_name_or_path)
            if os.path.isfile(pretrained_model_name_or_path):  # transformers would torch.load it (an unpickle)
                raise TideRouterFileError(f"{pretrained_model_name_or_path} is a file, not a TIDE router folder: give "
                                          "the folder holding its config.json and model.safetensors")
        refuse_variant(kwargs)
        kwargs["use_safetensors"] = True
        if kwargs.get("config") is None and not args:
            check_config_source(pretrained_model_name_or_path, cls.config_class, kwargs)
        elif isinstance(pretrained_model_name_or_path, (str, os.PathLike)):  # a config given: weights checked still
            folder = os.path.join(pretrained_model_name_or_path, kwargs.get("subfolder") or "")
            check_local_weights(folder, pretrained_model_name_or_path)
        fields = cls.config_class.field_names()  # set on the config as given: numpy numbers and paths made plain
        kwargs = {k: (os.fspath(v) if isinstance(v, os.PathLike) else plain(v)) if k in fields else v
                  for k, v in kwargs.items()}
        want_info = kwargs.pop("output_loading_info", False)
        kwargs.setdefault("ignore_mismatched_sizes", True)  # reported below as a TideRouterFileError
        with quiet_hf():  # a router is a few MB: no "Loading weights" bar
            try:
                model, info = super().from_pretrained(pretrained_model_name_or_path, *args, output_loading_info=True,
                                                      **kwargs)
            except SafetensorError as exc:
                raise TideRouterFileError(f"TIDE router {pretrained_model_name_or_path}: its weights file cannot "
                                          f"be read ({exc})") from exc
        check_loading_info(pretrained_model_name_or_path, info)
        check_finite(pretrained_model_name_or_path, model.state_dict())
        model.config.validate()  # fields given as keywords here are set after the config's own checks ran
        if hasattr(model, "draft_vocab") and len(model.draft_vocab) and int(model.draft_vocab.min()) < 0:
            raise TideRouterFileError(f"TIDE router {pretrained_model_name_or_path}: its draft vocabulary holds "
                                      f"negative token ids (down to {int(model.draft_vocab.min())})")
        return (model, info) if want_info else model

    def save_pretrained(self, save_directory: str | os.PathLike, *args: Any, overwrite: bool = False,
                        push_to_hub: bool = False, **kwargs: Any) -> None:
        """Save config + safetensors weights + a model card (README.md with Hub metadata).

        Only into a new or empty folder, or (`overwrite=True`) over a folder holding a TIDE router and
        nothing else: a model's folder is refused (`TideRouterFileError`). Written to a folder next to
        `save_directory` and moved into place, so an interrupted save never leaves a half-written router.
        `push_to_hub=True` then uploads the saved files, as `push_to_hub` does, to `repo_id` (default: the
        folder's name, in your namespace); `commit_message`, `commit_description`, `private`, `token`,
        `revision` and `create_pr` go to the push. A repo id that is not valid is refused before saving.

        Args:
            save_directory: the folder to write.
            *args: passed to transformers' `save_pretrained`.
            overwrite: replace a TIDE router saved there before.
            push_to_hub: upload the saved files too.
            **kwargs: transformers' saving keywords, and the push's.

        Raises:
            TideRouterFileError: the folder holds something else, or `safe_serialization=False`.
        """
        if kwargs.get("safe_serialization") is False:
            raise TideRouterFileError("TideRouter saves safetensors only; safe_serialization=False is not supported")
        refuse_variant(kwargs)
        for name, value in (("overwrite", overwrite), ("push_to_hub", push_to_hub)):
            if not isinstance(value, bool):  # "no" is truthy: it replaced a router
                raise TideArgumentTypeError(f"{name} must be True or False, got {value!r}")
        self.check_consistent(kwargs.get("state_dict"))
        if not kwargs.get("is_main_process", True):
            return  # other processes of a distributed run write nothing
        push = {k: kwargs.pop(k) for k in PUSH_KEYWORDS if k in kwargs} if push_to_hub else {}
        if push_to_hub:  # like transformers: the repo is named after the folder unless repo_id says otherwise
            named = bool(push.get("repo_id"))
            push["repo_id"] = push.get("repo_id") or os.path.basename(os.path.abspath(save_directory))
            check_repo_id(push["repo_id"], "repo_id" if named else "repo_id (the folder's name; give repo_id=)")

        def write(folder: str) -> None:
            with quiet_hf():  # no "Writing model shards" bar for a few MB
                super(TideRouter, self).save_pretrained(folder, *args, **kwargs)
            self.model_card().save(os.path.join(folder, "README.md"))

        atomic_save(save_directory, write, overwrite=overwrite)
        if push_to_hub:  # the files just saved, model card included
            push_folder(save_directory, **push)

    def push_to_hub(
        self,
        repo_id: str,
        *,
        commit_message: str | None = None,
        commit_description: str | None = None,
        private: bool | None = None,
        token: bool | str | None = None,
        revision: str | None = None,
        create_pr: bool = False,
        max_shard_size: int | str | None = "50GB",
        tags: list[str] | str | None = None,
    ) -> CommitInfo:
        """Upload exactly what `save_pretrained` writes (TIDE model card included) as one commit.

        The inherited `push_to_hub` replaces README.md with a generic transformers card, which drops the
        Hub metadata (library, base model, tags) and the validation table of `model_card()`. The commit also
        deletes the router weight files of an earlier push that this save does not write (an unsharded
        model.safetensors under new shards), so the repo never serves this config with old weights. A repo
        whose config.json is not a TIDE router's (a model's) is refused before anything is uploaded
        (`TideRouterFileError`).

        Args:
            repo_id: the Hub repo ("owner/name", or a name in your namespace).
            commit_message: the commit's message.
            commit_description: the commit's description.
            private: create the repo private.
            token: the Hub token (default: the saved login).
            revision: the branch to push to.
            create_pr: open a pull request instead of committing to the branch.
            max_shard_size: the largest weights file.
            tags: Hub tags added to the card.

        Returns:
            The commit's info.
        """
        check_repo_id(repo_id)
        with tempfile.TemporaryDirectory() as tmp_dir:
            self.save_pretrained(tmp_dir, max_shard_size=max_shard_size)
            extra_tags = [*(self.model_tags or []), *([tags] if isinstance(tags, str) else tags or [])]
            if extra_tags:
                card = self.model_card()
                card.data.tags = list(dict.fromkeys([*(card.data.tags or []), *extra_tags]))
                card.save(os.path.join(tmp_dir, "README.md"))
            return push_folder(tmp_dir, repo_id, commit_message=commit_message,
                               commit_description=commit_description, private=private, token=token,
                               revision=revision, create_pr=create_pr)

    def model_card(self) -> ModelCard:
        """A Hub model card: metadata (library, base model, tags), how to load the base model at the revision the
        routers were calibrated on, and the per-router validation table."""
        return model_card(self.config)

    def check_consistent(self, state: dict[str, torch.Tensor] | None = None, *, reuse: bool = False) -> None:
        """Raise where the config (edited after loading?) and the weights (`state`, default the router's own)
        disagree: the save would write a router `from_pretrained` refuses, and attach would serve missing routers.
        Run by `save_pretrained` and by `attach` given a router object (~40 ms: not by each `generate(tide=router)`
        call; `from_pretrained` checks a loaded router against its file). `reuse` (attach): pass at once where the
        config's fields and the weights' shapes equal those of the last check that passed (~3 ms)."""
        snapshot = (copy.deepcopy(vars(self.config)), {k: v.shape for k, v in self.state_dict().items()}) \
            if reuse and state is None else None
        if snapshot is not None and _CONSISTENT.get(self) == snapshot:
            return
        self.config.validate()
        with torch.device("meta"):
            expected = {k: v.shape for k, v in type(self)(copy.deepcopy(self.config)).state_dict().items()}
        held = {k: v.shape for k, v in (self.state_dict() if state is None else state).items()}
        problems = [f"{what} {names}" for what, names in (
            ("missing tensors", sorted(expected.keys() - held.keys())),
            ("extra tensors", sorted(held.keys() - expected.keys())),
            ("tensors of another shape", sorted(k for k in expected.keys() & held.keys() if expected[k] != held[k])))
            if names]
        if problems:
            raise TideRouterFileError("the router's config and its weights do not agree (a config field changed "
                                      "after the weights were made?): " + "; ".join(problems))
        if snapshot is not None:
            _CONSISTENT[self] = snapshot

    def check_compatible(self, model: nn.Module, *, ignore_fingerprint: bool = False,
                         adapter: ModelAdapter | None = None) -> None:
        """Raise `TideCompatibilityError` naming every way `model` differs from the calibration model.

        `ignore_fingerprint=True` accepts different weights of the same shape (e.g. a fine-tune); the
        architecture, layer count and hidden size must always match. `adapter`: `model`'s, when the caller
        already has it.
        """
        if not isinstance(ignore_fingerprint, bool):
            raise TideArgumentTypeError(f"ignore_fingerprint must be True or False, got {ignore_fingerprint!r}")
        check_materialized(model)  # whatever ignore_fingerprint says: such a model cannot run
        cfg = self.config
        adapter = adapter or get_adapter(model)
        text_cfg = text_config(model)
        problems = []
        n_layers = adapter.num_layers
        if n_layers != cfg.num_hidden_layers:
            problems.append(f"number of layers: router {cfg.num_hidden_layers}, model {n_layers}")
        if text_cfg.hidden_size != cfg.hidden_size:
            problems.append(f"hidden size: router {cfg.hidden_size}, model {text_cfg.hidden_size}")
        arch = type(model).__name__
        if cfg.base_architecture and arch != cfg.base_architecture:
            problems.append(f"architecture: router {cfg.base_architecture}, model {arch}")
        rows = getattr(getattr(adapter.lm_head, "weight", None), "shape", (None,))[0]
        if hasattr(self, "draft_vocab") and rows is not None and int(self.draft_vocab.max()) >= rows:
            problems.append(f"draft vocabulary: token ids up to {int(self.draft_vocab.max())}, model head {rows} rows")
        if not ignore_fingerprint and cfg.base_fingerprint and not problems:
            fp = model_fingerprint(model, adapter, fingerprint_version(cfg.base_fingerprint))
            if fp != cfg.base_fingerprint:
                problems.append(
                    f"weights fingerprint: router {cfg.base_fingerprint}, model {fp} (different weights; "
                    "pass ignore_fingerprint=True if this is intended, e.g. a fine-tune of the base model)"
                )
        if problems:
            raise TideCompatibilityError(
                f"this TIDE router was calibrated for {cfg.base_model_name_or_path or cfg.base_architecture} and "
                "does not fit the given model: " + "; ".join(problems)
            )


AutoConfig.register(TideRouterConfig.model_type, TideRouterConfig, exist_ok=True)
AutoModel.register(TideRouterConfig, TideRouter, exist_ok=True)
