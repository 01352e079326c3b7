"""Continuous batching (`model.generate_batch`, `init_continuous_batching`) with a router attached.

transformers' continuous batching does not go through `generate`: a manager thread packs the requests of a step
into one row (prompt chunks and decode tokens side by side) over a paged KV cache, each request's queries
attending to its own keys through a 4-D mask. TIDE's hooks see that row like a prefill: each position is scored
at each checkpoint, exits are per position, so a request's tokens do not depend on the others packed beside it.
Select mode swaps the exit states in as in `generate`. Skip mode runs the layers after a checkpoint only on the
positions still running (`skip/compaction.py`): their K/V and the propagated K/V of the exited ones (`kv="propagate"`)
go through the paged cache's own write, with the step's write indices.

What cannot be served is refused before any work, at `init_continuous_batching` (which `generate_batch` and
`transformers serve` call): speculative mode (continuous batching has no draft-and-verify loop), skip mode with
`kv="recompute"` (its parked tokens wait for their own cache's next forward, and a paged cache's next step packs
other requests), CUDA graphs or a
compiled forward (the hooks decide in Python at every forward), and, in skip mode, attention other than sdpa /
paged eager (flash kernels take the packed layout from cumulative lengths, which a gather would change).
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from ..compat import PAGED_UPDATE_TAKES_KWARGS, undo_attention_switch
from ..errors import TideUnsupportedError
from .patching import Patches
from .session import Session, Step
from .skip.compaction import COMPACT_ATTENTION
from .stats import ExitStats

BATCHING_ENTRY = "init_continuous_batching"  # the method every continuous-batching path starts with


def guard_continuous_batching(model: Any, handle: Any, patches: Patches) -> None:
    """Shadow `model.init_continuous_batching` by one that checks the handle's mode and the manager's settings
    and raises `TideUnsupportedError` where TIDE cannot serve them; `patches` puts the class's method back at
    detach."""
    original = getattr(type(model), BATCHING_ENTRY, None)
    if original is None:  # a transformers without continuous batching
        return

    @functools.wraps(original)
    def init_continuous_batching(*args: Any, **kwargs: Any) -> Any:
        reason = mode_refusal(handle.options)
        if reason is not None:
            raise TideUnsupportedError(f"continuous batching (generate_batch / init_continuous_batching) {reason}")
        manager = original(model, *args, **kwargs)
        reason = manager_refusal(handle.options, manager)
        if reason is not None:
            undo_attention_switch(manager)
            raise TideUnsupportedError(f"continuous batching (generate_batch / init_continuous_batching) {reason}")
        return manager

    patches.set_attr(model, BATCHING_ENTRY, init_continuous_batching)


def mode_refusal(options: Any) -> str | None:
    """Why continuous batching cannot run in this mode (None: it can)."""
    way_out = "; call handle.detach() first (or leave the `with tide_hf.attach(...)` block), or use model.generate()"
    if not PAGED_UPDATE_TAKES_KWARGS:
        return ("needs transformers >= 5.24 with a TIDE router attached: before it, the attention function writes "
                f"the paged cache itself, out of TIDE's reach{way_out}")
    if options.mode == "speculative":
        return (f"with mode='speculative': continuous batching has no draft-and-verify loop, so nothing would be "
                f"drafted; use mode='select' or 'skip'{way_out}")
    if options.mode == "skip" and options.kv == "recompute":
        return (f"with mode='skip', kv='recompute': its skipped tokens wait for their cache's next forward to run "
                f"those layers, and a paged cache's next step packs other requests; use kv='propagate'{way_out}")
    return None


def manager_refusal(options: Any, manager: Any) -> str | None:
    """Why TIDE cannot serve the continuous-batching `manager` as it was set up (None: it can)."""
    config = manager.continuous_batching_config
    if any(config.cuda_graph_booleans) or config.varlen_compile_config is not None \
            or config.decode_compile_config is not None:
        return ("with CUDA graphs or a compiled forward: TIDE's hooks decide exits in Python at every forward, which "
                "a replayed graph would skip; pass continuous_batching_config=ContinuousBatchingConfig("
                "use_cuda_graph=False) without compile configs")
    attention = manager.model.config._attn_implementation
    if options.mode == "skip" and attention not in COMPACT_ATTENTION:
        return (f"with mode='skip' and attention {attention!r}: skip mode gathers the positions still running, "
                f"which only {' / '.join(COMPACT_ATTENTION)} take; load the model with attn_implementation='sdpa' "
                "and pass ContinuousBatchingConfig(auto_switch_to_flash=False), or use mode='select'")
    return None


def decode_positions(kwargs: dict[str, Any], tokens: torch.Tensor) -> torch.Tensor:
    """(1, T) bool: the positions of a packed step over `tokens` (1, T) that are decode tokens (a request's one
    query there, past its first position). A prompt chunk of one token past position 0 counts as decode too: the
    step's tensors do not tell them apart. No cumulative query lengths given: all prefill."""
    bounds, ids, width = kwargs.get("cu_seq_lens_q"), kwargs.get("position_ids"), tokens.shape[1]
    if not isinstance(bounds, torch.Tensor) or not isinstance(ids, torch.Tensor) or ids.shape[-1] != width:
        return torch.zeros(1, width, dtype=torch.bool, device=tokens.device)
    place = torch.arange(width, device=bounds.device)
    request = torch.searchsorted(bounds[1:].long(), place, right=True).clamp(max=len(bounds) - 2)
    alone = (bounds[request + 1] - bounds[request]) == 1
    return (alone & (ids.reshape(-1).to(bounds.device) > 0))[None].to(tokens.device)


def commit_packed(session: Session, step: Step, num_layers: int) -> ExitStats:
    """Count a packed step's positions in `session`'s stats and return them: its decode positions as decode, the
    rest (prompt chunks) as prefill, each with the layers it ran (no host sync)."""
    executed = step.executed(num_layers)  # one number, or one per position (`PhaseStats.add`)
    decode = step.packed.to(step.valid.device)
    session.stats.prefill.add(step.exit_layer, executed, step.valid & ~decode, step.recomputed)
    session.stats.decode.add(step.exit_layer, executed, step.valid & decode)
    return session.stats
