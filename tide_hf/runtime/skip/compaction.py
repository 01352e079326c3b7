"""Skip mode in a batch: after a checkpoint, a layer runs only on the positions that have not exited.

The running positions of each row are gathered into a smaller batch: rows with none leave it (decode), and
each kept row holds its running positions in order (prefill). A row with fewer than the most is padded by
repeating its last running position; those slots' outputs and K/V are dropped. The layer runs on the small
batch and its output is scattered back; exited positions pass through unchanged.

The cache keeps one length for every row: the layer's own cache write is intercepted, and the K/V it computed
for the running positions are written together with the kv policy's K/V for the exited ones (`kv="propagate"`:
the K/V the layer computes from the state they left with, the checkpoint's output). The layer then reads back
only its rows.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ...compat import cache_in, is_paged, writes_cache

MASK_QUERY_DIM = 2  # 4-D attention masks are (B, 1, T, keys)
# implementations that take any 4-D mask (flash kernels take none; continuous batching runs eager as "paged|eager")
COMPACT_ATTENTION = ("sdpa", "eager", "paged|eager")
GROWING = -1  # a cache layer's `get_max_length()` when it grows with the sequence (one key slot per position)


@dataclass
class Compaction:
    """Where the running positions of a step (B, T) sit in the gathered batch (R, S)."""

    running: torch.Tensor  # (B, T) bool: positions that run the layers after the checkpoint
    rows: torch.Tensor  # (R,) the rows kept (at least one running position)
    index: torch.Tensor  # (R, S) the step position each slot runs
    real: torch.Tensor  # (R, S) bool: False for padding slots (a repeat of the row's last running position)
    real_rows: torch.Tensor  # (N,) row and position of each running position, in slot order
    real_positions: torch.Tensor
    out_rows: torch.Tensor  # (M,) row and position of each position that does not run
    out_positions: torch.Tensor
    slot_rows: torch.Tensor  # (N,) where each running position sits in (R, S): integer indices, no device sync
    slot_columns: torch.Tensor
    memo: dict = field(default_factory=dict, repr=False)  # arguments gathered once for all layers (`remember`)

    def remember(self, sources: tuple, make: Callable[[], Any]) -> Any:
        """`make()`, computed once for the same `sources` objects: every layer of a forward gets the same mask,
        rotary embeddings and position ids, so their gathered forms are shared by the layers after a checkpoint."""
        key = tuple(map(id, sources))
        hit = self.memo.get(key)
        if hit is None or any(a is not b for a, b in zip(hit[0], sources)):
            hit = self.memo[key] = (sources, make())
        return hit[1]

    @classmethod
    def build(cls, running: torch.Tensor, flags: list[list[bool]]) -> Compaction | None:
        """The gather for `running` (B, T), read once on the host as `flags` (indices are built there: no further
        device sync); None when it would keep every row and slot (nothing to save)."""
        batch, width = running.shape
        kept = [(b, [t for t, run in enumerate(row) if run]) for b, row in enumerate(flags)]
        kept = [(b, positions) for b, positions in kept if positions]
        longest = max(len(positions) for _, positions in kept)
        if len(kept) == batch and longest == width:
            return None
        pad = [longest - len(positions) for _, positions in kept]

        def tensor(values: list) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.long, device=running.device)

        index = tensor([positions + positions[-1:] * n for (_, positions), n in zip(kept, pad)])
        real = tensor([[1] * len(positions) + [0] * n for (_, positions), n in zip(kept, pad)]).bool()
        stopped = [(b, t) for b, row in enumerate(flags) for t, run in enumerate(row) if not run]
        return cls(running, tensor([b for b, _ in kept]), index, real,
                   tensor([b for b, positions in kept for _ in positions]),
                   tensor([t for _, positions in kept for t in positions]),
                   tensor([b for b, _ in stopped]), tensor([t for _, t in stopped]),
                   tensor([i for i, (_, positions) in enumerate(kept) for _ in positions]),
                   tensor([j for _, positions in kept for j in range(len(positions))]))

    def gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Rows and positions of `tensor` (B or 1, T, ...) as the small batch (R, S, ...)."""
        tensor = tensor.expand(self.running.shape[0], *tensor.shape[1:])
        return tensor[self.rows[:, None], self.index]

    def scatter(self, full: torch.Tensor, small: torch.Tensor) -> torch.Tensor:
        """`full` (B, T, ...) with the running positions replaced by their values in `small` (R, S, ...)."""
        merged = full.clone()
        merged[self.real_rows, self.real_positions] = small[self.slot_rows, self.slot_columns].to(full.dtype)
        return merged

    def gather_mask(self, mask: torch.Tensor) -> torch.Tensor:
        """A 4-D mask (B or 1, heads or 1, T, keys): the rows kept, and each slot's query row."""
        mask = mask.expand(self.running.shape[0], *mask.shape[1:])[self.rows]
        index = self.index[:, None, :, None].expand(-1, mask.shape[1], -1, mask.shape[-1])
        return mask.gather(MASK_QUERY_DIM, index)

    def causal_mask(self, past: int, dtype: torch.dtype) -> torch.Tensor:
        """The additive causal mask of the small batch over `past` cached keys plus the step's (a forward given
        none: no padding, full attention)."""
        width = self.running.shape[1]
        keys = torch.arange(past + width, device=self.index.device)
        allowed = keys[None, None, :] <= (past + self.index)[:, :, None]
        mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
        return mask.masked_fill(~allowed, torch.finfo(dtype).min)[:, None]


@contextmanager
def intercepted_update(cache: Any, write: Callable[..., tuple[torch.Tensor, torch.Tensor]]) -> Iterator[None]:
    """`cache.update` is `write` on this cache object only, for one layer call; then it is as it was."""
    own = cache.__dict__.get("update")
    cache.update = write
    try:
        yield
    finally:
        if own is None:
            del cache.update
        else:
            cache.update = own


def compactable(layer: nn.Module) -> bool:
    """Whether `layer` can run on a gathered batch: Llama-style attention under an implementation that takes
    any 4-D mask."""
    attn = getattr(layer, "self_attn", None)
    config = getattr(attn, "config", None)
    return attn is not None and getattr(config, "_attn_implementation", None) in COMPACT_ATTENTION


def _gathered_kwargs(comp: Compaction, layer: nn.Module, kwargs: dict[str, Any], width: int,
                     dtype: torch.dtype) -> dict[str, Any] | None:
    """The layer's keyword arguments for the small batch; None when one cannot be gathered (no rotary embeddings
    given, a block mask, a mask-less forward on a cache whose key slots are not positions)."""
    out = dict(kwargs)
    rotary = kwargs.get("position_embeddings")
    if not (isinstance(rotary, tuple) and len(rotary) == 2):  # the layer computes its own rotary: not gathered
        return None
    out["position_embeddings"] = comp.remember(rotary, lambda: tuple(comp.gather(t) for t in rotary))
    ids = kwargs.get("position_ids")
    if isinstance(ids, torch.Tensor) and ids.dim() == 2 and ids.shape[1] == width:
        out["position_ids"] = comp.remember((ids,), lambda: comp.gather(ids))
    mask = kwargs.get("attention_mask")
    if isinstance(mask, torch.Tensor) and mask.dim() == 4:
        reads = kwargs.get("read_index")
        if is_paged(cache_in(kwargs)) and isinstance(reads, list) and len(reads) == 1 \
                and reads[0].shape[0] == mask.shape[-1]:  # (a step of fresh prompts reads nothing: its own keys)
            out["attention_mask"], out["read_index"] = comp.remember((mask, reads[0]), lambda: paged_keys(comp, mask,
                                                                                                        reads))
        else:
            out["attention_mask"] = comp.remember((mask,), lambda: comp.gather_mask(mask))
    elif mask is None and comp.index.shape[1] > 1:  # a causal forward without a mask (sdpa's is_causal)
        cache = cache_in(kwargs)
        layer_idx = layer.self_attn.layer_idx
        cache_layers = getattr(cache, "layers", []) if cache is not None else []
        if layer_idx < len(cache_layers) and cache_layers[layer_idx].get_max_length() != GROWING:
            return None  # a static or sliding cache: its key slots are not the positions
        past = cache.get_seq_length(layer_idx) if cache is not None else 0
        out["attention_mask"] = comp.causal_mask(past, dtype)
    elif mask is not None:
        return None
    return out


def paged_keys(comp: Compaction, mask: torch.Tensor, reads: list[torch.Tensor]
               ) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The mask of the running queries of a continuous-batching step (one packed row over a paged cache) and the
    cache slots they read: only the keys some running query attends to (a request with no running position is
    left out, as the mask leaves it out of every running query's attention; one host read)."""
    small = comp.gather_mask(mask)
    allowed = small if small.dtype == torch.bool else small > torch.finfo(small.dtype).min
    columns = allowed.reshape(-1, allowed.shape[-1]).any(0).nonzero().squeeze(1)
    if len(columns) == allowed.shape[-1]:
        return small, reads
    return small[..., columns], [reads[0][columns.to(reads[0].device)]]


def run_compacted(comp: Compaction, layer: nn.Module, original: Callable, hidden: torch.Tensor,
                  kwargs: dict[str, Any], exited_kv: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None
                  ) -> Any | None:
    """Run `layer` (its forward `original`) on the running positions of `hidden` (B, T, H) only; the exited
    positions' K/V come from `exited_kv(layer, states (1, M, H), (cos, sin))` (`kv.project_kv`). Returns the
    layer's output for the whole batch, or None when its arguments cannot be gathered (the caller runs it whole)."""
    batch, width = hidden.shape[:2]
    small_kwargs = _gathered_kwargs(comp, layer, kwargs, width, hidden.dtype)
    if small_kwargs is None:
        return None
    cache = cache_in(kwargs)
    if not writes_cache(kwargs):
        out = original(comp.gather(hidden), **small_kwargs)
    else:
        cos, sin = (t.expand(batch, *t.shape[1:]) for t in kwargs["position_embeddings"])
        rows, positions = comp.out_rows, comp.out_positions
        exited = exited_kv(layer, hidden[rows, positions][None], (cos[rows, positions][None],
                                                                  sin[rows, positions][None])) \
            if exited_kv is not None and len(rows) else None
        update = cache.update

        def write(key: torch.Tensor, value: torch.Tensor, *args: Any, **kw: Any) -> tuple[torch.Tensor, torch.Tensor]:
            full_k = key.new_zeros(batch, key.shape[1], width, key.shape[-1])
            full_v = value.new_zeros(batch, value.shape[1], width, value.shape[-1])
            if exited is not None:
                full_k[rows, :, positions] = exited[0][0].transpose(0, 1).to(key.dtype)
                full_v[rows, :, positions] = exited[1][0].transpose(0, 1).to(value.dtype)
            full_k[comp.real_rows, :, comp.real_positions] = key[comp.slot_rows, :, comp.slot_columns]
            full_v[comp.real_rows, :, comp.real_positions] = value[comp.slot_rows, :, comp.slot_columns]
            keys, values = update(full_k, full_v, *args, **kw)
            return (keys, values) if len(comp.rows) == batch else (keys[comp.rows], values[comp.rows])

        with intercepted_update(cache, write):
            out = original(comp.gather(hidden), **small_kwargs)
    small = out[0] if isinstance(out, tuple) else out
    merged = comp.scatter(hidden, small)
    return (merged, *out[1:]) if isinstance(out, tuple) else merged
