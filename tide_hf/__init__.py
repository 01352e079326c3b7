"""tide_hf: TIDE (Token-Informed Depth Execution) early exit for HuggingFace causal LMs.

The public API, re-exported lazily from the rooms that hold it (PEP 562). `import tide_hf` on its own imports
neither torch nor transformers, and changes nothing in them. Where transformers is already imported, it registers
`TideRouter` with transformers' `AutoConfig` / `AutoModel` (importing `TideRouter` does so in any order).
`attach` hooks one model (reversibly); `enable_generate_keyword` teaches stock `generate()` and `pipeline()` the
`tide=` keyword (`tide_hf.integrations.disable_generate_keyword` takes it back). Every error class is in
`tide_hf.errors`; the rest of the API is in the rooms (`tide_hf.calibration`, `tide_hf.modeling`, `tide_hf.runtime`,
`tide_hf.integrations`).
"""

from __future__ import annotations

import importlib
import sys
from importlib.metadata import PackageNotFoundError, version
from typing import Any

try:
    __version__ = version("tide_hf")
except PackageNotFoundError:  # a source tree that was never installed
    __version__ = "0+unknown"

_API = {  # public name -> the room that holds it
    "attach": "integrations", "detach": "runtime", "get_handle": "runtime", "last_stats": "runtime",
    "ExitStats": "runtime", "TideConfig": "runtime",
    "calibrate": "calibration", "CalibrationConfig": "settings", "TideRouterConfig": "config",
    "TideRouter": "modeling",
    "TideError": "errors", "enable_generate_keyword": "integrations", "fast_linears": "runtime",
}


def __getattr__(name: str) -> Any:
    if name in _API:
        value = getattr(importlib.import_module(f".{_API[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_API})


__all__ = sorted([*_API, "__version__"])

if "transformers" in sys.modules:  # AutoConfig / AutoModel then know a router folder's model type, as importing
    importlib.import_module(".modeling.router", __name__)  # `TideRouter` registers it (torch comes with it)
