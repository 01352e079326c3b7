"""Compiled decoding while attached: transformers' compiled step becomes a graph of TIDE's own.

With a static cache, transformers compiles each decoding step (`get_compiled_call`, a `torch.compile` of
the model's `__call__`). Dynamo does not guard on empty hook dicts (`torch._dynamo.config.
skip_nnmodule_hook_guards`), so a step graph compiled before `attach` would keep running without TIDE's
hooks, silently without exits. While attached, `get_compiled_call` compiles a distinct function instead
(its graphs hold the hooks, and guard on them); `detach` brings stock's compiled call back.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from transformers import CompileConfig

from .patching import Patches

COMPILED_CALL = "get_compiled_call"  # transformers' PreTrainedModel method that compiles decoding steps


def model_call(model: nn.Module) -> Callable:
    """`model(...)` behind a code object of tide_hf's own, whose compiled graphs are TIDE's alone."""
    def call(*args: Any, **kwargs: Any) -> Any:
        return model(*args, **kwargs)
    return call


class CompiledCall:
    """Stands in for `model.get_compiled_call` while a handle is attached (same signature and caching)."""

    def __init__(self, model: nn.Module, steps: Callable[[Any], Callable] | None = None) -> None:
        """`steps(config)`, when given, makes the compiled step instead (skip mode's segments, `segments.py`)."""
        self.model, self.steps = model, steps
        self._compiled: tuple[Any, Callable] | None = None

    def __call__(self, compile_config: Any = None) -> Callable:
        config = compile_config or getattr(self.model.generation_config, "compile_config", None) or CompileConfig()
        if self.steps is not None:
            return self.steps(config)
        if self._compiled is None or self._compiled[0] != config:
            self._compiled = (config, torch.compile(model_call(self.model), **config.to_dict()))
        return self._compiled[1]


def install_compiled_call(model: nn.Module, patches: Patches, steps: Callable[[Any], Callable] | None = None) -> None:
    """Replace `model.get_compiled_call` (recorded in `patches`) when the model has one; `steps`: see `CompiledCall`."""
    if hasattr(model, COMPILED_CALL):
        patches.set_attr(model, COMPILED_CALL, CompiledCall(model, steps))
