"""One reversible patching mechanism for everything tide_hf changes on a model or a class.

Learned from accelerate's `add_hook_to_module` / `remove_hook_from_module`: every change is recorded
with what it replaced, and `restore()` undoes all of them in reverse order, leaving each object exactly
as found (an attribute that was not in the instance's `__dict__` is deleted again, not set to a copy).
Used by attach (forward hooks), skip mode (layer forwards), the baselines (dropped layers), early-exit
drafting (`config.num_hidden_layers`), speculative mode (stock's candidate-generator factory) and the
`generate(tide=...)` keyword (`GenerationMixin.generate`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn
from torch.utils.hooks import RemovableHandle

MISSING = object()  # what `Patches` records for an attribute the object did not hold itself


def forward_attribute(module: nn.Module) -> str:
    """The attribute holding `module`'s forward: accelerate's `_old_forward` when it wraps the module (so its
    device hooks keep running around ours), else `forward`."""
    return "_old_forward" if hasattr(module, "_old_forward") else "forward"


class Patches:
    """A stack of reversible changes; `restore()` (or leaving the `with` block) undoes them all."""

    def __init__(self) -> None:
        self._undo: list[Callable[[], None]] = []

    def __enter__(self) -> Patches:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.restore()

    def __len__(self) -> int:
        return len(self._undo)

    def hook(self, handle: RemovableHandle) -> RemovableHandle:
        """Own a torch hook handle (`register_forward_hook` & co.): removed on restore."""
        self._undo.append(handle.remove)
        return handle

    def set_attr(self, obj: Any, name: str, value: Any) -> None:
        """`setattr(obj, name, value)`, undone on restore (instance or class attribute alike)."""
        own = vars(obj) if hasattr(obj, "__dict__") else {}
        if name in own:  # the object's own value (a config field, accelerate's `_old_forward`, a class's method)
            saved = own[name]
        elif isinstance(obj, type) or hasattr(type(obj), name) or not hasattr(obj, name):
            saved = MISSING  # inherited or absent: deleting our attribute brings it back
        else:  # computed on access (e.g. a config's attribute_map alias): set the old value back
            saved = getattr(obj, name)
        setattr(obj, name, value)
        self._undo.append(lambda: delattr(obj, name) if saved is MISSING else setattr(obj, name, saved))

    def replace_forward(self, module: nn.Module, make: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
        """Replace `module`'s forward on the instance by `make(original_forward)`."""
        attr = forward_attribute(module)
        self.set_attr(module, attr, make(getattr(module, attr)))

    def restore(self) -> None:
        """Undo every change, newest first."""
        while self._undo:
            self._undo.pop()()
