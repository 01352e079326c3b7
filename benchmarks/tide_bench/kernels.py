"""`tide-hf bench kernels`: the fused kernels against the PyTorch reference, timed on this machine.

On the CPU each op is timed on the host (median of blocks). On a GPU each op is timed on the device: a CUDA
graph of several calls that rotate through distinct input buffers (so no call finds its rows in L2) is
replayed between CUDA events; host time per call (what the Python caller waits to enqueue one) is reported
beside it. The same run measures the device's copy bandwidth and bf16 matmul throughput, and each shape is
placed on that roofline: achieved GB/s and TFLOP/s, their shares, and which bound applies.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from torch import nn

from tide_hf.kernels import NORM_KINDS, NormSpec, active_backend, norm_router_scores, norm_router_scores_reference
from tide_hf.kernels.build import extension

BENCH_WARMUP = 3  # untimed calls, timed blocks, target seconds per block
BENCH_BLOCKS = 7
BENCH_BLOCK_S = 0.02
ROTATE_BYTES = 256 * 2**20  # device timing: input sets rotated so that together they exceed any L2 (H100: 50 MB)
MAX_ROTATIONS = 8  # ... but at most this many sets, and at least 2
GRAPH_CALLS = 16  # calls captured per CUDA graph; each replay's time / GRAPH_CALLS = device time per call
DEVICE_REPEATS = 15  # graph replays timed (median)
HOST_CALLS = 200  # calls enqueued back to back for the host time per call
COPY_BYTES = 512 * 2**20  # device-to-device copy for the bandwidth reference
MATMUL_SIZE = 8192  # bf16 square matmul for the matrix-throughput reference
ROUTER_PATHS = {"auto": 0, "small": 1, "tensor": 2, "gemm": 3}  # cuda/tide_cuda_kernels.cu kPath*
GPU_HIDDEN, GPU_BOTTLENECK, SMOL_HIDDEN = 4096, 128, 576
GPU_ROWS = (1, 8, 64, 256, 4096, 32768)
SMOL_ROWS = (1, 8, 64, 256, 4096)
CPU_SMOL_ROWS, CPU_8B_ROWS = (1, 8, 64), (1, 256)  # the CPU run's rows at SmolLM2's and an 8B model's hidden size
BENCH_NORM_KIND, BENCH_NORM_EPS = "rms", 1e-6  # the final norm the benchmarked routers read through (Llama's)


def _time_us(fn: Callable[[], Any], device: torch.device) -> float:
    """Median microseconds per call over BENCH_BLOCKS blocks sized to about BENCH_BLOCK_S each (host clock)."""
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


def _event_us(run: Callable[[], Any]) -> float:
    """Median device microseconds of `run()` between two CUDA events (DEVICE_REPEATS runs)."""
    times = []
    for _ in range(DEVICE_REPEATS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def device_time_us(calls: list[Callable[[], Any]]) -> tuple[float, str]:
    """Device microseconds per call, cycling through `calls` (one per input set): CUDA-graph replay of
    GRAPH_CALLS calls, or, when capture fails, eager calls between events (then launch gaps count too)."""
    sequence = [calls[i % len(calls)] for i in range(GRAPH_CALLS)]
    for fn in calls:  # warm up: builds, cuBLAS handles, allocator blocks
        fn()
    torch.cuda.synchronize()
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for fn in sequence[:2]:
                fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for fn in sequence:
                fn()
        graph.replay()
        torch.cuda.synchronize()
        return _event_us(graph.replay) / GRAPH_CALLS, "cuda-graph"
    except Exception:  # an op that cannot be captured: time it eagerly, and say so
        torch.cuda.synchronize()

        def eager() -> None:
            for fn in sequence:
                fn()

        return _event_us(eager) / GRAPH_CALLS, "eager"


def host_time_us(calls: list[Callable[[], Any]]) -> float:
    """Host microseconds per call: enqueueing HOST_CALLS calls back to back (median of BENCH_BLOCKS)."""
    blocks = []
    for _ in range(BENCH_BLOCKS):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for i in range(HOST_CALLS):
            calls[i % len(calls)]()
        blocks.append((time.perf_counter() - start) / HOST_CALLS * 1e6)
        torch.cuda.synchronize()
    return statistics.median(blocks)


def device_roofline(device: torch.device) -> dict[str, Any]:
    """The device's measured copy bandwidth (GB/s, bytes read + written) and bf16 matmul TFLOP/s."""
    src = torch.empty(COPY_BYTES // 2, dtype=torch.bfloat16, device=device).normal_()
    dst = torch.empty_like(src)
    copy_us = _event_us(partial(dst.copy_, src))
    a = torch.randn(MATMUL_SIZE, MATMUL_SIZE, device=device, dtype=torch.bfloat16)
    b = torch.randn_like(a)
    torch.matmul(a, b)  # warm-up: cuBLAS handle and heuristics
    matmul_us = _event_us(partial(torch.matmul, a, b))
    return {"device_name": torch.cuda.get_device_name(device), "copy_gbps": 2 * COPY_BYTES / copy_us / 1e3,
            "matmul_tflops": 2 * MATMUL_SIZE**3 / matmul_us / 1e6}


def _router(n: int, h: int, b: int, dtype: torch.dtype, device: torch.device) -> tuple:
    """One input set: hidden rows in `dtype`, norm params in `dtype`, fp32 router (nn.Linear init)."""
    fc1, fc2 = nn.Linear(h, b).to(device), nn.Linear(b, 1).to(device)
    norm = NormSpec(BENCH_NORM_KIND, torch.randn(h, device=device).to(dtype), torch.randn(h, device=device).to(dtype),
                    BENCH_NORM_EPS)
    hidden = torch.randn(n, h, device=device).to(dtype)
    return hidden, norm, fc1.weight.detach(), fc1.bias.detach(), fc2.weight.detach(), fc2.bias.detach()


def moved_bytes(n: int, h: int, b: int, dtype: torch.dtype) -> int:
    """Bytes the op must touch once: hidden rows, fp32 router weights and scores, norm weight and bias."""
    size = torch.empty(0, dtype=dtype).element_size()
    return n * h * size + 4 * (b * h + 2 * b + 1 + n) + 2 * h * size


def path_fn(path: str) -> Callable[..., torch.Tensor]:
    """norm_router_scores forced onto one CUDA route (ROUTER_PATHS); raises when the route refuses the input."""
    ext = extension("cuda")
    if ext is None:
        raise RuntimeError("the CUDA kernels are not built here")
    code = ROUTER_PATHS[path]

    def run(hidden: torch.Tensor, spec: NormSpec, w1: torch.Tensor, b1: torch.Tensor, w2: torch.Tensor,
            b2: torch.Tensor) -> torch.Tensor:
        scores = ext.norm_router_scores_path(hidden, NORM_KINDS[spec.kind], spec.weight, spec.bias, spec.eps, w1,
                                             b1, w2, b2, code)
        if scores.numel() != hidden.shape[0]:  # the extension answers a refusal with no scores (never throws)
            raise RuntimeError(f"the {path} route cannot take this input (small: <= 64 rows; tensor: bf16 / fp16 "
                               "rows, <= 128 units, a norm exact in the input dtype, compute capability >= 8.0)")
        return scores

    return run


def _roofline_fields(us: float, n: int, h: int, b: int, dtype: torch.dtype, roof: dict) -> dict[str, Any]:
    moved, flops = moved_bytes(n, h, b, dtype), 2 * n * h * b
    mem_us, math_us = moved / roof["copy_gbps"] / 1e3, flops / roof["matmul_tflops"] / 1e6
    return {"gbps": moved / us / 1e3, "tflops": flops / us / 1e6, "copy_share": moved / us / 1e3 / roof["copy_gbps"],
            "matmul_share": flops / us / 1e6 / roof["matmul_tflops"],
            "bound": "memory" if mem_us >= math_us else "compute", "roofline_share": max(mem_us, math_us) / us}


def device_bench(n: int, h: int, b: int, dtype: torch.dtype, device: torch.device, roof: dict,
                 fn: Callable[..., torch.Tensor]) -> dict[str, Any]:
    """Device and host µs per call of fn (a norm_router_scores variant) at one shape, with its roofline."""
    sets = max(2, min(MAX_ROTATIONS, ROTATE_BYTES // max(moved_bytes(n, h, b, dtype), 1)))
    inputs = [_router(n, h, b, dtype, device) for _ in range(sets)]
    calls = [partial(fn, *args) for args in inputs]
    with torch.inference_mode():
        err = (fn(*inputs[0]) - norm_router_scores_reference(*inputs[0])).abs().max().item()
        device_us, timing = device_time_us(calls)
        host_us = host_time_us(calls)
    return {"device_us": device_us, "host_us": host_us, "timing": timing, "max_abs_diff": err,
            **_roofline_fields(device_us, n, h, b, dtype, roof)}


def microbench(
    shapes: list[tuple[int, int, int]],
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> list[dict[str, Any]]:
    """Time norm_router_scores (kernel) against the PyTorch reference for each (rows, hidden, bottleneck).

    CPU: host time per call. CUDA: device time (graph replay, rotating inputs) as kernel_us / torch_us, plus
    host time, achieved GB/s and TFLOP/s and their shares of the roofline measured in the same run.
    """
    device = torch.device(device)
    backend = active_backend(device)
    roof = device_roofline(device) if device.type == "cuda" else None
    rows = []
    for n, h, b in shapes:
        row = {"rows": n, "hidden": h, "bottleneck": b, "dtype": str(dtype).removeprefix("torch."),
               "device": str(device), "backend": backend}
        if roof is not None:
            kernel = device_bench(n, h, b, dtype, device, roof, norm_router_scores)
            torch_path = device_bench(n, h, b, dtype, device, roof, norm_router_scores_reference)
            row.update(roof)
            row.update({"kernel_us": kernel["device_us"], "torch_us": torch_path["device_us"],
                        "kernel_host_us": kernel["host_us"], "torch_host_us": torch_path["host_us"],
                        "timing": kernel["timing"], "speedup": torch_path["device_us"] / kernel["device_us"],
                        "kernel_gbps": kernel["gbps"], "torch_gbps": torch_path["gbps"],
                        "kernel_tflops": kernel["tflops"], "copy_share": kernel["copy_share"],
                        "matmul_share": kernel["matmul_share"], "bound": kernel["bound"],
                        "roofline_share": kernel["roofline_share"], "max_abs_diff": kernel["max_abs_diff"]})
            rows.append(row)
            continue
        args = _router(n, h, b, dtype, device)
        with torch.inference_mode():
            kernel_us = _time_us(partial(norm_router_scores, *args), device)
            torch_us = _time_us(partial(norm_router_scores_reference, *args), device)
            err = (norm_router_scores(*args) - norm_router_scores_reference(*args)).abs().max().item()
        moved = moved_bytes(n, h, b, dtype)
        row.update({"kernel_us": kernel_us, "torch_us": torch_us, "speedup": torch_us / kernel_us,
                    "kernel_gbps": moved / kernel_us / 1e3, "torch_gbps": moved / torch_us / 1e3,
                    "max_abs_diff": err})
        rows.append(row)
    return rows


def kernel_rows(dtype: str) -> list[dict]:
    """Microbenchmark of the fused kernels at SmolLM2's and an 8B model's hidden size, on this machine.

    On a GPU: rows GPU_ROWS at hidden 4096 and SMOL_ROWS at SmolLM2's 576, bottleneck 128.
    """
    if torch.cuda.is_available():
        shapes = [(n, GPU_HIDDEN, GPU_BOTTLENECK) for n in GPU_ROWS]
        shapes += [(n, SMOL_HIDDEN, GPU_BOTTLENECK) for n in SMOL_ROWS]
        return microbench(shapes, getattr(torch, dtype), "cuda")
    shapes = [(n, SMOL_HIDDEN, GPU_BOTTLENECK) for n in CPU_SMOL_ROWS]
    shapes += [(n, GPU_HIDDEN, GPU_BOTTLENECK) for n in CPU_8B_ROWS]
    return microbench(shapes, getattr(torch, dtype), "cpu")
