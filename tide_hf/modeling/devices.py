"""Where a module computes and what its weights are, also on models dispatched by accelerate.

`device_map="auto"`, `dispatch_model` and `cpu_offload` wrap modules in accelerate hooks (`_hf_hook`); an
offloaded module keeps its parameters on the meta device and loads them from a weights map (CPU state dict
or offload folder) around each forward. TIDE asks the hooks: the execution device for where routers sit,
and the weights map for values (the model fingerprint) and for the final norm the fused kernel reads.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from itertools import chain

import torch
from accelerate.hooks import AlignDevicesHook, SequentialHook
from torch import nn

from ..errors import TideCompatibilityError


def _align_hooks(module: nn.Module) -> list[AlignDevicesHook]:
    """accelerate's device hooks on `module` itself (also inside a `SequentialHook`)."""
    hook = getattr(module, "_hf_hook", None)
    hooks = hook.hooks if isinstance(hook, SequentialHook) else [hook]
    return [h for h in hooks if isinstance(h, AlignDevicesHook)]


def execution_device(module: nn.Module) -> torch.device:
    """The device `module` computes on: the execution device of accelerate's hook on it (or on its first
    hooked submodule) when it was dispatched, else the device of its first tensor not on meta (CPU if none)."""
    for sub in module.modules():
        for hook in _align_hooks(sub):
            if hook.execution_device is not None:
                return torch.device(hook.execution_device)
    for tensor in chain(module.parameters(), module.buffers()):
        if tensor.device.type != "meta":
            return tensor.device
    return torch.device("cpu")


def _offload_source(modules: dict[str, nn.Module], name: str) -> tuple[AlignDevicesHook, str] | None:
    """The offload hook that loads the tensor at dotted path `name`, and its key in the hook's weights map."""
    parts = name.split(".")
    for depth in range(len(parts) - 1, -1, -1):
        owner = modules.get(".".join(parts[:depth]))
        for hook in _align_hooks(owner) if owner is not None else []:
            direct = depth == len(parts) - 1
            if hook.offload and hook.weights_map is not None and (direct or hook.place_submodules):
                return hook, ".".join(parts[depth:])
    return None


def _offloaded_value(modules: dict[str, nn.Module], name: str) -> torch.Tensor | None:
    """Value of the tensor at dotted path `name` from the weights map of the offload hook that loads it."""
    source = _offload_source(modules, name)
    return None if source is None else source[0].weights_map[source[1]]


def check_materialized(model: nn.Module) -> None:
    """Refuse a model with weights on the meta device that no accelerate offload hook loads (built under
    `init_empty_weights` and never loaded): every forward of it fails deep inside (no weights are read here)."""
    modules = dict(model.named_modules())
    for name, param in model.named_parameters():
        if param.device.type == "meta" and _offload_source(modules, name) is None:
            raise TideCompatibilityError(f"parameter {name} is on the meta device and no accelerate offload hook "
                                         "holds its value: load the model's weights (from_pretrained, "
                                         "load_checkpoint_and_dispatch) before TIDE uses it")


def named_weights(model: nn.Module, module: nn.Module, modules: dict[str, nn.Module] | None = None
                  ) -> Iterator[tuple[str, torch.Tensor]]:
    """`module.named_parameters()` with the real values of offloaded (meta) parameters, read from
    accelerate's weights map; `module` is a submodule of `model` (`modules`: `dict(model.named_modules())`, for a
    caller that reads several submodules)."""
    modules = dict(model.named_modules()) if modules is None else modules
    prefix = next(name for name, sub in modules.items() if sub is module)
    for name, param in module.named_parameters():
        if param.device.type == "meta":
            value = _offloaded_value(modules, f"{prefix}.{name}" if prefix else name)
            if value is None:
                raise TideCompatibilityError(f"parameter {prefix}.{name} is on the meta device and no accelerate "
                                             "offload hook holds its value")
            yield name, value
        else:
            yield name, param


@contextmanager
def onloaded(module: nn.Module) -> Iterator[None]:
    """Bring the offloaded weights of `module` and its submodules in for the block (as its forward would)."""
    hooked = [(sub, hook) for sub in module.modules() for hook in _align_hooks(sub) if hook.offload]
    for sub, hook in hooked:
        hook.pre_forward(sub)
    try:
        yield
    finally:
        for sub, hook in hooked:
            hook.post_forward(sub, None)
