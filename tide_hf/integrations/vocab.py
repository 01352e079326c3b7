"""Draft logits over the draft vocabulary only: the slice of the LM head speculative drafts compute.

The router's draft vocabulary (`tide_hf.calibration.vocab`) ranks tokens by how often the model emits them;
a draft over the first n computes an n x hidden matmul instead of the vocab x hidden one. Its logits are the
model's own logits on those n tokens (same weights, bias, logit scale and soft-capping) and -inf
elsewhere, so greedy drafts take the argmax among covered tokens and sampled drafts sample from the model's
distribution restricted to them (attach checks the adapter's head against the model's: `check_head`); stock's
verification then keeps what the full model agrees with (sampling: speculative
sampling with those draft probabilities), so the output is unchanged. Heads that are not a plain
`nn.Linear` (quantized, or with a projection before them) or that accelerate offloads are not sliced.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..modeling import ModelAdapter, TideRouter


def sliceable(adapter: ModelAdapter) -> bool:
    """Whether the model's head is a plain floating-point `nn.Linear` right after the final norm, with its weight
    in memory (an offloaded head's weight is on the meta device until accelerate's hook loads it)."""
    head = adapter.lm_head
    return (type(head) is nn.Linear and adapter.pre_head is None and head.weight.is_floating_point()
            and head.weight.device.type != "meta")


def vocab_sizes(router: TideRouter, adapter: ModelAdapter) -> dict[int, float]:
    """Draft vocabulary sizes this router offers on this model, with their held-out coverage (none when the
    router has no draft vocabulary or the head cannot be sliced)."""
    if not sliceable(adapter):
        return {}
    return {int(n): share for n, share in router.config.draft_vocab_coverage.items()}


def coverage(router: TideRouter, vocab: int | None) -> float:
    """Held-out share of the final top-1 inside the first `vocab` draft-vocabulary tokens (None: all, 1.0)."""
    return 1.0 if vocab is None else router.config.draft_vocab_coverage[str(vocab)]


class DraftHead:
    """The model's head restricted to the first `size` tokens of the router's draft vocabulary."""

    def __init__(self, adapter: ModelAdapter, router: TideRouter, size: int) -> None:
        head = adapter.lm_head
        self.vocab = head.weight.shape[0]
        self.ids = router.draft_vocab[:size].to(head.weight.device)
        self.weight = head.weight.index_select(0, self.ids)  # one copy per call: the head may change between calls
        self.bias = None if head.bias is None else head.bias.index_select(0, self.ids)
        self.finish = adapter.finish  # the logit scale and soft-cap, as on the whole vocabulary

    def __call__(self, normed: torch.Tensor) -> torch.Tensor:
        """Vocabulary-wide logits (rows, vocab) from final-normed states (rows, hidden): the model's on the draft
        vocabulary, -inf elsewhere."""
        logits = self.finish(F.linear(normed.to(self.weight.device, self.weight.dtype), self.weight, self.bias))
        out = logits.new_full((logits.shape[0], self.vocab), float("-inf"))
        return out.index_copy_(1, self.ids, logits)
