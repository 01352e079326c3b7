"""Where speculative mode drafts: the expected speed-up of drafting at each router checkpoint.

The estimate comes from the router's held-out calibration metrics and the share of the model's
parameters a draft forward runs; `speculative.py` uses it for the default `draft_layer` and to decide
whether a call's first draft may go ahead before any timing is known.
"""

from __future__ import annotations

import weakref

from torch import nn

from ..modeling import ModelAdapter, TideRouter

MAX_DRAFT_TOKENS = 8  # longest draft per round; the router gate usually stops earlier
DEFAULT_DRAFT_FRACTION = 0.5  # without calibration metrics: the checkpoint nearest this fraction of depth
_PARAM_COUNTS: weakref.WeakKeyDictionary[nn.Module, tuple[int, int]] = weakref.WeakKeyDictionary()


def expected_speedup(gate_rate: float, success_rate: float, cost: float, max_draft: int = MAX_DRAFT_TOKENS) -> float:
    """Tokens per full-forward-equivalent of a gated draft, relative to plain decoding (1.0 = break-even).

    A draft forward runs while the gate stays open (probability r = `gate_rate` per token, the first one
    too: it needs the previous token's gate open) and costs c = `cost` full forwards; its token is accepted
    while every proposal so far was gated open and correct (s = `success_rate` per token). With at most
    g = `max_draft` draft forwards, one round emits sum_{i=0..g} s^i tokens (accepted prefix + the
    verifier's bonus token) for 1 + c * sum_{i=1..g} r^i full forwards (verification + drafts).
    """
    tokens = sum(success_rate ** i for i in range(max_draft + 1))
    forwards = 1.0 + cost * sum(gate_rate ** i for i in range(1, max_draft + 1))
    return tokens / forwards


def draft_cost(adapter: ModelAdapter, layer: int) -> float:
    """Cost of a forward through `layer` layers + head relative to a full one, by parameter count
    (per-token FLOPs are proportional to it; the LM head is a sizeable share in small models)."""
    counts = _PARAM_COUNTS.get(adapter.layers)
    if counts is None:  # walking every parameter takes milliseconds: once per model
        head = sum(p.numel() for p in adapter.lm_head.parameters())
        head += sum(p.numel() for p in adapter.pre_head.parameters()) if adapter.pre_head is not None else 0
        counts = _PARAM_COUNTS[adapter.layers] = (sum(p.numel() for p in adapter.layers.parameters()), head)
    layers, head = counts
    return (layer * layers / adapter.num_layers + head) / (layers + head)


def prior_speedup(router: TideRouter, adapter: ModelAdapter, layer: int) -> float | None:
    """`expected_speedup` of drafting at `layer` from the router's held-out calibration metrics (None without).

    Gate rate r = `predicted_rate` (tokens the router lets through at the calibration threshold). Success
    rate s = r * P(draft token correct | gated): the router's `precision` when it was trained on the
    "top1" label (exactly that probability), else the unconditional top-1 agreement `label_rates["top1"]`
    (a lower bound when gate and correctness are positively correlated). Cost: `draft_cost`.
    """
    m = router.config.metrics.get(str(layer)) or {}
    gate = m.get("predicted_rate")
    correct = m.get("precision") if router.config.label == "top1" else None
    correct = correct if correct is not None else (m.get("label_rates") or {}).get("top1")
    if gate is None or correct is None:
        return None
    return expected_speedup(gate, gate * correct, draft_cost(adapter, layer))


def choose_draft_layer(router: TideRouter, adapter: ModelAdapter, candidates: list[int]) -> int:
    """The checkpoint with the best `prior_speedup`; without metrics, the one nearest `DEFAULT_DRAFT_FRACTION`
    of depth."""
    priors = {k: prior_speedup(router, adapter, k) for k in candidates}
    known = [k for k in candidates if priors[k] is not None]
    if known:
        return max(known, key=lambda k: priors[k])
    return min(candidates, key=lambda k: abs(k - DEFAULT_DRAFT_FRACTION * adapter.num_layers))
