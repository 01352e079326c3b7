"""Fused TIDE kernels (final norm + router scoring, skip-mode row gather/scatter) with a PyTorch fallback.

The sources live in the repository's `cuda/` folder and are compiled on first use with
`torch.utils.cpp_extension.load` into torch's extension cache (a second process reuses the build). CPU
tensors use the C++ extension, CUDA tensors the CUDA one. Without a compiler or device, after a failed build,
or with `TIDE_HF_NO_KERNELS=1`, everything runs through the PyTorch reference instead.
"""

from __future__ import annotations

import logging
import os
import shutil
import statistics
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

logger = logging.getLogger(__name__)


def _find_kernel_dir() -> Path:
    """Kernel sources: shipped in a wheel as tide_hf/_kernel_src, in a checkout (editable install) as cuda/."""
    package = Path(__file__).resolve().parent
    shipped = package / "_kernel_src"
    return shipped if shipped.is_dir() else package.parent / "cuda"


ENV_NO_KERNELS = "TIDE_HF_NO_KERNELS"  # "1" forces the PyTorch path
KERNEL_DIR = _find_kernel_dir()
EXTENSIONS = {  # flavour -> (torch extension name, sources in KERNEL_DIR)
    "cpu": ("tide_hf_cpu", ("tide_cpu.cpp",)),
    "cuda": ("tide_hf_cuda", ("tide_cuda.cpp", "tide_cuda_kernels.cu")),
}
OPT_FLAGS = ["/O2"] if os.name == "nt" else ["-O3"]
NORM_KINDS = {"none": 0, "rms": 1, "rms_gemma": 2, "layernorm": 3, "rms_fp32": 4}  # ids shared with cuda/*.cpp|cu
KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
PROBE_ROWS = 4  # rows of the random input norm_spec() uses to confirm a module's formula
PROBE_SEED = 0
PROBE_ULPS = 4  # probe tolerance, in units of the dtype's epsilon times the output scale
BENCH_WARMUP = 3  # microbench: untimed calls, timed blocks, target seconds per block
BENCH_BLOCKS = 7
BENCH_BLOCK_S = 0.02

_build_lock = threading.Lock()
_extensions: dict[str, ModuleType | None] = {}
_build_errors: dict[str, str] = {}


@dataclass
class NormSpec:
    """The model's final norm as data: kind in NORM_KINDS, its weight / bias (model dtype) and eps."""

    kind: str
    weight: torch.Tensor | None = None
    bias: torch.Tensor | None = None
    eps: float = 0.0


def _rms_candidates(module: nn.Module) -> list[NormSpec]:
    """RMSNorm-like modules (HF *RMSNorm, torch.nn.RMSNorm): both formulas, the class name's guess first."""
    name = type(module).__name__
    weight = getattr(module, "weight", None)
    eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))
    if not name.endswith("RMSNorm") or not isinstance(weight, torch.Tensor) or weight.dim() != 1:
        return []
    if eps is None:  # torch.nn.RMSNorm(eps=None) uses the dtype's machine epsilon
        eps = torch.finfo(weight.dtype).eps
    kinds = ["rms_gemma", "rms", "rms_fp32"] if name.startswith("Gemma") else ["rms", "rms_fp32", "rms_gemma"]
    return [NormSpec(kind, weight, None, float(eps)) for kind in kinds]  # ties (fp32: rms == rms_fp32) go first


@torch.no_grad()
def norm_spec(module: nn.Module) -> NormSpec | None:
    """Describe `module` (a model's final norm) as a NormSpec, or None when it is not one we reproduce.

    The class name only proposes a formula; the one matching the module on a random probe wins (Qwen3-Next
    uses Gemma's (1 + w) without the name, OLMo-2 / GPT-OSS / Gemma-3n scale in fp32), and an unknown variant
    yields None rather than silently wrong scores.
    """
    if isinstance(module, nn.Identity):
        return NormSpec("none")
    if isinstance(module, nn.LayerNorm):
        if len(module.normalized_shape) != 1:
            return None
        return NormSpec("layernorm", module.weight, module.bias, float(module.eps))
    candidates = _rms_candidates(module)
    if not candidates:
        return None
    weight = candidates[0].weight
    try:
        gen = torch.Generator(device=weight.device).manual_seed(PROBE_SEED)
        probe = torch.randn(PROBE_ROWS, weight.numel(), generator=gen, device=weight.device).to(weight.dtype)
        expected = module(probe).float()
        errors = [(_apply_norm(probe, spec).float() - expected).abs().max().item() for spec in candidates]
    except Exception as err:  # meta / offloaded weights, exotic forward signatures
        logger.debug("norm_spec: probing %s failed: %s", type(module).__name__, err)
        return None
    best = min(range(len(candidates)), key=errors.__getitem__)
    scale = expected.abs().max().item()
    return candidates[best] if errors[best] <= PROBE_ULPS * torch.finfo(weight.dtype).eps * max(scale, 1.0) else None


def _apply_norm(hidden: torch.Tensor, spec: NormSpec) -> torch.Tensor:
    """The norm exactly as HF / torch compute it, dtype handling included (see modeling_llama / _gemma)."""
    if spec.kind == "none":
        return hidden
    if spec.kind == "layernorm":
        return F.layer_norm(hidden, hidden.shape[-1:], spec.weight, spec.bias, spec.eps)
    x = hidden.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + spec.eps)
    if spec.kind == "rms_gemma":  # GemmaRMSNorm: scale by (1 + w) in fp32, then cast
        return (x * (1.0 + spec.weight.float())).type_as(hidden)
    if spec.kind == "rms_fp32":  # Olmo2RMSNorm / GptOssRMSNorm: scale by w in fp32, then cast
        return (x * spec.weight.float()).type_as(hidden)
    if spec.kind != "rms":
        raise ValueError(f"unknown norm kind {spec.kind!r}; expected one of {sorted(NORM_KINDS)}")
    x = x.to(hidden.dtype)  # LlamaRMSNorm: cast back to the input dtype, then multiply by the weight
    return x if spec.weight is None else spec.weight * x


def norm_router_scores_reference(
    hidden: torch.Tensor, spec: NormSpec, w1: torch.Tensor, b1: torch.Tensor, w2: torch.Tensor, b2: torch.Tensor
) -> torch.Tensor:
    """PyTorch reference: sigmoid(fc2(relu(fc1(norm(hidden))))) as TideRouter computes it, fp32 (...,)."""
    features = _apply_norm(hidden, spec).to(w1.dtype)
    logit = F.linear(F.relu(F.linear(features, w1, b1)), w2.reshape(1, -1), b2)
    return torch.sigmoid(logit).squeeze(-1).float()


def _flavour(device: torch.device | str) -> str | None:
    kind = torch.device(device).type
    return kind if kind in EXTENSIONS else None


def _toolchain_missing(flavour: str) -> str | None:
    """Why the extension for `flavour` cannot be built here, or None when it can."""
    from torch.utils import cpp_extension

    if not cpp_extension.is_ninja_available():
        return "ninja is not installed (pip install ninja)"
    compiler = os.environ.get("CXX", "cl" if os.name == "nt" else "c++")
    if shutil.which(compiler) is None:
        return f"no C++ compiler ({compiler!r} is not on PATH)"
    if flavour == "cuda":
        if not torch.cuda.is_available():
            return "no CUDA device"
        if cpp_extension.CUDA_HOME is None or not (Path(cpp_extension.CUDA_HOME) / "bin" / "nvcc").exists():
            return "nvcc not found (set CUDA_HOME)"
    if not all((KERNEL_DIR / src).is_file() for src in EXTENSIONS[flavour][1]):
        return f"kernel sources missing from {KERNEL_DIR}"
    return None


def _build(flavour: str) -> ModuleType:
    from torch.utils.cpp_extension import load

    name, sources = EXTENSIONS[flavour]
    with warnings.catch_warnings(record=True) as caught:  # keep the build quiet; details at DEBUG level
        warnings.simplefilter("always")
        module = load(
            name=name,
            sources=[str(KERNEL_DIR / src) for src in sources],
            extra_cflags=OPT_FLAGS,
            extra_cuda_cflags=OPT_FLAGS if flavour == "cuda" else None,
            verbose=False,
        )
    for warning in caught:
        logger.debug("building %s: %s", name, warning.message)
    return module


def _extension(flavour: str | None) -> ModuleType | None:
    """The compiled extension for `flavour`, building it once per process (thread-safe); None -> PyTorch."""
    if flavour is None or os.environ.get(ENV_NO_KERNELS, "0") not in ("", "0"):
        return None
    if flavour in _extensions:
        return _extensions[flavour]
    with _build_lock:
        if flavour not in _extensions:
            reason = _toolchain_missing(flavour)
            module = None
            if reason is None:
                try:
                    module = _build(flavour)
                except Exception as err:  # any build failure means: use PyTorch
                    logger.debug("building the %s kernels failed", flavour, exc_info=True)
                    lines = [line.strip() for line in str(err).splitlines() if line.strip()] or [type(err).__name__]
                    reason = "build failed: " + next((line for line in lines if "error:" in line), lines[0])
            if reason is not None:
                _build_errors[flavour] = reason
                logger.warning("tide_hf: %s kernels unavailable (%s); using PyTorch", flavour, reason)
            _extensions[flavour] = module
    return _extensions[flavour]


def kernels_available(device: torch.device | str) -> bool:
    """Whether compiled kernels serve tensors on `device` (builds them on first call)."""
    return _extension(_flavour(device)) is not None


def active_backend(device: torch.device | str) -> str:
    """Which implementation runs for `device`: "cpp", "cuda" or "pytorch" (see kernel_build_error)."""
    flavour = _flavour(device)
    return ("cpp" if flavour == "cpu" else "cuda") if _extension(flavour) is not None else "pytorch"


def kernel_build_error(device: torch.device | str) -> str | None:
    """Why `device` has no compiled kernels (no compiler, no device, build error), if it was tried."""
    return _build_errors.get(_flavour(device) or "")


def _ready(device: torch.device, *tensors: torch.Tensor | None) -> ModuleType | None:
    """The extension for `device`, unless autograd must see the op (then PyTorch). The C++ checks devices."""
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors):
        return None
    return _extension(device.type if device.type in EXTENSIONS else None)


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


def gather_rows(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """x[index] along dim 0 (skip mode: pick the rows still running)."""
    ext = _ready(x.device, x)
    return x.index_select(0, index) if ext is None or index.dtype != torch.int64 else ext.gather_rows(x, index)


def scatter_rows_(dst: torch.Tensor, index: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """dst[index] = src in place, returns dst (skip mode: write the computed rows back)."""
    ext = _ready(dst.device, dst, src)
    if ext is None or not dst.is_contiguous() or src.dtype != dst.dtype or index.dtype != torch.int64:
        return dst.index_copy_(0, index, src)
    return ext.scatter_rows_(dst, index, src)


def _time_us(fn: Callable[[], Any], device: torch.device) -> float:
    """Median microseconds per call over BENCH_BLOCKS blocks sized to about BENCH_BLOCK_S each."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(BENCH_WARMUP):
        fn()
    sync()
    start = time.perf_counter()
    fn()
    sync()
    iters = max(1, int(BENCH_BLOCK_S / max(time.perf_counter() - start, 1e-7)))
    blocks = []
    for _ in range(BENCH_BLOCKS):
        start = time.perf_counter()
        for _ in range(iters):
            fn()
        sync()
        blocks.append((time.perf_counter() - start) / iters)
    return statistics.median(blocks) * 1e6


def microbench(
    shapes: list[tuple[int, int, int]],
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    kind: str = "rms",
) -> list[dict[str, Any]]:
    """Time norm_router_scores (kernel) against the PyTorch reference for each (rows, hidden, bottleneck)."""
    device = torch.device(device)
    backend = active_backend(device)
    rows = []
    for n, h, b in shapes:
        fc1, fc2 = nn.Linear(h, b).to(device), nn.Linear(b, 1).to(device)
        norm = NormSpec(kind, torch.randn(h, device=device).to(dtype), torch.randn(h, device=device).to(dtype), 1e-6)
        hidden = torch.randn(n, h, device=device).to(dtype)
        args = (hidden, norm, fc1.weight.detach(), fc1.bias.detach(), fc2.weight.detach(), fc2.bias.detach())
        with torch.inference_mode():
            kernel_us = _time_us(partial(norm_router_scores, *args), device)
            torch_us = _time_us(partial(norm_router_scores_reference, *args), device)
            err = (norm_router_scores(*args) - norm_router_scores_reference(*args)).abs().max().item()
        # bytes the op must touch: hidden rows, fp32 router weights + scores, norm weight and bias
        moved = hidden.numel() * hidden.element_size() + 4 * (b * h + 2 * b + 1 + n) + 2 * h * hidden.element_size()
        rows.append({
            "rows": n, "hidden": h, "bottleneck": b, "dtype": str(dtype).removeprefix("torch."),
            "device": str(device), "backend": backend, "kernel_us": kernel_us, "torch_us": torch_us,
            "speedup": torch_us / kernel_us, "kernel_gbps": moved / kernel_us / 1e3,
            "torch_gbps": moved / torch_us / 1e3, "max_abs_diff": err,
        })  # fmt: skip
    return rows
