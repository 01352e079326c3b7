"""Compiled decoding while attached: transformers' compiled step becomes a graph of TIDE's own.

With a static cache, transformers compiles each decoding step (`get_compiled_call`, a `torch.compile` of
the model's `__call__`). Dynamo does not guard on empty hook dicts (`torch._dynamo.config.
skip_nnmodule_hook_guards`), so a step graph compiled before `attach` would keep running without TIDE's
hooks, silently without exits. While attached, `get_compiled_call` compiles a distinct function instead
(its graphs hold the hooks, and guard on them); `detach` brings stock's compiled call back.

Skip mode on layers that cannot run as segments (`SegmentedDecoding.unsupported`) compiles the whole step, whose
graph breaks where a checkpoint reads its flag on the host: `fullgraph=True` is refused there when transformers
asks for the compiled step, before the prefill, rather than failing inside dynamo on that read.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from transformers import CompileConfig

from ..errors import TideUnsupportedError
from .patching import Patches
from .session import StepHost

COMPILED_CALL = "get_compiled_call"  # transformers' PreTrainedModel method that compiles decoding steps


def model_call(model: nn.Module, name: str) -> Callable:
    """`model(...)` behind a code object of its own, named `name`: dynamo caches graphs (and counts recompiles)
    per code object, so the graphs of one attach are neither guarded against nor counted with another's (each
    attach places new hooks, which an earlier attach's graphs would fail to match)."""
    def call(*args: Any, **kwargs: Any) -> Any:
        return model(*args, **kwargs)
    return types.FunctionType(call.__code__.replace(co_name=name), call.__globals__, name, None, call.__closure__)


class CompiledCall:
    """Stands in for `model.get_compiled_call` while a handle is attached (same signature and caching)."""

    def __init__(self, model: nn.Module, host: StepHost, steps: Callable[[Any], Callable] | None = None,
                 breaks: str | None = None) -> None:
        """`steps(config)`, when given, makes the compiled step instead (skip mode's segments, `skip/segments.py`);
        while `host.prefilling()` holds, the model runs uncompiled (a prompt prefilled in chunks: generate's usual
        prefill is not compiled, and each chunk would meet the graphs with a new prompt offset and width).
        `breaks`: why skip mode's step compiles whole, with graph breaks at the checkpoints (None: no break)."""
        self.model, self.host, self.steps, self.breaks = model, host, steps, breaks
        self._compiled: tuple[Any, Callable] | None = None

    def __call__(self, compile_config: Any = None) -> Callable:
        config = compile_config or getattr(self.model.generation_config, "compile_config", None) or CompileConfig()
        check_fullgraph(self.model, config, self.breaks)
        if self.steps is not None:
            compiled = self.steps(config)
        else:
            if self._compiled is None or self._compiled[0] != config:
                self._compiled = (config, torch.compile(model_call(self.model, f"tide_step_{id(self)}"),
                                                        **config.to_dict()))
            compiled = self._compiled[1]

        def step(*args: Any, **kwargs: Any) -> Any:
            return (self.model if self.host.prefilling() else compiled)(*args, **kwargs)
        return step


def check_fullgraph(model: nn.Module, config: Any, breaks: str | None) -> None:
    """Refuse `fullgraph=True` where skip mode's compiled step has graph breaks (`breaks` says why), naming the
    way out: dynamo would fail on the first checkpoint's host read with a raw data-dependent-guard error."""
    if breaks is None or not getattr(config, "fullgraph", False):
        return
    raise TideUnsupportedError(
        f"compile_config with fullgraph=True in mode='skip' on {type(model).__name__}: {breaks}, so skip mode "
        "cannot compile its decoding steps as one graph per segment of layers, and the whole-step graph breaks "
        "where each checkpoint reads on the host whether every row exited; pass CompileConfig(fullgraph=False) "
        "(the same step, with graph breaks at the checkpoints), or attach with mode='select'")


def install_compiled_call(model: nn.Module, patches: Patches, host: StepHost,
                          steps: Callable[[Any], Callable] | None = None, breaks: str | None = None) -> None:
    """Replace `model.get_compiled_call` (recorded in `patches`) when the model has one; `host`, `steps`,
    `breaks`: see `CompiledCall`."""
    if hasattr(model, COMPILED_CALL):
        patches.set_attr(model, COMPILED_CALL, CompiledCall(model, host, steps, breaks))
