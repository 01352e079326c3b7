"""Skip mode: layers after an exit are not computed.

The forward of every layer after the first checkpoint is replaced on the instance (on accelerate's
`_old_forward` when the model is dispatched, so accelerate's device hooks keep running). Once every row
of a step has exited, the replaced forwards pass the hidden state through untouched and keep the KV
cache sound (see `kv.py`); otherwise they call the original forward. The replacements are recorded in
the handle's `Patches`, whose `restore()` leaves the layers exactly as they were.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from ..compat import cache_in, is_stateful
from ..errors import TideUnsupportedError
from .compaction import Compaction, compactable, run_compacted
from .kv import FusedPropagation, KVRecompute, project_kv, propagate_kv, propagate_support, recompute_support
from .patching import Patches
from .probe import probe_skipped_layers
from .session import Step


@dataclass
class SkipPlan:
    """What `LayerSkipper.check` found: the fused propagation to use (None: layer by layer, or recompute) and
    which layers return a tuple (layer number -> bool; from the probe forward)."""

    fused: FusedPropagation | None = None
    returns_tuple: dict[int, bool] = field(default_factory=dict)


class LayerSkipper:
    """Runs the layers after `first_checkpoint` (1-based layer numbers) only for steps that did not all exit."""

    @staticmethod
    def check(model: nn.Module, layers: nn.ModuleList, first_checkpoint: int, kv: str, text_config: Any) -> SkipPlan:
        """Raise before anything is patched when a layer that may be skipped cannot keep its cache sound (by
        its attributes, then, for kv="propagate", by the probe forward of `probe.py`); return the plan."""
        if is_stateful(model):
            raise TideUnsupportedError(f"mode='skip' on {type(model).__name__}: its layers keep a recurrent state "
                                       "that a skipped layer would not advance; use mode='select'")
        support = propagate_support if kv == "propagate" else recompute_support
        for number in range(first_checkpoint + 1, len(layers) + 1):
            reason = support(layers[number - 1])
            if reason is not None:
                raise TideUnsupportedError(f"mode='skip' with kv={kv!r} on layer {number}: {reason}")
        fused = FusedPropagation.build(list(layers)[first_checkpoint:], first_checkpoint + 1) \
            if kv == "propagate" else None
        return SkipPlan(fused, probe_skipped_layers(model, layers, first_checkpoint, kv, fused, text_config))

    def __init__(self, layers: nn.ModuleList, first_checkpoint: int, plan: SkipPlan, kv: str,
                 current_step: Callable[[], Step | None], recompute_state: Callable[[Any], KVRecompute | None],
                 patches: Patches) -> None:
        """Replace the forwards of `layers` after `first_checkpoint` (recorded in `patches`) as `plan` says.

        `current_step()` gives the exit decisions of the forward running in this thread, `recompute_state(cache)`
        the tokens of `cache` awaiting their deep layers (None unless kv="recompute").
        """
        self.current_step, self.recompute_state = current_step, recompute_state
        self._returns_tuple: dict[int, bool] = dict(plan.returns_tuple)
        self.originals: dict[int, Callable] = {}  # layer number -> the forward it replaced (compiled segments run it)
        self.fused = plan.fused
        self.recompute = kv == "recompute"
        for number in range(first_checkpoint + 1, len(layers) + 1):
            layer = layers[number - 1]
            patches.replace_forward(
                layer, lambda original, number=number, layer=layer: self._wrap(number, layer, original))

    def decide(self, step: Step, layer: int, num_layers: int) -> None:
        """After checkpoint `layer` decided its exits: skip the later layers when no position runs on (one host
        read); else, under `kv="propagate"`, gather the positions still running for them (`compaction.py`).
        `kv="recompute"` keeps the whole batch running until every row has exited."""
        running = step.valid.to(step.exit_layer.device) & (step.exit_layer == num_layers)
        if self.recompute:
            if not bool(running.any()):
                step.skip_after = layer
            return
        counts = running.sum(1).tolist()
        if not any(counts):
            step.skip_after = layer
        else:
            step.compaction = Compaction.build(running, counts) or step.compaction

    def _wrap(self, number: int, layer: nn.Module, original: Callable) -> Callable:
        self.originals[number] = original
        def forward(*args: Any, **kwargs: Any) -> Any:
            step = self.current_step()
            recompute = self.recompute_state(cache_in(kwargs))
            if step is None or step.skip_after is None or number <= step.skip_after:
                out = None
                if step is not None and step.compaction is not None and len(args) == 1 and compactable(layer):
                    out = run_compacted(step.compaction, layer, original, args[0], kwargs, project_kv)
                    if out is not None:
                        step.stopped = step.stopped + (~step.compaction.running).long()
                if out is None and recompute is not None and len(args) == 1:
                    out = recompute.run(number, layer, original, args[0], kwargs, step)
                elif out is None:
                    out = original(*args, **kwargs)
                self._returns_tuple[number] = isinstance(out, tuple)
                return out
            hidden = args[0] if args else kwargs["hidden_states"]
            if recompute is not None:
                if number == step.skip_after + 1:
                    recompute.park(hidden, step.skip_after, kwargs)
            elif self.fused is not None:
                if number == step.skip_after + 1:  # one pass writes every skipped layer's K/V
                    self.fused.write(step.skip_after, hidden, kwargs)
            else:
                propagate_kv(layer, hidden, kwargs)
            step.skipped += 1
            return (hidden,) if self._returns_tuple.get(number) else hidden
        return own_code(forward, f"tide_skip_layer_{number}")  # compiled per layer, not as recompiles of one


def own_code(fn: Callable, name: str) -> Callable:
    """`fn` with a code object of its own: dynamo caches graphs (and counts recompiles) per code object, so
    functions sharing one (the skipped layers' forwards, compiled segments) would count as recompiles of each
    other and hit dynamo's recompile limit."""
    code = fn.__code__.replace(co_name=name)
    return types.FunctionType(code, fn.__globals__, name, fn.__defaults__, fn.__closure__)
