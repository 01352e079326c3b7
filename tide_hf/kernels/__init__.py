"""Fused kernels for router scoring and row gather / scatter, compiled at first use, with a PyTorch fallback.

`ops` dispatches, `build` compiles the sources of the repository's `cuda/` folder, `reference` is the
PyTorch path and reads a model's final norm into a `NormSpec`.
"""

from __future__ import annotations

from .build import active_backend, build_in_background, kernel_build_error
from .ops import bind_router_scores, gather_rows, norm_router_scores, scatter_rows_
from .reference import NORM_KINDS, NormSpec, apply_norm, norm_router_scores_reference, norm_spec

__all__ = [
    "NORM_KINDS",
    "NormSpec",
    "active_backend",
    "apply_norm",
    "bind_router_scores",
    "build_in_background",
    "gather_rows",
    "kernel_build_error",
    "norm_router_scores",
    "norm_router_scores_reference",
    "norm_spec",
    "scatter_rows_",
]
