"""The weights fingerprint that pairs a router with the model it was calibrated for."""

from __future__ import annotations

import hashlib
import weakref
from collections.abc import Callable
from typing import Any, TypeVar

import torch
from torch import nn

from ..errors import TideCompatibilityError
from .adapters import ModelAdapter, get_adapter
from .devices import named_weights

FINGERPRINT_SAMPLES = 4096  # values read from each fingerprinted tensor (a strided sample)


FINGERPRINT_VERSION = 2  # 1: embeddings, first and last layer only; 2: every decoder layer, final norm and head too
FIRST_VERSION = 1  # written as 16 hex digits alone; every later version as "v<version>:" and 16 hex digits
HASH_DIGITS = 16


def fingerprint_version(fingerprint: str) -> int:
    """The version a stored fingerprint was computed with (routers calibrated before version 2 have version 1);
    `TideCompatibilityError` for one this tide_hf cannot compute (a newer version's)."""
    head, sep, _ = fingerprint.partition(":")
    if not sep:
        return FIRST_VERSION
    version = int(head[1:]) if head[:1] == "v" and head[1:].isdigit() else None
    if version is None or version > FINGERPRINT_VERSION:
        raise TideCompatibilityError(f"the router's weights fingerprint {fingerprint!r} is of a kind this tide_hf "
                                     f"(fingerprint version {FINGERPRINT_VERSION}) cannot check: a newer tide_hf "
                                     "made it; upgrade tide_hf")
    return version


def in_model(module: nn.Module, owned: set[int]) -> list[nn.Module]:
    """`module` if the model holds it, else its outermost parts the model holds: an adapter's stand-ins (an
    `Identity` for a missing final norm, a head composed of the model's projection and head) are not the model's."""
    if id(module) in owned:
        return [module]
    return [part for child in module.children() for part in in_model(child, owned)]


T = TypeVar("T")
# model -> {check: (the model state it passed on, its result)}: work that reads the whole model (the weights hash,
# skip mode's probe forward, speculative mode's depth check) is done once per model state: attaching again is cheap
_REMEMBERED: weakref.WeakKeyDictionary[nn.Module, dict[Any, tuple[tuple, Any]]] = weakref.WeakKeyDictionary()


def model_state(model: nn.Module) -> tuple:
    """What a check of `model` depends on: each parameter's name, storage, dtype and version (a load, a cast, a
    move), each module's own forward (a patch) and the config's fields."""
    params = tuple((name, "meta" if p.device.type == "meta" else p.data_ptr(), p.dtype, p._version)
                   for name, p in model.named_parameters())
    forwards = tuple(id(vars(module).get("forward")) for module in model.modules())
    config = getattr(model, "config", None)
    return params, forwards, dict(vars(config)) if config is not None else None


def remembered(model: nn.Module, check: Any, compute: Callable[[], T]) -> T:
    """`compute()` (a check of `model` named by `check`), or its result from an earlier call on the same model
    state (`model_state`); a check that raises is not remembered."""
    memo = _REMEMBERED.setdefault(model, {})
    state = model_state(model)
    if check in memo and memo[check][0] == state:
        return memo[check][1]
    result = compute()
    memo[check] = (state, result)
    return result


def model_fingerprint(model: nn.Module, adapter: ModelAdapter | None = None, version: int = FINGERPRINT_VERSION
                      ) -> str:
    """`weights_hash` of `model`, remembered per model state (`remembered`): attaching again hashes nothing."""
    return remembered(model, ("fingerprint", version), lambda: weights_hash(model, adapter, version))


@torch.no_grad()
def weights_hash(model: nn.Module, adapter: ModelAdapter | None = None, version: int = FINGERPRINT_VERSION) -> str:
    """A short hash of the names, shapes and the sign bits of a strided sample of the values of the embeddings,
    every decoder layer, the final norm and the head (`version=1`: the embeddings, first and last layer, which
    missed a model whose middle layers alone differ, e.g. a fine-tune of some layers; kept to check routers
    calibrated before).

    Sign bits because they are exactly dtype-independent: rounding the same weights to bf16 or fp16 (or
    back to fp32) never changes a sign, underflow included (it gives a signed zero), so fp32 / bf16 / fp16
    copies of a model agree bit for bit, whereas any rounding of the values themselves has boundaries that
    some weights sit next to. A fine-tune moves the small weights of these tensors across zero (thousands of
    sampled values), which changes the hash. Offloaded weights of a dispatched model are read from
    accelerate's weights map: the fingerprint is the model's own.
    """
    adapter = adapter or get_adapter(model)
    owned = {id(module) for module in model.modules()}
    modules = [adapter.embeddings, adapter.layers[0], adapter.layers[-1]] if version == FIRST_VERSION else \
        [part for module in (adapter.embeddings, *adapter.layers, adapter.final_norm, adapter.lm_head)
         for part in in_model(module, owned)]
    named = dict(model.named_modules())
    headers, signs = [], []
    for index, module in enumerate(modules):
        for name, param in sorted(named_weights(model, module, named)):  # offloaded weights: accelerate's map
            flat = param.detach().reshape(-1)
            sample = flat[:: max(1, flat.numel() // FINGERPRINT_SAMPLES)][:FINGERPRINT_SAMPLES]
            signs.append(torch.signbit(sample) if sample.is_floating_point() else sample < 0)
            headers.append(f"{name}{tuple(param.shape)}" if version == FIRST_VERSION else
                           f"{index}.{name}{tuple(param.shape)}")
    # one copy to the host for every tensor's signs (a sync per tensor cost more than the sampling)
    host = torch.cat([s.to(signs[0].device, torch.uint8) for s in signs]).cpu().numpy()
    digest, start = hashlib.sha256(), 0
    for header, sign in zip(headers, signs):
        digest.update(header.encode())
        digest.update(host[start : start + sign.numel()].tobytes())
        start += sign.numel()
    hashed = digest.hexdigest()[:HASH_DIGITS]
    return hashed if version == FIRST_VERSION else f"v{version}:{hashed}"


def same_weights(model: nn.Module, fingerprint: str, adapter: ModelAdapter | None = None) -> bool:
    """Whether `model`'s weights give `fingerprint` (False for a fingerprint this tide_hf cannot compute)."""
    try:
        version = fingerprint_version(fingerprint)
    except TideCompatibilityError:
        return False
    return model_fingerprint(model, adapter, version) == fingerprint
