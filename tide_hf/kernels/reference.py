"""The PyTorch reference of the fused kernels, and the model's final norm described as data (`NormSpec`).

`norm_spec` reads a final-norm module into a `NormSpec` the kernels understand (the formula is confirmed on
a random probe, never guessed from the class name alone); `apply_norm` and `norm_router_scores_reference`
compute exactly what the kernels compute, and are what runs when no kernel is available.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import TideArgumentError

logger = logging.getLogger(__name__)

NORM_KINDS = {"none": 0, "rms": 1, "rms_gemma": 2, "layernorm": 3, "rms_fp32": 4}  # ids shared with cuda/*.cpp|cu
PROBE_ROWS = 4  # rows of the random input norm_spec() uses to confirm a module's formula
PROBE_SEED = 0
PROBE_ULPS = 4  # probe tolerance, in units of the dtype's epsilon times the output scale


@dataclass
class NormSpec:
    """The model's final norm as data: kind in NORM_KINDS, its weight / bias (model dtype) and eps."""

    kind: str
    weight: torch.Tensor | None = None
    bias: torch.Tensor | None = None
    eps: float = 0.0

    def to(self, device: torch.device) -> NormSpec:
        """This norm with its tensors on `device` (the layer a router runs next to)."""
        return replace(self, weight=None if self.weight is None else self.weight.to(device),
                       bias=None if self.bias is None else self.bias.to(device))


def _rms_candidates(module: nn.Module) -> list[NormSpec]:
    """RMSNorm-like modules (HF *RMSNorm, torch.nn.RMSNorm): both formulas, the class name's guess first."""
    name = type(module).__name__
    weight = getattr(module, "weight", None)
    eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))
    if not name.endswith("RMSNorm") or not isinstance(weight, torch.Tensor) or weight.dim() != 1:
        return []
    if eps is None:  # torch.nn.RMSNorm(eps=None) uses the dtype's machine epsilon
        eps = torch.finfo(weight.dtype).eps
    kinds = ["rms_gemma", "rms", "rms_fp32"] if name.startswith("Gemma") else ["rms", "rms_fp32", "rms_gemma"]
    return [NormSpec(kind, weight, None, float(eps)) for kind in kinds]  # ties (fp32: rms == rms_fp32) go first


def _candidates(module: nn.Module) -> list[NormSpec]:
    """Formulas `module` may compute: LayerNorm for nn.LayerNorm and its subclasses (whose forward may differ:
    Nemotron's LayerNorm1P scales by 1 + w), else the RMSNorm variants."""
    if isinstance(module, nn.LayerNorm):
        if len(module.normalized_shape) != 1:
            return []
        return [NormSpec("layernorm", module.weight, module.bias, float(module.eps))]
    return _rms_candidates(module)


@torch.no_grad()
def norm_spec(module: nn.Module) -> NormSpec | None:
    """Describe `module` (a model's final norm) as a NormSpec, or None when it is not one we reproduce.

    The class only proposes a formula; the one matching the module on a random probe wins (Qwen3-Next uses
    Gemma's (1 + w) without the name, OLMo-2 / GPT-OSS / Gemma-3n scale in fp32), and an unknown variant, an
    nn.LayerNorm subclass computing something else included, yields None rather than silently wrong scores.
    """
    if isinstance(module, nn.Identity):
        return NormSpec("none")
    candidates = _candidates(module)
    if not candidates:
        return None
    weight = candidates[0].weight
    size = module.normalized_shape[0] if isinstance(module, nn.LayerNorm) else weight.numel()
    device = weight.device if weight is not None else torch.device("cpu")
    dtype = weight.dtype if weight is not None else torch.get_default_dtype()
    try:
        gen = torch.Generator(device=device).manual_seed(PROBE_SEED)
        probe = torch.randn(PROBE_ROWS, size, generator=gen, device=device).to(dtype)
        expected = module(probe).float()
        errors = [(apply_norm(probe, spec).float() - expected).abs().max().item() for spec in candidates]
    except Exception as err:  # meta / offloaded weights, exotic forward signatures
        logger.debug("norm_spec: probing %s failed: %s", type(module).__name__, err)
        return None
    best = min(range(len(candidates)), key=errors.__getitem__)
    scale = expected.abs().max().item()
    return candidates[best] if errors[best] <= PROBE_ULPS * torch.finfo(dtype).eps * max(scale, 1.0) else None


def apply_norm(hidden: torch.Tensor, spec: NormSpec) -> torch.Tensor:
    """The norm exactly as HF / torch compute it, dtype handling included (see modeling_llama / _gemma)."""
    if spec.kind == "none":
        return hidden
    if spec.kind == "layernorm":
        return F.layer_norm(hidden, hidden.shape[-1:], spec.weight, spec.bias, spec.eps)
    x = hidden.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + spec.eps)
    if spec.kind == "rms_gemma":  # GemmaRMSNorm: scale by (1 + w) in fp32, then cast
        return (x * (1.0 + spec.weight.float())).type_as(hidden)
    if spec.kind == "rms_fp32":  # Olmo2RMSNorm / GptOssRMSNorm: scale by w in fp32, then cast
        return (x * spec.weight.float()).type_as(hidden)
    if spec.kind != "rms":
        raise TideArgumentError(f"unknown norm kind {spec.kind!r}; expected one of {sorted(NORM_KINDS)}")
    x = x.to(hidden.dtype)  # LlamaRMSNorm: cast back to the input dtype, then multiply by the weight
    return x if spec.weight is None else spec.weight * x


def norm_router_scores_reference(
    hidden: torch.Tensor, spec: NormSpec, w1: torch.Tensor, b1: torch.Tensor, w2: torch.Tensor, b2: torch.Tensor
) -> torch.Tensor:
    """PyTorch reference: sigmoid(fc2(relu(fc1(norm(hidden))))) as TideRouter computes it, fp32 (...,)."""
    features = apply_norm(hidden, spec).to(w1.dtype)
    logit = F.linear(F.relu(F.linear(features, w1, b1)), w2.reshape(1, -1), b2)
    return torch.sigmoid(logit).squeeze(-1).float()


