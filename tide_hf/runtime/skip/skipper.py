"""Skip mode: layers after an exit are not computed.

The forward of every layer after the first checkpoint is replaced on the instance (on accelerate's
`_old_forward` when the model is dispatched, so accelerate's device hooks keep running). Once every row
of a step has exited, the replaced forwards pass the hidden state through untouched and keep the KV
cache sound (see `kv.py`). While some rows or positions run on, the original forward runs on those only
(`compaction.py`). Under `kv="recompute"` it runs on the whole batch. The replacements are recorded in the
handle's `Patches`, whose `restore()` leaves the layers exactly as they were.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from ...compat import cache_in, is_stateful, with_cache
from ...errors import TideUnsupportedError
from ...modeling.fingerprint import remembered
from ..patching import Patches
from ..session import Step, StepHost
from .compaction import Compaction, compactable, run_compacted
from .kv import FusedPropagation, KVRecompute, project_kv, propagate_kv, propagate_support, recompute_support
from .probe import probe_skipped_layers


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
            if reason is not None:  # the way out: kv='propagate' where only recompute's window check failed
                way_out = "kv='propagate' or mode='select'" if propagate_support(layers[number - 1]) is None \
                    else "mode='select'"
                raise TideUnsupportedError(f"mode='skip' with kv={kv!r} on {type(model).__name__} (model_type="
                                           f"{getattr(model.config, 'model_type', None)!r}), layer {number}: "
                                           f"{reason}; use {way_out}")
        fused = FusedPropagation.build(list(layers)[first_checkpoint:], first_checkpoint + 1) \
            if kv == "propagate" else None
        returns = remembered(model, ("skip probe", first_checkpoint, kv, fused is not None),
                             lambda: probe_skipped_layers(model, layers, first_checkpoint, kv, fused, text_config))
        return SkipPlan(fused, dict(returns))

    def __init__(self, layers: nn.ModuleList, first_checkpoint: int, plan: SkipPlan, kv: str, host: StepHost,
                 patches: Patches) -> None:
        """Replace the forwards of `layers` after `first_checkpoint` (recorded in `patches`) as `plan` says; `host`
        gives each forward's `Step` and each cache's waiting tokens."""
        self.host = host
        self._returns_tuple: dict[int, bool] = dict(plan.returns_tuple)
        self.originals: dict[int, Callable] = {}  # layer number -> the forward it replaced (compiled segments run it)
        self.fused = plan.fused
        self.recompute = kv == "recompute"
        self.layers = layers
        for number in range(first_checkpoint + 1, len(layers) + 1):
            layer = layers[number - 1]
            patches.replace_forward(
                layer, lambda original, number=number, layer=layer: self._wrap(number, layer, original))

    def decide(self, step: Step, layer: int, num_layers: int) -> None:
        """After checkpoint `layer` decided its exits: skip the later layers when no position runs on (one host
        read); else gather the positions still running for them (`compaction.py`). Under `kv="recompute"` the
        whole batch runs until every row has exited: the layers a stopped position skips still run for it (at
        the next step, or now with its batch), so setting it aside saves no work."""
        step.skip.decided = True  # (what follows depends on the exits so far only)
        running = step.valid.to(step.exit_layer.device) & (step.exit_layer == num_layers)
        if not bool(running.any()):  # skip mode's one host read per checkpoint reached ...
            step.skip.all_exited_at = layer
        elif not self.recompute:  # ... and, where some rows run on, a copy of the flags (the device is idle by then)
            step.skip.compaction = Compaction.build(running, running.tolist()) or step.skip.compaction

    def complete_cache(self, cache: Any, waiting: KVRecompute) -> None:
        """Run the tokens of `cache` waiting for layers they skipped through them, writing their exact K/V
        (`KVRecompute.catch_up`)."""
        if waiting.pending:
            waiting.catch_up(self.layers, self.originals, {**with_cache({}, cache), "use_cache": True})

    def _run(self, number: int, layer: nn.Module, original: Callable, args: tuple, kwargs: dict[str, Any],
             step: Step | None, waiting: KVRecompute | None) -> Any:
        """A layer that runs in this step: on the positions still running when some stopped, else whole."""
        comp = step.skip.compaction if step is not None else None
        if comp is None or len(args) != 1 or not compactable(layer):
            if waiting is not None and waiting.pending and len(args) == 1:  # (nothing waiting: the layer alone)
                return waiting.run(number, layer, original, args[0], kwargs, step)
            return original(*args, **kwargs)
        out = run_compacted(comp, layer, original, args[0], kwargs, project_kv)
        if out is None:
            return original(*args, **kwargs)
        step.skip.stopped = step.skip.stopped + (~comp.running).long()
        return out

    def _wrap(self, number: int, layer: nn.Module, original: Callable) -> Callable:
        self.originals[number] = original
        def forward(*args: Any, **kwargs: Any) -> Any:
            step = self.host.current_step()
            if step is not None and step.skip.pass_through:  # a plain step with no token waiting: the layer alone
                return original(*args, **kwargs)
            waiting = self.host.waiting_tokens(cache_in(kwargs))
            after = None if step is None else step.skip.all_exited_at
            if after is None or number <= after:
                out = self._run(number, layer, original, args, kwargs, step, waiting)
                self._returns_tuple[number] = isinstance(out, tuple)
                return out
            hidden = args[0] if args else kwargs["hidden_states"]
            if waiting is not None:
                if number == after + 1:
                    waiting.park(hidden, after, kwargs, step.mask2d)
            elif self.fused is not None:
                if number == after + 1:  # one pass writes every skipped layer's K/V
                    self.fused.write(after, hidden, kwargs)
            else:
                propagate_kv(layer, hidden, kwargs)
            step.skip.skipped += 1
            return (hidden,) if self._returns_tuple.get(number) else hidden
        return own_code(forward, f"tide_skip_layer_{number}")  # compiled per layer, not as recompiles of one


def own_code(fn: Callable, name: str) -> Callable:
    """`fn` with a code object of its own: dynamo caches graphs (and counts recompiles) per code object, so
    functions sharing one (the skipped layers' forwards, compiled segments) would count as recompiles of each
    other and hit dynamo's recompile limit."""
    code = fn.__code__.replace(co_name=name)
    return types.FunctionType(code, fn.__globals__, name, fn.__defaults__, fn.__closure__)
