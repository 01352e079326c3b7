"""Per-call state: the exit decisions of one forward (`Step`) and of one generate call (`Session`).

Both live in the calling thread only (the handle keeps them in a `threading.local`), so concurrent calls
on one model never see each other's decisions.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from .stats import ExitStats


@dataclass
class Step:
    """Exit decisions of one forward pass: (rows, positions) of the tokens it processed."""

    valid: torch.Tensor  # bool, False on padding
    exit_layer: torch.Tensor  # long, num_layers where the token did not exit
    exit_state: torch.Tensor | None = None  # hidden state at the exit checkpoint
    skip_after: int | None = None  # skip mode: every row exited here, later layers are not run
    skipped: int = 0  # layers the skip wrappers did not run in this forward
    recomputed: int = 0  # kv="recompute": layer x position runs of earlier steps' parked tokens in this forward
    mask2d: torch.Tensor | None = None  # the call's (batch, length) attention mask, when it has one
    segmented: bool = False  # compiled skip mode: the segment graphs make the exit decisions, not the hooks


@dataclass
class Session:
    """State of one generate call or one plain forward; never shared between calls or threads."""

    stats: ExitStats
    generating: bool
    eos: torch.Tensor | None = None  # the model's own EOS ids, to stop counting finished rows
    pending: list[Step] = field(default_factory=list)
    started_decode: bool = False
    finished: torch.Tensor | None = None
    # A static cache (and a sliding-window model) gives each forward a 4-D mask (or a dict of them), which does
    # not say which positions are padding: generate's (batch, prompt) mask until the first forward, then (only
    # where kv="recompute" reads it: its forwards run eager, a growing tensor would recompile a step graph) the
    # call's 2-D mask so far (that prompt mask, one column more per position fed since, as generate extends it)
    prompt_mask: torch.Tensor | None = None
    running_mask: torch.Tensor | None = None
    chunked: bool = False  # generate prefills the prompt in chunks (`prefill_chunk_size`): the prompt mask's
    prompt_fed: int = 0  # first columns go to the first forwards, `prompt_fed` of them so far
    full_depth: bool = False  # count every token at full depth, decide no exits (speculative mode's stock fallbacks)


def new_step(session: Session, tokens: torch.Tensor, mask: Any, num_layers: int, *, running: bool) -> Step:
    """The `Step` of a forward over `tokens` (batch, width, ...), no exits yet: padding and the call's 2-D mask
    from the forward's own 2-D mask, else from the session's prompt mask (the prefill: the whole prompt, its
    next chunk, or the last `width` columns of a call continuing a cache; rows repeated when generate expanded
    them, e.g. num_return_sequences) and, with `running`, the running mask after it."""
    batch, width = tokens.shape[:2]
    if isinstance(mask, torch.Tensor) and mask.dim() == 2:
        session.prompt_mask = session.running_mask = None
    else:
        mask, prompt, session.prompt_mask = None, session.prompt_mask, None
        if prompt is not None and prompt.shape[1] >= width and batch % prompt.shape[0] == 0:
            mask = prompt.to(tokens.device).repeat_interleave(batch // prompt.shape[0], dim=0)
            if session.chunked:  # this chunk's columns; the rest waits for the next chunks
                session.prompt_fed += width
                mask = mask[:, : session.prompt_fed]
                session.prompt_mask = prompt if session.prompt_fed < prompt.shape[1] else None
        elif running and session.running_mask is not None and session.running_mask.shape[0] == batch:
            mask = torch.cat([session.running_mask, session.running_mask.new_ones(batch, width)], dim=1)
        session.running_mask = mask if running else None
    valid = mask[:, -width:].bool() if mask is not None else torch.ones(batch, width, dtype=torch.bool,
                                                                         device=tokens.device)
    exit_layer = torch.full((batch, width), num_layers, dtype=torch.long, device=tokens.device)
    return Step(valid, exit_layer, mask2d=mask)
