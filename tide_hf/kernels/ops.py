"""Fused TIDE kernels (final norm + router scoring; row gather / scatter by index) with a PyTorch fallback.

The runtime scores with `norm_router_scores`; it writes exit states with `torch.where`, which needs no row
index and so no host sync. `gather_rows` / `scatter_rows_` stay public for callers that move rows by index.

Each kernel is a real PyTorch custom op (`torch.ops.tide_hf.*`, declared with `torch.library.custom_op`, with
a fake implementation), so `torch.compile` puts it in the graph as one opaque call instead of breaking the
graph at a compiled extension it cannot trace. The op runs the compiled extension for the tensors' device
when it is built (see `build.py`), else the PyTorch reference (`reference.py`); both compute the same values
(`tests/test_kernels.py`; `tests/test_compile.py` runs `torch.library.opcheck` on every op).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..errors import TideIndexError
from .build import extension, flavour_of
from .reference import NORM_KINDS, NormSpec, norm_router_scores_reference

KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
KIND_NAMES = {v: k for k, v in NORM_KINDS.items()}
LIBRARY = "tide_hf"


def scores_impl(hidden: torch.Tensor, kind: int, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float,
                w1: torch.Tensor, b1: torch.Tensor, w2: torch.Tensor, b2: torch.Tensor) -> torch.Tensor:
    """Router scores (N,) fp32 of hidden (N, H): the extension when built for this device, else PyTorch."""
    ext = extension(flavour_of(hidden.device))
    if ext is None or hidden.dtype not in KERNEL_DTYPES:
        spec = NormSpec(KIND_NAMES[kind], weight, bias, eps)
        return norm_router_scores_reference(hidden, spec, w1, b1, w2, b2)
    return ext.norm_router_scores(hidden, kind, weight, bias, eps, w1, b1, w2, b2)


norm_router_scores_op = torch.library.custom_op(f"{LIBRARY}::norm_router_scores", mutates_args=())(scores_impl)


@norm_router_scores_op.register_fake
def _(hidden: torch.Tensor, kind: int, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float,
      w1: torch.Tensor, b1: torch.Tensor, w2: torch.Tensor, b2: torch.Tensor) -> torch.Tensor:
    return hidden.new_empty(hidden.shape[:1], dtype=torch.float32)


@torch.library.custom_op(f"{LIBRARY}::gather_rows", mutates_args=())
def gather_rows_op(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """x[index] along dim 0: the extension when built for this device, else `index_select`."""
    ext = extension(flavour_of(x.device))
    if ext is None:
        return x.index_select(0, index)
    check_rows(index, x.shape[0])
    return ext.gather_rows(x, index)


@gather_rows_op.register_fake
def _(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    return x.new_empty((index.shape[0], *x.shape[1:]))


@torch.library.custom_op(f"{LIBRARY}::scatter_rows_", mutates_args=("dst",))
def scatter_rows_op(dst: torch.Tensor, index: torch.Tensor, src: torch.Tensor) -> None:
    """dst[index] = src in place: the extension when built for this device (dst contiguous, `src` not in `dst`'s
    memory: the extension would copy rows it already overwrote), else `index_copy_` (which refuses overlap)."""
    ext = extension(flavour_of(dst.device))
    if ext is None or not dst.is_contiguous() or src.untyped_storage().data_ptr() == dst.untyped_storage().data_ptr():
        dst.index_copy_(0, index, src)
        return
    check_rows(index, dst.shape[0])
    ext.scatter_rows_(dst, index, src)


@scatter_rows_op.register_fake
def _(dst: torch.Tensor, index: torch.Tensor, src: torch.Tensor) -> None:
    return None


def _autograd(*tensors: torch.Tensor | None) -> bool:
    """Whether autograd must see the computation (the custom ops have no backward: then PyTorch runs)."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def norm_router_scores(
    hidden: torch.Tensor, spec: NormSpec, w1: torch.Tensor, b1: torch.Tensor, w2: torch.Tensor, b2: torch.Tensor
) -> torch.Tensor:
    """Router scores (...,) fp32 for hidden (..., H): the fused custom op when it applies, else the reference."""
    if (
        _autograd(hidden, w1, b1, w2, b2, spec.weight, spec.bias)
        or hidden.dtype not in KERNEL_DTYPES
        or spec.kind not in NORM_KINDS
        or not w1.dtype == b1.dtype == w2.dtype == b2.dtype == torch.float32
    ):
        return norm_router_scores_reference(hidden, spec, w1, b1, w2, b2)
    flat = hidden.reshape(-1, hidden.shape[-1])
    # Eager callers skip the custom-op dispatcher (Python work on every call); compiled graphs need the op.
    op = norm_router_scores_op if torch.compiler.is_compiling() else scores_impl
    scores = op(flat, NORM_KINDS[spec.kind], spec.weight, spec.bias, spec.eps, w1, b1, w2, b2)
    return scores.reshape(hidden.shape[:-1])


def bind_router_scores(spec: NormSpec, w1: torch.Tensor, b1: torch.Tensor, w2: torch.Tensor, b2: torch.Tensor
                       ) -> Callable[[torch.Tensor], torch.Tensor]:
    """`norm_router_scores` with these weights, its checks done once: a decode step scores every open checkpoint,
    and on a small model the Python around the kernel costs as much as the kernel. Eager calls with the kernel's
    dtypes go straight to the extension built for the weights' device (looked up now: `TIDE_HF_NO_KERNELS` is
    read when bound); anything else (autograd, another dtype, a compiled graph) takes `norm_router_scores`."""
    ext = extension(flavour_of(w1.device))
    if (ext is None or spec.kind not in NORM_KINDS
            or not w1.dtype == b1.dtype == w2.dtype == b2.dtype == torch.float32):
        return lambda hidden: norm_router_scores(hidden, spec, w1, b1, w2, b2)
    args = (NORM_KINDS[spec.kind], spec.weight, spec.bias, spec.eps, w1, b1, w2, b2)
    weights = [t for t in (w1, b1, w2, b2, spec.weight, spec.bias) if t is not None]

    def scores(hidden: torch.Tensor) -> torch.Tensor:
        if hidden.dtype not in KERNEL_DTYPES or torch.compiler.is_compiling() or _autograd(hidden, *weights):
            return norm_router_scores(hidden, spec, w1, b1, w2, b2)
        return ext.norm_router_scores(hidden.reshape(-1, hidden.shape[-1]), *args).reshape(hidden.shape[:-1])
    return scores


def check_rows(index: torch.Tensor, rows: int) -> None:
    """Raise `TideIndexError` (an `IndexError`) for a CPU row index outside [0, rows) before compiled code reads it.

    The C++ extension checks too, but an exception thrown across the extension boundary has crashed the
    interpreter with some torch builds (torch 2.11): the check in Python always raises cleanly.
    """
    if index.device.type == "cpu" and index.numel() and (int(index.min()) < 0 or int(index.max()) >= rows):
        bad = index[(index < 0) | (index >= rows)][0].item()
        raise TideIndexError(f"index {bad} is out of range for {rows} rows")


def gather_rows(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """x[index] along dim 0 (pick rows by index), through the `tide_hf::gather_rows` op."""
    if _autograd(x) or index.dtype != torch.int64 or x.dim() == 0:
        return x.index_select(0, index)
    return gather_rows_op(x, index)


def scatter_rows_(dst: torch.Tensor, index: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """dst[index] = src in place, returns dst (write rows back by index), through `tide_hf::scatter_rows_`."""
    if _autograd(dst, src) or src.dtype != dst.dtype or index.dtype != torch.int64 or dst.dim() == 0:
        return dst.index_copy_(0, index, src)
    scatter_rows_op(dst, index, src)
    return dst
