"""The adapter's head checked against the model's own forward, where TIDE computes logits itself.

Calibration labels (top-1, KL, NLL change), `analyze`, the softmax-confidence baseline and speculative drafts
over the draft vocabulary turn states into logits with `ModelAdapter.logits`, not with the model's forward. A
family whose forward does more between its last layer and its logits than the adapter knows (a logit scale
missing from the table, a prediction head, states mixed after the last layer) would make all of them wrong
without an error, so `check_head` runs one tiny forward and refuses the model on a mismatch.
"""

from __future__ import annotations

import torch
from torch import nn

from ..errors import TideCompatibilityError
from .adapters import ModelAdapter, get_adapter, layer_output, text_config
from .devices import check_materialized, execution_device

HEAD_CHECK_TOKENS = 4  # positions of the check's forward: a few, it runs at every calibration / analyze and at
# speculative attaches with a draft vocabulary
# Tolerance, in units of the coarsest dtype's epsilon times the largest logit: the same ops in another order
# (a scale before or after the head, a division as a multiplication) differ by a few roundings; a missing
# transform differs by a share of the logits themselves.
HEAD_CHECK_ULPS = 8


def check_ids(adapter: ModelAdapter, model: nn.Module) -> torch.Tensor:
    """Evenly spaced ids inside the vocabulary: ordinary text tokens (multimodal placeholders sit at its ends)."""
    vocab = getattr(adapter.embeddings, "num_embeddings", None) or text_config(model).vocab_size
    ids = torch.linspace(0, vocab - 1, HEAD_CHECK_TOKENS + 2).long()[1:-1]
    return ids[None].to(execution_device(adapter.embeddings))


@torch.no_grad()
def check_head(model: nn.Module, adapter: ModelAdapter | None = None) -> None:
    """Raise `TideCompatibilityError` unless `adapter.logits(last layer's output)` equals the model's own logits.

    One forward of `HEAD_CHECK_TOKENS` tokens without a cache, in eval mode, a hook on the last decoder layer;
    the hook is removed and every module's training flag restored, so the model is left exactly as found.
    """
    check_materialized(model)
    adapter = adapter or get_adapter(model)
    ids = check_ids(adapter, model)
    captured: list[torch.Tensor] = []
    training = [(module, module.training) for module in model.modules()]
    hook = adapter.layers[-1].register_forward_hook(lambda _m, _a, out: captured.append(layer_output(out)))
    try:
        model.eval()
        out = model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False)
    finally:
        hook.remove()
        for module, mode in training:
            module.training = mode
    name = f"{type(model).__name__} (model_type={getattr(model.config, 'model_type', None)!r})"
    if not captured:
        raise TideCompatibilityError(f"{name}: a forward did not run the decoder layers tide_hf found; call "
                                     "tide_hf.register_adapter(model_type, layers=..., norm=...)")
    theirs = out.logits if hasattr(out, "logits") else out[0]
    hidden = captured[-1].to(execution_device(adapter.lm_head))
    mine = adapter.logits(hidden)
    eps = max(torch.finfo(t.dtype).eps for t in (hidden, mine, theirs) if t.is_floating_point())
    theirs, mine = theirs.float(), mine.float().to(theirs.device)
    if mine.shape != theirs.shape:
        error = float("inf")
    else:  # equal values (-inf of a masked token too) agree; a NaN or a lone inf never does
        error = float(torch.where(mine == theirs, 0.0, (mine - theirs).abs()).max())
    finite = theirs[torch.isfinite(theirs)]
    scale = float(finite.abs().max()) if finite.numel() else 0.0
    if not error <= HEAD_CHECK_ULPS * eps * max(scale, 1.0):
        raise TideCompatibilityError(
            f"{name}: its head applies a transform tide_hf does not reproduce (on the last layer's output, the "
            f"adapter's final norm and LM head, logit scale {adapter.logit_scale:g}, soft-cap "
            f"{adapter.logit_softcap}, give logits up to {error:.3g} away from the model's own, whose largest is "
            f"{scale:.3g}). If the model only scales its logits, call "
            "tide_hf.register_adapter(model_type, layers=..., norm=..., logit_scale=...).")
