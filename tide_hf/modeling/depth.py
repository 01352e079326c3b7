"""Whether a model runs only its first `config.num_hidden_layers` decoder layers when that field is lowered:
speculative drafts (and transformers' own early-exit drafting) rely on it, and a model that loops over all of
its layers would draft with every one of them. Checked by `attach` with one tiny forward, so the refusal comes
before any call instead of in the middle of one whose router happens to draft."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..errors import TideUnsupportedError
from .adapters import ModelAdapter, text_config
from .head import check_ids


def layers_owner(model: nn.Module, layers: nn.ModuleList) -> nn.Module:
    """The module holding `layers` as a child: the one whose forward loops over them."""
    return next(m for m in model.modules() if any(child is layers for child in m.children()))


def layers_config(owner: nn.Module, model: nn.Module) -> Any:
    """The config whose `num_hidden_layers` the loop of `owner` (`layers_owner`) reads: its own (a multimodal
    base model's is the composite config, not its text decoder's), else the model's text config."""
    return getattr(owner, "config", text_config(model))


@torch.no_grad()
def check_depth_follows_config(model: nn.Module, adapter: ModelAdapter, depth: int,
                               way_out: str = "use mode='select' or 'skip'") -> None:
    """Raise `TideUnsupportedError` unless a forward with `num_hidden_layers` lowered to `depth` runs and leaves
    `layers[depth]` unrun; its message ends with `way_out` (the modes this model can run instead). The field,
    the hook and every module's training flag are restored."""
    layers = adapter.layers
    config = layers_config(layers_owner(model, layers), model)
    ids = check_ids(adapter, model)
    ran: list[bool] = []
    training = [(module, module.training) for module in model.modules()]
    saved = config.num_hidden_layers
    hook = layers[depth].register_forward_pre_hook(lambda *_: ran.append(True))
    try:
        config.num_hidden_layers = depth
        model.eval()
        model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False)
    except Exception as err:
        raise TideUnsupportedError(f"mode='speculative' on {type(model).__name__}: a forward with "
                                   f"config.num_hidden_layers lowered to {depth} (how drafts run) failed: {err}; "
                                   f"{way_out}") from err
    finally:
        config.num_hidden_layers = saved
        hook.remove()
        for module, mode in training:
            module.training = mode
    if ran:
        raise TideUnsupportedError(
            f"mode='speculative' on {type(model).__name__}: it ignores config.num_hidden_layers, so it cannot draft "
            "with its first layers; speculative mode needs a model that runs `layers[: config.num_hidden_layers]` "
            f"(the Llama family does); {way_out}")
