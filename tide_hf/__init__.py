"""tide_hf: TIDE (Token-Informed Depth Execution) early exit for HuggingFace causal LMs.

The public API, re-exported lazily from the rooms that hold it (PEP 562), so `import tide_hf` itself imports
neither torch nor transformers and `tide-hf --help` answers at once. `import tide_hf` also teaches stock
`generate()` the `tide=` keyword (`tide_hf.integrations.uninstall()` takes it back): at once when transformers'
generation module is already loaded, else as soon as it is (a post-import hook that wraps
`GenerationMixin.generate` in a trampoline; its first call installs the real keyword). The same hook registers
the router with `AutoConfig` / `AutoModel` once transformers' auto modules load, so `AutoModel.from_pretrained`
reads a router folder after a bare `import tide_hf`.
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
    "TideRouterConfig": "config",
    "TideCompatibilityError": "errors", "TideDataError": "errors", "TideError": "errors",
    "TideArgumentError": "errors", "TideArgumentTypeError": "errors", "TideConcurrencyError": "errors",
    "TideRouterFileError": "errors", "TideTargetError": "errors", "TideUnsupportedError": "errors",
    "TideMissingError": "errors", "TideMissingRouterError": "errors",
    "TideMissingDataError": "errors", "TideDependencyError": "errors",
    "TideIndexError": "errors", "TideDistributedError": "errors",
    "TideLogitsProcessor": "integrations",
    "ModelAdapter": "modeling", "TideRouter": "modeling", "get_adapter": "modeling",
    "model_fingerprint": "modeling", "register_adapter": "modeling",
    "ExitStats": "runtime", "TideHandle": "runtime", "TideOptions": "runtime", "attach": "runtime", "detach": "runtime",
    "get_handle": "runtime", "last_stats": "runtime",
}
GENERATION_MODULE = "transformers.generation.utils"
AUTO_CONFIG_MODULE = "transformers.models.auto.configuration_auto"
AUTO_MODEL_MODULE = "transformers.models.auto.modeling_auto"
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
    """Wrap `mixin.generate` and `mixin.init_continuous_batching` (continuous batching's entry) so the first call of
    either installs the real wrappers (all imports done by then; the install drops both placeholders)."""
    for name in ("generate", "init_continuous_batching"):
        original = getattr(mixin, name, None)
        if original is not None:
            setattr(mixin, name, _bounce(mixin, name, original))


def _bounce(mixin: type, name: str, original: Any) -> Any:
    @functools.wraps(original)
    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        if getattr(getattr(mixin, name), TRAMPOLINE_FLAG, False):
            setattr(mixin, name, original)
            _install_keyword()
        return getattr(mixin, name)(self, *args, **kwargs)

    setattr(method, TRAMPOLINE_FLAG, True)
    return method


def _register_config(module: Any) -> None:
    from .config import TideRouterConfig

    module.AutoConfig.register(TideRouterConfig.model_type, TideRouterConfig, exist_ok=True)


def _register_model(_module: Any) -> None:
    importlib.import_module(".modeling.router", __name__)  # registers AutoConfig and AutoModel when it runs


_AFTER_IMPORT = {GENERATION_MODULE: lambda module: _trampoline(module.GenerationMixin),
                 AUTO_CONFIG_MODULE: _register_config, AUTO_MODEL_MODULE: _register_model}


class _PostImportHook(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Post-import hook: once one of `_AFTER_IMPORT`'s transformers modules has run, call its function (the
    generation module: put the trampoline on GenerationMixin; the auto modules: register the router).

    Installing the real keyword here would import tide_hf's rooms while transformers is half imported."""

    def __init__(self, pending: set[str]) -> None:
        self.pending, self.inner = pending, {}

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname not in self.pending:
            return None
        self.pending.discard(fullname)
        if not self.pending:
            sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is not None and spec.loader is not None:
            self.inner[fullname] = spec.loader
            spec.loader = self
        return spec

    def create_module(self, spec: Any) -> Any:
        return self.inner[spec.name].create_module(spec)

    def exec_module(self, module: Any) -> None:
        self.inner.pop(module.__name__).exec_module(module)
        try:
            _AFTER_IMPORT[module.__name__](module)
        except Exception as err:  # noqa: BLE001 - never fail transformers' own import because of tide_hf
            import warnings

            warnings.warn(f"tide_hf: its hook on {module.__name__} failed ({type(err).__name__}: {err}); "
                          "transformers is unaffected, the generate(tide=) keyword or the Auto classes' knowledge "
                          "of routers may be missing", stacklevel=2)


def _hook_transformers() -> None:
    """What `_AFTER_IMPORT` does for the modules transformers has loaded already, and the hook for the rest."""
    if GENERATION_MODULE in sys.modules:
        _install_keyword()
    if AUTO_MODEL_MODULE in sys.modules:
        _register_model(sys.modules[AUTO_MODEL_MODULE])
    elif AUTO_CONFIG_MODULE in sys.modules:
        _register_config(sys.modules[AUTO_CONFIG_MODULE])
    waiting = {name for name in _AFTER_IMPORT if name not in sys.modules}
    if waiting and not any(isinstance(f, _PostImportHook) for f in sys.meta_path):
        sys.meta_path.insert(0, _PostImportHook(waiting))


_hook_transformers()

__all__ = sorted([*_API, "__version__"])
