"""tide_hf: TIDE (Token-Informed Depth Execution) early exit for HuggingFace causal LMs.

The public API, re-exported from the rooms that hold it; `import tide_hf` also teaches stock
`generate()` the `tide=` keyword (`tide_hf.integrations.uninstall()` takes it back).
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

from .calibration import calibrate, load_texts
from .config import TideOptions, TideRouterConfig
from .errors import (
    TideArgumentError,
    TideArgumentTypeError,
    TideCompatibilityError,
    TideConcurrencyError,
    TideDataError,
    TideError,
    TideRouterFileError,
)
from .integrations import TideLogitsProcessor, install
from .modeling import ModelAdapter, TideRouter, get_adapter, model_fingerprint, register_adapter
from .runtime import ExitStats, TideHandle, attach, detach, get_handle, last_stats

try:
    __version__ = version("tide_hf")
except PackageNotFoundError:  # a source tree that was never installed
    __version__ = "0+unknown"

install()

__all__ = [
    "ExitStats",
    "ModelAdapter",
    "TideArgumentError",
    "TideArgumentTypeError",
    "TideCompatibilityError",
    "TideConcurrencyError",
    "TideDataError",
    "TideError",
    "TideHandle",
    "TideLogitsProcessor",
    "TideOptions",
    "TideRouter",
    "TideRouterFileError",
    "TideRouterConfig",
    "__version__",
    "attach",
    "calibrate",
    "detach",
    "get_adapter",
    "get_handle",
    "last_stats",
    "load_texts",
    "model_fingerprint",
    "register_adapter",
]
