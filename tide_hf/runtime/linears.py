"""The CPU fast path of a model's linear layers: oneDNN's matmul on a copy of each weight packed once.

Eager `nn.Linear` on the CPU multiplies by the weight as stored. oneDNN can multiply faster by a copy reordered
once into its blocked layout (SmolLM2-135M fp32 on 2 cores, one probe run: 42 vs 54 ms a step for 1 new token, 49 vs
93 for 2; with other jobs on the cores it measured slower for 1-2 tokens: whether it pays is the CPU's to say).
`fast_linears` gives each `nn.Linear` it can serve a forward that calls oneDNN on that copy, through `Patches`
(`forward_attribute`: under accelerate's hooks, its device hooks keep running around it); `undo` restores it.

- The packed copy lives in the patched forward, not in the module: not in `state_dict`, `parameters`, `buffers`
  or `save_pretrained`. It costs one extra copy of the switched layers' weights (a tied LM head's included).
- The copy is never served stale as far as torch can tell: each call compares the weight with the one packed
  (object, version counter, storage, dtype, device) and packs again on a change (`load_state_dict`, an in-place
  edit, `.to(dtype)`), or runs eagerly where the new weight cannot be packed (moved to CUDA or meta). An edit
  through `.data` (peft's default LoRA merge) bumps no version counter: call `LinearPath.repack()` after one.
- A call runs eagerly where the packed op would differ from stock: under autograd (it has no backward), under
  autocast, and for an input that is not a plain CPU tensor of the weight's dtype.
- A deep copy or a pickle of the model runs eagerly on its own weights: the packed copies stay with the original.
"""

from __future__ import annotations

import copy
import statistics
import time
import warnings
import weakref
from collections import Counter
from collections.abc import Callable
from typing import Any, NamedTuple, SupportsIndex

import torch
import torch.nn.functional as F
from torch import nn
from transformers.pytorch_utils import Conv1D

from ..callers import caller_stacklevel
from ..compat import onednn_available, onednn_dtypes, packed_linear, prepack_linear_weight
from ..errors import TideArgumentError
from .patching import Patches, forward_attribute

PLAIN_TENSORS = (torch.Tensor, nn.Parameter)  # what oneDNN reads as stored (not a quantized or sharded subclass)
CPU = "cpu"
CONV1D = "transformers Conv1D (GPT-2's projections), not nn.Linear"
NO_ONEDNN = "oneDNN or its prepacked linear ops missing from this torch build"
UNPACKED = "oneDNN refused to pack the weight"
SLOWER = "oneDNN measured slower than eager at every row count timed"
ROW_COUNTS = (1, 2, 4, 8, 16)  # rows (tokens x batch) a sweep is timed at to choose where oneDNN starts serving
SWEEP_REPEATS = 3  # timed sweeps per path and row count (the median is kept), after one untimed


class LinearPathWarning(UserWarning):
    """`fast_linears` left some linear layers eager (the message names each reason and its count)."""


def unpackable(weight: Any) -> str | None:
    """Why oneDNN cannot pack `weight` for the fast path (None: it can)."""
    if type(weight) not in PLAIN_TENSORS:
        return f"{type(weight).__name__} weight (a quantized or sharded tensor)"
    if weight.device.type == "meta":
        return "weight on the meta device (offloaded by accelerate, or never loaded)"
    if weight.device.type != CPU:
        return f"weight on {weight.device.type}"
    if weight.dtype not in onednn_dtypes():
        return f"{weight.dtype} weight (oneDNN computes {', '.join(sorted(map(str, onednn_dtypes())))} here)"
    if weight.layout != torch.strided or weight.dim() != 2 or weight.numel() == 0:
        return "sparse, empty or not 2-D weight"
    if weight.is_inference():
        return "weight made under torch.inference_mode (no version counter to watch)"
    return None


def why_eager(module: nn.Linear) -> str | None:
    """Why `module` stays eager (None: the fast path serves it)."""
    if type(module).forward is not nn.Linear.forward:
        return f"{type(module).__name__} has a forward of its own (a quantized or adapter layer)"
    forward = getattr(module, forward_attribute(module))
    if getattr(forward, "__func__", None) is not nn.Linear.forward or forward.__self__ is not module:
        return "forward already replaced on the instance (the fast path, or another library)"
    if dict(module.named_parameters(recurse=False)).get("weight") is not module.weight:
        return "weight computed from other tensors (parametrized or weight-normed)"
    return unpackable(module.weight)


class Packing(NamedTuple):
    """A packed copy and the weight it was packed from (a weak reference: the copy keeps no old weight alive)."""

    source: weakref.ref
    version: int
    data_ptr: int
    dtype: torch.dtype
    device: torch.device
    packed: torch.Tensor

    def serves(self, weight: torch.Tensor) -> bool:
        """Whether `weight` is still the weight packed, unchanged as far as torch can tell."""
        return (self.source() is weight and weight.data_ptr() == self.data_ptr and weight.dtype == self.dtype
                and weight.device == self.device and weight._version == self.version)


class PackedWeight:
    """One layer's packed copy (`state`, replaced whole: a call never reads half of a new one); `current()` packs
    again when the layer's weight changed."""

    def __init__(self, module: nn.Linear) -> None:
        self.module, self.live = module, True
        self.state: Packing | None = None
        self.pack()

    def pack(self) -> None:
        """Pack the module's weight now (none where it cannot be packed: the layer then runs eagerly)."""
        self.state = None  # the stale copy goes first: one extra copy at a time
        weight = self.module.weight
        if not self.live or unpackable(weight) is not None:
            return
        try:
            packed = prepack_linear_weight(weight)
        except RuntimeError:  # a shape or layout this oneDNN refuses: the layer runs eagerly
            return
        self.state = Packing(weakref.ref(weight), weight._version, weight.data_ptr(), weight.dtype, weight.device,
                             packed)

    def current(self, weight: torch.Tensor) -> torch.Tensor | None:
        """The packed copy of `weight` (the module's weight now), packed again if it changed; None: run eagerly."""
        state = self.state
        if (state is None or not state.serves(weight)) and self.live:
            self.pack()
            state = self.state
        return None if state is None else state.packed

    def release(self) -> None:
        """Drop the copy for good: a forward kept past `undo` (inside another library's wrapper) runs eagerly."""
        self.live = False
        self.state = None


def runs_eagerly(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether this call must run as stock: autograd records it (the packed op has no backward), autocast would
    recast it, or the input is not a plain CPU tensor of the weight's dtype and width."""
    if torch.is_grad_enabled() and (input.requires_grad or weight.requires_grad
                                    or (bias is not None and bias.requires_grad)):
        return True
    if torch.is_autocast_enabled(CPU) or type(input) is not torch.Tensor or input.device.type != CPU:
        return True
    if input.dtype != weight.dtype or input.dim() == 0 or input.shape[-1] != weight.shape[-1]:
        return True
    return bias is not None and (type(bias) not in PLAIN_TENSORS or bias.dtype != weight.dtype
                                 or bias.device.type != CPU)


class FastForward:
    """The forward of a switched layer: oneDNN on the packed copy, or `eager` (the forward it replaced).

    A deep copy or a pickle of the model gets `eager` in its place, bound to the copy's layer: the packed copy
    and the `LinearPath` that undoes it belong to this model (a copy computing with this model's weights would
    be wrong)."""

    def __init__(self, pack: PackedWeight, eager: Callable[[torch.Tensor], torch.Tensor], rows_from: int) -> None:
        self.pack, self.eager, self.rows_from = pack, eager, rows_from

    def __call__(self, input: torch.Tensor) -> torch.Tensor:
        module = self.pack.module
        weight, bias = module.weight, module.bias
        eager = runs_eagerly(input, weight, bias) or input.numel() < self.rows_from * input.shape[-1]
        packed = None if eager else self.pack.current(weight)
        if packed is None:
            return self.eager(input)
        out = packed_linear(input.reshape(-1, input.shape[-1]), packed, bias)
        return out.reshape(*input.shape[:-1], weight.shape[0])

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        return copy.deepcopy(self.eager, memo)

    def __reduce_ex__(self, protocol: SupportsIndex) -> Any:
        return self.eager.__reduce_ex__(protocol)


class LinearPath:
    """The fast path on one model (`fast_linears`): a context manager; `undo()` restores every layer.

    Attributes:
        switched: how many linear layers the fast path serves.
        left: why the other linear layers stayed eager: reason -> how many.
        rows_from: the fewest rows (tokens x batch) of a call oneDNN serves; fewer run eagerly (None: no layer
            switched).
    """

    def __init__(self, packs: list[PackedWeight], left: dict[str, int], patches: Patches, rows_from: int | None
                 ) -> None:
        self.switched, self.left, self.rows_from = len(packs), left, rows_from
        self.packs, self.patches = packs, patches

    def __enter__(self) -> LinearPath:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.undo()

    def __repr__(self) -> str:
        return f"LinearPath(switched={self.switched}, left={self.left}, rows_from={self.rows_from})"

    def undo(self) -> None:
        """Give every switched layer its forward back and drop the packed copies (idempotent)."""
        self.patches.restore()
        for pack in self.packs:
            pack.release()
        self.packs = []

    def repack(self) -> None:
        """Pack every switched layer's weight again now: needed after an edit through `.data` (peft's default
        LoRA merge), which bumps no version counter; every other change is seen at the next call."""
        for pack in self.packs:
            pack.pack()


def sweep_seconds(packs: list[PackedWeight], rows: int, packed: bool) -> float:
    """Median seconds of one pass over every packed layer with `rows` random rows, eagerly or on the packed copies:
    each weight is read once, as a forward reads it (a single layer timed alone would stay in the CPU's cache)."""
    inputs = {(p.module.in_features, p.module.weight.dtype): torch.randn(rows, p.module.in_features,
                                                                        dtype=p.module.weight.dtype) for p in packs}
    times = []
    with torch.no_grad():
        for _ in range(SWEEP_REPEATS + 1):  # the first pass is untimed
            started = time.perf_counter()
            for p in packs:
                x = inputs[p.module.in_features, p.module.weight.dtype]
                if packed:
                    packed_linear(x, p.state.packed, p.module.bias)
                else:
                    F.linear(x, p.module.weight, p.module.bias)
            times.append(time.perf_counter() - started)
    return statistics.median(times[1:])


def measured_rows_from(packs: list[PackedWeight]) -> int | None:
    """The fewest rows of `ROW_COUNTS` from which the packed copies ran faster than eager, there and at every larger
    count timed (None: eager won at the largest). Where oneDNN pays depends on the CPU: its cache, its matmul
    kernels, the threads."""
    faster = [sweep_seconds(packs, rows, True) < sweep_seconds(packs, rows, False) for rows in ROW_COUNTS]
    if not faster[-1]:
        return None
    first = len(faster) - 1
    while first > 0 and faster[first - 1]:
        first -= 1
    return ROW_COUNTS[first]


# model -> rows_from measured on it (per dtype and thread count): a model's path is chosen once, so its outputs do
# not change from call to call with the machine's load
_MEASURED: weakref.WeakKeyDictionary[nn.Module, dict[tuple[torch.dtype, int], int | None]] = \
    weakref.WeakKeyDictionary()


def fast_linears(model: nn.Module, rows_from: int | None = None) -> LinearPath:
    """Run `model`'s linear layers through oneDNN on the CPU, on a copy of each weight packed once.

    Each `nn.Linear` (or subclass that keeps its forward) with a plain CPU weight oneDNN computes (fp32, and
    bf16 / fp16 where this CPU has them) gets a forward that multiplies by a packed copy of its weight. The
    other layers stay as they are: quantized or adapter subclasses, weights on CUDA or meta (offloaded by
    accelerate), GPT-2's `Conv1D`; one `LinearPathWarning` names each reason and its count. Outputs match eager
    within float rounding (the sum is ordered differently), the same on every call. Calls under autograd or
    autocast run eagerly, so training is unchanged: the fast path serves `torch.no_grad()` and
    `torch.inference_mode()` (as `generate` runs). Memory: one extra copy of the switched layers' weights,
    outside the model's state (not in `state_dict` or `save_pretrained`); `undo` frees it.

    Where oneDNN pays depends on the CPU. With `rows_from=None` it is measured once per model, dtype and thread
    count: a pass over every layer is timed eagerly and packed at 1 to 16 rows (SmolLM2-135M on 2 CPU cores: 1.7 s
    with the packing; 0.13 s for a later call). Calls with fewer rows than where packed first won (and won at every
    larger count) run eagerly. Where eager won at 16 rows, no
    layer is switched (the warning says so).

    Args:
        model: the model (any `nn.Module`); its linear layers are changed in place until `undo`.
        rows_from: the fewest rows (tokens x batch) of a call served by oneDNN; fewer run eagerly. None: measured
            (see above). 1: every call oneDNN can serve.

    Returns:
        A `LinearPath`: `switched` (layers served), `left` (reason -> count of layers left eager), `rows_from`,
        `undo()`,
        `repack()` (after editing weights through `.data`); a context manager that undoes on exit.

    Example:
        >>> import torch
        >>> import tide_hf
        >>> model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
        >>> x = torch.randn(3, 8)
        >>> with torch.no_grad(), tide_hf.fast_linears(model, rows_from=1) as path:
        ...     fast = model(x)
        >>> torch.allclose(fast, model(x), atol=1e-5)
        True
    """
    if rows_from is not None and (isinstance(rows_from, bool) or not isinstance(rows_from, int) or rows_from < 1):
        raise TideArgumentError(f"rows_from must be a positive int or None (measured), got {rows_from!r}")
    packs, left = [], Counter()
    for module in model.modules():
        if isinstance(module, Conv1D):
            left[CONV1D] += 1
        if not isinstance(module, nn.Linear):
            continue
        reason = why_eager(module) if onednn_available() else NO_ONEDNN
        pack = PackedWeight(module) if reason is None else None
        if pack is None or pack.state is None:
            left[reason or UNPACKED] += 1
            continue
        packs.append(pack)
    if rows_from is None and packs:
        key = (frozenset(p.module.weight.dtype for p in packs), torch.get_num_threads())
        measured = _MEASURED.setdefault(model, {})
        if key not in measured:
            measured[key] = measured_rows_from(packs)
        rows_from = measured[key]
        if rows_from is None:  # eager won at every row count: nothing is switched, no copy kept
            left[SLOWER] += len(packs)
            for pack in packs:
                pack.release()
            packs = []
    patches = Patches()
    for pack in packs:
        attr = forward_attribute(pack.module)
        patches.set_attr(pack.module, attr, FastForward(pack, getattr(pack.module, attr), rows_from))
    if left:
        reasons = "; ".join(f"{reason}: {count}" for reason, count in left.items())
        warnings.warn(f"tide_hf: fast_linears left {sum(left.values())} linear layer(s) of {type(model).__name__} "
                      f"eager ({reasons})", LinearPathWarning, stacklevel=caller_stacklevel())
    return LinearPath(packs, dict(left), patches, rows_from if packs else None)
