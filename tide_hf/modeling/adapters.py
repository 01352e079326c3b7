"""Find the decoder layers, final norm, LM head and embeddings of any causal LM.

TIDE needs to hook the decoder layers and to turn an intermediate hidden state into logits exactly the
way the model turns its final state into logits (final norm, optional projection, LM head, optional
soft-capping). Known families are a table of attribute paths; other models go through `register_adapter`
or a probing fallback whose error names what it could not find.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..errors import TideCompatibilityError

# model_type -> (decoder layers, final norm, optional projection before the LM head)
_PATHS: dict[str, tuple[str, str, str | None]] = {}
_NORM_NAMES = ("norm", "ln_f", "final_layernorm", "final_layer_norm", "norm_f")


# Model types whose forward does not apply the text config's `final_logit_softcapping` (Gemma 3's multimodal
# wrapper; PaliGemma, Gemma 3n / 4 and the others apply it, like the text models)
SOFTCAP_NOT_APPLIED = {"gemma3"}


def register_adapter(model_type: str, *, layers: str, norm: str, pre_head: str | None = None) -> None:
    """Teach tide_hf where a model family keeps its parts (dotted attribute paths from the CausalLM)."""
    _PATHS[model_type] = (layers, norm, pre_head)


for _mt in ("llama", "mistral", "mixtral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "phi3", "smollm3"):
    register_adapter(_mt, layers="model.layers", norm="model.norm")
register_adapter("phi", layers="model.layers", norm="model.final_layernorm")
register_adapter("gpt2", layers="transformer.h", norm="transformer.ln_f")
register_adapter("falcon", layers="transformer.h", norm="transformer.ln_f")
register_adapter("gpt_neox", layers="gpt_neox.layers", norm="gpt_neox.final_layer_norm")
register_adapter("opt", layers="model.decoder.layers", norm="model.decoder.final_layer_norm",
                 pre_head="model.decoder.project_out")


@dataclass
class ModelAdapter:
    """The parts of one causal LM that TIDE touches, and the model's own head as a function."""

    layers: nn.ModuleList
    final_norm: nn.Module
    pre_head: nn.Module | None
    lm_head: nn.Module
    embeddings: nn.Module
    logit_softcap: float | None

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def normed(self, hidden: torch.Tensor) -> torch.Tensor:
        """The model's final norm applied to any layer's output: the router's input representation."""
        return self.final_norm(hidden)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits the model would produce if `hidden` were its last layer's output."""
        return self.head(self.normed(hidden))

    def head(self, normed: torch.Tensor) -> torch.Tensor:
        """The model's head on an already final-normed state (what follows the final norm)."""
        out = normed
        if self.pre_head is not None:
            out = self.pre_head(out)
        out = self.lm_head(out)
        if self.logit_softcap:
            out = torch.tanh(out / self.logit_softcap) * self.logit_softcap
        return out


def _get(root: nn.Module, path: str) -> nn.Module | None:
    obj: object = root
    for part in path.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj  # type: ignore[return-value]


def text_config(model: nn.Module) -> Any:
    """The config holding the text decoder's sizes (multimodal models nest it; `get_text_config`)."""
    config = model.config
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def _probe(model: nn.Module) -> tuple[str, str]:
    """Guess the layer list and final norm of an unknown model, or say exactly what is missing."""
    n_layers = getattr(text_config(model), "num_hidden_layers", None)
    layer_paths = [
        name for name, mod in model.named_modules()
        if isinstance(mod, nn.ModuleList) and len(mod) > 0 and (n_layers is None or len(mod) == n_layers)
    ]
    if len(layer_paths) != 1:
        found = ", ".join(layer_paths) or "none"
        raise TideCompatibilityError(
            f"tide_hf cannot find the decoder layers of {type(model).__name__} "
            f"(model_type={getattr(model.config, 'model_type', None)!r}): expected exactly one nn.ModuleList "
            f"of {n_layers} layers, found: {found}. Call tide_hf.register_adapter(model_type, layers=..., norm=...)."
        )
    layers = layer_paths[0]
    parent = layers.rsplit(".", 1)[0] if "." in layers else ""
    for name in _NORM_NAMES:
        candidate = f"{parent}.{name}" if parent else name
        if _get(model, candidate) is not None:
            return layers, candidate
    raise TideCompatibilityError(
        f"tide_hf found the decoder layers of {type(model).__name__} at '{layers}' but no final norm next to "
        f"them (looked for {', '.join(_NORM_NAMES)} under '{parent or type(model).__name__}'). "
        "Call tide_hf.register_adapter(model_type, layers=..., norm=...)."
    )


def get_adapter(model: nn.Module) -> ModelAdapter:
    """Return the `ModelAdapter` of a causal LM (registered family first, probing otherwise)."""
    if callable(getattr(model, "get_base_model", None)) and model.get_base_model() is not model:  # peft's wrapper
        raise TideCompatibilityError(f"{type(model).__name__} wraps the causal LM: attach to model.get_base_model() "
                                     "(the adapters stay active; generate through either model)")
    model_type = getattr(model.config, "model_type", None)
    if model_type in _PATHS:
        layers_path, norm_path, pre_head_path = _PATHS[model_type]
    else:
        (layers_path, norm_path), pre_head_path = _probe(model), None
    layers = _get(model, layers_path)
    if not isinstance(layers, nn.ModuleList):
        raise TideCompatibilityError(f"{type(model).__name__}: '{layers_path}' is not the list of decoder layers")
    # A missing final norm is legitimate (e.g. OPT-350m normalizes after each layer instead).
    norm = _get(model, norm_path) or nn.Identity()
    lm_head = model.get_output_embeddings()
    if lm_head is None:
        raise TideCompatibilityError(f"{type(model).__name__} has no output embeddings (LM head): is it a causal LM?")
    return ModelAdapter(
        layers=layers,
        final_norm=norm,
        pre_head=_get(model, pre_head_path) if pre_head_path else None,
        lm_head=lm_head,
        embeddings=model.get_input_embeddings(),
        logit_softcap=None if getattr(model.config, "model_type", None) in SOFTCAP_NOT_APPLIED
        else getattr(text_config(model), "final_logit_softcapping", None),
    )


def layer_output(output: torch.Tensor | tuple) -> torch.Tensor:
    """The hidden states a decoder layer returned (some families return a tuple)."""
    return output[0] if isinstance(output, tuple) else output
