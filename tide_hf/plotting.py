"""matplotlib, imported only when a plot is drawn (an optional dependency: the `plot` extra)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .errors import TideDependencyError

PLOT_DPI = 110


PLOT_EXTRA = "pip install 'tide_hf[plot]'"


class PlottingUnavailable(TideDependencyError):
    """matplotlib is not installed: the message says which extra brings it."""


def pyplot() -> Any:
    """matplotlib's pyplot on the Agg backend (no display needed); a clear error naming the extra without it."""
    try:
        import matplotlib
    except ImportError as err:
        raise PlottingUnavailable(f"drawing plots needs matplotlib, which a plain install leaves out: "
                                  f"{PLOT_EXTRA} (or pip install matplotlib)") from err

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_png(fig: Any, path: str | Path) -> Path:
    """Write `fig` to `path` as PNG and close it."""
    path = Path(path)
    fig.tight_layout()
    fig.savefig(path, dpi=PLOT_DPI)
    pyplot().close(fig)
    return path
