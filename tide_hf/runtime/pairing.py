"""What keeps an attached router paired with its model after attach: a watch on the weights (a model loaded
with other weights while attached is served as an attach after the change would serve it: refused, or with
`ignore_fingerprint=True` served with a warning), routers placed beside their layers (again after a cast or a
move), and the refusal to pickle or copy an attached model (its hooks belong to the attach)."""

from __future__ import annotations

import warnings
from typing import Any, NoReturn

from torch import nn

from ..errors import TideArgumentError, TideCompatibilityError
from ..kernels import NormSpec, norm_spec
from ..modeling import ModelAdapter, TideRouter
from ..modeling.devices import execution_device, onloaded
from ..modeling.fingerprint import same_weights


def refuse_pickling(*_: Any) -> NoReturn:
    """Set as an attached model's `__reduce_ex__`: `torch.save(model)`, `pickle` and `copy.copy` failed on a
    hook's local function, with an AttributeError that did not say why."""
    raise TideArgumentError("an attached model cannot be deep-copied, copied or pickled (copy.deepcopy, copy.copy, "
                            "torch.save(model), pickle): its hooks belong to this attach; copy it before attach or "
                            "after detach, or save its weights (state_dict(), save_pretrained()), which attach leaves "
                            "as they are")


def place_routers(router: TideRouter, adapter: ModelAdapter) -> dict[int, NormSpec | None]:
    """Per checkpoint, the final norm its router reads (None: a norm the fused kernel does not reproduce), with
    the router, its exit head and that norm's weights on the execution device of the checkpoint's layer
    (accelerate's for a dispatched model; an offloaded final norm is loaded once here). The norm's formula is
    probed in the model's current dtype: fp32 cannot tell OLMo-2's fp32-scaled RMSNorm from Llama's."""
    specs: dict[int, NormSpec | None] = {}
    with onloaded(adapter.final_norm):
        spec = norm_spec(adapter.final_norm)
        for k in router.checkpoint_layers:
            device = execution_device(adapter.layers[k - 1])
            for modules in (router.routers, router.exit_heads):
                if str(k) in modules:  # (a router without exit heads has an empty dict of them)
                    modules[str(k)].to(device)
            specs[k] = None if spec is None else spec.to(device)
    return specs


def warn_uncertified(target: Any, situation: str) -> None:
    """Warn that `target` (served with `ignore_fingerprint=True`) holds no certificate on these weights."""
    warnings.warn(f"{situation}: the quality target {target} is certified for the weights the router was "
                  "calibrated on, not these (ignore_fingerprint=True), so it is not guaranteed here: check it on "
                  "your text, or recalibrate on this model", stacklevel=6)


class WeightsWatch:
    """Whether the weights changed since attach (`load_state_dict`, a cast, an optimizer step; not an edit
    through `.data`, which bumps no tensor version), and if so whether they are still the router's.

    A change is noticed from each parameter's name, storage and version (one pass over the parameters per
    call); only then is the fingerprint computed again (a cast keeps it: it hashes sign bits)."""

    def __init__(self, model: nn.Module, adapter: ModelAdapter, fingerprint: str | None, *, ignore: bool,
                 target: Any) -> None:
        self.model, self.adapter, self.fingerprint = model, adapter, fingerprint
        self.ignore, self.target = ignore, target
        self.seen = self.versions()
        if ignore and target is not None and fingerprint and not same_weights(model, fingerprint, adapter):
            warn_uncertified(target, "this model's weights differ from the router's")

    def versions(self) -> tuple:
        """Name, storage and version of every parameter; an offloaded one (on meta, brought in by accelerate
        for each forward, as a new tensor) by its name alone, or every call would count as a change."""
        return tuple((name, "meta") if p.device.type == "meta" else (name, p.data_ptr(), p._version)
                     for name, p in self.model.named_parameters())

    def check(self) -> bool:
        """Whether the weights changed since the last check (a cast, a move, new values). Raise
        `TideCompatibilityError` if they changed to ones the router was not calibrated for (as a fresh attach
        would); with `ignore_fingerprint=True`, warn when a quality target loses its certificate (as a fresh
        attach would)."""
        now = self.versions()
        if now == self.seen:
            return False
        if not self.fingerprint or same_weights(self.model, self.fingerprint, self.adapter):
            self.seen = now
            return True
        if not self.ignore:
            raise TideCompatibilityError(
                "the model's weights changed while the router was attached (load_state_dict, a merge, a training "
                "step...) and are no longer those it was calibrated for: detach, then recalibrate on these weights, "
                "or attach again with ignore_fingerprint=True to use the router on them anyway")
        if self.target is not None:
            warn_uncertified(self.target, "the model's weights changed while attached")
        self.seen = now
        return True
