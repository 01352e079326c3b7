"""Find the decoder layers, final norm, LM head and embeddings of any causal LM.

TIDE needs to hook the decoder layers and to turn an intermediate hidden state into logits exactly the
way the model turns its final state into logits (final norm, optional projection, LM head, the family's logit
scale, optional soft-capping). Known families are a table of attribute paths; other models go through
`register_adapter` or a probing fallback whose error names what it could not find. `head.check_head` confirms
the head on the model's own forward where it matters (calibration, analyze, speculative drafts).
Encoder-decoder models are refused: TIDE serves decoder-only causal LMs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..errors import TideArgumentTypeError, TideCompatibilityError

# model_type -> (decoder layers, final norm, optional projection before the LM head)
_PATHS: dict[str, tuple[str, str, str | None]] = {}
_NORM_NAMES = ("norm", "ln_f", "final_layernorm", "final_layer_norm", "norm_f", "final_norm")


# Model types whose forward does not apply the text config's `final_logit_softcapping` (Gemma 3's multimodal
# wrapper; PaliGemma, Gemma 3n / 4 and the others apply it, like the text models)
SOFTCAP_NOT_APPLIED = {"gemma3"}
SOFTCAP_ATTRIBUTES = {"recurrent_gemma": "logits_soft_cap"}  # where the cap is not `final_logit_softcapping`

LogitScale = Callable[[Any], float]  # the text config -> the factor the model multiplies its head's logits by


def _config_scale(attribute: str, *, divides: bool = False) -> LogitScale:
    """The scale a family reads from its text config's `attribute` (None: 1), multiplying or dividing by it."""
    def scale(config: Any) -> float:
        value = getattr(config, attribute, None)
        value = 1.0 if value is None else float(value)
        return 1.0 / value if divides else value
    return scale


# model_type (the model's own config, which says what its forward does) -> its logit scale, applied after the LM
# head and before soft-capping, as transformers' forwards do. MiniCPM3 divides the state before its bias-free head,
# the same factor.
_LOGIT_SCALES: dict[str, LogitScale] = {
    **dict.fromkeys(("cohere", "cohere2", "cohere2_moe", "cohere_compass", "cohere_compass_text"),
                    _config_scale("logit_scale")),
    **dict.fromkeys(("granite", "granite_swa", "granitemoe", "granitemoe_swa", "granitemoehybrid", "granitemoeshared",
                     "granite4_vision", "granite_docling", "minicpm3"), _config_scale("logits_scaling", divides=True)),
    **dict.fromkeys(("hyperclovax", "hyperclovax_vision_v2"), _config_scale("logits_scaling")),
    "falcon_h1": _config_scale("lm_head_multiplier"),
    **dict.fromkeys(("muse_glimmer", "muse_spark"), _config_scale("output_multiplier")),
}


def register_adapter(model_type: str, *, layers: str, norm: str, pre_head: str | None = None,
                     logit_scale: LogitScale | None = None) -> None:
    """Teach tide_hf where a model family keeps its parts (dotted attribute paths from the CausalLM) and, with
    `logit_scale` (a function of the text config), the factor its forward multiplies the head's logits by
    before any soft-capping (None keeps the known family's, or 1)."""
    _PATHS[model_type] = (layers, norm, pre_head)
    if logit_scale is not None:
        _LOGIT_SCALES[model_type] = logit_scale


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
    logit_scale: float = 1.0  # Cohere's logit_scale, Granite's 1 / logits_scaling, ...: after the head, before capping

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def scale_free(self) -> bool:
        """Whether the final norm discards a state's scale (RMSNorm, LayerNorm), so only its direction reaches the
        head; without a final norm (OPT-350m normalizes inside each layer) the head reads the state as is."""
        return not isinstance(self.final_norm, nn.Identity)

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
        return self.finish(self.lm_head(out))

    def finish(self, logits: torch.Tensor) -> torch.Tensor:
        """What the model does to its LM head's logits: the family's logit scale, then soft-capping."""
        if self.logit_scale != 1.0:
            logits = logits * self.logit_scale
        if self.logit_softcap:
            logits = torch.tanh(logits / self.logit_softcap) * self.logit_softcap
        return logits


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


def check_model(model: Any) -> None:
    """Refuse what is not a torch module by name (a model id, a pipeline: else a TypeError or AttributeError
    deep inside; attach's registries hold models by weak reference)."""
    if isinstance(model, nn.Module):
        return
    hint = "; for a pipeline, pass pipe.model" if isinstance(getattr(model, "model", None), nn.Module) else ""
    raise TideArgumentTypeError(f"model must be a torch.nn.Module (a transformers model), got "
                                f"{type(model).__name__}{hint}")


def get_adapter(model: nn.Module) -> ModelAdapter:
    """Return the `ModelAdapter` of a causal LM (registered family first, probing otherwise); no forward runs."""
    check_model(model)
    if getattr(model, "config", None) is None:
        raise TideCompatibilityError(f"{type(model).__name__} has no config: tide_hf serves transformers causal LMs "
                                     "(a PreTrainedModel)")
    if callable(getattr(model, "get_base_model", None)) and model.get_base_model() is not model:  # peft's wrapper
        raise TideCompatibilityError(f"{type(model).__name__} wraps the causal LM: attach to model.get_base_model() "
                                     "(the adapters stay active; generate through either model)")
    model_type = getattr(model.config, "model_type", None)
    if getattr(model.config, "is_encoder_decoder", False):  # a probe could take the encoder's blocks for the layers
        raise TideCompatibilityError(
            f"{type(model).__name__} (model_type={model_type!r}) is an encoder-decoder model: tide_hf supports "
            "decoder-only causal LMs (early exit decides per generated token, inside one decoder stack)")
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
        logit_softcap=None if model_type in SOFTCAP_NOT_APPLIED
        else getattr(text_config(model), SOFTCAP_ATTRIBUTES.get(model_type, "final_logit_softcapping"), None),
        logit_scale=_LOGIT_SCALES[model_type](text_config(model)) if model_type in _LOGIT_SCALES else 1.0,
    )


def layer_output(output: torch.Tensor | tuple) -> torch.Tensor:
    """The hidden states a decoder layer returned (some families return a tuple)."""
    return output[0] if isinstance(output, tuple) else output
