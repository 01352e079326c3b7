"""`mode="speculative"`: lossless, router-gated self-speculative decoding inside stock `generate()`.

The decoding loop is stock assisted generation (`_assisted_decoding`): it verifies every drafted token in
one full-depth forward, accepts the longest matching prefix (greedy) or runs speculative sampling, and
crops the KV cache. TIDE only supplies the candidates, through a `CandidateGenerator` that stock builds
via `_get_candidate_generator`, replaced on the model instance for the duration of the call:

* drafts run the model's first `draft_layer` layers (`config.num_hidden_layers` is lowered around each
  draft forward, the mechanism of stock `assistant_early_exit`) on the main KV cache: the verified cache
  of those layers is reused, so drafting needs no prefill of its own; a draft token's logits are an exit's
  (through the router's exit head at `draft_layer` when it has one);
* verification reuses the draft's work (`reuse.py`): the draft already ran the first `draft_layer` layers
  one token at a time for every position the verifier checks, so the verification forward runs only the
  deeper layers (and the head) on the draft's layer-`draft_layer` states and K/V;
* the router at `draft_layer` gates every draft token: drafting stops as soon as it says "not converged",
  and a round only starts drafting when the router called the previous token converged (its score comes
  for free from the full-depth forward, which runs `draft_layer` anyway), so a shut gate costs nothing;
* a draft's logits may cover only the router's draft vocabulary (the tokens the model emits most often,
  `vocab.py`), when that cheaper head outweighs the drafts it makes wrong (`draft.draft_plan`);
* a policy plans every round's draft length k as the speculative-decoding optimum (`draft.py`): the
  argmax of expected tokens per unit of time from the measured per-token acceptance and the measured
  costs of a draft forward and of verifying k + 1 tokens. While the estimates say drafting loses it takes
  plain steps, probing with one-token drafts often enough to notice when drafting would pay again, at a
  bounded cost (`PROBE_LOSS`). The estimates live as long as the model and carry over between calls;
* a round may draft from the context instead (`sources.py`): what followed the earlier occurrence of its
  longest repeated suffix (prompt lookup decoding), free to make, verified by every layer, trusted by the
  match's length; the policy drafts from the arm whose optimum, by its own measured acceptance and costs, is
  highest.

Lossless means: every emitted token is the argmax (greedy) or the accepted sample (sampling) of the full
model's logits computed in a verification forward; drafts only decide how many positions one
verification forward checks. In fp32 greedy output equals stock greedy token for token. In bf16 / fp16 a
verification forward of k + 1 tokens rounds differently from k + 1 one-token steps, so a near-tie can
resolve the other way and the text diverge from stock's (transformers' own assisted decoding does the
same): `tide-hf bench modes` reports the divergence rate beside transformers' `assistant_early_exit`.

Stock assisted decoding supports batch size 1 only, so a batch is decoded row by row (each row keeps its
left padding and mask) and re-assembled like stock batched generate lays it out, `return_dict_in_generate`
outputs included (`outputs.py`); a prompt given as `inputs_embeds` is drafted after too (`embeds.py`).
Configurations assisted decoding cannot reproduce exactly (beam search, several sequences per prompt, stop
strings and custom stopping criteria, user logits processors, user caches, `output_attentions`, and with
several rows `max_time` or a streamer: `rows.fallback_reason`) run stock generate instead: the output is the
same, only the speed-up is missing; `last_stats.speculative["fallback"]` names the reason (None: drafted) and a
`SpeculativeFallbackWarning` says it once per reason and attach. Either way the statistics count every token
at full depth, as select mode counts them (a fallback through the handle's own hooks, told to decide no exits).
Like stock early-exit drafting, a draft forward lowers the shared `config.num_hidden_layers` (of the module
owning the layers): a speculative call runs alone, other threads' calls of the model waiting (`turns.py`).
"""

from __future__ import annotations

import copy
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn
from transformers import GenerationConfig, LogitsProcessorList
from transformers.generation.candidate_generator import CandidateGenerator

from ..compat import CANDIDATE_GENERATOR_FACTORY, eos_token_tensor, extend_model_kwargs, split_cache, with_cache
from ..errors import TideArgumentError, TideConcurrencyError, TideUnsupportedError
from ..modeling import layer_output
from ..runtime import Patches, Session, TideHandle
from .draft import DRAFT_SOURCES, EARLY_EXIT, LOOKUP, SOURCE_COUNTERS, SpeculativeStats, draft_body, draft_plan
from .embeds import with_placeholder_ids, without_prompt
from .outputs import stack_outputs
from .processor import TideLogitsProcessor
from .reuse import DraftReuse, install_reuse
from .rows import count_full_depth, fallback_reason, row_kwargs, warn_fallback
from .sources import (
    EARLY_EXIT_ARM,
    LOOKUP_MAX_TOKENS,
    MATCH_LABELS,
    Arm,
    ContextLookup,
    SourcePolicy,
    draft_estimates,
    lookup_estimates,
    match_class,
    match_label,
    resolve_draft_layer,
)
from .vocab import DraftHead

# A rejected draft token costs one draft forward, nothing else: the gate stops a draft only where the router
# calls the token more likely unconverged than not, never at a quality target's stricter threshold (those are
# for exits whose tokens are emitted).
GATE_THRESHOLD = 0.5
PLAIN_TIMING_EVERY = 16  # drafting rounds between plain steps that keep the plain-step time current
_ALLOWED = threading.local()  # the sources `only_sources` leaves on in this thread


@contextmanager
def only_sources(*sources: str) -> Iterator[None]:
    """Draft only from `sources` (of `DRAFT_SOURCES`) in this thread's speculative calls: the bench's ablation of
    early-exit and lookup drafts. Output is unchanged (lossless); only the speed and the rounds per source move."""
    unknown = [s for s in sources if s not in DRAFT_SOURCES]
    if unknown or not sources:
        raise TideArgumentError(f"only_sources takes some of {DRAFT_SOURCES}, got {sources!r}")
    previous, _ALLOWED.sources = getattr(_ALLOWED, "sources", DRAFT_SOURCES), tuple(sources)
    try:
        yield
    finally:
        _ALLOWED.sources = previous


# -- the candidate generator ------------------------------------------------------------------------------
class TideCandidateGenerator(CandidateGenerator):
    """Drafts with the first `layer` layers on the shared KV cache, as many tokens as the policy plans and
    while the router at `layer` says converged."""

    def __init__(self, handle: TideHandle, stats: SpeculativeStats, draft_head: DraftHead | None,
                 generation_config: GenerationConfig, logits_processor: Any, model_kwargs: dict[str, Any]) -> None:
        self.handle, self.layer, self.stats, self.draft_head = handle, stats.draft_layer, stats, draft_head
        self.model = handle.model
        self.body, self.config = draft_body(self.model, handle.adapter.layers)
        self.estimates = draft_estimates(handle, self.layer, stats.draft_vocab)
        self.policy = SourcePolicy({EARLY_EXIT_ARM: self.estimates, **lookup_estimates(handle)})
        self.lookup = ContextLookup(eos_token_tensor(generation_config))
        self.cache, self.kwargs = split_cache(model_kwargs)  # the cache stock verifies with, for the whole call
        self.processors = logits_processor
        self.do_sample = bool(generation_config.do_sample)
        self.max_length = generation_config.max_length
        self.eos = eos_token_tensor(generation_config)
        self.reuse = DraftReuse(self.cache, self.layer, enabled=not (generation_config.output_hidden_states
                                                                     or generation_config.output_attentions))
        self.threshold = min(handle.options.threshold(self.layer), GATE_THRESHOLD)
        self.drafting = False  # set around draft forwards (read by the hooks)
        self.gate_open = False  # the router's verdict on the newest draft token
        self.window = 1  # positions of the next verification forward whose scores may open the next round
        self.window_scores: torch.Tensor | None = None
        self.pregate = False  # the router's verdict on the last token the verifier emitted
        self.round_start: float | None = None
        self.prefill = True  # the open round is the prefill (not a plain step's time)
        # (arm, proposed, draft forwards, their seconds, whether the verification is a timing sample) of the
        # open round
        self.last: tuple[Arm, int, int, float, bool] | None = None
        self.ended, self.draft_end = False, None  # whether the last round's draft ended with an EOS id; its last token
        self.since_plain = 0  # rounds since the last plain step (timed: drafting rounds leave no plain time)

    # -- hooks (registered by `_patched` for the call) --
    def gate_hook(self, _module: nn.Module, _args: tuple, output: Any) -> Any:
        hidden = layer_output(output)
        if self.drafting:
            self.gate_open = bool(self.handle.score(self.layer, hidden[:, -1]).min() >= self.threshold)
            self.reuse.record(output)  # the layer's own output: what verification continues from
            state = self.handle.exit_state(self.layer, hidden)
            if state is not hidden:  # the draft's logits come from the router's exit head, as an exit's do
                return (state, *output[1:]) if isinstance(output, tuple) else state
        else:  # a verification forward: keep the scores of the positions that may predict the next token
            self.window_scores = self.handle.score(self.layer, hidden[:, -self.window:])

    def depth_guard(self, _module: nn.Module, _args: tuple) -> None:
        if self.drafting:
            raise TideUnsupportedError(
                f"{type(self.model).__name__} ignores config.num_hidden_layers, so it cannot draft with its first "
                "layers; mode='speculative' needs a model that runs `layers[: config.num_hidden_layers]` "
                "(the Llama family does)")

    # -- stock interface --
    @property
    def num_drafting_tokens(self) -> int:
        """The most tokens one round may draft: stock assisted decoding (transformers >= 5.25) sizes the recurrent
        states it keeps by it."""
        return max(estimates.max_draft for estimates in self.policy.estimates.values())

    def get_candidates(self, input_ids: torch.LongTensor, **kwargs: Any) -> tuple[torch.LongTensor, Tensor | None]:
        now = time.perf_counter()
        if self.round_start is not None:
            self._close_round(now - self.round_start)
        self.round_start, self.last, self.window = now, None, 1
        self.reuse.clear()
        room = self.max_length - input_ids.shape[1] - 1  # tokens one round may draft, the verifier's own aside
        if self.cache.get_seq_length() != input_ids.shape[1] - 1 or room < 1:  # the prefill, or no room left
            return input_ids, None
        allowed = getattr(_ALLOWED, "sources", DRAFT_SOURCES)
        rooms = {EARLY_EXIT_ARM: room} if self.pregate and EARLY_EXIT in allowed else {}
        self.stats.gate_skips += not self.pregate
        self.since_plain += 1
        if self.estimates.plain_s is None or self.since_plain > PLAIN_TIMING_EVERY:  # time a plain step: the cost
            return input_ids, None  # unit of every estimate (never a loss against plain decoding)
        # the ids are scanned only where a lookup draft could pay, or its probe is due
        found, length = (self.lookup.draft(input_ids, room) if LOOKUP in allowed and self.policy.worth_looking(
            LOOKUP, min(room, LOOKUP_MAX_TOKENS)) else (None, 0))
        if found is not None:
            rooms[LOOKUP, match_class(length)] = found.shape[1]
        if not rooms:
            return input_ids, None
        arm, k, probe = self.policy.choose(rooms)
        if arm is None:  # drafting loses by the estimates: a plain step
            self.stats.plan_skips += 1
            return input_ids, None
        source, match = self._counted(arm)
        self.stats.count_plan(source, k, probe, match)
        if arm[0] == LOOKUP:  # the verification runs every layer: nothing to reuse, no gate to ask
            self.last, self.window = (arm, k, k, time.perf_counter() - now, True), k + 1
            self.ended = False  # (lookup drafts stop before an EOS id)
            return torch.cat([input_ids, found[:, :k]], dim=-1), None
        return self._draft(input_ids, k, now)

    def update_candidate_strategy(self, input_ids: torch.LongTensor, scores: torch.Tensor, num_matches: int) -> None:
        matches = int(num_matches)
        verdicts = self.window_scores  # the token just emitted was predicted at window position `matches`
        if verdicts is not None:
            self.pregate = bool(verdicts[0, min(matches, verdicts.shape[1] - 1)] >= self.threshold)
        if self.last is None or self.last[1] == 0:
            self.stats.plain_steps += 1
            return
        arm, proposed = self.last[:2]
        if self.ended and matches == proposed - 1 and bool(input_ids[0, -1] == self.draft_end):
            matches = proposed  # stock counts a matched final EOS one short: it emits it as the verifier's own token
        source, match = self._counted(arm)
        self.stats.count_round(source, proposed, matches, match)
        self.policy.estimates[arm].observe_round(proposed, matches)

    # -- internals --
    @staticmethod
    def _counted(arm: Arm) -> tuple[str, str | None]:
        """(source, its class of match length for lookup, None for early exit): how a round is counted."""
        return arm[0], match_label(arm[1]) if arm[0] == LOOKUP else None

    def _draft(self, input_ids: torch.LongTensor, room: int, start: float) -> tuple[torch.LongTensor, Tensor | None]:
        ids, scores, forwards, tail = input_ids, [], 0, False
        reuse = self.reuse.available()
        patches = Patches()
        patches.set_attr(self.config, "num_hidden_layers", self.layer)  # stock early-exit drafting's mechanism
        self.drafting = True
        try:
            for _ in range(room):
                logits = self._forward(ids)
                forwards += 1
                if not self.gate_open:
                    self.stats.gate_stops += 1
                    break
                step = self.processors(ids, logits)
                if not bool(torch.isfinite(step).any()):  # the processors removed every draft-vocabulary token
                    break
                token = (torch.multinomial(step.softmax(-1), 1) if self.do_sample else step.argmax(-1, keepdim=True))
                ids, scores = torch.cat([ids, token.to(ids.device)], dim=-1), [*scores, step]
                if self.eos is not None and bool(torch.isin(token, self.eos.to(token.device)).any()):
                    break
            draft_seconds = time.perf_counter() - start
            proposed = ids.shape[1] - input_ids.shape[1]
            if reuse and forwards == proposed:  # the last draft token still needs the first layers: the tail
                self._forward(ids, head=False)
                tail = True
        finally:
            patches.restore()
            self.drafting = False
            if forwards:  # back to the verified length, the draft's work kept for the verification
                self.reuse.stash(forwards + tail, keep=reuse)
        self.stats.draft_forwards += forwards
        self.stats.tail_forwards += tail
        # a verification whose first position the last draft forward ran is cheaper than the model's v(k + 1)
        self.last, self.window = (EARLY_EXIT_ARM, proposed, forwards, draft_seconds, tail or not reuse), proposed + 1
        self.draft_end = ids[0, -1]
        self.ended = proposed > 0 and self.eos is not None and bool(torch.isin(self.draft_end, self.eos.to(ids.device)))
        if proposed == 0:
            return input_ids, None
        return ids, (torch.stack(scores, dim=1) if self.do_sample else None)

    def _forward(self, ids: torch.LongTensor, head: bool = True) -> torch.Tensor | None:
        """Logits of the last position of `ids`, its predecessors being in the cache of the draft layers, through
        the draft head when there is one (`head=False`: the model body only, for its cache entries and the hooks;
        returns None)."""
        kwargs = extend_model_kwargs(self.kwargs, ids.shape[1])
        inputs = self.model.prepare_inputs_for_generation(ids, next_sequence_length=1, **with_cache(kwargs, self.cache))
        if not head or self.draft_head is not None:
            inputs.pop("logits_to_keep", None)
            body = self.body(**inputs)
            if not head:
                return None
            return self.draft_head(body.last_hidden_state[:, -1]).to(dtype=torch.float32, device=ids.device)
        if "logits_to_keep" in inputs:
            inputs["logits_to_keep"] = 1
        return self.model(**inputs).logits[:, -1].to(dtype=torch.float32, device=ids.device)

    def _close_round(self, seconds: float) -> None:
        """Fold the finished round's time into the estimates (the prefill is nobody's step time)."""
        if self.prefill:
            self.prefill = False
            return
        if self.last is None:
            self._observe_plain(seconds)
            self.since_plain = 0
            return
        arm, proposed, forwards, draft_seconds, timed = self.last
        timings = [self.policy.estimates[a] for a in self.policy.arms(arm[0])]  # a source's arms share its costs
        for estimates in timings:
            estimates.observe_draft(draft_seconds / forwards)
        if not timed:  # the last draft forward did the verification's first layers: not the modelled cost
            return
        verify = seconds - draft_seconds
        if proposed == 0:  # the gate shut at the first draft forward: the verification was a plain step
            self._observe_plain(verify)
            return
        for estimates in timings:
            estimates.observe_verify(verify, proposed + 1)

    def _observe_plain(self, seconds: float) -> None:
        """A plain step's time: the unit of every source's costs."""
        for estimates in self.policy.estimates.values():
            estimates.observe_plain(seconds)


@contextmanager
def _patched(model: nn.Module, factory: Callable[..., CandidateGenerator], handle: TideHandle, layer: int,
             owner: list[TideCandidateGenerator]) -> Iterator[None]:
    """Route stock `_get_candidate_generator` to `factory` on this instance, with the gate and depth hooks;
    everything is removed afterwards, also on errors, leaving the model exactly as before."""
    if CANDIDATE_GENERATOR_FACTORY in vars(model):
        raise TideConcurrencyError("a speculative generate call is already running on this model (one at a time)")
    layers = handle.adapter.layers
    with Patches() as patches:
        install_reuse(layers, layer, lambda: owner[-1].reuse if owner else None, patches)
        patches.hook(layers[layer - 1].register_forward_hook(lambda *a: owner[-1].gate_hook(*a) if owner else None))
        patches.hook(layers[layer].register_forward_pre_hook(lambda *a: owner[-1].depth_guard(*a) if owner else None))
        patches.set_attr(model, CANDIDATE_GENERATOR_FACTORY, factory)
        with handle.turns.exclusive():  # other threads' calls wait: drafts truncate the shared model
            yield


# -- entry point ------------------------------------------------------------------------------------------
def generate(handle: TideHandle, original: Callable, model: nn.Module, args: tuple, kwargs: dict,
             session: Session, config: GenerationConfig) -> Any:
    """Stock `generate` with router-gated self-speculation: the output equals stock generate's (greedy: token
    for token); `session.stats.speculative` gets the counters of this call. `config`: the call's settings as
    generate merges them."""
    inputs = args[0] if args else kwargs.get("inputs", kwargs.get("input_ids"))
    embeds = kwargs.get("inputs_embeds")
    batch = inputs.shape[0] if isinstance(inputs, torch.Tensor) and inputs.dim() == 2 else \
        embeds.shape[0] if inputs is None and isinstance(embeds, torch.Tensor) and embeds.dim() == 3 else 0
    layer = resolve_draft_layer(handle)
    vocab, expected = draft_plan(handle.router, handle.adapter, layer)
    stats = SpeculativeStats(layer, expected, vocab,
                             lookup_matches={label: dict.fromkeys(SOURCE_COUNTERS, 0) for label in MATCH_LABELS})
    stats.fallback = fallback_reason(model, args, kwargs, batch, config, handle.options.auto)
    warn_fallback(handle, stats.fallback)
    try:
        if stats.fallback is not None and (config.assistant_early_exit is not None or kwargs.get("assistant_model")
                                           is not None or config.prompt_lookup_num_tokens is not None):
            with handle.disabled():  # assisted decoding chosen by the user: its nested generate calls stay stock
                out = original(model, *args, **kwargs)
            count_full_depth(session, handle.num_layers, inputs, kwargs.get("attention_mask"), out, config.pad_token_id)
            return out
        if stats.fallback is not None:  # stock ran every layer: counted as select mode counts it, with no exits
            session.full_depth = True
            processors = LogitsProcessorList([*(kwargs.get("logits_processor") or []),
                                              TideLogitsProcessor(handle, session)])
            return original(model, *args, **{**kwargs, "logits_processor": processors})
        with handle.disabled():  # the router runs only in the gate hook; verification is the stock model
            width = 0  # placeholder prompt columns to cut (a prompt given as embeddings only)
            if inputs is None:
                kwargs, width = with_placeholder_ids(kwargs, config)
            else:
                key = "inputs" if "inputs" in kwargs or args else "input_ids"
                kwargs = {k: v for k, v in kwargs.items() if k != "inputs"} | {key: inputs}
            head = None if vocab is None else DraftHead(handle.adapter, handle.router, vocab)  # one slice per call
            rows = [without_prompt(_generate_row(handle, original, model, kwargs if batch == 1 else
                                                 row_kwargs(kwargs, i, batch), stats, head, session, config), width)
                    for i in range(batch)]
            return rows[0] if batch == 1 else stack_outputs(rows, config)
    finally:
        estimates = draft_estimates(handle, layer, vocab)
        stats.draft_cost, stats.verify_costs = estimates.cost, estimates.verify_costs
        lookup = lookup_estimates(handle)[LOOKUP, 0]  # (its classes share the timings)
        stats.lookup_cost, stats.lookup_verify_costs = lookup.cost, lookup.verify_costs
        session.stats.speculative = stats.as_dict()


def _generate_row(handle: TideHandle, original: Callable, model: nn.Module, kwargs: dict, stats: SpeculativeStats,
                  head: DraftHead | None, session: Session, config: GenerationConfig) -> Any:
    owner: list[TideCandidateGenerator] = []

    def factory(*, generation_config: GenerationConfig, logits_processor: Any, model_kwargs: dict, **_: Any
                ) -> TideCandidateGenerator:
        owner.append(TideCandidateGenerator(handle, stats, head, generation_config, logits_processor, model_kwargs))
        return owner[-1]

    with _patched(model, factory, handle, stats.draft_layer, owner):
        given = kwargs.get("generation_config")
        if given is None:
            out = original(model, **kwargs, assistant_early_exit=stats.draft_layer)
        else:  # in the config given: stock warns about a generation_config given beside generation keywords
            given = copy.deepcopy(given)
            given.assistant_early_exit = stats.draft_layer
            out = original(model, **{**kwargs, "generation_config": given})
    stats.reused += sum(generator.reuse.verified for generator in owner)
    count_full_depth(session, handle.num_layers, kwargs.get("inputs", kwargs.get("input_ids")),
                     kwargs.get("attention_mask"), out, config.pad_token_id)
    return out

