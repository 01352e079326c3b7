"""Calibration under `accelerate launch` (any number of processes, one machine or several).

Every process builds the same global sample list, runs the model over its own contiguous block of
batches (the single-process batches, so every sample is padded exactly as it would be there), and the
kept tokens are gathered in process order: every process then holds exactly the single-process data
(token subsampling and the validation split are drawn from the global list). The main process trains
the routers; their parameters and metrics are broadcast so every process returns the same router.
Only tensor collectives are used (metrics travel as UTF-8 JSON bytes), never pickling.

In a single process (no launcher) every function here is a no-op and calibration is unchanged.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable
from contextlib import nullcontext
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from ..errors import TideDistributedError
from ..modeling import TideRouter
from ..modeling.targets import HeldOut

if TYPE_CHECKING:
    from accelerate import PartialState


def _state() -> PartialState | None:
    """accelerate's process state when several processes run (it sets up the process group), else None."""
    launched = int(os.environ.get("WORLD_SIZE", "1")) > 1
    if not launched and not (dist.is_available() and dist.is_initialized()):
        return None
    from accelerate import PartialState
    from accelerate.utils import parse_flag_from_env

    # Without a GPU, accelerate only sets up the gloo backend when told to use the CPU.
    state = PartialState(cpu=parse_flag_from_env("ACCELERATE_USE_CPU") or not torch.cuda.is_available())
    return state if state.num_processes > 1 else None


def is_main_process() -> bool:
    """True in the main process of a launch, and in a single process."""
    state = _state()
    return state is None or state.is_main_process


def main_process_first() -> Any:
    """Context in which the main process runs first (e.g. building a dataset cache), the others after it."""
    state = _state()
    return nullcontext() if state is None else state.main_process_first()


def process_device() -> torch.device:
    """Where this process computes: its accelerator under a launcher (`PartialState().device`), else the CPU."""
    state = _state()
    return torch.device("cpu") if state is None else state.device


def to_process_device(model: nn.Module) -> nn.Module:
    """Under a launcher: `model` on this process's accelerator; else unchanged."""
    device = process_device()
    return model if device.type == "cpu" else model.to(device)


def finish() -> None:
    """Under a launcher: wait until every process got here (e.g. the main one saved), leave the process group."""
    state = _state()
    if state is not None:
        state.wait_for_everyone()
        state.destroy_process_group()


def _comm_device(state: PartialState) -> torch.device:
    """Where collective tensors must be: the CPU for gloo, the process's device for NCCL and the like."""
    return torch.device("cpu") if dist.get_backend() == "gloo" else state.device


# -- collection ---------------------------------------------------------------------------------------------
def local_starts(num_samples: int, batch_size: int) -> range:
    """This process's batches (their first sample index): a contiguous block, in process order."""
    starts = range(0, num_samples, batch_size)
    state = _state()
    if state is None:
        return starts
    per, extra = divmod(len(starts), state.num_processes)
    index = state.process_index
    first = index * per + min(index, extra)
    return starts[first : first + per + (index < extra)]


def local_batches(keep: list[torch.Tensor], batch_size: int) -> tuple[range, slice]:
    """This process's batches (their first sample index) and its rows among the kept tokens of all samples.

    `keep[i]` marks the kept tokens of sample i. Batches are split in contiguous blocks, in process order,
    so concatenating every process's rows gives the single-process row order.
    """
    mine = local_starts(len(keep), batch_size)
    if _state() is None:
        return mine, slice(None)
    counts = [int(k.sum()) for k in keep]
    return mine, slice(sum(counts[: mine.start]), sum(counts[: mine.stop]))


def _gather_rows(tensor: torch.Tensor, counts: list[int], device: torch.device) -> torch.Tensor:
    """Every process's `tensor` (rows along dim 0, `counts[i]` of them in process i), concatenated in order."""
    wire = torch.uint8 if tensor.dtype == torch.bool else tensor.dtype  # NCCL has no bool
    padded = torch.zeros((max(1, *counts), *tensor.shape[1:]), dtype=wire, device=device)
    padded[: len(tensor)] = tensor.to(device, wire)
    parts = [torch.empty_like(padded) for _ in counts]
    dist.all_gather(parts, padded)
    return torch.cat([part[:n] for part, n in zip(parts, counts)]).to(tensor.device, tensor.dtype)


def gather_collected(data: Any) -> Any:
    """All processes' collected tokens (a `labels.Collected`), in process order; wall times (`seconds`)
    are the slowest process's. In a single process: `data` itself."""
    state = _state()
    if state is None:
        return data
    device = _comm_device(state)
    count = torch.tensor([data.is_val.numel()], dtype=torch.int64, device=device)
    counts = [torch.empty_like(count) for _ in range(state.num_processes)]
    dist.all_gather(counts, count)
    counts = [int(c) for c in counts]
    fields: dict[str, Any] = {}
    for field in dataclasses.fields(data):
        value = getattr(data, field.name)
        if isinstance(value, torch.Tensor):
            fields[field.name] = _gather_rows(value, counts, device)
        elif all(isinstance(v, torch.Tensor) for v in value.values()):
            fields[field.name] = {k: _gather_rows(v, counts, device) for k, v in value.items()}
        else:  # wall times: the processes ran in parallel
            fields[field.name] = {k: _max(float(v), device) for k, v in value.items()}
    return dataclasses.replace(data, **fields)


def _max(value: float, device: torch.device) -> float:
    tensor = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return float(tensor)


# -- training -----------------------------------------------------------------------------------------------
def _broadcast_bytes(payload: bytes, state: PartialState) -> bytes:
    """The main process's `payload` in every process."""
    device = _comm_device(state)
    size = torch.tensor([len(payload)], dtype=torch.int64, device=device)
    dist.broadcast(size, src=0)
    if state.is_main_process:
        buffer = torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(device)
    else:
        buffer = torch.empty(int(size), dtype=torch.uint8, device=device)
    dist.broadcast(buffer, src=0)
    return buffer.cpu().numpy().tobytes()


def train_on_main(train: Callable[..., None], router: TideRouter, data: Any, *, progress: bool) -> None:
    """`train(router, data, progress=progress)` in the main process only; then every process holds the main
    process's router parameters and buffers (the held-out scores among them), `config.metrics`,
    `config.exit_paths`, `config.held_out_tokens` and `config.draft_vocab_coverage`. An error in training is
    raised in every process."""
    state = _state()
    if state is None:
        train(router, data, progress=progress)
        return
    failure: Exception | None = None
    if state.is_main_process:
        try:
            train(router, data, progress=progress)
        except Exception as exc:  # the other processes must not wait for parameters that never come
            failure = exc
    report = {"metrics": router.config.metrics, "exit_paths": router.config.exit_paths,
              "draft_vocab_coverage": router.config.draft_vocab_coverage,
              "held_out_tokens": router.config.held_out_tokens,
              "error": None if failure is None else f"{type(failure).__name__}: {failure}"}
    report = json.loads(_broadcast_bytes(json.dumps(report).encode(), state))
    if failure is not None:
        raise failure
    if report["error"] is not None:
        raise TideDistributedError(f"router training failed in the main process: {report['error']}")
    router.config.metrics = report["metrics"]
    router.config.exit_paths = report["exit_paths"]
    if report["draft_vocab_coverage"] and not state.is_main_process:  # the ranking itself comes with the tensors
        coverage = report["draft_vocab_coverage"]
        router.set_draft_vocab(torch.zeros(router.draft_vocab_length(coverage), dtype=torch.long), coverage)
    if report["held_out_tokens"] is not None and not state.is_main_process:  # sized here, filled by the tensors
        n_order, n_test = report["held_out_tokens"]
        k = len(router.checkpoint_layers)
        router.set_held_out(HeldOut(order_scores=torch.zeros(n_order, k), test_scores=torch.zeros(n_test, k),
                                    test_mismatch=torch.zeros(n_test, k, dtype=torch.bool),
                                    test_nll=torch.zeros(n_test, k)))
    device = _comm_device(state)
    with torch.no_grad():
        for tensor in router.state_dict().values():  # (bool buffers travel as bytes: not every backend sends bool)
            wire = tensor.to(device, torch.uint8 if tensor.dtype == torch.bool else tensor.dtype)
            dist.broadcast(wire, src=0)
            tensor.copy_(wire)

