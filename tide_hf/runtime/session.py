"""Per-call state: the exit decisions of one forward (`Step`) and of one generate call (`Session`).

Both live in the calling thread only (the handle keeps them in a `threading.local`), so concurrent calls
on one model never see each other's decisions.
"""

from __future__ import annotations

from dataclasses import dataclass, field

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
