"""tide_hf: TIDE (Token-Informed Depth Execution) early exit for HuggingFace causal LMs.

The public API, re-exported lazily from the rooms that hold it (PEP 562), so `import tide_hf` itself imports
neither torch nor transformers and `tide-hf --help` answers at once. `import tide_hf` also teaches stock
`generate()` the `tide=` keyword (`tide_hf.integrations.uninstall()` takes it back): at once when transformers'
generation module is already loaded, else as soon as it is (a post-import hook that wraps
`GenerationMixin.generate` in a trampoline; its first call installs the real keyword).
"""

from __future__ import annotations

import functools
import importlib
import importlib.abc
import importlib.machinery
import sys
from importlib.metadata import PackageNotFoundError, version
from typing import Any

try:
    __version__ = version("tide_hf")
except PackageNotFoundError:  # a source tree that was never installed
    __version__ = "0+unknown"

_API = {  # public name -> the room that holds it
    "calibrate": "calibration", "calibrate_tokens": "calibration", "load_texts": "calibration",
    "TideOptions": "config", "TideRouterConfig": "config",
    "TideCompatibilityError": "errors", "TideDataError": "errors", "TideError": "errors",
    "TideArgumentError": "errors", "TideArgumentTypeError": "errors", "TideConcurrencyError": "errors",
    "TideRouterFileError": "errors",
    "TideLogitsProcessor": "integrations",
    "ModelAdapter": "modeling", "TideRouter": "modeling", "get_adapter": "modeling",
    "model_fingerprint": "modeling", "register_adapter": "modeling",
    "ExitStats": "runtime", "TideHandle": "runtime", "attach": "runtime", "detach": "runtime",
    "get_handle": "runtime", "last_stats": "runtime",
}
GENERATION_MODULE = "transformers.generation.utils"
TRAMPOLINE_FLAG = "__tide_trampoline__"  # set on the placeholder wrapper until the real keyword is installed


def __getattr__(name: str) -> Any:
    if name in _API:
        value = getattr(importlib.import_module(f".{_API[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_API})


def _install_keyword() -> None:
    from .integrations import install

    install()


def _trampoline(mixin: type) -> None:
    """Wrap `mixin.generate` so its first call installs the real `tide=` wrapper (all imports done by then)."""
    original = mixin.generate

    @functools.wraps(original)
    def generate(self: Any, *args: Any, **kwargs: Any) -> Any:
        if getattr(mixin.generate, TRAMPOLINE_FLAG, False):
            mixin.generate = original
            _install_keyword()
        return mixin.generate(self, *args, **kwargs)

    setattr(generate, TRAMPOLINE_FLAG, True)
    mixin.generate = generate


class _GenerationHook(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Post-import hook: once transformers' generation module has run, put the trampoline on GenerationMixin.

    Installing the real keyword here would import tide_hf's rooms while transformers is half imported."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != GENERATION_MODULE:
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is not None and spec.loader is not None:
            self.inner = spec.loader
            spec.loader = self
        return spec

    def create_module(self, spec: Any) -> Any:
        return self.inner.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self.inner.exec_module(module)
        _trampoline(module.GenerationMixin)


if GENERATION_MODULE in sys.modules:
    _install_keyword()
elif not any(isinstance(f, _GenerationHook) for f in sys.meta_path):
    sys.meta_path.insert(0, _GenerationHook())

__all__ = sorted([*_API, "__version__"])
