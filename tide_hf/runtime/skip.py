"""Skip mode: layers after an exit are not computed.

The forward of every layer after the first checkpoint is replaced on the instance (on accelerate's
`_old_forward` when the model is dispatched, so accelerate's device hooks keep running). Once every row
of a step has exited, the replaced forwards pass the hidden state through untouched and keep the KV
cache sound (see `kv.py`). While some rows or positions run on, the original forward runs on those only
(`compaction.py`). Under `kv="recompute"` it runs on the whole batch, or with `park_rows` on the running
positions while the stopped ones park (`parked.py`). The replacements are recorded in the handle's
`Patches`, whose `restore()` leaves the layers exactly as they were.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from ..compat import cache_in, is_stateful, with_cache
from ..errors import TideUnsupportedError
from ..modeling.fingerprint import remembered
from .compaction import Compaction, Plan, compactable, run_compacted, run_planned
from .kv import FusedPropagation, KVRecompute, project_kv, propagate_kv, propagate_support, recompute_support
from .parked import ParkedRows
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

    def __init__(self, layers: nn.ModuleList, first_checkpoint: int, plan: SkipPlan, kv: str,
                 current_step: Callable[[], Step | None], recompute_state: Callable[[Any], KVRecompute | None],
                 patches: Patches, park_rows: bool) -> None:
        """Replace the forwards of `layers` after `first_checkpoint` (recorded in `patches`) as `plan` says.

        `current_step()` gives the exit decisions of the forward running in this thread, `recompute_state(cache)`
        the tokens of `cache` awaiting their deep layers (None unless kv="recompute"). `park_rows`: under
        kv="recompute", a batch's stopped positions park (`parked.py`) instead of running with their batch.
        """
        self.current_step, self.recompute_state = current_step, recompute_state
        self._returns_tuple: dict[int, bool] = dict(plan.returns_tuple)
        self.originals: dict[int, Callable] = {}  # layer number -> the forward it replaced (compiled segments run it)
        self.fused = plan.fused
        self.recompute = kv == "recompute"
        self.park_rows = park_rows
        self.layers = layers
        for number in range(first_checkpoint + 1, len(layers) + 1):
            layer = layers[number - 1]
            patches.replace_forward(
                layer, lambda original, number=number, layer=layer: self._wrap(number, layer, original))

    def decide(self, step: Step, layer: int, num_layers: int) -> None:
        """After checkpoint `layer` decided its exits: skip the later layers when no position runs on (one host
        read); else gather the positions still running for them (`compaction.py`). Under `kv="recompute"` the
        whole batch runs until every row has exited: the layers a stopped position skips still run for it (at
        the next step, or now with its batch), so parking it saves no work. With `park_rows` a position stops
        where no running position of its row follows it in the step (a prefill's later positions read its deep
        K/V), and stopped positions park (`parked.py`) where rows can (not at batch 1, with a static or
        compiled cache)."""
        running = step.valid.to(step.exit_layer.device) & (step.exit_layer == num_layers)
        if step.per_row is None:
            step.per_row = self.recompute and self.park_rows and self._rows_can_park(step)
        if self.recompute and not step.per_row:
            if not bool(running.any()):
                step.skip_after = layer
            return
        if self.recompute:  # a stopped position must not be read by a later one of its row in this step
            running = running.flip(1).cummax(1).values.flip(1)
            previous = step.valid if step.active is None else step.active
            step.parking, step.active = previous.to(running.device) & ~running, running
            self.recompute_state(step.cache).rows.key_mask = step.mask2d
        if not bool(running.any()):  # skip mode's one host read per checkpoint reached ...
            step.skip_after = layer
        else:  # ... and, where some rows run on, a copy of the flags (the device is idle by then)
            step.compaction = Compaction.build(running, running.tolist()) or step.compaction
        if self.recompute:
            step.park_after = layer

    def _rows_can_park(self, step: Step) -> bool:
        """Rows of this step can park (`parked.py`): a batch of several rows filling a cache that grows one slot
        per position, no step-wide parked tokens waiting in it, and layers that take a gathered batch."""
        cache, batch = step.cache, step.valid.shape[0]
        state = self.recompute_state(cache)
        if batch < 2 or state is None or state.pending or not isinstance(cache, DynamicCache) \
                or any(type(layer) is not DynamicLayer for layer in cache.layers) \
                or not all(compactable(layer) for layer in self.layers):
            return False
        if state.rows is None:
            state.rows = ParkedRows(len(self.layers))
        return True

    def settle(self, cache: Any, state: KVRecompute, blocks: bool) -> None:
        """Run the tokens of `cache` waiting for layers they skipped through them, writing their exact K/V: the
        positions parked per row, and with `blocks` the steps parked whole (`KVRecompute.settle`)."""
        kwargs = {**with_cache({}, cache), "use_cache": True}
        if blocks and state.pending:
            state.settle(self.layers, self.originals, kwargs)
        parked = state.rows
        while parked is not None and len(parked):
            number = parked.first_due()
            due = parked.due(number)
            plan = Plan.build(None, parked.rows[due].tolist(), parked.slots[due].tolist(), 0, 0, due.device)
            run_planned(plan, self.layers[number - 1], self.originals[number], None, kwargs, parked, due, number)

    def _run(self, number: int, layer: nn.Module, original: Callable, args: tuple, kwargs: dict[str, Any],
             step: Step | None, recompute: KVRecompute | None) -> Any:
        """A layer that runs in this step: on the positions still running when some stopped, with the due
        parked positions of their rows (kv="recompute" in a batch), else whole."""
        per_row = step is not None and bool(step.per_row)
        comp = step.compaction if step is not None else None
        if per_row and comp is None:  # nothing stopped yet in this step: every row runs, with its parked ones
            comp = Compaction.whole(step.valid)
        if comp is None or len(args) != 1 or not compactable(layer):
            if recompute is not None and len(args) == 1:
                return recompute.run(number, layer, original, args[0], kwargs, step)
            return original(*args, **kwargs)
        if per_row:
            parked = recompute.rows
            due = parked.due(number, comp.rows)
            if len(due):
                width = args[0].shape[1]
                past = cache_in(kwargs).get_seq_length(layer.self_attn.layer_idx)
                plan = Plan.build(comp, parked.rows[due].tolist(), parked.slots[due].tolist(), width, past,
                                  args[0].device)
                step.recomputed += len(due)
                out = run_planned(plan, layer, original, args[0], kwargs, parked, due, number)
            else:
                out = run_compacted(comp, layer, original, args[0], kwargs, None)
            if out is None:
                raise TideUnsupportedError(f"kv='recompute' in a batch: layer {number}'s arguments cannot be "
                                           "gathered by row (no rotary embeddings or a block mask given); use "
                                           "kv='propagate'")
        else:
            out = run_compacted(comp, layer, original, args[0], kwargs, project_kv)
            if out is None:
                return original(*args, **kwargs)
        step.stopped = step.stopped + (~comp.running).long()
        return out

    def _park(self, step: Step, parked: ParkedRows, depth: int, hidden: torch.Tensor, kwargs: dict[str, Any],
              layer: nn.Module) -> None:
        """Park the positions that stopped after layer `depth` (their state `hidden`, the input of the next)."""
        rows, positions = step.parking.to(hidden.device).nonzero(as_tuple=True)
        cos, sin = (t.expand(hidden.shape[0], *t.shape[1:]) for t in kwargs["position_embeddings"])
        past = cache_in(kwargs).get_seq_length(layer.self_attn.layer_idx)
        parked.park(rows, past + positions, hidden[rows, positions], depth, cos[rows, positions],
                    sin[rows, positions])

    def _wrap(self, number: int, layer: nn.Module, original: Callable) -> Callable:
        self.originals[number] = original
        def forward(*args: Any, **kwargs: Any) -> Any:
            step = self.current_step()
            recompute = self.recompute_state(cache_in(kwargs))
            if step is not None and step.per_row and step.park_after == number - 1:
                self._park(step, recompute.rows, number - 1, args[0] if args else kwargs["hidden_states"],
                           kwargs, layer)
            if step is None or step.skip_after is None or number <= step.skip_after:
                out = self._run(number, layer, original, args, kwargs, step, recompute)
                self._returns_tuple[number] = isinstance(out, tuple)
                return out
            hidden = args[0] if args else kwargs["hidden_states"]
            if step.per_row:
                append_placeholders(layer, hidden, kwargs)
            elif recompute is not None:
                if number == step.skip_after + 1:
                    recompute.park(hidden, step.skip_after, kwargs, step.mask2d)
            elif self.fused is not None:
                if number == step.skip_after + 1:  # one pass writes every skipped layer's K/V
                    self.fused.write(step.skip_after, hidden, kwargs)
            else:
                propagate_kv(layer, hidden, kwargs)
            step.skipped += 1
            return (hidden,) if self._returns_tuple.get(number) else hidden
        return own_code(forward, f"tide_skip_layer_{number}")  # compiled per layer, not as recompiles of one


def append_placeholders(layer: nn.Module, hidden: torch.Tensor, kwargs: dict[str, Any]) -> None:
    """Append zero K/V for every position of the step to `layer`'s cache: parked positions write theirs later."""
    cache = cache_in(kwargs)
    if cache is None or not kwargs.get("use_cache", True):
        return
    attn = layer.self_attn
    batch, width = hidden.shape[:2]
    key, value = (hidden.new_zeros(batch, proj.out_features // attn.head_dim, width, attn.head_dim)
                  for proj in (attn.k_proj, attn.v_proj))
    cache.update(key, value, attn.layer_idx)


def own_code(fn: Callable, name: str) -> Callable:
    """`fn` with a code object of its own: dynamo caches graphs (and counts recompiles) per code object, so
    functions sharing one (the skipped layers' forwards, compiled segments) would count as recompiles of each
    other and hit dynamo's recompile limit."""
    code = fn.__code__.replace(co_name=name)
    return types.FunctionType(code, fn.__globals__, name, fn.__defaults__, fn.__closure__)
