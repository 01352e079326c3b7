"""matplotlib, imported only when a plot is drawn (an optional dependency: the `plot` extra)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .errors import PlottingUnavailable, TideArgumentError, TideArgumentTypeError

PLOT_DPI = 110


PLOT_EXTRA = "pip install matplotlib"  # (the `plot` extra from a checkout: pip install '.[plot]')


def pyplot() -> Any:
    """matplotlib's pyplot on the Agg backend (no display needed); a clear error naming the extra without it."""
    try:
        import matplotlib
    except ImportError as err:
        raise PlottingUnavailable(f"drawing plots needs matplotlib, which a plain install leaves out: "
                                  f"{PLOT_EXTRA}") from err

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def png_path(path: str | Path) -> Path:
    """`path` (`~` expanded) checked before anything is drawn: a `.png` file name in an existing folder, so the
    path returned is the file written (matplotlib would add `.png` to a bare name, write another format for
    another suffix, or fail on a missing folder)."""
    if not isinstance(path, (str, Path)):
        raise TideArgumentTypeError(f"a plot path must be a str or Path, got {type(path).__name__}")
    path = Path(path).expanduser()
    if path.suffix.lower() != ".png" or path.name == path.suffix:
        raise TideArgumentError(f"plots are PNG files: give a path ending in .png, got {str(path)!r}")
    if path.is_dir():
        raise TideArgumentError(f"{path} is a folder: give the PNG file's path")
    if not path.parent.is_dir():
        raise TideArgumentError(f"{path.parent} is not an existing folder: create it first")
    return path


def save_png(fig: Any, path: str | Path) -> Path:
    """Write `fig` to `path` (checked by `png_path`) as PNG; the figure is closed whatever happens."""
    try:
        path = png_path(path)
        fig.tight_layout()
        fig.savefig(path, dpi=PLOT_DPI, format="png")
    finally:
        pyplot().close(fig)
    return path
