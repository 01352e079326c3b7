"""`inputs_embeds` in speculative mode: the prompt as embeddings, drafted after like any other.

Stock assisted decoding cannot start from embeddings alone: it sizes the attention mask and positions by the
token ids it holds, and with embeddings only those are the new tokens, not the prompt. Stock generate also
takes `input_ids` beside `inputs_embeds` (decoder-only models feed the embeddings in the prefill and keep
the ids as the prompt of the sequences), so speculative mode gives it placeholder ids of the prompt's width:
every length then counts the prompt, as assisted decoding needs, and the placeholder columns are cut from the
output, which so holds the new tokens only, as stock returns them. A streamer gets an empty prompt, as stock
gives it. Settings that read the prompt's ids (`PROMPT_ID_READERS`, `prefix_allowed_tokens_fn`) would see
the placeholders, which stock never shows them: with those the call runs stock generate (`embeds_reason`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from transformers.generation.streamers import BaseStreamer

from .outputs import pad_id

# generation settings whose logits processors read the prompt's token ids, not only its length
PROMPT_ID_READERS = ("repetition_penalty", "no_repeat_ngram_size", "bad_words_ids", "sequence_bias",
                     "watermarking_config")
NEUTRAL = {"repetition_penalty": 1.0, "no_repeat_ngram_size": 0}  # settings' values that read nothing


def embeds_reason(inputs: Any, kwargs: dict, gc: Any) -> str | None:
    """Why a call with `inputs_embeds` cannot be drafted exactly (None: it can, or it has none)."""
    embeds = kwargs.get("inputs_embeds")
    if embeds is None:
        return None
    if not isinstance(embeds, Tensor) or embeds.dim() != 3:
        return "inputs_embeds= that is not a (batch, length, hidden) tensor"
    if inputs is not None:
        if not isinstance(inputs, Tensor) or inputs.shape[:2] != embeds.shape[:2]:
            return "inputs_embeds= with input_ids of another shape (stock keeps both; assisted decoding cannot)"
        return None
    readers = [name for name in PROMPT_ID_READERS if getattr(gc, name, None) not in (None, NEUTRAL.get(name))]
    readers += ["prefix_allowed_tokens_fn"] * (kwargs.get("prefix_allowed_tokens_fn") is not None)
    if readers:
        return (f"inputs_embeds= without input_ids, with {readers[0]} (it reads the prompt's ids, which only the "
                "embeddings hold)")
    return None


def with_placeholder_ids(kwargs: dict, gc: Any) -> tuple[dict, int]:
    """(the call with placeholder `input_ids` of the embedded prompt's width, an all-ones attention mask unless
    one is given, as stock makes for embeddings, and a streamer that sees no prompt; that width)."""
    embeds = kwargs["inputs_embeds"]
    width = embeds.shape[1]
    ids = torch.full(embeds.shape[:2], pad_id(gc) or 0, dtype=torch.long, device=embeds.device)
    call = {k: v for k, v in kwargs.items() if k != "inputs"} | {"input_ids": ids}
    if call.get("attention_mask") is None:  # (a mask inferred from placeholder pad ids would hide the prompt)
        call["attention_mask"] = torch.ones(embeds.shape[:2], dtype=torch.long, device=embeds.device)
    if call.get("streamer") is not None:
        call["streamer"] = PromptlessStreamer(call["streamer"])
    return call, width


def without_prompt(out: Any, width: int) -> Any:
    """`out` (sequences, or a `return_dict_in_generate` output) without its first `width` columns."""
    if isinstance(out, Tensor):
        return out[:, width:]
    out["sequences"] = out["sequences"][:, width:]
    return out


class PromptlessStreamer(BaseStreamer):
    """Passes everything to `inner`, but the prompt as stock passes an embedded one: no ids (width 0)."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.prompt_sent = inner, False

    def put(self, value: Tensor) -> None:
        if not self.prompt_sent:
            self.prompt_sent = True
            value = value[..., :0]
        self.inner.put(value)

    def end(self) -> None:
        self.inner.end()
