"""`tide-hf bench --kernels`: the fused kernels against the PyTorch reference, timed on this machine."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from torch import nn

from ..kernels import NormSpec, active_backend, norm_router_scores, norm_router_scores_reference

BENCH_WARMUP = 3  # untimed calls, timed blocks, target seconds per block
BENCH_BLOCKS = 7
BENCH_BLOCK_S = 0.02


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


def kernel_rows(dtype: str) -> list[dict]:
    """Microbenchmark of the fused kernels at SmolLM2's and an 8B model's hidden size, on this machine."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    shapes = [(1, 576, 128), (8, 576, 128), (64, 576, 128), (1, 4096, 128), (256, 4096, 128)]
    return microbench(shapes, getattr(torch, dtype), device)


def format_kernels(result: dict) -> str:
    keys = ["rows", "hidden", "bottleneck", "dtype", "backend", "kernel_us", "torch_us", "speedup"]
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    for r in result["rows"]:
        lines.append("| " + " | ".join(f"{r[k]:.1f}" if isinstance(r[k], float) else str(r[k]) for k in keys) + " |")
    return "\n".join(lines)
