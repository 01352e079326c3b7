"""`kv="recompute"` with `park_rows` in a batch: positions that stop early park, and run their skipped layers later,
with their row.

Where rows of a batch exit on their own (eager decoding into a `DynamicCache`), an exited position gets a zero
placeholder in the cache of each layer it skips, so every row keeps one length, and parks: its state, the
layers it has run, its cache slot and its rotary embeddings. When its row next runs a layer the position has
not run, the position joins that layer's queries (`compaction.py`). It starts from its own state, so the K/V
it writes over the placeholder are exactly the full model's, before any later query of its row reads them.
Positions still parked when a generate call ends catch up then (`TideHandle.settle`).
"""

from __future__ import annotations

import torch


class ParkedRows:
    """The parked positions of one cache: flat tensors, one entry per (row, cache slot)."""

    def __init__(self, num_layers: int) -> None:
        self.num_layers = num_layers
        self.hidden: torch.Tensor | None = None  # (P, H) each position's state after `depth` layers
        self.rows: torch.Tensor | None = None  # (P,) its row
        self.slots: torch.Tensor | None = None  # (P,) its cache slot (its position: a cache that grows)
        self.depth: torch.Tensor | None = None  # (P,) layers it has run
        self.cos: torch.Tensor | None = None  # (P, d) its rotary embeddings
        self.sin: torch.Tensor | None = None
        self.key_mask: torch.Tensor | None = None  # (B, keys) padding of the call's keys so far (None: no padding)

    def __len__(self) -> int:
        return 0 if self.rows is None else len(self.rows)

    def park(self, rows: torch.Tensor, slots: torch.Tensor, hidden: torch.Tensor, depth: int, cos: torch.Tensor,
             sin: torch.Tensor) -> None:
        """Add positions (rows, slots) whose state `hidden` (n, H) is the output of layer `depth`."""
        if not len(rows):
            return
        new = {"hidden": hidden, "rows": rows, "slots": slots, "depth": torch.full_like(rows, depth),
               "cos": cos, "sin": sin}
        for name, value in new.items():
            old = getattr(self, name)
            setattr(self, name, value if old is None else torch.cat([old, value.to(old.device, old.dtype)]))

    def due(self, number: int, rows: torch.Tensor | None = None) -> torch.Tensor:
        """Indices of the positions whose next layer is `number` (1-based), among `rows` when given."""
        if not len(self):
            return torch.zeros(0, dtype=torch.long)
        due = self.depth == number - 1
        if rows is not None:
            due &= torch.isin(self.rows, rows.to(self.rows.device))
        return due.nonzero(as_tuple=True)[0]

    def first_due(self) -> int:
        """The lowest layer number some parked position runs next."""
        return int(self.depth.min()) + 1

    def advance(self, index: torch.Tensor, hidden: torch.Tensor, number: int) -> None:
        """The positions `index` ran layer `number`, giving `hidden`; those past the last layer are done."""
        self.hidden[index] = hidden.to(self.hidden.dtype)
        self.depth[index] = number
        keep = self.depth < self.num_layers
        if not bool(keep.all()):
            for name in ("hidden", "rows", "slots", "depth", "cos", "sin"):
                setattr(self, name, getattr(self, name)[keep])
            if not len(self):
                self.hidden = self.rows = self.slots = self.depth = self.cos = self.sin = None
