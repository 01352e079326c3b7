"""Per-call state: the exit decisions of one forward (`Step`) and of one generate call (`Session`).

Both live in the calling thread only (the handle keeps them in a `threading.local`), so concurrent calls
on one model never see each other's decisions.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from .skip.compaction import Compaction
from .stats import ExitStats


@dataclass
class Step:
    """Exit decisions of one forward pass: (rows, positions) of the tokens it processed."""

    valid: torch.Tensor  # bool, False on padding
    exit_layer: torch.Tensor  # long, num_layers where the token did not exit
    exit_state: torch.Tensor | None = None  # hidden state at the exit checkpoint
    skip_after: int | None = None  # skip mode: every row exited here, later layers are not run
    skipped: int = 0  # layers the skip wrappers did not run in this forward
    compaction: Compaction | None = None  # skip mode: the positions still running after the latest checkpoint
    stopped: torch.Tensor | int = 0  # (rows, positions): layers a position did not run beyond `skipped`
    cache: Any = None  # the cache this forward writes
    recomputed: int = 0  # kv="recompute": layer x position runs of earlier steps' parked tokens in this forward
    mask2d: torch.Tensor | None = None  # the call's (batch, length) attention mask, when it has one
    segmented: bool = False  # compiled skip mode: the segment graphs make the exit decisions, not the hooks
    diverged_after: int | None = None  # compiled skip mode: not every row exited here; later layers run eager
    counted: bool = True  # a forward of the call's own decoding stream (see `Session.stream`)
    # a continuous-batching step (requests side by side in one row, `batching.py`): its decode positions (1, T)
    packed: torch.Tensor | None = None


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
    # the running masks, per cache (id): a call may feed a second stream (the unconditional forwards of
    # classifier-free guidance run with their own cache and 2-D mask)
    running_masks: dict[int, torch.Tensor] = field(default_factory=dict)
    stream: int | None = None  # the cache (id) of the call's first forward with one: only its forwards are counted
    chunked: bool = False  # generate prefills the prompt in chunks (`prefill_chunk_size`): the prompt mask's
    prompt_fed: int = 0  # first columns go to the first forwards, `prompt_fed` of them so far
    full_depth: bool = False  # count every token at full depth, decide no exits (speculative mode's stock fallbacks)

    def commit(self, last_tokens: torch.Tensor | None, num_layers: int) -> None:
        """Move the pending forwards into the stats.

        The first forwards of a generate call are prefill (every non-padding prompt position); later
        ones are decode steps, of which only the newest position of rows still generating counts.
        `last_tokens` is the token each row fed into the step (None outside generate, and after a compiled
        step, before generate's processors see its tokens).
        """
        if self.eos is not None and self.finished is None and self.pending:  # rows finished, for `new_step`:
            first = self.pending[0].exit_layer  # a tensor from the prefill on, so compiled steps trace one graph
            self.finished = torch.zeros(first.shape[0], dtype=torch.bool, device=first.device)
        if last_tokens is not None and self.finished is not None:
            ended = torch.isin(last_tokens, self.eos.to(last_tokens.device)) & self.started_decode
            self.finished = self.finished | ended.to(self.finished.device)
        for step in filter(lambda step: step.counted, self.pending):  # (the call's own stream only)
            executed = num_layers - step.skipped - step.stopped
            if not self.generating or not self.started_decode:
                self.stats.prefill.add(step.exit_layer, executed, step.valid, step.recomputed)
                continue
            last = executed[:, -1] if isinstance(executed, torch.Tensor) else executed
            self.stats.decode.add(step.exit_layer[:, -1], last, step.valid[:, -1], step.recomputed)
        self.pending.clear()


def new_step(session: Session, tokens: torch.Tensor, mask: Any, num_layers: int, *, running: bool,
             cache: Any = None, packed: torch.Tensor | None = None) -> Step:
    """The `Step` of a forward over `tokens` (batch, width, ...) into `cache`, no exits yet: padding and the call's
    2-D mask from the forward's own 2-D mask, else from the session's prompt mask (the prefill: the whole prompt,
    its next chunk, or the last `width` columns of a call continuing a cache; rows repeated when generate
    expanded them, e.g. num_return_sequences) and, with `running`, `cache`'s running mask after it. In decode
    steps, rows that fed one of the EOS ids or finished earlier count as padding: generate discards their
    outputs, so they neither hold skip mode's layers for the others nor count in the statistics. `packed`: the
    decode positions of a continuous-batching step."""
    batch, width = tokens.shape[:2]
    if torch.compiler.is_compiling():  # transformers' compiled decoding steps, the call's own stream (an id
        stream, counted = None, True  # read in a graph would be guarded on: one graph per call)
    else:  # the first forward with a cache names the stream (a model may get none before its first forward)
        stream = id(cache)
        counted = (cache is None and session.stream is None) or stream == session.stream
        if cache is not None and session.stream is None:
            session.stream, counted = stream, True
    if isinstance(mask, torch.Tensor) and mask.dim() == 2:
        session.prompt_mask = None
        session.running_masks.pop(stream, None)
    else:
        mask, prompt, session.prompt_mask = None, session.prompt_mask, None
        previous = session.running_masks.pop(stream, None)
        if prompt is not None and prompt.shape[1] >= width and batch % prompt.shape[0] == 0:
            mask = prompt.to(tokens.device).repeat_interleave(batch // prompt.shape[0], dim=0)
            if session.chunked:  # this chunk's columns; the rest waits for the next chunks
                session.prompt_fed += width
                mask = mask[:, : session.prompt_fed]
                session.prompt_mask = prompt if session.prompt_fed < prompt.shape[1] else None
        elif running and previous is not None and previous.shape[0] == batch:
            mask = torch.cat([previous, previous.new_ones(batch, width)], dim=1)
        if running and mask is not None:
            session.running_masks[stream] = mask
    valid = mask[:, -width:].bool() if mask is not None else torch.ones(batch, width, dtype=torch.bool,
                                                                         device=tokens.device)
    if session.generating and session.started_decode and session.eos is not None and tokens.dim() == 2 \
            and not tokens.is_floating_point():
        ended = torch.isin(tokens[:, -1], session.eos.to(tokens.device))
        if session.finished is not None and session.finished.shape[0] == batch:
            ended = ended | session.finished.to(tokens.device)
        valid = torch.cat([valid[:, :-1], valid[:, -1:] & ~ended[:, None]], dim=1)
    exit_layer = torch.full((batch, width), num_layers, dtype=torch.long, device=tokens.device)
    return Step(valid, exit_layer, mask2d=mask, counted=counted, cache=cache, packed=packed)
