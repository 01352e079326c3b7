"""The model side: where a causal LM keeps its parts (adapters) and whether its head is reproduced (head), where
modules compute (devices), and the router sidecar (`TideRouter`) with the fingerprint that pairs it with its model."""

from __future__ import annotations

from .adapters import ModelAdapter, check_model, get_adapter, layer_output, register_adapter, text_config
from .fingerprint import model_fingerprint
from .head import check_head
from .quiet import quiet_hf
from .router import RouterMLP, TideRouter

__all__ = ["ModelAdapter", "RouterMLP", "TideRouter", "check_head", "check_model", "get_adapter", "layer_output",
           "model_fingerprint", "quiet_hf", "register_adapter", "text_config"]
