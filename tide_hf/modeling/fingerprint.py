"""The weights fingerprint that pairs a router with the model it was calibrated for."""

from __future__ import annotations

import hashlib

import torch
from torch import nn

from .adapters import ModelAdapter, get_adapter
from .devices import named_weights

FINGERPRINT_SAMPLES = 64  # values read from each fingerprinted tensor
FINGERPRINT_DIGITS = 3  # significant digits kept, so fp32 / bf16 / fp16 copies of a model agree


@torch.no_grad()
def model_fingerprint(model: nn.Module, adapter: ModelAdapter | None = None) -> str:
    """A short hash of the shapes and a strided sample of values of the embeddings, first and last layer.

    Values are rounded to a few significant digits so the same weights in another dtype agree. Offloaded
    weights of a dispatched model are read from accelerate's weights map: the fingerprint is the model's own.
    """
    adapter = adapter or get_adapter(model)
    digest = hashlib.sha256()
    for module in (adapter.embeddings, adapter.layers[0], adapter.layers[-1]):
        for name, param in sorted(named_weights(model, module)):  # offloaded weights read from accelerate's map
            flat = param.detach().reshape(-1)
            step = max(1, flat.numel() // FINGERPRINT_SAMPLES)
            sample = flat[::step][:FINGERPRINT_SAMPLES].float().cpu().tolist()
            digest.update(f"{name}{tuple(param.shape)}".encode())
            digest.update(",".join(f"{v:.{FINGERPRINT_DIGITS - 1}e}" for v in sample).encode())
    return digest.hexdigest()[:16]
