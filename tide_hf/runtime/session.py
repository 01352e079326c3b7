"""Per-call state: the exit decisions of one forward (`Step`) and of one generate call (`Session`).

Both live in the calling thread only (the handle keeps them in a `threading.local`), so concurrent calls
on one model never see each other's decisions. A `Step` has named parts: the core decisions every mode makes
(written by the handle's hooks), skip mode's `SkipState` (the skipper, the K/V policy, the segments) and compiled
skip mode's `CompiledState` (the segments alone). `StepHost` is what skip mode and the compiled step read from
the handle: one object, not loose callables.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from .skip.compaction import Compaction
from .stats import ExitStats


@dataclass
class SkipState:
    """Skip mode's part of a `Step`: the layers it did not run (written by `skip/skipper.py`, `skip/segments.py`,
    and, for `recomputed`, `skip/kv.py`)."""

    all_exited_at: int | None = None  # the checkpoint where every row had exited: later layers are not run
    skipped: int = 0  # layers the skip wrappers did not run in this forward
    compaction: Compaction | None = None  # the positions still running after the latest checkpoint
    stopped: torch.Tensor | int = 0  # (rows, positions): layers a position did not run beyond `skipped`
    recomputed: int = 0  # kv="recompute": layer x position runs of earlier steps' waiting tokens in this forward
    decided: bool = False  # `compaction` / `all_exited_at` follow the exits so far (no exit since the last decision)
    settled: bool = False  # exits only where they stop the step (`TideHandle.whole_steps`): one position stays
    pass_through: bool = False  # a plain step with no token of its cache waiting: every layer runs as it is


@dataclass
class CompiledState:
    """Compiled skip mode's part of a `Step` (written by `skip/segments.py` alone)."""

    segmented: bool = True  # the segment graphs make the exit decisions, not the checkpoint and final hooks
    diverged_at: int | None = None  # the checkpoint where rows diverged: the layers after it run eager


@dataclass
class Step:
    """Exit decisions of one forward pass: (rows, positions) of the tokens it processed."""

    valid: torch.Tensor  # bool, False on padding
    exit_layer: torch.Tensor  # long, num_layers where the token did not exit
    exit_state: torch.Tensor | None = None  # hidden state at the exit checkpoint
    exited: bool = False  # some position may have exited (a checkpoint wrote `exit_layer`)
    plain: bool = False  # decide no exits: a step-aside probe, or a step while stepped aside (`aside.py`)
    started: float | None = None  # perf_counter() at the forward's start, where step aside times it
    cache: Any = None  # the cache this forward writes
    mask2d: torch.Tensor | None = None  # the call's (batch, length) attention mask, when it has one
    counted: bool = True  # a forward of the call's own decoding stream (see `Session.stream`)
    # a continuous-batching step (requests side by side in one row, `batching.py`): its decode positions (1, T)
    packed: torch.Tensor | None = None
    skip: SkipState | None = None  # skip mode only
    compiled: CompiledState | None = None  # compiled skip mode only, once the segments take the step

    @property
    def segmented(self) -> bool:
        """The segment graphs make this step's exit decisions (the checkpoint and final hooks leave it alone)."""
        return self.compiled is not None and self.compiled.segmented

    @property
    def all_exited(self) -> bool:
        """Skip mode: every row has exited, so later checkpoints have nothing to decide."""
        return self.skip is not None and self.skip.all_exited_at is not None

    def executed(self, num_layers: int) -> torch.Tensor | int:
        """Layers each position ran: one number, or one per (row, position) where skip mode stopped some."""
        return num_layers if self.skip is None else num_layers - self.skip.skipped - self.skip.stopped

    @property
    def recomputed(self) -> int:
        """Layer x position runs of earlier steps' waiting tokens in this forward (kv="recompute")."""
        return 0 if self.skip is None else self.skip.recomputed


class StepHost(Protocol):
    """What skip mode and the compiled step read from the handle they serve (`TideHandle` is one)."""

    def current_step(self) -> Step | None:
        """Exit decisions of the forward running in this thread (None outside a forward)."""

    def waiting_tokens(self, cache: Any) -> Any:
        """The tokens of `cache` awaiting their deep layers (a `skip.kv.KVRecompute`; None unless kv="recompute")."""

    def prefilling(self) -> bool:
        """A generate call in this thread before its first decode step."""

    def score(self, layer: int, hidden: torch.Tensor) -> torch.Tensor:
        """Router score of each position of `hidden` at checkpoint `layer`."""

    def exit_mask(self, scores: torch.Tensor, hidden: torch.Tensor, threshold: float) -> torch.Tensor:
        """Positions that may exit."""

    def exit_state(self, layer: int, hidden: torch.Tensor) -> torch.Tensor:
        """What the final norm and head read for a position exiting at `layer`."""


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
            ended = is_eos(last_tokens, self.eos) & self.started_decode
            self.finished = self.finished | ended.to(self.finished.device)
        for step in filter(lambda step: step.counted, self.pending):  # (the call's own stream only)
            executed = step.executed(num_layers)
            if not self.generating or not self.started_decode:
                self.stats.prefill.add(step.exit_layer, executed, step.valid, step.recomputed)
                continue
            last = executed[:, -1] if isinstance(executed, torch.Tensor) else executed
            self.stats.decode.add(step.exit_layer[:, -1], last, step.valid[:, -1], step.recomputed)
        self.pending.clear()


def is_eos(tokens: torch.Tensor, eos: torch.Tensor) -> torch.Tensor:
    """Which of `tokens` (rows,) are one of the `eos` ids: `torch.isin`'s answer, at a fraction of its cost for
    the few ids a model has (one comparison per step, not a sort)."""
    return (tokens[:, None] == eos.to(tokens.device)).any(-1)


def new_step(session: Session, tokens: torch.Tensor, mask: Any, num_layers: int, *, running: bool,
             skipping: bool = False, cache: Any = None, packed: torch.Tensor | None = None) -> Step:
    """The `Step` of a forward over `tokens` (batch, width, ...) into `cache`, no exits yet: padding and the call's
    2-D mask from the forward's own 2-D mask, else from the session's prompt mask (the prefill: the whole prompt,
    its next chunk, or the last `width` columns of a call continuing a cache; rows repeated when generate
    expanded them, e.g. num_return_sequences) and, with `running`, `cache`'s running mask after it. In decode
    steps, rows that fed one of the EOS ids or finished earlier count as padding: generate discards their
    outputs, so they neither hold skip mode's layers for the others nor count in the statistics. `skipping`: skip
    mode is on (the step gets its `SkipState`). `packed`: the decode positions of a continuous-batching step."""
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
        ended = is_eos(tokens[:, -1], session.eos)
        if session.finished is not None and session.finished.shape[0] == batch:
            ended = ended | session.finished.to(tokens.device)
        valid = torch.cat([valid[:, :-1], valid[:, -1:] & ~ended[:, None]], dim=1)
    exit_layer = torch.full((batch, width), num_layers, dtype=torch.long, device=tokens.device)
    return Step(valid, exit_layer, mask2d=mask, counted=counted, cache=cache, packed=packed,
                skip=SkipState() if skipping else None)
