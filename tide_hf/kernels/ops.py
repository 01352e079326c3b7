"""Fused TIDE kernels (final norm + router scoring, exit-row gather/scatter) with a PyTorch fallback.

Each op takes the compiled extension for the tensors' device when it is built (see `build.py`), else
runs the PyTorch reference (`reference.py`); both compute the same values (`tests/test_kernels.py`).
"""

from __future__ import annotations

from types import ModuleType

import torch

from .build import extension, flavour_of
from .reference import NORM_KINDS, NormSpec, norm_router_scores_reference

KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _ready(device: torch.device, *tensors: torch.Tensor | None) -> ModuleType | None:
    """The extension for `device`, unless autograd must see the op (then PyTorch). The C++ checks devices."""
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors):
        return None
    return extension(flavour_of(device))


def norm_router_scores(
    hidden: torch.Tensor, spec: NormSpec, w1: torch.Tensor, b1: torch.Tensor, w2: torch.Tensor, b2: torch.Tensor
) -> torch.Tensor:
    """Router scores (...,) fp32 for hidden (..., H): fused kernel when available, else the reference."""
    ext = _ready(hidden.device, hidden, w1, b1, w2, b2, spec.weight, spec.bias)
    if (
        ext is None
        or hidden.dtype not in KERNEL_DTYPES
        or spec.kind not in NORM_KINDS
        or not w1.dtype == b1.dtype == w2.dtype == b2.dtype == torch.float32
    ):
        return norm_router_scores_reference(hidden, spec, w1, b1, w2, b2)
    flat = hidden if hidden.dim() == 2 else hidden.reshape(-1, hidden.shape[-1])
    scores = ext.norm_router_scores(flat, NORM_KINDS[spec.kind], spec.weight, spec.bias, spec.eps, w1, b1, w2, b2)
    return scores if hidden.dim() == 2 else scores.reshape(hidden.shape[:-1])


def check_rows(index: torch.Tensor, rows: int) -> None:
    """Raise `IndexError` for a CPU row index outside [0, rows), before any compiled code reads it.

    The C++ extension checks too, but an exception thrown across the extension boundary has crashed the
    interpreter with some torch builds (torch 2.11): the check in Python always raises cleanly.
    """
    if index.device.type == "cpu" and index.numel() and (int(index.min()) < 0 or int(index.max()) >= rows):
        bad = index[(index < 0) | (index >= rows)][0].item()
        raise IndexError(f"index {bad} is out of range for {rows} rows")


def gather_rows(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """x[index] along dim 0 (skip mode: pick the rows still running)."""
    ext = _ready(x.device, x)
    if ext is None or index.dtype != torch.int64:
        return x.index_select(0, index)
    check_rows(index, x.shape[0] if x.dim() else 0)
    return ext.gather_rows(x, index)


def scatter_rows_(dst: torch.Tensor, index: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """dst[index] = src in place, returns dst (skip mode: write the computed rows back)."""
    ext = _ready(dst.device, dst, src)
    if ext is None or not dst.is_contiguous() or src.dtype != dst.dtype or index.dtype != torch.int64:
        return dst.index_copy_(0, index, src)
    check_rows(index, dst.shape[0] if dst.dim() else 0)
    return ext.scatter_rows_(dst, index, src)

