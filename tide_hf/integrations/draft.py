"""How far and where speculative mode drafts: the speculative-decoding optimum from acceptance and cost.

A round drafts k tokens (k forwards through the first `draft_layer` layers, c plain steps each) and verifies
k + 1 tokens (V(k + 1) plain steps). Verification reuses the drafts' first layers (`reuse.py`): it runs the last
draft token through them (the tail) and only the deeper layers and the head for all k + 1 positions. How V
grows with the width depends on the hardware: it should stay near 1 where a step is memory-bound (a GPU), but
on a CPU a forward of 2-9 tokens can cost 1.4-2.0 plain steps with no steady growth in the width, so no
straight line through V(1) = 1 and V(2) predicts V(5). With per-token acceptance a a round emits
(1 - a^(k+1)) / (1 - a) tokens (Leviathan et al., 2023), so its speed relative to plain decoding is

    E(k) = (1 - a^(k+1)) / ((1 - a) * (c * k + V(k + 1))),   E(0) = 1 (a plain step, V(1) = 1).

`DraftEstimates` keeps running estimates of a, c and V per verified width for one model and draft layer
(measured warm: the first sample of each timing is dropped, so first-call costs, lazy allocation and
compilation are never charged to drafting; widths not measured yet are interpolated, and wider ones taken as
costly as the widest measured, so the plan tries them and then knows) and plans every round's k as the
argmax of E; `draft_plan` picks the draft vocabulary size (`vocab.py`) and `choose_draft_layer` ranks router
checkpoints by the same E from calibration metrics and parameter counts. `SpeculativeStats` counts a call's
rounds and reports the optimum its measured acceptance and costs imply.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from ..modeling import ModelAdapter, TideRouter
from ..modeling.depth import layers_config, layers_owner
from .vocab import coverage, sliceable, vocab_sizes

EARLY_EXIT, LOOKUP = "early_exit", "lookup"  # draft sources: the first layers; n-gram matches of the context
DRAFT_SOURCES = (EARLY_EXIT, LOOKUP)
SOURCE_COUNTERS = ("rounds", "planned", "probes", "drafted", "accepted", "trials")  # kept per draft source
MAX_DRAFT_TOKENS = 8  # longest draft per round (the router gate and the plan usually stop earlier)
DEFAULT_DRAFT_FRACTION = 0.5  # without calibration metrics: the checkpoint nearest this fraction of depth
DEFAULT_ACCEPTANCE = 0.5  # prior per-token acceptance without calibration metrics
PRIOR_TRIALS = 4.0  # weight of the prior acceptance, in draft tokens: a few verified drafts outweigh it
ACCEPTANCE_MEMORY = 0.95  # per round, the weight kept by earlier acceptance counts (~20 rounds of memory)
TIMING_EMA = 0.2  # weight of the newest sample in a running timing (CPU timings are noisy)
PROBE_LOSS = 0.02  # while drafting loses, probe rounds may cost at most this share of plain-step time
_PARAM_COUNTS: weakref.WeakKeyDictionary[nn.Module, tuple[int, int]] = weakref.WeakKeyDictionary()


def expected_tokens(acceptance: float, k: int) -> float:
    """Tokens one round emits: the accepted prefix of k drafts plus the verifier's own token."""
    if acceptance >= 1.0:
        return k + 1.0
    return (1.0 - acceptance ** (k + 1)) / (1.0 - acceptance)


VerifyCost = Callable[[int], float]  # V(w): plain steps a verification of w tokens costs (V(1) = 1)


def linear_verify(slope: float) -> VerifyCost:
    """V(w) = 1 + slope * (w - 1): each extra verified token costs `slope` plain steps (0: memory-bound)."""
    return lambda width: 1.0 + slope * (width - 1)


MEMORY_BOUND = linear_verify(0.0)  # V before any verification is timed, and for ranking draft layers


def interpolated_verify(costs: dict[int, float]) -> VerifyCost:
    """V(w) through (1, 1) and the measured `costs` (width -> plain steps): linear between known widths, as
    costly as the widest known beyond it (no measurement: memory-bound, V = 1)."""
    known = sorted({1: 1.0, **{int(w): float(v) for w, v in costs.items()}}.items())

    def verify(width: int) -> float:
        for (w0, v0), (w1, v1) in zip(known, known[1:]):
            if width <= w1:
                return v0 + (v1 - v0) * (width - w0) / (w1 - w0)
        return known[-1][1]
    return verify


def speedup(acceptance: float, k: int, cost: float, verify: VerifyCost) -> float:
    """E(k): tokens per plain-step time of rounds drafting k tokens (1.0 = plain decoding)."""
    return expected_tokens(acceptance, k) / (cost * k + verify(k + 1))


def best_draft_length(acceptance: float, cost: float, verify: VerifyCost,
                      max_draft: int = MAX_DRAFT_TOKENS) -> tuple[int, float]:
    """(k, E(k)) maximizing E over 0..`max_draft` (k = 0: drafting loses)."""
    return max(((k, speedup(acceptance, k, cost, verify)) for k in range(max_draft + 1)), key=lambda p: p[1])


def draft_cost(adapter: ModelAdapter, layer: int, vocab: int | None = None) -> float:
    """Cost of a forward through `layer` layers + head relative to a full one, by parameter count (per-token
    FLOPs are proportional to it; the LM head is a sizeable share in small models); `vocab`: a head sliced to
    that many tokens (`vocab.DraftHead`)."""
    counts = _PARAM_COUNTS.get(adapter.layers)
    if counts is None:  # walking every parameter takes milliseconds: once per model
        head = sum(p.numel() for p in adapter.lm_head.parameters())
        head += sum(p.numel() for p in adapter.pre_head.parameters()) if adapter.pre_head is not None else 0
        rows = adapter.lm_head.weight.shape[0] if sliceable(adapter) else 1
        counts = _PARAM_COUNTS[adapter.layers] = (sum(p.numel() for p in adapter.layers.parameters()), head, rows)
    layers, head, rows = counts
    drafted_head = head if vocab is None else head * vocab / rows
    return (layer * layers / adapter.num_layers + drafted_head) / (layers + head)


def draft_body(model: nn.Module, layers: nn.ModuleList) -> tuple[nn.Module, Any]:
    """(the module a draft forward runs, the config whose `num_hidden_layers` its layer loop reads): the model's
    base model where it holds `layers` (it takes every input generate prepares), else the module owning them
    (Llama4ForCausalLM names a base model, `language_model`, it keeps under `model`); the config is the owner's
    (a multimodal base model's is the composite config, not its text decoder's)."""
    owner = layers_owner(model, layers)
    base = getattr(model, model.base_model_prefix, None)
    body = base if isinstance(base, nn.Module) and any(m is layers for m in base.modules()) else owner
    return body, layers_config(owner, model)


def prior_acceptance(router: TideRouter, layer: int) -> float | None:
    """The top-1 agreement of `layer`'s exit with the final layer on the kept calibration tokens (`label_rates
    ["top1"]`, recorded by calibration for every label kind; training tokens with their cross-fitted exit heads):
    the acceptance of an ungated draft token, before a call measures its own. None without metrics."""
    m = router.config.metrics.get(str(layer)) or {}
    return (m.get("label_rates") or {}).get("top1")


def draft_plan(router: TideRouter, adapter: ModelAdapter, layer: int) -> tuple[int | None, float | None]:
    """(draft vocabulary size, optimum E) of drafting at `layer`: the size (None: the whole vocabulary) whose
    cheaper draft best outweighs its lost acceptance (a draft token can only be right where the final top-1
    is covered: acceptance x held-out coverage), by calibration metrics and parameter counts (E None without
    metrics: the whole vocabulary)."""
    acceptance = prior_acceptance(router, layer)
    if acceptance is None:
        return None, None
    options = {None: 1.0, **vocab_sizes(router, adapter)}
    gains = {n: best_draft_length(acceptance * share, draft_cost(adapter, layer, n), MEMORY_BOUND)[1]
             for n, share in options.items()}
    best = max(gains, key=lambda n: (gains[n], n is None))  # ties: the whole vocabulary
    return best, gains[best]


def choose_draft_layer(router: TideRouter, adapter: ModelAdapter, candidates: list[int]) -> int:
    """The checkpoint with the best `draft_plan` optimum, ties (E = 1 where drafting loses everywhere) broken by
    the cheapest one-token probe; without metrics, the one nearest `DEFAULT_DRAFT_FRACTION` of depth."""
    known = {k: a for k in candidates if (a := prior_acceptance(router, k)) is not None}
    if known:
        def rank(k: int) -> tuple[float, float]:
            vocab, gain = draft_plan(router, adapter, k)
            return gain, speedup(known[k] * coverage(router, vocab), 1, draft_cost(adapter, k, vocab), MEMORY_BOUND)
        return max(known, key=rank)
    return min(candidates, key=lambda k: abs(k - DEFAULT_DRAFT_FRACTION * adapter.num_layers))


@dataclass
class DraftEstimates:
    """Running acceptance and costs of drafting at one layer of one model, kept across calls and attaches.

    Acceptance counts one trial per draft token the verifier checked up to the first rejection; earlier
    rounds fade by `ACCEPTANCE_MEMORY` so the estimate follows the text. Timings are in seconds: a plain
    step, a draft forward, and a verification per width (tokens verified, tail included).
    """

    prior_cost: float  # c by parameter count, until both timings are measured
    accepted: float
    trials: float
    plain_s: float | None = None
    draft_s: float | None = None
    verify_s: dict[int, float] = field(default_factory=dict)  # width -> running seconds of its verification
    warm: set[str] = field(default_factory=set)  # timings whose first (one-time-cost) sample was dropped

    max_draft: int = MAX_DRAFT_TOKENS  # longest draft a round of this source may plan

    @classmethod
    def start(cls, prior_cost: float, acceptance: float | None, max_draft: int = MAX_DRAFT_TOKENS) -> DraftEstimates:
        a = DEFAULT_ACCEPTANCE if acceptance is None else acceptance
        return cls(prior_cost, a * PRIOR_TRIALS, PRIOR_TRIALS, max_draft=max_draft)

    @property
    def acceptance(self) -> float:
        return self.accepted / self.trials

    @property
    def cost(self) -> float:
        return self.draft_s / self.plain_s if self.draft_s is not None and self.plain_s else self.prior_cost

    @property
    def measured(self) -> bool:
        """Whether this source drafted on the model: a draft forward and a verification were timed."""
        return self.draft_s is not None and bool(self.verify_s) and self.plain_s is not None

    @property
    def verify_costs(self) -> dict[int, float]:
        """Measured V(w) in plain steps (none until a plain step is timed), at least 1: a verification runs
        every layer and the head for at least one token, as a plain step does (a lower reading is noise)."""
        if not self.plain_s:
            return {}
        return {w: max(t / self.plain_s, 1.0) for w, t in sorted(self.verify_s.items())}

    @property
    def verify(self) -> VerifyCost:
        return interpolated_verify(self.verify_costs)

    def plan(self, room: int) -> tuple[int, float]:
        """The draft length maximizing E with the current estimates, at most `room` tokens."""
        return best_draft_length(self.acceptance, self.cost, self.verify, min(room, self.max_draft))

    def probe_interval(self) -> int:
        """Plain steps between one-token probes while drafting loses: a probe round costs c + V(2) plain steps
        and emits 1 + a tokens, and its expected loss must stay within `PROBE_LOSS` of the steps between."""
        loss = max(self.cost + self.verify(2) - 1.0 - self.acceptance, 0.0)
        return max(1, math.ceil(loss / PROBE_LOSS))

    def observe_round(self, proposed: int, accepted: int) -> None:
        self.accepted = ACCEPTANCE_MEMORY * self.accepted + accepted
        self.trials = ACCEPTANCE_MEMORY * self.trials + accepted + (accepted < proposed)

    def observe_plain(self, seconds: float) -> None:
        self.plain_s = self._running("plain", self.plain_s, seconds)

    def observe_draft(self, seconds_per_forward: float) -> None:
        self.draft_s = self._running("draft", self.draft_s, seconds_per_forward)

    def observe_verify(self, seconds: float, tokens: int) -> None:
        """A verification of `tokens` > 1 tokens (tail included); each width is a new shape (kernel selection,
        allocations), so its first sample is dropped."""
        if tokens > 1:
            value = self._running(f"verify{tokens}", self.verify_s.get(tokens), seconds)
            if value is not None:
                self.verify_s[tokens] = value

    def _running(self, kind: str, old: float | None, new: float) -> float | None:
        if kind not in self.warm:  # the first sample carries one-time costs: drop it
            self.warm.add(kind)
            return old
        return new if old is None else (1.0 - TIMING_EMA) * old + TIMING_EMA * new


# -- statistics of a call ---------------------------------------------------------------------------------
def with_acceptance(counts: dict[str, int]) -> dict[str, float]:
    """Round counters and their per-token acceptance (accepted over trials)."""
    return {**counts, "acceptance_per_token": counts["accepted"] / counts["trials"] if counts["trials"] else 0.0}


@dataclass
class SpeculativeStats:
    """Counters of one speculative call (all rows), published as `ExitStats.speculative` (a dict).

    Round counters sum over the draft sources (`sources.py`: lookup and early exit), `sources` splits them.
    `as_dict` adds the measured per-token acceptance (overall and per source), and the optimum early exit's
    acceptance implies with its measured costs: `optimal_draft_length` and `optimal_speedup` (E over plain
    steps, the best any draft-length policy can expect at that acceptance and cost).
    """

    draft_layer: int
    expected_speedup: float | None = None  # `draft_plan`: the optimum E from calibration (None: no metrics)
    draft_vocab: int | None = None  # drafts' logits cover this many most frequent tokens (None: all)
    rounds: int = 0  # verification forwards that checked at least one drafted token
    plain_steps: int = 0  # verification forwards without candidates (prefill, closed gate, drafting loses, ...)
    gate_skips: int = 0  # rounds early exit could not draft: the router called the previous token unconverged
    plan_skips: int = 0  # rounds not drafted because the estimates said drafting loses
    probes: int = 0  # one-token drafts while the estimates said drafting loses
    planned: int = 0  # draft tokens the policy planned, summed over drafted rounds
    drafted: int = 0  # tokens proposed to the verifier
    accepted: int = 0  # proposed tokens the verifier kept
    trials: int = 0  # proposed tokens the verifier checked (up to and including the first rejected one)
    draft_forwards: int = 0  # forwards through the first `draft_layer` layers
    tail_forwards: int = 0  # the last draft token through the first layers, without the head (for reuse)
    reused: int = 0  # verification forwards that ran only the layers after `draft_layer`
    gate_stops: int = 0  # drafts cut short because the router said "not converged"
    draft_cost: float = 0.0  # c at the end of the call: a draft forward's time over a plain step's
    verify_costs: dict[int, float] = field(default_factory=dict)  # measured V(w) at the end of the call
    lookup_cost: float = 0.0  # c of lookup drafts (matching time over a plain step's), at the end of the call
    lookup_verify_costs: dict[int, float] = field(default_factory=dict)  # their V(w): every layer verifies
    # why stock generate ran instead (`rows.fallback_reason`), set on every call: None when it drafted
    fallback: str | None = None
    # per draft source (`DRAFT_SOURCES`): its share of the round counters above, which sum over the sources
    sources: dict[str, dict[str, int]] = field(
        default_factory=lambda: {name: dict.fromkeys(SOURCE_COUNTERS, 0) for name in DRAFT_SOURCES})
    # lookup rounds per class of match length (`sources.MATCH_LABELS`: "1", "2-3", ...): their share of
    # `sources["lookup"]`
    lookup_matches: dict[str, dict[str, int]] = field(default_factory=dict)

    def _groups(self, source: str, match: str | None) -> list[dict]:
        """The counters a round of `source` adds to (`match`: its class of match length, lookup only)."""
        groups = [self.__dict__, self.sources[source]]
        if match is not None:
            groups.append(self.lookup_matches.setdefault(match, dict.fromkeys(SOURCE_COUNTERS, 0)))
        return groups

    def count_round(self, source: str, proposed: int, accepted: int, match: str | None = None) -> None:
        """A verified round of `proposed` drafts from `source`, `accepted` of them kept."""
        trials = accepted + (accepted < proposed)
        for counts in self._groups(source, match):
            counts["rounds"] += 1
            counts["drafted"] += proposed
            counts["accepted"] += accepted
            counts["trials"] += trials

    def count_plan(self, source: str, planned: int, probe: bool, match: str | None = None) -> None:
        """A round drafting from `source`, `planned` tokens planned (`probe`: a one-token probe)."""
        for counts in self._groups(source, match):
            counts["planned"] += planned
            counts["probes"] += probe

    def as_dict(self) -> dict[str, Any]:
        acceptance = self.accepted / self.trials if self.trials else 0.0
        early = self.sources[EARLY_EXIT]  # the optimum is early exit's: c and V below are its measured costs
        early_acceptance = early["accepted"] / early["trials"] if early["trials"] else 0.0
        k, gain = best_draft_length(early_acceptance, self.draft_cost, interpolated_verify(self.verify_costs))
        sources, matches = ({key: with_acceptance(counts) for key, counts in group.items()}
                            for group in (self.sources, self.lookup_matches))
        return {**self.__dict__, "sources": sources, "lookup_matches": matches,
                "acceptance_rate": self.accepted / self.drafted if self.drafted else 0.0,
                "acceptance_per_token": acceptance,
                "mean_draft_length": self.drafted / self.rounds if self.rounds else 0.0,
                "mean_planned_length": self.planned / self.rounds if self.rounds else 0.0,
                "optimal_draft_length": k, "optimal_speedup": gain}
