"""Where a speculative round's drafts come from: n-gram matches of the context, the first layers, or nowhere.

Two sources propose drafts, and one verification forward checks them exactly alike, so the choice never
changes the output, only the speed:

* lookup: the continuation of an earlier occurrence of the context's last n-gram (prompt and generated
  text), matched by transformers' own `PromptLookupCandidateGenerator` (prompt lookup decoding). It costs
  next to nothing to make (c ~ 0: a scan of the ids), so it pays wherever the text repeats what it has
  seen (a copy, a quotation, a loop) and loses where its matches are wrong: a rejected draft still costs a
  verification of its width;
* early exit: the first `draft_layer` layers (`speculative.py`), c ~ their share of the model's parameters,
  gated by the router (a round drafts only when it called the previous token converged).

Each source keeps its own `DraftEstimates` (acceptance per token, draft cost c, verification cost per
width V(w): an early-exit verification reuses the draft's first layers, a lookup one runs every layer), for
as long as the model lives, and each round `SourcePolicy` drafts from the source whose optimum
E = max_k (1 - a^(k+1)) / ((1 - a) (c k + V(k+1))) is highest among those available (lookup: a match
exists; early exit: the gate is open), k from that optimum; where none beats a plain step (E = 1) it takes
plain steps and probes each source now and then, at a bounded cost (`DraftEstimates.probe_interval`).
"""

from __future__ import annotations

import weakref

import torch
from torch import nn
from transformers.generation.candidate_generator import PromptLookupCandidateGenerator

from ..runtime import TideHandle
from .draft import EARLY_EXIT, LOOKUP, DraftEstimates, choose_draft_layer, draft_cost, prior_acceptance
from .vocab import coverage

# The longest n-gram of the context's end looked up: the longest one that occurs earlier wins (transformers
# tries the longest first). Its default, 2, matches common pairs ("of the") at their first occurrence, most
# often the wrong one in a passage being copied; 3 tokens single out the place being copied.
LOOKUP_NGRAM = 3
LOOKUP_MAX_TOKENS = 10  # longest lookup draft (transformers' recommended prompt_lookup_num_tokens)
LOOKUP_PRIOR_COST = 0.0  # a lookup draft costs no forward: c = 0 until its matching time is measured
LOOKUP_KEY = (0, None)  # the estimates of lookup among a model's: drafts that run 0 layers over no head
_ESTIMATES: weakref.WeakKeyDictionary[nn.Module, dict[tuple[int, int | None], DraftEstimates]] = \
    weakref.WeakKeyDictionary()


def resolve_draft_layer(handle: TideHandle) -> int:
    """`options.draft_layer`, or `choose_draft_layer` (attach checked that it is a router checkpoint and that one
    is at or after `min_layers`: `TideOptions.validate`)."""
    layer = handle.options.draft_layer
    return layer if layer is not None else choose_draft_layer(handle.router, handle.adapter, handle.checkpoints)


def draft_estimates(handle: TideHandle, layer: int, vocab: int | None) -> DraftEstimates:
    """The running estimates of drafting at `layer` over `vocab` tokens (None: all) of this model (made from the
    router's priors once)."""
    per_draft = _ESTIMATES.setdefault(handle.model, {})
    if (layer, vocab) not in per_draft:
        prior = prior_acceptance(handle.router, layer)
        if prior is not None:
            prior *= coverage(handle.router, vocab)
        per_draft[layer, vocab] = DraftEstimates.start(draft_cost(handle.adapter, layer, vocab), prior)
    return per_draft[layer, vocab]


def lookup_estimates(handle: TideHandle) -> DraftEstimates:
    """The running estimates of lookup drafts on this model (no prior acceptance: the text decides)."""
    per_draft = _ESTIMATES.setdefault(handle.model, {})
    if LOOKUP_KEY not in per_draft:
        per_draft[LOOKUP_KEY] = DraftEstimates.start(LOOKUP_PRIOR_COST, None, max_draft=LOOKUP_MAX_TOKENS)
    return per_draft[LOOKUP_KEY]


class ContextLookup:
    """Lookup drafts: transformers' `PromptLookupCandidateGenerator` (EOS ids end a draft). It is given no logits
    processors: stock then runs them over a vocabulary-wide tensor per draft token to drop forbidden ones, a cost
    on every round; a forbidden token the verifier scores -inf is rejected anyway, so the output is the same."""

    def __init__(self, eos: torch.Tensor | None, max_length: int) -> None:
        self.matcher = PromptLookupCandidateGenerator(
            eos_token_id=eos, num_output_tokens=LOOKUP_MAX_TOKENS, max_matching_ngram_size=LOOKUP_NGRAM,
            max_length=max_length)

    def draft(self, input_ids: torch.LongTensor, room: int) -> torch.LongTensor | None:
        """Up to `room` draft tokens (1, n) continuing `input_ids` (1, L) as the context did after the same
        n-gram, or None where nothing matches."""
        self.matcher.num_output_tokens = min(room, LOOKUP_MAX_TOKENS)
        ids, _ = self.matcher.get_candidates(input_ids)
        return ids[:, input_ids.shape[1]:] if ids.shape[1] > input_ids.shape[1] else None


class SourcePolicy:
    """Per round, the draft source and length with the best expected speed (`DraftEstimates.plan`), or a plain
    step where no source beats one, with a one-token probe of a source once its `probe_interval` of declined
    rounds has passed (so a source whose drafts start paying again is noticed)."""

    def __init__(self, estimates: dict[str, DraftEstimates]) -> None:
        self.estimates = estimates
        self.declined = dict.fromkeys(estimates, 0)  # rounds each source was available and declined

    def worth_looking(self, source: str, room: int) -> bool:
        """Whether to look for `source`'s drafts this round: a draft of `room` tokens would pay by its estimates,
        or its probe is due. A round not looked counts as declined, so the probe still comes."""
        estimates = self.estimates[source]
        if estimates.plan(room)[0] > 0 or self.declined[source] + 1 >= estimates.probe_interval():
            return True
        self.declined[source] += 1
        return False

    def choose(self, rooms: dict[str, int]) -> tuple[str | None, int, bool]:
        """(source, draft length, whether it is a probe) among the available sources (`rooms`: source -> the
        most tokens it can draft this round); (None, 0, False): a plain step."""
        plans = {s: self.estimates[s].plan(room) for s, room in rooms.items()}
        paying = {s: plan for s, plan in plans.items() if plan[0] > 0}
        if paying:
            best = max(paying, key=lambda s: (paying[s][1], s == EARLY_EXIT))  # ties: the gated source
            self.declined[best] = 0
            return best, paying[best][0], False
        for s in sorted(rooms, key=lambda s: s != LOOKUP):  # the cheaper probe first
            self.declined[s] += 1
            if self.declined[s] >= self.estimates[s].probe_interval():
                self.declined[s] = 0
                return s, 1, True
        return None, 0, False
