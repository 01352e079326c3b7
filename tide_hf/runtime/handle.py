"""attach / detach (`TideHandle`): forward hooks that make TIDE exit decisions inside the model's own forward pass.

Per forward, a hook at each checkpoint layer scores the positions of the step with that checkpoint's
router (on `final_norm(h)`, the representation the router was trained on) and records, per row and
position, the first checkpoint whose score reaches that checkpoint's threshold (`TideOptions.threshold`: a quality
target's per-checkpoint thresholds, or the global `exit_threshold`). A hook on the last layer then
replaces the output of the positions that exited by their exit state (the router's exit head on the
checkpoint's state, or that state itself), so the model's own final norm and LM head produce the exit
logits, and every stock logits processor and decoding strategy acts on them. Nothing is asked of the model
beyond its layers' outputs: no `output_hidden_states`, no second forward.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

import tide_hf.runtime.costs as costs  # (by name, not `from . import`: not the runtime package)
import tide_hf.runtime.pricing as pricing

from ..compat import cache_in, is_paged
from ..errors import TideArgumentError, TideArgumentTypeError, TideUnsupportedError
from ..kernels import bind_router_scores
from ..modeling import ModelAdapter, TideRouter, check_model, get_adapter, layer_output
from ..modeling.fingerprint import remembered
from ..record import CLOSED
from .aside import StepAside, new_report
from .batching import commit_packed, decode_positions, guard_continuous_batching
from .compiled import install_compiled_call
from .costs import StepCosts
from .modes import resolve_mode
from .options import TideConfig, TideOptions
from .pairing import WeightsWatch, place_routers, refuse_pickling
from .patching import Patches
from .registry import (  # detach, get_handle, last_stats: also here, their import path before registry.py
    LOCK,
    check_free,
    detach,
    get_handle,
    last_stats,
    publish_stats,
    register,
    register_call,
    unregister,
)
from .session import Session, Step, new_step
from .skip.kv import KVRecompute
from .skip.segments import SegmentedDecoding
from .skip.skipper import LayerSkipper, SkipPlan
from .stats import ExitStats
from .turns import Turns

__all__ = ["TideHandle", "attach_for_call", "detach", "get_handle", "hook_model", "last_stats"]

class TideHandle:
    """An attached router: options, hooks, and the stats of the last call (`last_stats`); also a context manager,
    `with tide_hf.attach(model, router): ...` detaches when the block ends."""

    def __init__(self, model: nn.Module, router: TideRouter, options: TideOptions, adapter: ModelAdapter,
                 *, owner: int | None = None, skip_plan: SkipPlan | None = None, ignore_fingerprint: bool = False
                 ) -> None:
        self.model, self.router, self.options, self.adapter = model, router, options, adapter
        self._watch = WeightsWatch(model, adapter, router.config.base_fingerprint, ignore=ignore_fingerprint,
                                   target=options.target)
        self.owner = owner  # the thread of a per-call attach (`generate(tide=router)`); None: every thread
        self.num_layers = adapter.num_layers
        # On the CPU reading a flag from a tensor costs nothing: a checkpoint where no position passes then makes
        # no exit state. On an accelerator select mode reads nothing (a read waits for the device).
        self.host_reads_free = all(p.device.type == "cpu" for p in adapter.layers.parameters())
        self.checkpoints = [k for k in router.checkpoint_layers if k >= options.min_layers]
        # checkpoint -> its exit threshold, read at every call (pricing's measurement forces exits through it)
        self.thresholds = {k: options.threshold(k) for k in self.checkpoints}
        self.open_checkpoints = [k for k in self.checkpoints if self.thresholds[k] < CLOSED]  # those that can exit
        self.turns = Turns(options.mode == "speculative")  # a speculative call runs alone (`turns.py`)
        self._local = threading.local()
        self._local.owner = owner is not None  # set in the owner's thread only (`_bypassed`)
        self._waiting: weakref.WeakKeyDictionary[Any, KVRecompute] = weakref.WeakKeyDictionary()
        priced = skip_plan is not None and bool(self.open_checkpoints) and options.priced is not None \
            and "costs" in options.priced
        # Priced skip mode with kv="recompute" takes exits only where they stop a step's layers: a position that
        # exits while another runs on saves nothing (the step runs whole) and would change its token. The exits
        # taken are a subset of the target's rule, each at the same checkpoint, so the target still holds.
        self.whole_steps = priced and options.kv == "recompute"
        self._paying: dict[int, bool] = {}  # positions of a step -> whether an exit can pay there (`_pays`)
        # priced skip mode on the CPU times its decode steps against plain ones, per batch size (`aside.py`); the
        # schedules outlive the handle, per model state (read before any patch) and thresholds, as the costs do
        thresholds = tuple(sorted(self.thresholds.items()))
        self._aside: dict[int, StepAside] | None = remembered(
            model, ("step aside", options.kv, thresholds), dict) if priced and self.host_reads_free else None
        self._norm_specs = place_routers(router, adapter)
        self._scorers = self._bind_scorers()
        self._patches = Patches()
        self._patches.set_attr(model, "__reduce_ex__", refuse_pickling)  # pickle and copy look it up on the instance
        if owner is None:  # attached in every thread: continuous batching (no thread's call scopes it) is checked
            guard_continuous_batching(model, self, self._patches)
        self._patches.hook(model.register_forward_pre_hook(self._begin, with_kwargs=True))
        self._patches.hook(model.register_forward_hook(self._end, with_kwargs=True, always_call=True))  # also on errors
        for k in self.checkpoints:
            self._patches.hook(adapter.layers[k - 1].register_forward_hook(self._checkpoint_hook(k)))
        self._patches.hook(adapter.layers[-1].register_forward_hook(self._final_hook))
        self._skipper = None if skip_plan is None or not self.open_checkpoints else LayerSkipper(
            adapter.layers, self.open_checkpoints[0], skip_plan, options.kv, self, self._patches)
        breaks = None if self._skipper is None else SegmentedDecoding.unsupported(adapter.layers)
        thresholds = {k: self.thresholds[k] for k in self.open_checkpoints}
        segments = SegmentedDecoding(model, adapter.layers, thresholds, options.kv, self, self._skipper,
                                     self._patches) if self._skipper is not None and breaks is None else None
        # transformers' compiled decoding steps: graphs of TIDE's own (skip mode: per segment of layers, or `breaks`)
        install_compiled_call(model, self._patches, self, getattr(segments, "compiled_call", None), breaks)

    def __enter__(self) -> TideHandle:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.detach()

    def patch_attribute(self, owner: Any, name: str, value: Any) -> None:
        """Set `owner.name` to `value` until detach, which puts back what was there."""
        self._patches.set_attr(owner, name, value)

    def current_step(self) -> Step | None:
        """Exit decisions of the forward running in this thread (None outside a forward)."""
        return getattr(self._local, "step", None)

    def waiting_tokens(self, cache: Any) -> KVRecompute | None:
        """Tokens of `cache` still awaiting their deep layers (skip mode with kv="recompute" only), kept per cache
        object: the pending tokens belong to that cache, whatever call uses it next."""
        if self.options.kv != "recompute" or cache is None:
            return None
        return self._waiting.get(cache) or self._waiting.setdefault(cache, KVRecompute(self.num_layers))

    @torch.no_grad()
    def complete_cache(self, cache: Any) -> None:
        """Write the exact K/V of `cache`'s tokens waiting for layers they skipped (kv="recompute"): when a generate
        call whose cache outlives it ends, or a plain forward returns it."""
        waiting = self._waiting.get(cache) if cache is not None and len(self._waiting) else None
        if waiting is not None and self._skipper is not None:
            self._skipper.complete_cache(cache, waiting)

    def __deepcopy__(self, memo: dict) -> TideHandle:  # reached through the hooks of a deep-copied layer
        refuse_pickling()

    # -- per-call state -------------------------------------------------------------------------
    @property
    def last_stats(self) -> ExitStats | None:
        """Exit statistics of the latest generate call or forward on this model (continuous batching: so far)."""
        return last_stats(self.model)

    def _new_session(self, generating: bool, eos: torch.Tensor | None = None) -> Session:
        if not torch.compiler.is_compiling():  # the model may have been cast, moved or loaded since the last call
            if self._watch.check():  # a cast or a move: the norm's formula and the routers' devices follow it
                self._norm_specs = place_routers(self.router, self.adapter)
            self._scorers = self._bind_scorers()  # (the router's weights as they are now)
            if self._skipper is not None and self._skipper.fused is not None:
                self._skipper.fused.refresh()
        stats = ExitStats(self.num_layers, list(self.router.checkpoint_layers), mode=self.options.mode,
                          reason=self.options.reason, pricing=self.options.priced,
                          aside=new_report() if self._aside is not None and generating else None)
        return Session(stats, generating, eos)

    @contextmanager
    def session(self, *, generating: bool, eos: torch.Tensor | None = None) -> Iterator[Session]:
        """Scope one call: fresh stats, published as `last_stats` when the call ends."""
        outer = getattr(self._local, "session", None)
        if getattr(self._local, "auto", False):  # left by a plain forward that raised before its end hook
            outer, self._local.auto = None, False
        session = self._new_session(generating, eos)
        self._local.session = session
        try:
            yield session
        finally:  # (a forward interrupted by a BaseException, e.g. Ctrl-C, skips `_end`: its step is dropped here)
            self.commit(session, None)
            self._local.session, self._local.step = outer, None
            publish_stats(self.model, session.stats)

    @contextmanager
    def disabled(self) -> Iterator[None]:
        """Run the model as if TIDE were not attached (`generate(..., tide=False)`), in this thread only."""
        previous, self._local.disabled = getattr(self._local, "disabled", False), True
        try:
            yield
        finally:
            self._local.disabled = previous

    def is_disabled(self) -> bool:
        """Inside `disabled()` in this thread (a nested `generate`, as stock assisted decoding's, runs stock too)."""
        return getattr(self._local, "disabled", False)

    def _pays(self, positions: int) -> bool:
        """Whether an exit can pay in a step of `positions` (rows x tokens): `pricing.pays_at`, kept per count."""
        if positions not in self._paying:
            self._paying[positions] = pricing.pays_at(self.options.priced, positions)
        return self._paying[positions]

    def _bypassed(self) -> bool:
        if self.owner is not None and not getattr(self._local, "owner", False):
            return True  # a per-call attach is invisible to every other thread (a thread-local flag, which
            # compiled graphs guard on; `threading.get_ident()` broke them)
        return self.is_disabled()

    def _active(self) -> bool:
        return not self._bypassed() and bool(self.open_checkpoints)

    # -- hooks ------------------------------------------------------------------------------------
    def _begin(self, _module: nn.Module, args: tuple, kwargs: dict) -> None:
        if self.turns.owner is not None and not self.turns.mine():
            self.turns.wait()  # a plain forward during another thread's speculative call (generate calls waited for
            # their turn before starting: `Turns.shared`)
        if self._bypassed():  # a stock call: no exits and no stats (keeps `last_stats` of the last TIDE call)
            self._local.step = None
            cache = cache_in(kwargs)  # kv="recompute": a cache TIDE filled, tokens waiting in it
            waiting = self._waiting.get(cache) if cache is not None and len(self._waiting) else None
            if waiting is not None:  # its waiting tokens catch up in this call: padding from its 2-D mask
                mask = kwargs.get("attention_mask")
                waiting.stock_mask = mask if isinstance(mask, torch.Tensor) and mask.dim() == 2 else None
            return
        for output in ("output_attentions", "output_hidden_states"):
            if self._skipper is not None and kwargs.get(output, getattr(self.model.config, output)):
                raise TideUnsupportedError(f"{output} with mode='skip': the layers it skips compute no "
                                           f"{output.removeprefix('output_')}; use mode='select', or tide=False")
        if self.model.training and torch.is_grad_enabled():
            raise TideUnsupportedError("a training forward (model.train(), gradients on) while TIDE is attached: "
                                       "its exits would change the loss and gradients; detach first")
        session = getattr(self._local, "session", None)
        packed = is_paged(cache_in(kwargs))
        if packed:  # continuous batching's manager thread: one session for all its forwards (`batching.py`)
            session = self._local.session = self._local.packed = getattr(self._local, "packed", None) \
                or self._new_session(generating=False)
        elif session is None or getattr(self._local, "auto", False):  # a plain forward is a call of its own
            session = self._local.session = self._new_session(generating=False)
            self._local.auto = True
        tokens = kwargs.get("input_ids", args[0] if args else None)
        tokens = kwargs.get("inputs_embeds") if tokens is None else tokens
        if tokens is None:  # neither ids nor embeddings: the model itself will refuse this forward
            self._local.step = None
            return
        step = self._local.step = new_step(
            session, tokens, kwargs.get("attention_mask"), self.num_layers,
            running=self._skipper is not None and self.options.kv == "recompute", skipping=self._skipper is not None,
            cache=cache_in(kwargs), packed=decode_positions(kwargs, tokens) if packed else None)
        if self.whole_steps and not torch.compiler.is_compiling() and not self._pays(step.exit_layer.numel()):
            step.plain = True  # no exit can stop this step: every position would have to exit (`pricing.pays_at`)
            waiting = self._waiting.get(step.cache) if step.cache is not None else None
            step.skip.pass_through = waiting is None or not waiting.pending
            if session.stats.aside is not None:
                session.stats.aside["priced_plain"] += 1
        elif session.stats.aside is not None and session.started_decode and not packed \
                and not torch.compiler.is_compiling():
            waiting = self._waiting.get(step.cache) if step.cache is not None else None
            catching_up = waiting is not None and bool(waiting.pending)
            schedule = self._aside.setdefault(step.exit_layer.shape[0], StepAside())
            step.plain = schedule.plain_next(catching_up=catching_up)
            step.skip.pass_through = step.plain and not catching_up
            step.started = time.perf_counter()

    def _end(self, _module: nn.Module, _args: tuple, _kwargs: dict, output: Any) -> None:
        step, self._local.step = getattr(self._local, "step", None), None
        if step is None:
            return
        session = self._local.session
        if step.started is not None:
            self._aside[step.exit_layer.shape[0]].record(time.perf_counter() - step.started, step.plain,
                                                          session.stats.aside)
        if step.packed is not None:  # counted and published now: continuous batching has no call end of its own
            publish_stats(self.model, commit_packed(session, step, self.num_layers))
            return
        session.pending.append(step)
        if getattr(self._local, "auto", False):
            self._local.auto = False
            self._local.session = None
            self.commit(session, None)
            publish_stats(self.model, session.stats)
            if output is not None:  # a plain forward returns a complete cache: tokens kv="recompute" parked catch up
                made = cache_in(output) if isinstance(output, dict) else None  # (a cache the model made itself)
                self.complete_cache(step.cache if step.cache is not None else made)

    def score(self, layer: int, hidden: torch.Tensor) -> torch.Tensor:
        """Router score in [0, 1] of each position of `hidden` (..., H) at checkpoint `layer`.

        The fused norm + router kernel when the model's final norm is a known kind, else the model's own
        norm module followed by the router MLP (the two agree; `tests/test_kernels.py` checks it).
        """
        if torch.is_grad_enabled():  # (a no_grad context on every call costs more than the check: generate has none)
            with torch.no_grad():
                return self.score(layer, hidden)
        scorer = self._scorers[layer]
        if scorer is None:
            return torch.sigmoid(self.router.logit(layer, self.adapter.normed(hidden).float()))
        return scorer(hidden)

    def _bind_scorers(self) -> dict[int, Callable[[torch.Tensor], torch.Tensor] | None]:
        """Per checkpoint, the fused scorer bound to its router's weights (None: the model's own norm runs first)."""
        scorers = {}
        for layer, spec in self._norm_specs.items():
            mlp = self.router.routers[str(layer)]
            scorers[layer] = None if spec is None else bind_router_scores(
                spec, mlp.fc1.weight, mlp.fc1.bias, mlp.fc2.weight, mlp.fc2.bias)
        return scorers

    def exit_state(self, layer: int, hidden: torch.Tensor) -> torch.Tensor:
        """What the final norm and head read for a position exiting at `layer` (`TideRouter.exit_state`)."""
        return self.router.exit_state(self.adapter, layer, hidden)

    def exit_mask(self, scores: torch.Tensor, hidden: torch.Tensor, threshold: float) -> torch.Tensor:
        """Positions that may exit: a finite hidden state whose finite score reaches `threshold`.

        A NaN / inf state (a broken forward) never exits, whatever a backend makes of its score.
        """
        ok = torch.isfinite(scores) & (scores >= threshold)
        return ok & torch.isfinite(hidden).all(-1).to(ok.device)

    def _checkpoint_hook(self, layer: int) -> Callable[[nn.Module, tuple, Any], None]:
        def hook(_module: nn.Module, _args: tuple, output: Any) -> None:
            step = getattr(self._local, "step", None)
            threshold = self.thresholds[layer]
            if step is None or step.plain or threshold >= CLOSED or step.all_exited or step.segmented \
                    or (step.skip is not None and step.skip.settled) or not self._active() \
                    or self._local.session.full_depth:
                return  # (skip mode: once every row has exited, or one stays, later checkpoints decide nothing)
            hidden = layer_output(output)
            if hidden.shape[:2] != step.exit_layer.shape:
                raise TideUnsupportedError(
                    f"checkpoint layer {layer} got {tuple(hidden.shape[:2])} (rows, positions) where the model's "
                    f"forward got {tuple(step.exit_layer.shape)}: a forward pre-hook registered on the model after "
                    "attach changed its inputs; register it before attach")
            scores = self.score(layer, hidden)
            if self.host_reads_free and not torch.compiler.is_compiling():  # one host read, free on the CPU
                passing = scores >= threshold
                if step.exited:  # positions that exited at an earlier checkpoint do not exit again
                    passing = passing & (step.exit_layer == self.num_layers).to(passing.device)
                if not bool(passing.any()):  # nothing exits here: no exit state to make, no new decision
                    if self._skipper is not None and not step.skip.decided:
                        self._skipper.decide(step, layer, self.num_layers)
                    return
            fresh = step.exit_layer == self.num_layers
            exits = fresh & self.exit_mask(scores, hidden, threshold).to(fresh.device)
            if self.whole_steps and not bool((exits | ~(fresh & step.valid.to(fresh.device))).all()):
                step.skip.settled = True  # some running position stays: no exit can stop this step's layers
                if not step.skip.decided:
                    self._skipper.decide(step, layer, self.num_layers)
                return
            # Device-side writes only (no `exits.any()`, no row indices): select mode never waits for an accelerator.
            step.exit_layer = step.exit_layer.masked_fill(exits, layer)
            step.exited = True
            # (speculative mode never swaps exit states in: no exit head to run there)
            state = hidden if self.options.mode == "speculative" else self.exit_state(layer, hidden)
            states = step.exit_state
            if states is None:  # values of rows that have not exited are never read
                step.exit_state = state if state is not hidden else hidden.clone()
            else:  # checkpoints of a model split over devices write into the exit states of the first one
                step.exit_state = torch.where(exits.to(states.device).unsqueeze(-1), state.to(states.device), states)
            if self._skipper is not None:  # skip mode's one host read per checkpoint reached
                self._skipper.decide(step, layer, self.num_layers)
        return hook

    def _final_hook(self, _module: nn.Module, _args: tuple, output: Any) -> Any:
        step = getattr(self._local, "step", None)
        if step is None or step.exit_state is None or step.segmented or self.options.mode == "speculative":
            return None  # speculative mode only drafts with exits; verification stays exact
        hidden = layer_output(output)
        exited = (step.exit_layer < self.num_layers).to(hidden.device).unsqueeze(-1)
        swapped = torch.where(exited, step.exit_state.to(hidden.device), hidden)
        return (swapped, *output[1:]) if isinstance(output, tuple) else swapped

    # -- accounting -------------------------------------------------------------------------------
    def commit(self, session: Session, last_tokens: torch.Tensor | None) -> None:
        """Move the pending forwards of `session` into its stats (`Session.commit`)."""
        session.commit(last_tokens, self.num_layers)

    def prefilling(self) -> bool:
        """A generate call in this thread before its first decode step."""
        session = getattr(self._local, "session", None)
        return session is not None and session.generating and not session.started_decode

    def detach(self) -> None:
        """Remove every hook and replaced forward: the model is exactly as before `attach`.

        Only this handle's own: the hooks of a concurrent per-call attach on the same model stay.
        """
        with LOCK:
            self._patches.restore()
            unregister(self.model, self)


def hook_model(handle_class: type[TideHandle], model: nn.Module, router: TideRouter | str | os.PathLike,
               config: TideConfig | None = None, *, ignore_fingerprint: bool = False, **options: Any) -> TideHandle:
    """Check everything, then hook `model`'s layers with a `handle_class` handle (`tide_hf.attach` is this and the
    model's generate wired to it; a subclass scores checkpoints differently, as the bench's baselines do)."""
    check_model(model)
    if not (isinstance(handle_class, type) and issubclass(handle_class, TideHandle)):
        raise TideArgumentTypeError(f"handle_class must be a TideHandle subclass, got {handle_class!r}")
    request = TideConfig.merged(config, options)
    if isinstance(router, (str, os.PathLike)):
        router = TideRouter.from_pretrained(router)  # checked as it loads
    elif isinstance(router, TideRouter):
        router.check_consistent(reuse=True)  # its config edited since its weights were made: named, not a KeyError
    else:
        raise TideArgumentTypeError(f"router must be a TideRouter, a router folder or a Hub repo id; got "
                                    f"{type(router).__name__}")
    with LOCK:
        check_free(model)
        handle = _build(model, router, request, ignore_fingerprint=ignore_fingerprint, handle_class=handle_class)
        register(model, handle)
    return handle


def attach_for_call(model: nn.Module, router: TideRouter, request: TideConfig | None = None) -> TideHandle:
    """Attach `router` with `request` (None: attach's defaults) for one call in the calling thread only
    (`generate(tide=router, tide_config=request)`).

    Other threads see the stock model, and any number of such calls may run on one model at once, each
    detaching only its own hooks. Refused while an `attach` (which acts in every thread) is in place.
    """
    with LOCK:
        if get_handle(model) is not None:
            raise TideArgumentError("a different TIDE router is already attached to this model; use tide=True, "
                                    "or detach it before passing another router")
        handle = _build(model, router, request or TideConfig(), owner=threading.get_ident())
        register_call(model, handle)
    return handle


def _build(model: nn.Module, router: TideRouter, request: TideConfig, *, ignore_fingerprint: bool = False,
           handle_class: type[TideHandle] = TideHandle, owner: int | None = None) -> TideHandle:
    """Check everything, then hook the model (the caller holds the registry lock and registers the handle)."""
    adapter = get_adapter(model)
    router.check_compatible(model, ignore_fingerprint=ignore_fingerprint, adapter=adapter)
    options, plan = resolve_mode(model, adapter, router, request)
    if pricing.applies(options):
        options = pricing.unpriced(options, router) or pricing.price(
            options, router, step_costs(model, router, options, adapter, plan, handle_class, ignore_fingerprint))
    return handle_class(model, router, options, adapter, owner=owner, skip_plan=plan,
                        ignore_fingerprint=ignore_fingerprint)


def step_costs(model: nn.Module, router: TideRouter, options: TideOptions, adapter: ModelAdapter,
               plan: SkipPlan | None, handle_class: type[TideHandle], ignore_fingerprint: bool) -> StepCosts:
    """The costs pricing reads (`costs.measure`), remembered per model state, cache policy and thread count: a
    handle of this thread alone forces exits at the timed checkpoints, then goes; `last_stats` is left as it was."""
    timed = pricing.timed_checkpoints(router, options)

    def measured() -> StepCosts:
        forced = {k: costs.FORCED if k in timed else CLOSED for k in router.checkpoint_layers}
        probe = handle_class(model, router, dataclasses.replace(options, thresholds=forced), adapter,
                             owner=threading.get_ident(), skip_plan=plan, ignore_fingerprint=ignore_fingerprint)
        previous = last_stats(model)
        try:
            return costs.measure(model, probe, adapter.layers, timed)
        finally:
            probe.detach()
            publish_stats(model, previous)

    scorer = (router.config.router_bottleneck_dim, router.config.exit_head, router.config.exit_head_rank)
    key = ("step costs", options.kv, tuple(timed), torch.get_num_threads(), scorer)
    return remembered(model, key, measured)
