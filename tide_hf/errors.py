"""The `TideError` family: every error tide_hf raises on purpose.

Each subclass keeps the builtin base it replaced, so code written as `except ValueError` (or
`RuntimeError`) keeps working, while `except TideError` catches everything tide_hf refuses.
"""

from __future__ import annotations


class TideError(Exception):
    """Base of every error tide_hf raises on purpose (the CLI prints it as one line)."""


class TideCompatibilityError(TideError, ValueError):
    """A router was paired with a model it was not calibrated for, or tide_hf cannot read the model (decoder
    layers or final norm not found, a head it does not reproduce, an encoder-decoder)."""


class TideDataError(TideError, RuntimeError):
    """Calibration or evaluation text could not be loaded, or is too short (the message names the source and the
    cause)."""


class TideMissingError(TideError, FileNotFoundError):
    """A folder the user named, or the package or tool that fetches an embedded asset, is missing (the message
    says how to get it)."""


class TideDependencyError(TideError, ImportError):
    """An optional dependency a feature needs is not installed (the message names the extra that brings it)."""


class TideIndexError(TideError, IndexError):
    """A row index is out of range (the message names it)."""


class TideArgumentError(TideError, ValueError):
    """An argument or option is out of range or of the wrong kind (the message names it)."""


class TideArgumentTypeError(TideError, TypeError):
    """An argument has the wrong type, or a keyword is unknown (the message names it)."""


class TideRouterFileError(TideError, ValueError):
    """A router folder is incomplete or inconsistent, or a save would overwrite something that is not a router."""


class TideTargetError(TideError, ValueError):
    """A quality target cannot be met or used with this router (out of range, no calibrated path, or
    certified with checkpoints open that the attach would not serve)."""


class TideUnsupportedError(TideError, NotImplementedError):
    """The model cannot run the asked mode (the message names the layer or feature it lacks and what works)."""


class TideConcurrencyError(TideError, RuntimeError):
    """Two calls would fight over the same model's hooks."""


class TideDistributedError(TideError, RuntimeError):
    """Another process of an `accelerate launch` run failed (the message carries its error)."""


class TideMissingRouterError(TideRouterFileError, TideMissingError):
    """No router folder where a path names one (a `TideRouterFileError` and a `FileNotFoundError` alike)."""


class TideMissingDataError(TideDataError, TideMissingError):
    """No file or folder where a dataset name written as a path points (a `TideDataError` and a
    `FileNotFoundError` alike)."""


class PlottingUnavailable(TideDependencyError):
    """matplotlib is not installed: the message says which extra brings it."""
