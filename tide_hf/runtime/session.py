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
    # generate's (batch, prompt) attention mask until the first forward: a static cache gives that prefill a 4-D
    # mask, which does not say which positions are padding
    prompt_mask: torch.Tensor | None = None


def new_step(session: Session, tokens: torch.Tensor, mask: Any, num_layers: int) -> Step:
    """The `Step` of a forward over `tokens` (batch, width, ...): padding read from its 2-D mask, or, for a
    prefill given a 4-D one (or a dict of them per layer type: sliding-window models), from the session's
    prompt mask; no exits yet."""
    batch, width = tokens.shape[:2]
    prompt, session.prompt_mask = session.prompt_mask, None
    if not isinstance(mask, torch.Tensor) or mask.dim() != 2:
        mask = None
    if mask is not None:
        valid = mask[:, -width:].bool()
    elif prompt is not None and tuple(prompt.shape) == (batch, width):
        valid = prompt.to(tokens.device).bool()
    else:
        valid = torch.ones(batch, width, dtype=torch.bool, device=tokens.device)
    exit_layer = torch.full((batch, width), num_layers, dtype=torch.long, device=tokens.device)
    return Step(valid, exit_layer, mask2d=mask)
