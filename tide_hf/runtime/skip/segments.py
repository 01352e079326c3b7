"""Skip mode under compiled decoding: one compiled graph per segment of layers between exit checkpoints.

With a static cache, transformers compiles each decoding step (`get_compiled_call`). Skip mode decides on
the host whether a step goes on after a checkpoint (one flag read: has every row exited?), which would
break a whole-step graph, after which dynamo compiles the remaining layers one by one (recompiling for
each). While a skip-mode handle is attached, `get_compiled_call` returns `SegmentedDecoding.step` instead:
the model's own forward runs (embeddings, mask, rotary, final norm and head, in eager), and its decoder
layers run as segments, the layers from one open checkpoint to the next, each one compiled graph that ends
with the checkpoint's router scores, the step's exit decisions and the flag. The host reads the flag and
either runs the next segment or finishes: one more graph per checkpoint, swapping exit states in (and, for
`kv="propagate"`, writing the skipped layers' K/V); `kv="recompute"` parks the step's tokens as in eager.

Under `kv="propagate"`, a step in which not every row exited at a checkpoint finishes in eager from there: the
checkpoint's hook gathers the rows still running (`compaction.py`), as in eager decoding. Under `kv="recompute"`
the rows all run the next segment, exited rows masked as in select mode.
Graphs: one per segment and one finish per checkpoint; with `kv="recompute"` each segment after the first
also gets one catch-up graph whose query length is dynamic (pending tokens of earlier skipped steps).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ...compat import cache_in, traceable_output_capture
from ..patching import Patches, forward_attribute
from ..session import CompiledState, Step, StepHost
from .kv import initialize_cache_layers, propagate_kv, sliding_window
from .skipper import LayerSkipper, own_code

SEQUENCE_DIM = 1  # hidden states and rotary embeddings are (B, T, ...)
MASK_QUERY_DIM = 2  # the catch-up attention mask is (B, 1, T, keys)


@dataclass(frozen=True)
class Segment:
    """Decoder layers `first`..`last` (1-based); `last` is an open checkpoint unless it is the last layer."""

    first: int
    last: int
    threshold: float | None  # the checkpoint's exit threshold; None for the final segment


def with_hidden(out: Any, hidden: torch.Tensor) -> Any:
    """A layer's output (tensor, or tuple with the hidden states first) carrying `hidden` instead."""
    return (hidden, *out[1:]) if isinstance(out, tuple) else hidden


class SegmentedDecoding:
    """Compiled skip-mode decoding steps: segment graphs chosen per step by the exit decisions."""

    @staticmethod
    def unsupported(layers: nn.ModuleList) -> str | None:
        """Why segments cannot run `layers` (None: they can). Segments call the layers' own forwards with the
        first layer's arguments; a dispatched model (accelerate's device hooks around each layer) and one mixing
        attention kinds (Gemma 2 / 3: sliding and full layers take different masks and rotary embeddings) keep
        the whole-step compile, whose graph breaks at each checkpoint's flag read (so no fullgraph there)."""
        windows = {sliding_window(layer.self_attn) if hasattr(layer, "self_attn") else None for layer in layers}
        if len(windows) != 1:
            return "its layers mix attention kinds (sliding-window and full attention layers take different masks)"
        if any(forward_attribute(layer) != "forward" for layer in layers):
            return "accelerate's device hooks wrap its layers (a dispatched or offloaded model)"
        return None

    def __init__(self, model: nn.Module, layers: nn.ModuleList, thresholds: dict[int, float], kv: str,
                 host: StepHost, skipper: LayerSkipper, patches: Patches) -> None:
        """Segments of `layers` between the open checkpoints (`thresholds`: checkpoint -> its exit threshold);
        `host` scores, decides exits and gives each forward's `Step`. The layers' dispatchers go in (recorded in
        `patches`, after the skipper's) when compiled decoding first asks for a step (`compiled_call`): eager
        decoding never passes through them."""
        self.model, self.layers, self.num_layers, self.kv, self.host = model, layers, len(layers), kv, host
        bounds = [0, *sorted(thresholds), self.num_layers]
        self.segments = [Segment(a + 1, b, thresholds.get(b)) for a, b in zip(bounds, bounds[1:])]
        self.segment_of = {n: s for s in self.segments for n in range(s.first, s.last + 1)}
        self.forwards = [skipper.originals.get(n, layer.forward) for n, layer in enumerate(layers, 1)]
        self.fused = skipper.fused
        self._local = threading.local()
        self._graphs: dict[tuple[int, bool], Callable] = {}  # (first layer, catch-up) -> compiled segment
        self._finish: dict[int, Callable] = {}
        self._config: Any = None
        self._patches: Patches | None = patches  # None once the dispatchers are in
        self._installing = threading.Lock()

    def _install(self) -> None:
        """Replace every layer's forward by a dispatcher that runs the segments while `step` runs, and the forward
        it replaced otherwise (once, whichever thread asks first)."""
        with self._installing:
            if self._patches is None:
                return
            for number, layer in enumerate(self.layers, 1):
                self._patches.replace_forward(layer, lambda previous, number=number: self._dispatch(number, previous))
            self._patches = None

    # -- graphs -----------------------------------------------------------------------------------
    def compiled_call(self, config: Any) -> Callable:
        """What `get_compiled_call(config)` returns while attached: `step`, with graphs compiled per `config`
        (a `transformers.CompileConfig`; a new config compiles new graphs)."""
        if self._patches is not None:
            self._install()
        if self._config != config:
            # dynamic=True would trace the segments' checkpoint numbers as symbols (and fail on `str(layer)`);
            # automatic dynamic shapes (None) mark a size dynamic once it changes, the catch-up's explicitly
            options = {**config.to_dict(), "dynamic": None if config.dynamic else config.dynamic}
            # plain steps and catch-up steps (kv="recompute": pending tokens ahead, dynamic length) per segment
            self._graphs = {(s.first, catch_up): torch.compile(
                own_code(self._segment_fn(s), f"tide_{'catch_up' if catch_up else 'segment'}_{s.first}_{s.last}"),
                **options) for s in self.segments for catch_up in (False, True)}
            self._finish = {s.last: torch.compile(own_code(self._finish_fn(s.last), f"tide_finish_{s.last}"), **options)
                            for s in self.segments if s.threshold is not None}
            self._config = config
        return self.step

    def step(self, *args: Any, **kwargs: Any) -> Any:
        """One decoding step: the model's forward, its decoder layers run as compiled segments."""
        self._local.running = True
        try:
            return self.model(*args, **kwargs)
        finally:
            self._local.running = False

    def _segment_fn(self, segment: Segment) -> Callable:
        forwards, num_layers = self.forwards[segment.first - 1 : segment.last], self.num_layers
        host, layer = self.host, segment.last
        score, exit_mask, exit_state_of = host.score, host.exit_mask, host.exit_state

        def run(block: torch.Tensor, exit_layer: torch.Tensor, exit_state: torch.Tensor | None, valid: torch.Tensor,
                kwargs: dict[str, Any]) -> tuple:
            """Layers of the segment on `block` (pending tokens, if any, ahead of the step's own): (block states,
            the step's output, exit layers, exit states, flag: every row of the step has exited)."""
            out = block
            for forward in forwards:
                out = forward(out[0] if isinstance(out, tuple) else out, **kwargs)
            states = out[0] if isinstance(out, tuple) else out
            mine = states[:, states.shape[1] - exit_layer.shape[1]:].contiguous()  # a catch-up's strides: as plain
            if segment.threshold is None:  # the last layer: exited positions get their exit states
                if exit_state is not None:
                    mine = torch.where((exit_layer < num_layers).unsqueeze(-1), exit_state, mine)
                return states, with_hidden(out, mine), exit_layer, exit_state, None
            exits = (exit_layer == num_layers) & exit_mask(score(layer, mine), mine, segment.threshold)
            exit_layer = exit_layer.masked_fill(exits, layer)
            state = exit_state_of(layer, mine)
            if exit_state is None:
                exit_state = state if state is not mine else mine.clone()
            else:
                exit_state = torch.where(exits.unsqueeze(-1), state, exit_state)
            done = ((exit_layer < num_layers) | ~valid).all()
            return states, with_hidden(out, mine), exit_layer, exit_state, done
        return run

    def _finish_fn(self, checkpoint: int) -> Callable:
        fused, later, num_layers = self.fused, list(self.layers)[checkpoint:], self.num_layers
        propagate = self.kv == "propagate"

        def finish(out: Any, exit_layer: torch.Tensor, exit_state: torch.Tensor, kwargs: dict[str, Any]) -> Any:
            """Every row exited at `checkpoint`: propagate's K/V for the skipped layers, exit states swapped in."""
            hidden = out[0] if isinstance(out, tuple) else out
            if propagate and fused is not None:
                fused.write(checkpoint, hidden, kwargs)
            elif propagate:
                for layer in later:
                    propagate_kv(layer, hidden, kwargs)
            return with_hidden(out, torch.where((exit_layer < num_layers).unsqueeze(-1), exit_state, hidden))
        return finish

    # -- per step ---------------------------------------------------------------------------------
    def _dispatch(self, number: int, previous: Callable) -> Callable:
        def forward(*args: Any, **kwargs: Any) -> Any:
            step = self.host.current_step()
            if step is None or not getattr(self._local, "running", False):
                return previous(*args, **kwargs)
            if step.compiled is None:  # the checkpoint and final hooks leave this step to the segments
                step.compiled = CompiledState()
            elif step.compiled.diverged_at is not None and number > step.compiled.diverged_at:
                return previous(*args, **kwargs)  # (after rows diverged: eager, on the rows still running)
            segment = self.segment_of[number]
            if number == segment.first and step.skip.all_exited_at is None:
                hidden = args[0] if args else kwargs.pop("hidden_states")
                self._local.output = self._run(segment, step, hidden, kwargs)
            return self._local.output  # later layers of a segment, and layers after an exit: its output
        return forward

    def _run(self, segment: Segment, step: Step, hidden: torch.Tensor, kwargs: dict[str, Any]) -> Any:
        """Run one segment graph; at a checkpoint, read its flag and finish the step when every row exited."""
        waiting = self.host.waiting_tokens(cache_in(kwargs))
        extended = None if waiting is None else waiting.extend(
            segment.first, self.layers[segment.first - 1], hidden, kwargs, step.mask2d)
        block, call_kwargs = hidden, kwargs
        if extended is not None:  # tokens of earlier skipped steps catch up: one graph, query length dynamic
            due, block, call_kwargs = extended
            cos, sin = call_kwargs["position_embeddings"]
            mask = call_kwargs["attention_mask"]
            # at least one pending token ahead of the step's own; at most the cache's length (the mask's keys)
            bounds = {"min": hidden.shape[1] + 1, "max": mask.shape[-1]}
            for tensor in (block, cos, sin):
                torch._dynamo.mark_dynamic(tensor, SEQUENCE_DIM, **bounds)
            torch._dynamo.mark_dynamic(mask, MASK_QUERY_DIM, **bounds)
        if waiting is not None:  # deep cache layers a skipped prefill left unallocated: allocated before tracing
            initialize_cache_layers(cache_in(kwargs), self.layers[segment.first - 1 : segment.last])
        with traceable_output_capture():
            states, out, step.exit_layer, step.exit_state, done = self._graphs[segment.first, extended is not None](
                block, step.exit_layer, step.exit_state, step.valid, call_kwargs)
        if extended is not None:
            step.skip.recomputed += sum(p.positions for p in due) * (segment.last - segment.first + 1)
            waiting.advance(due, states, segment.last)
        if done is None or not bool(done):  # skip mode's one host read per checkpoint reached
            if done is not None and self.kv == "propagate":  # rows may have diverged: the rest of the step runs
                step.compiled.segmented, step.compiled.diverged_at = False, segment.last  # eager, on the rows
            return out  # still running
        step.skip.all_exited_at, step.skip.skipped = segment.last, self.num_layers - segment.last
        if waiting is not None:
            waiting.park(out[0] if isinstance(out, tuple) else out, segment.last, kwargs, step.mask2d)
        with traceable_output_capture():
            return self._finish[segment.last](out, step.exit_layer, step.exit_state, kwargs)
