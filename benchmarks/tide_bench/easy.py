"""Easy models: every decoder layer after `keep` made near-identity, so exiting at `keep` is usually right.

Scaling a layer's attention output projection and MLP down projection by a small factor shrinks what it
adds to the residual stream, so layer `keep`'s exit agrees with the final layer on most tokens while the
model still costs what it cost. This is the case where self-speculative decoding should pay, with a
known answer: `tide-hf bench modes --near-identity-after K` and `tide-hf bench gpu` measure the
speculative mode on it against the optimum its measured acceptance and costs allow.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tide_hf.calibration import calibrate
from tide_hf.errors import TideArgumentError
from tide_hf.modeling import TideRouter, get_adapter

NEAR_IDENTITY_SCALE = 0.02  # factor on o_proj / down_proj of the deep layers (the 8B experiment)
EASY_CALIBRATION_SAMPLES = 48  # a quick calibration: the routers only need to see the easy layers
EASY_CALIBRATION_LEN = 128
_OUTPUT_PROJECTIONS = ("self_attn.o_proj", "mlp.down_proj")  # what a Llama-like layer adds to the residual


@torch.no_grad()
def make_near_identity(model: nn.Module, keep: int, scale: float = NEAR_IDENTITY_SCALE) -> nn.Module:
    """Scale the residual-writing projections of every decoder layer after the first `keep` by `scale`, in
    place; returns `model`. Needs Llama-like layers (`self_attn.o_proj`, `mlp.down_proj`)."""
    layers = get_adapter(model).layers
    if not 1 <= keep < len(layers):
        raise TideArgumentError(f"near-identity after layer {keep}: keep must be in [1, {len(layers) - 1}] "
                                f"for this {len(layers)}-layer model")
    for index, layer in enumerate(layers[keep:], start=keep + 1):
        for name in _OUTPUT_PROJECTIONS:
            try:
                layer.get_submodule(name).weight.mul_(scale)
            except AttributeError as exc:
                raise TideArgumentError(f"layer {index} ({type(layer).__name__}) has no {name}: near-identity "
                                        "layers need a Llama-like model") from exc
    return model


def easy_router(model: nn.Module, tokenizer: Any, dataset: str, *, num_samples: int = EASY_CALIBRATION_SAMPLES,
                seq_len: int = EASY_CALIBRATION_LEN) -> TideRouter:
    """Routers for an easy model from a quick top-1 calibration (their metrics give the draft-layer prior)."""
    return calibrate(model, tokenizer, dataset, num_samples=num_samples, seq_len=seq_len, label="top1",
                     progress=False)
