"""Where a speculative round's drafts come from: matches in the context, the first layers, or nowhere.

Two sources propose drafts, and one verification forward checks them exactly alike, so the choice never
changes the output, only the speed:

* lookup: what followed the earlier occurrence of the context's longest repeated suffix (prompt and generated
  text; prompt lookup decoding, with the occurrence chosen by the longest match rather than the first
  n-gram). It costs next to nothing to make (c ~ 0: a scan of the ids), so it pays wherever the text repeats
  what it has seen (a copy, a quotation, a loop) and loses where its matches are wrong: a rejected draft still
  costs a verification of its width;
* early exit: the first `draft_layer` layers (`speculative.py`), c ~ their share of the model's parameters,
  gated by the router (a round drafts only when it called the previous token converged).

How long the match is says how far a lookup draft can be trusted. A 1-token match is most often chance; one of
16 tokens is a passage being copied. So lookup keeps its acceptance per class of match length (1, 2-3, 4-7,
8-15, 16+ tokens), each starting from Laplace's rule of succession for the class's shortest length: after n
tokens that matched, the next one matches with probability (n + 1) / (n + 2). The text then decides.

Every draft source keeps `DraftEstimates` (acceptance per token, draft cost c, verification cost per width
V(w): an early-exit verification reuses the draft's first layers, a lookup one runs every layer), for as long
as the model lives; the classes of lookup share its timings. Each round `SourcePolicy` drafts from the arm (a
source and, for lookup, the class of this round's match) whose optimum
E = max_k (1 - a^(k+1)) / ((1 - a) (c k + V(k+1))) is highest among those available (lookup: a match
exists; early exit: the gate is open), k from that optimum; where none beats a plain step (E = 1) it takes
plain steps and probes each arm now and then, at a bounded cost (`DraftEstimates.probe_interval`).
"""

from __future__ import annotations

import weakref

import torch
from torch import nn

from ..runtime import TideHandle
from .draft import (
    EARLY_EXIT,
    LOOKUP,
    MAX_DRAFT_TOKENS,
    DraftEstimates,
    best_draft_length,
    choose_draft_layer,
    draft_cost,
    draft_plan,
    prior_acceptance,
)
from .vocab import coverage

LOOKUP_MAX_TOKENS = 10  # longest lookup draft (transformers' recommended prompt_lookup_num_tokens)
LOOKUP_PRIOR_COST = 0.0  # a lookup draft costs no forward: c = 0 until its matching time is measured
MATCH_CLASSES = 5  # lookup's acceptance is kept per class of match length: 1, 2-3, 4-7, 8-15, 16+ tokens
LONGEST_MATCH = 2 ** (MATCH_CLASSES - 1)  # matches are measured up to the last class's shortest length
Arm = tuple[str, int]  # (draft source, class of match length): what the policy keeps estimates of
EARLY_EXIT_ARM: Arm = (EARLY_EXIT, 0)  # early exit has one class
_ESTIMATES: weakref.WeakKeyDictionary[nn.Module, dict[tuple[int, int | None], DraftEstimates]] = \
    weakref.WeakKeyDictionary()
_LOOKUP_ESTIMATES: weakref.WeakKeyDictionary[nn.Module, dict[Arm, DraftEstimates]] = weakref.WeakKeyDictionary()


def match_class(length: int) -> int:
    """The class of a match of `length` >= 1 tokens: floor(log2(length)), the last class taking the longer."""
    return min(length.bit_length() - 1, MATCH_CLASSES - 1)


def shortest_match(cls: int) -> int:
    """The shortest match length of class `cls`."""
    return 2 ** cls


def match_label(cls: int) -> str:
    """The match lengths of class `cls` in words: "1", "2-3", ..., "16+"."""
    shortest, longest = shortest_match(cls), 2 * shortest_match(cls) - 1
    return f"{shortest}+" if cls == MATCH_CLASSES - 1 else str(shortest) if shortest == longest else \
        f"{shortest}-{longest}"


MATCH_LABELS = tuple(match_label(cls) for cls in range(MATCH_CLASSES))


def succession_prior(cls: int) -> float:
    """Laplace's rule of succession at the class's shortest match n: (n + 1) / (n + 2)."""
    return (shortest_match(cls) + 1) / (shortest_match(cls) + 2)


def resolve_draft_layer(handle: TideHandle) -> int:
    """`options.draft_layer`, else the checkpoint whose drafts pay best on this model and linear path.

    A checkpoint that drafted on this model is ranked by what was measured there (`DraftEstimates`: acceptance,
    draft and verification costs). One that has not is ranked by its calibration prior, priced at the
    verification costs measured on this path. Before any verification was timed, priors alone decide
    (`choose_draft_layer`), and ties go to that choice. So a checkpoint that drafted and lost yields to one that
    promises more, and each is tried before the measured best settles."""
    layer = handle.options.draft_layer
    if layer is not None:
        return layer
    prior = choose_draft_layer(handle.router, handle.adapter, handle.checkpoints)
    known = _ESTIMATES.get(handle.model, {})
    drafted = {key: est for key, est in known.items() if est.measured}
    if not drafted:
        return prior
    verify = max(drafted.values(), key=lambda est: len(est.verify_costs)).verify  # this path's verification

    def gain(k: int) -> float:
        vocab, _ = draft_plan(handle.router, handle.adapter, k)
        if (k, vocab) in drafted:
            return drafted[k, vocab].plan(MAX_DRAFT_TOKENS)[1]
        acceptance = prior_acceptance(handle.router, k)
        if acceptance is None:  # nothing known: a plain step's worth, the prior's choice breaking the tie
            return 1.0
        return best_draft_length(acceptance * coverage(handle.router, vocab), draft_cost(handle.adapter, k, vocab),
                                 verify)[1]

    return max(handle.checkpoints, key=lambda k: (gain(k), k == prior))


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


def lookup_estimates(handle: TideHandle) -> dict[Arm, DraftEstimates]:
    """The running estimates of lookup drafts on this model, one per class of match length (priors:
    `succession_prior`); every timing goes to all of them."""
    if handle.model not in _LOOKUP_ESTIMATES:
        _LOOKUP_ESTIMATES[handle.model] = {
            (LOOKUP, cls): DraftEstimates.start(LOOKUP_PRIOR_COST, succession_prior(cls), max_draft=LOOKUP_MAX_TOKENS)
            for cls in range(MATCH_CLASSES)}
    return _LOOKUP_ESTIMATES[handle.model]


class ContextLookup:
    """Lookup drafts: the tokens that followed the earlier occurrence of the context's longest repeated suffix
    (the first such occurrence, as transformers' prompt lookup takes the first match), up to an EOS id."""

    def __init__(self, eos: torch.Tensor | None) -> None:
        self.eos = eos

    def draft(self, input_ids: torch.LongTensor, room: int) -> tuple[torch.LongTensor | None, int]:
        """(up to `room` draft tokens (1, n) continuing `input_ids` (1, L), the match length, at most
        `LONGEST_MATCH`), or (None, 0) where the last token never occurred before (or an EOS id follows it)."""
        ids = input_ids[0]
        ends = (ids[:-1] == ids[-1]).nonzero().squeeze(1)  # earlier occurrences of the last token
        if ends.numel() == 0:
            return None, 0
        back = torch.arange(min(LONGEST_MATCH, ids.shape[0]), device=ids.device)
        at = ends[:, None] - back  # (occurrences, offset): the tokens before each occurrence, newest first
        same = (ids[at.clamp(min=0)] == ids[ids.shape[0] - 1 - back]) & (at >= 0)
        lengths = same.int().cumprod(dim=1).sum(dim=1)
        best = int(lengths.argmax())  # the first of the longest
        start = int(ends[best]) + 1
        draft = ids[start : start + min(room, LOOKUP_MAX_TOKENS)]
        if self.eos is not None:  # stop before an EOS id, as transformers' prompt lookup does
            stops = torch.isin(draft, self.eos.to(draft.device)).nonzero()
            draft = draft[: int(stops[0])] if stops.numel() else draft
        return (draft[None], int(lengths[best])) if draft.numel() else (None, 0)


class SourcePolicy:
    """Per round, the arm and draft length with the best expected speed (`DraftEstimates.plan`), or a plain step
    where no arm beats one, with a one-token probe of an arm once its `probe_interval` of declined rounds has
    passed (so an arm whose drafts start paying again is noticed)."""

    def __init__(self, estimates: dict[Arm, DraftEstimates]) -> None:
        self.estimates = estimates
        self.declined = dict.fromkeys(estimates, 0)  # rounds each arm was available and declined

    def arms(self, source: str) -> list[Arm]:
        """The arms drafting from `source`."""
        return [arm for arm in self.estimates if arm[0] == source]

    def worth_looking(self, source: str, room: int) -> bool:
        """Whether to look for `source`'s drafts this round: one of its arms would pay with a draft of `room`
        tokens, or its probe is due. A round not looked counts as declined for every arm of the source, so the
        probes still come."""
        arms = self.arms(source)
        if any(self.estimates[a].plan(room)[0] > 0 or self.declined[a] + 1 >= self.estimates[a].probe_interval()
               for a in arms):
            return True
        for arm in arms:
            self.declined[arm] += 1
        return False

    def choose(self, rooms: dict[Arm, int]) -> tuple[Arm | None, int, bool]:
        """(arm, draft length, whether it is a probe) among the available arms (`rooms`: arm -> the most tokens
        it can draft this round); (None, 0, False): a plain step."""
        plans = {a: self.estimates[a].plan(room) for a, room in rooms.items()}
        paying = {a: plan for a, plan in plans.items() if plan[0] > 0}
        if paying:
            best = max(paying, key=lambda a: (paying[a][1], a[0] == EARLY_EXIT))  # ties: the gated source
            self.declined[best] = 0
            return best, paying[best][0], False
        for a in sorted(rooms, key=lambda a: a[0] != LOOKUP):  # the cheaper probe first
            self.declined[a] += 1
            if self.declined[a] >= self.estimates[a].probe_interval():
                self.declined[a] = 0
                return a, 1, True
        return None, 0, False
