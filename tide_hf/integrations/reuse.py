"""Verification that reuses the draft's work for the layers it ran (LayerSkip's cache reuse, SWIFT).

A draft round runs the first `draft_layer` layers one token at a time for the last verified token and for
every draft token, the computation stock greedy decoding does for those layers. So verification needs
only the layers after `draft_layer` for the k + 1 positions it checks. `DraftReuse` keeps the draft's
layer-`draft_layer` outputs and its K/V of the first layers; it takes those K/V out of the cache before
stock's verification forward starts (stock derives positions and masks from the cache length, which so
stays the verified length), and in that forward the first layers put them back and pass the hidden
state through, the last of them returning the draft's hidden states. The verification then costs the
deep layers and the LM head for the k + 1 positions. The last draft token has no draft forward of its
own (a draft forward computes the next token), so the drafter runs it through the first layers in one
forward of the model body without the head (the "tail").

Reuse needs plain `DynamicLayer` caches (sliding-window layers trim on update) and no per-layer outputs
(`output_hidden_states` / `output_attentions` would see layers that passed the state through); otherwise
verification recomputes every layer, as stock assisted decoding does.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn
from transformers.cache_utils import DynamicLayer

from ..modeling import layer_output
from ..runtime import Patches


class DraftReuse:
    """The first `depth` layers' work of one draft round, handed to the verification forward that follows."""

    def __init__(self, cache: Any, depth: int, enabled: bool) -> None:
        self.cache, self.depth, self.enabled = cache, depth, enabled
        self.hidden: list[Tensor] = []  # layer-`depth` output of each draft forward's newest position
        self.kv: list[tuple[Tensor, Tensor]] = []  # per first layer: the draft positions' keys and values
        self.positions = 0  # verification positions the kept work covers (0: nothing is reused)
        self.returns_tuple = False  # the layers' output type (some families return a tuple)
        self.verified = 0  # verification forwards that reused a draft's work

    def available(self) -> bool:
        """Whether this round's work can be reused (checked per round: the cache fills its layers lazily)."""
        return self.enabled and all(type(layer) is DynamicLayer for layer in self.cache.layers[: self.depth])

    def clear(self) -> None:
        self.hidden, self.kv, self.positions = [], [], 0

    def record(self, output: Any) -> None:
        """A draft forward's layer-`depth` output (from the gate hook)."""
        self.returns_tuple = isinstance(output, tuple)
        self.hidden.append(layer_output(output)[:, -1:])

    def stash(self, forwards: int, keep: bool) -> None:
        """Take the `forwards` draft entries of the first layers out of the cache (back to the verified
        length); with `keep`, hold them for the next verification forward."""
        layers = self.cache.layers[: self.depth]
        if keep and len(self.hidden) == forwards:
            self.kv = [(layer.keys[..., -forwards:, :], layer.values[..., -forwards:, :]) for layer in layers]
            self.positions = forwards
        else:
            self.clear()
        for layer in layers:
            layer.crop(-forwards)

    def forward(self, index: int, original: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        """Layer `index` (0-based, < depth): the original forward, or in a verification with kept work, the
        draft's K/V put back and the hidden state passed through (the draft's states after the last one)."""
        if not self.positions:
            return original(*args, **kwargs)
        hidden = args[0] if args else kwargs["hidden_states"]
        if hidden.shape[1] != self.positions:
            raise RuntimeError(f"verification of {hidden.shape[1]} positions, but the draft ran {self.positions}")
        keys, values = self.kv[index]
        self.cache.layers[index].update(keys, values)
        out = hidden
        if index == self.depth - 1:
            out = torch.cat(self.hidden, dim=1).to(hidden.device)
            self.clear()
            self.verified += 1
        return (out,) if self.returns_tuple else out


def install_reuse(layers: nn.ModuleList, depth: int, current: Callable[[], DraftReuse | None],
                 patches: Patches) -> None:
    """Route the forwards of the first `depth` layers through `current()`'s reuse (recorded in `patches`;
    the original forward when there is none)."""
    def wrap(index: int, original: Callable[..., Any]) -> Callable[..., Any]:
        def forward(*args: Any, **kwargs: Any) -> Any:
            reuse = current()
            return original(*args, **kwargs) if reuse is None else reuse.forward(index, original, args, kwargs)
        return forward

    for index in range(depth):
        patches.replace_forward(layers[index], lambda original, index=index: wrap(index, original))
