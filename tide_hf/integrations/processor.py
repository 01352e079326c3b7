"""`TideLogitsProcessor`: the per-step hand-off between stock `generate()` and TIDE's accounting."""

from __future__ import annotations

import torch
from transformers import LogitsProcessor

from ..runtime import Session, TideHandle


class TideLogitsProcessor(LogitsProcessor):
    """Closes each generation step for TIDE.

    The exit logits are already in `scores`: the hooks swap exit states in before the model's own head,
    so processors that run before this one (repetition penalty, min-length, ...) saw them too. What only
    generate knows is where steps begin and which rows are still generating: the first call closes the
    prefill, every later call a decode step, and rows whose fed token is one of the model's EOS ids stop
    being counted. Scores pass through unchanged.
    """

    def __init__(self, handle: TideHandle, session: Session) -> None:
        self.handle, self.session = handle, session

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        # generate(inputs_embeds=...) without input_ids starts with no token ids: nothing was fed yet
        fed = input_ids[:, -1] if input_ids.dim() == 2 and input_ids.shape[1] else None
        self.handle.commit(self.session, fed)
        self.session.started_decode = True
        return scores
