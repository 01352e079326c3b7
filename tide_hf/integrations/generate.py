"""The `tide=` keyword of stock `model.generate()`, which `pipeline("text-generation")` forwards as is.

`attach` wires the attached model's own `generate` (`wire_generate`); `enable_generate_keyword()` wraps
`GenerationMixin.generate` once, for every model (`disable_generate_keyword` puts the original back);
`import tide_hf` does neither. Without `tide=` (and without an attached router) the wrapper calls the original
generate with the same arguments: stock behaviour is unchanged.

    tide=True          use the router attached with `tide_hf.attach` (error if none)
    tide=False         run stock generate even though a router is attached
    tide=<TideRouter | local dir | Hub repo id>
                       attach that router for this call, in this thread only: other threads (stock calls,
                       other tide= calls) never see it (routers loaded by name are cached)
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import os
import reprlib
import types
import weakref
from collections.abc import Callable
from typing import Any

import torch
from transformers import GenerationMixin, LogitsProcessorList

from ..compat import cache_in, merged_generation_config
from ..errors import TideArgumentError, TideArgumentTypeError
from ..modeling import TideRouter
from ..runtime import Patches, TideConfig, TideHandle, attach_for_call, get_handle
from .processor import TideLogitsProcessor
from .speculative import generate as speculative_generate

_ROUTER_CACHE_SIZE = 8
# attached router -> named router -> (their tensors' in-place version sum, one router?) (`same_router`)
_SAME_ROUTER: weakref.WeakKeyDictionary[Any, weakref.WeakKeyDictionary[Any, tuple[int, bool]]] = \
    weakref.WeakKeyDictionary()
_INSTALLED = Patches()  # the wrapped `GenerationMixin.generate`, while installed
_CURRENT: list[Any] = [None]  # the wrapper installed now: an older one another library still wraps passes through


@functools.lru_cache(maxsize=_ROUTER_CACHE_SIZE)
def _load_router(name: str, _version: tuple) -> TideRouter:
    return TideRouter.from_pretrained(name)


def _folder_version(path: str) -> tuple:
    """What identifies the current contents of a local router folder: (name, size, mtime) of each file.

    Part of the cache key, so a folder saved again (or deleted) is never answered with the old router.
    """
    try:
        entries = sorted(os.scandir(path), key=lambda e: e.name)
        files = tuple((e.name, e.stat().st_size, e.stat().st_mtime_ns) for e in entries if e.is_file())
        with open(os.path.join(path, "config.json"), "rb") as f:  # small: its content too
            return (*files, hashlib.sha256(f.read()).hexdigest())
    except OSError:
        return ("missing",)


def resolve_router(tide: Any) -> TideRouter:
    """A `TideRouter` from what a user may pass as `tide=`: the object, a local folder or a Hub repo id.

    Routers loaded by name are cached: a Hub id by name, a local folder by name and file sizes / times.
    """
    if isinstance(tide, TideRouter):
        return tide
    if isinstance(tide, (str, os.PathLike)):
        name = os.fspath(tide)
        if os.path.isdir(name):
            return _load_router(os.path.realpath(name), _folder_version(name))
        return _load_router(name, ())
    raise TideArgumentTypeError(f"tide= takes True/False, a TideRouter, a local folder or a Hub repo id; "
                                f"got {reprlib.repr(tide)} ({type(tide).__name__})")


def _eos_ids(config: Any) -> torch.Tensor | None:
    eos = config.eos_token_id
    if eos is None:
        return None
    return torch.as_tensor(eos).reshape(-1)  # an int, a list or a tensor (0-d included), as stock accepts


def _check_decoding(handle: TideHandle, config: Any, kwargs: dict) -> None:
    """Refuse decoding that edits the cache under `kv="recompute"`: its waiting tokens live outside the cache,
    so beam search's reordering and assisted decoding's cropping would not reach them."""
    if handle.options.mode != "skip" or handle.options.kv != "recompute":
        return
    beams = config.num_beams or 1
    used = [f"num_beams={beams}"] * (beams > 1) + [
        name for name in ("assistant_model", "prompt_lookup_num_tokens", "assistant_early_exit", "custom_generate")
        if kwargs.get(name, getattr(config, name, None)) is not None]
    if used:
        raise TideArgumentError(f"kv='recompute' cannot serve {', '.join(used)}: the tokens waiting for their "
                                "skipped layers live outside the cache that this decoding reorders or cuts; attach "
                                "with kv='propagate' (or mode='select') for it")


def as_keywords(original: Callable, model: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """`generate`'s positional arguments (inputs, generation_config, logits_processor, ...) as keywords, so the
    settings read below are the call's wherever it put them. Left as they are when the signature does not name
    them (another library's `(self, *args, **kwargs)` wrapper around generate) or they do not fit it."""
    if not args:
        return args, kwargs
    signature = inspect.signature(original)
    if any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in signature.parameters.values()):
        return args, kwargs
    try:
        bound = signature.bind_partial(model, *args, **kwargs).arguments
    except TypeError:  # generate itself will say what is wrong
        return args, kwargs
    named: dict[str, Any] = {}
    for name, value in bound.items():
        if signature.parameters[name].kind is inspect.Parameter.VAR_KEYWORD:
            named.update(value)
        elif name != "self":
            named[name] = value
    return (), named


def _run(handle: TideHandle, original: Callable, model: Any, args: tuple, kwargs: dict) -> Any:
    args, kwargs = as_keywords(original, model, args, kwargs)
    config = merged_generation_config(model, kwargs)  # once per call: the settings generate will run with
    _check_decoding(handle, config, kwargs)
    with handle.session(generating=True, eos=_eos_ids(config)) as session:
        mask = kwargs.get("attention_mask")
        session.prompt_mask = mask if isinstance(mask, torch.Tensor) and mask.dim() == 2 else None
        session.chunked = getattr(config, "prefill_chunk_size", None) is not None
        if handle.options.mode == "speculative":  # drafts + full-depth verification in stock assisted decoding
            return speculative_generate(handle, original, model, args, kwargs, session, config)
        processors = LogitsProcessorList(kwargs.get("logits_processor") or [])
        processors.append(TideLogitsProcessor(handle, session))
        out = original(model, *args, **{**kwargs, "logits_processor": processors})
        for cache in (cache_in(kwargs), cache_in(out) if isinstance(out, dict) else None):  # caches that outlive it
            handle.complete_cache(cache)
        return out


def same_router(a: TideRouter, b: TideRouter) -> bool:
    """`a` and `b` are one router: the same object, or equal configs and weights (the attached router, and
    `tide=` naming the folder it was loaded from). Weights are compared on `a`'s device, once per pair of
    objects while neither changes in place (routers load cached by folder: a repeated `tide=folder` is the
    same pair)."""
    if a is b:
        return True
    ours, theirs = a.state_dict(), b.state_dict()
    versions = sum(t._version for t in (*ours.values(), *theirs.values()))  # bumped by in-place edits
    known = _SAME_ROUTER.setdefault(a, weakref.WeakKeyDictionary()).get(b)
    if known is None or known[0] != versions:
        volatile = ("_name_or_path", "transformers_version")
        configs = [{k: v for k, v in r.config.to_dict().items() if k not in volatile} for r in (a, b)]
        known = (versions, configs[0] == configs[1] and ours.keys() == theirs.keys() and all(
            ours[k].shape == theirs[k].shape and torch.equal(ours[k], theirs[k].to(ours[k].device)) for k in ours))
        _SAME_ROUTER[a][b] = known
    return known[1]


def dispatch(original: Callable, model: Any, args: tuple, kwargs: dict, tide: Any, config: Any = None) -> Any:
    """One `generate` call on `model` with its `tide=` and `tide_config=` values, `original` being the generate
    beneath TIDE's. `tide_config` (a `TideConfig`) is what a router given as `tide=` is attached with for the call;
    it is refused where no router attaches for the call (it would be ignored)."""
    handle = get_handle(model)
    if config is not None and not isinstance(config, TideConfig):
        raise TideArgumentTypeError(f"tide_config= takes a tide_hf.TideConfig, got {type(config).__name__}")
    if config is not None and (tide in (True, False, None) or handle is not None):
        raise TideArgumentError("tide_config= applies where tide=<router> attaches for this call; "
                                + ("this model has a router attached, which serves its own options: detach it first"
                                   if handle is not None else f"tide={tide!r} attaches nothing"))
    if tide is False or (tide is None and (handle is None or handle.is_disabled())):
        if handle is None:
            return original(model, *args, **kwargs)
        with handle.disabled(), handle.turns.shared():
            return original(model, *args, **kwargs)
    if tide is True or tide is None:
        if handle is None:
            raise TideArgumentError("generate(tide=True) needs a router: call tide_hf.attach(model, router) first, "
                                    "or pass tide=<TideRouter | local dir | Hub repo id>")
        with handle.turns.shared():
            return _run(handle, original, model, args, kwargs)
    router = resolve_router(tide)
    if handle is not None and same_router(handle.router, router):
        with handle.turns.shared():
            return _run(handle, original, model, args, kwargs)
    handle = attach_for_call(model, router, config)  # this thread only; refused if another router is attached
    try:
        return _run(handle, original, model, args, kwargs)
    finally:
        handle.detach()


def keywords(tide: Any, config: Any) -> dict[str, Any]:
    """The TIDE keywords of a call as given (a keyword left out stays out), for the generate beneath."""
    return {name: value for name, value in (("tide", tide), ("tide_config", config)) if value is not None}


def enable_generate_keyword() -> None:
    """Teach stock `generate()` (and so `pipeline("text-generation")`) the `tide=` keyword.

    Wraps `GenerationMixin.generate` for every model in the process; idempotent; `disable_generate_keyword`
    reverts it. `attach` needs no keyword: it wires the attached model's own `generate`.

    Example:
        >>> import tide_hf
        >>> tide_hf.enable_generate_keyword()  # then model.generate(**inputs, tide=router)
    """
    if _INSTALLED:
        return
    original = GenerationMixin.generate

    @functools.wraps(original)
    def generate(self, *args: Any, tide: Any = None, tide_config: Any = None, **kwargs: Any) -> Any:
        if _CURRENT[0] is not generate:  # uninstalled, but kept inside a wrapper that another library put on top
            return original(self, *args, **kwargs, **keywords(tide, tide_config))
        return dispatch(original, self, args, kwargs, tide, tide_config)

    _INSTALLED.set_attr(GenerationMixin, "generate", generate)
    _CURRENT[0] = generate


def wire_generate(handle: TideHandle) -> None:
    """Make the attached model's own `generate` run TIDE (sessions, statistics, the recompute policy's cache,
    speculative drafting) and take `tide=`, until detach: a method on the model object, so no other model and no
    transformers class changes. With the keyword enabled for every model, the class's wrapper does the same."""
    model = handle.model
    stock = type(model).generate

    @functools.wraps(stock)
    def generate(self: Any, *args: Any, tide: Any = None, tide_config: Any = None, **kwargs: Any) -> Any:
        method = type(self).generate
        if _INSTALLED and method is _CURRENT[0]:  # the keyword is enabled: its wrapper serves this call
            return method(self, *args, **kwargs, **keywords(tide, tide_config))
        return dispatch(method, self, args, kwargs, tide, tide_config)

    handle.patch_attribute(model, "generate", types.MethodType(generate, model))


def disable_generate_keyword() -> None:
    """Put stock `GenerationMixin.generate` back (`enable_generate_keyword` wraps it again)."""
    _INSTALLED.restore()
    _CURRENT[0] = None
