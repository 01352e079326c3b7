"""What stock assisted decoding can reproduce of a generate call, and batches decoded row by row.

Stock assisted decoding supports batch size 1 only, so speculative mode decodes a batch row by row (each
row keeps its left padding and mask, `prefix_allowed_tokens_fn` is asked with the row's batch index) and
re-assembles it like stock batched generate lays it out (`outputs.py`). Calls it cannot reproduce exactly run
stock generate instead (`fallback_reason` says why): `last_stats.speculative["fallback"]` records the reason
of every such call (None: drafted), and `warn_fallback` warns once per reason and handle, so a user who asked
for drafting learns why none happened without a warning on every call. `count_tokens` counts a call's tokens
the way select mode does.
"""

from __future__ import annotations

import functools
import warnings
import weakref
from typing import Any

import torch
from torch import nn
from transformers import GenerationConfig

from ..callers import caller_stacklevel
from ..compat import CACHE_KWARGS
from ..runtime import Session, TideHandle
from .embeds import embeds_reason
from .outputs import first_id

# generate() arguments assisted decoding cannot take (or would change the output with); a cache by any of its names
FALLBACK_KWARGS = ("assistant_model", "custom_generate", *CACHE_KWARGS, "negative_prompt_ids")
_WARNED: weakref.WeakKeyDictionary[TideHandle, set[str]] = weakref.WeakKeyDictionary()  # reasons warned per handle


class SpeculativeFallbackWarning(UserWarning):
    """A generate call in speculative mode ran stock generate (no drafting); the message says why."""


def warn_fallback(handle: TideHandle, reason: str | None) -> None:
    """Warn that a call of `handle` fell back to stock generate for `reason`, the first time it does for that
    reason (None: it drafted; nothing to say), naming the user's generate call."""
    if reason is None:
        return
    seen = _WARNED.setdefault(handle, set())
    if reason in seen:
        return
    seen.add(reason)
    warnings.warn(f"tide_hf speculative mode ran stock generate for this call, without drafting (same output, no "
                  f"speed-up): {reason}. last_stats.speculative['fallback'] records it per call; this warning comes "
                  "once per reason and attach", SpeculativeFallbackWarning, stacklevel=caller_stacklevel())


def fallback_reason(model: nn.Module, args: tuple, kwargs: dict, batch: int, gc: Any, auto: bool = False
                    ) -> str | None:
    """Why stock assisted decoding could not reproduce stock generate for this call, or would not pay (None: it
    can); `gc`: the call's generation config as generate merges it with the model's defaults; `auto`: speculative
    mode was chosen by attach's default, not asked for."""
    if len(args) > 1:
        return "positional arguments after the inputs"
    if batch == 0:
        return "no 2-D input_ids nor 3-D inputs_embeds"
    embedded = embeds_reason(args[0] if args else kwargs.get("inputs", kwargs.get("input_ids")), kwargs, gc)
    if embedded is not None:
        return embedded
    given = [k for k in FALLBACK_KWARGS if kwargs.get(k) is not None]
    if given:
        return f"{given[0]}= given"
    if kwargs.get("stopping_criteria") or gc.stop_strings:
        return "stop strings or custom stopping criteria (assisted decoding checks them once per round, not per token)"
    if kwargs.get("logits_processor"):  # (a draft position the verifier rejects is one stock never scores)
        return "user logits processors (drafts call them for positions stock never scores: one that keeps state " \
               "between calls would see other calls)"
    if getattr(gc, "assistant_ensemble_weight", None) is not None:
        return "assistant_ensemble_weight (stock sampling ignores it; assisted decoding would mix the drafts in)"
    if model.device.type == "meta":  # stock moves candidates to `model.device`, its first parameter's device
        return "the model's first parameter is offloaded (on the meta device)"
    if gc.output_attentions and gc.return_dict_in_generate:
        return "output_attentions (stock assisted decoding fails on it with sdpa attention)"
    if (gc.num_beams or 1) > 1 or (gc.num_return_sequences or 1) > 1:
        return "beam search or several sequences per prompt"
    if gc.use_cache is False or gc.cache_implementation is not None or gc.use_mtp:
        return "cache settings that assisted decoding does not support"
    if getattr(gc, "prefill_chunk_size", None) is not None:
        return "prefill_chunk_size (assisted decoding prefills the prompt in one forward)"
    if gc.guidance_scale not in (None, 1.0) or gc.dola_layers is not None:
        return "classifier-free guidance or DoLa"
    if (getattr(gc, "penalty_alpha", None) or 0.0) > 0.0:
        return "contrastive search (penalty_alpha; stock runs it from its Hub custom_generate repo)"
    if gc.assistant_early_exit is not None or gc.prompt_lookup_num_tokens is not None:
        return "another assisted-decoding method requested"
    if batch > 1 and gc.max_time is not None:
        return "max_time with batch size > 1 (decoded row by row, each row would get the whole time)"
    if batch > 1 and auto:  # stock decodes the rows together: one step for all, where drafting takes one per row
        return (f"a batch of {batch} rows under attach's default mode (speculative mode decodes rows one at a time, "
                "slower than stock's batched steps; pass mode='speculative' to draft anyway)")
    if batch > 1 and kwargs.get("streamer") is not None:
        return "a streamer with batch size > 1 (stock streamers take one row; rows decoded one at a time would pass)"
    return None


@functools.cache
def generation_settings() -> frozenset[str]:
    """The names of `GenerationConfig` settings: never per-row, whatever their shape (EOS ids as a tensor)."""
    return frozenset(vars(GenerationConfig()))


def row_kwargs(kwargs: dict, i: int, batch: int) -> dict:
    """Row `i` of every per-row tensor model input (left padding and mask kept, as the batch had them; a
    generation setting such as `eos_token_id=torch.tensor([...])` holds for every row, so it stays whole), and a
    `prefix_allowed_tokens_fn` asked with batch index `i` (generate asks it with its own row index, 0)."""
    settings = generation_settings()
    row = {k: v[i: i + 1] if isinstance(v, torch.Tensor) and v.dim() >= 1 and v.shape[0] == batch
           and k not in settings else v for k, v in kwargs.items()}
    allowed = kwargs.get("prefix_allowed_tokens_fn")
    if allowed is not None:
        row["prefix_allowed_tokens_fn"] = lambda _row, ids: allowed(i, ids)
    return row


def prompt_mask(ids: torch.Tensor, mask: torch.Tensor | None, pad: Any, eos: torch.Tensor | None) -> torch.Tensor:
    """The prompt positions generate attends to: `mask`, else the one generate infers (not the pad id, where
    the prompt holds it and it is no EOS id; else every position)."""
    if mask is not None:
        return mask.bool()
    pad = first_id(pad)
    if pad is None or not bool((ids == pad).any()) or (eos is not None and bool((eos == pad).any())):
        return torch.ones_like(ids, dtype=torch.bool)
    return ids != pad


def count_tokens(ids: torch.Tensor, mask: torch.Tensor | None, sequences: torch.Tensor, pad: Any,
                 eos: torch.Tensor | None) -> tuple[int, int]:
    """(prefill, decode) tokens of a call that ran every layer with one sequence per prompt row, as select mode
    counts them: the prompt positions generate attends to, and per row the tokens it fed while still generating
    (the first new token comes from the prefill forward, the last is never fed; a row stops counting once it fed
    an EOS id, so the padding after it is not counted)."""
    prefill = int(prompt_mask(ids, mask, pad, eos).sum())
    fed = sequences[:, ids.shape[1]: -1]
    if eos is None or fed.numel() == 0:
        return prefill, fed.numel()
    finished = torch.isin(fed, eos.to(fed.device)).cumsum(dim=1) > 0
    return prefill, int((~finished).sum())


def count_full_depth(session: Session, num_layers: int, ids: torch.Tensor, mask: torch.Tensor | None, out: Any,
                     pad: Any) -> None:
    """Count a call's tokens from its output, every one at full depth (each emitted token came from the full
    model), as select mode counts them."""
    prefill, decode = count_tokens(ids, mask, out if isinstance(out, torch.Tensor) else out.sequences, pad,
                                   session.eos)
    session.stats.prefill.add(torch.full((prefill,), num_layers), num_layers)
    session.stats.decode.add(torch.full((decode,), num_layers), num_layers)
