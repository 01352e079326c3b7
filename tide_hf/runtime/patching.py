"""One reversible patching mechanism for everything tide_hf changes on a model or a class.

Learned from accelerate's `add_hook_to_module` / `remove_hook_from_module`: every change is recorded
with what it replaced, and `restore()` undoes all of them in reverse order, leaving each object exactly
as found (an attribute that was not in the instance's `__dict__` is deleted again, not set to a copy).
Used by attach (forward hooks), skip mode (layer forwards), the baselines (dropped layers), early-exit
drafting (`config.num_hidden_layers`), speculative mode (stock's candidate-generator factory) and the
`generate(tide=...)` keyword (`GenerationMixin.generate`).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import Any

from torch import nn
from torch.utils.hooks import RemovableHandle

MISSING = object()  # what `Patches` records for an attribute the object did not hold itself


class _Layers:
    """The patches of one attribute of one object: the value found before the first, and the live ones (oldest
    first). Held by the undo closures; the registry below only points at it, so a patched model stays free to
    be garbage collected."""

    def __init__(self, obj: Any, base: Any) -> None:
        self.owner = _owner(obj)
        self.base = base
        self.stack: list[list[Any]] = []


# (object id, attribute) -> its live `_Layers`; keyed by id (configs are unhashable), checked by owner.
_LAYERS: dict[tuple[int, str], weakref.ref[_Layers]] = {}
_LAYERS_LOCK = threading.Lock()


def _owner(obj: Any) -> Callable[[], Any]:
    try:
        return weakref.ref(obj)
    except TypeError:
        return lambda: obj


def _found(obj: Any, name: str) -> Any:
    """What restoring `obj.name` must bring back: its own value, or MISSING when deleting ours does it."""
    own = vars(obj) if hasattr(obj, "__dict__") else {}
    if name in own:  # the object's own value (a config field, accelerate's `_old_forward`, a class's method)
        return own[name]
    if isinstance(obj, type) or hasattr(type(obj), name) or not hasattr(obj, name):
        return MISSING  # inherited or absent: deleting our attribute brings it back
    return getattr(obj, name)  # computed on access (e.g. a config's attribute_map alias): set the old value back


# Where another library moves a forward it wraps (accelerate's `add_hook_to_module` keeps the wrapped forward as
# `_old_forward`; `remove_hook_from_module` moves `_old_forward` back to `forward`).
RELOCATED = {"forward": ("_old_forward",), "_old_forward": ("forward",)}


def _put_back(obj: Any, name: str, ours: Any, base: Any) -> None:
    """Undo our patch `ours` of `obj.name`: `base` (the value it replaced; MISSING: delete ours) back in its
    place. When another library patched the attribute after us, its value stays: if it moved ours elsewhere
    (`RELOCATED`), the value found goes there instead; if it wrapped ours out of reach, ours stays inside its
    wrapper (tide_hf's wrappers pass through once detached)."""
    own = vars(obj) if hasattr(obj, "__dict__") else {}
    # (a class's own entry as stored: staticmethod / classmethod objects differ from what `getattr` returns)
    current = own.get(name, MISSING) if isinstance(obj, type) else getattr(obj, name, MISSING)
    if current is ours or (isinstance(ours, (bool, int, float, str)) and current == ours):  # (a value, maybe a copy)
        where = name
    else:
        where = next((n for n in RELOCATED.get(name, ()) if own.get(n) is ours), None)
    if where == name and base is MISSING:
        delattr(obj, name)
    elif where is not None:
        if base is MISSING:  # the inherited value, as `obj.name` reads it once ours is gone
            base = getattr(type(obj), name)
            base = base.__get__(obj, type(obj)) if hasattr(base, "__get__") else base
        setattr(obj, where, base)


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
        """`setattr(obj, name, value)`, undone on restore (instance or class attribute alike).

        Patches of one attribute by several owners may end in any order (overlapping `generate(tide=...)`
        calls in two threads): each undo removes its own layer, and the attribute shows the newest layer left,
        or, once none is, the value found before the first."""
        key = (id(obj), name)
        with _LAYERS_LOCK:
            layers = _LAYERS[key]() if key in _LAYERS else None
            if layers is None or layers.owner() is not obj:
                layers = _Layers(obj, _found(obj, name))
                _LAYERS[key] = weakref.ref(layers, lambda ref: _LAYERS.pop(key) if _LAYERS.get(key) is ref else None)
            entry = [value]  # a fresh list: identity marks this layer
            layers.stack.append(entry)
            setattr(obj, name, value)

        def undo() -> None:
            with _LAYERS_LOCK:
                top = layers.stack[-1] is entry
                del layers.stack[next(i for i, e in enumerate(layers.stack) if e is entry)]  # identity, not ==
                if not layers.stack:
                    if key in _LAYERS and _LAYERS[key]() is layers:
                        del _LAYERS[key]
                    _put_back(obj, name, value, layers.base)
                elif top:
                    _put_back(obj, name, value, layers.stack[-1][0])

        self._undo.append(undo)

    def replace_forward(self, module: nn.Module, make: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
        """Replace `module`'s forward on the instance by `make(original_forward)`."""
        attr = forward_attribute(module)
        self.set_attr(module, attr, make(getattr(module, attr)))

    def restore(self) -> None:
        """Undo every change, newest first."""
        while self._undo:
            self._undo.pop()()
