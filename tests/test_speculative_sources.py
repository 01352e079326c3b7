"""Speculative mode's draft sources (`tide_hf.integrations.sources`): n-gram matches of the context (prompt
lookup) beside early exit, one cost model choosing per round.

References: stock generate on the same model (greedy token identity at batch 1 and per row of a batch of 8),
the speculative-decoding optimum of each arm's estimates, and the longest repeated suffix found by brute force.
"""

from __future__ import annotations

import pytest
import torch
from helpers import speculative, speculative_model, speculative_router

from tide_hf.integrations.draft import EARLY_EXIT, LOOKUP, DraftEstimates, best_draft_length, interpolated_verify
from tide_hf.integrations.sources import (
    EARLY_EXIT_ARM,
    LONGEST_MATCH,
    LOOKUP_MAX_TOKENS,
    MATCH_CLASSES,
    ContextLookup,
    SourcePolicy,
    match_class,
    succession_prior,
)

REPEATS = 4  # copies of a random phrase in a prompt: the continuation repeats it, lookup drafts pay
PHRASE = 9  # tokens per phrase
LOOKUP_ARM = (LOOKUP, 0)  # lookup drafts after a 1-token match
pytestmark = pytest.mark.usefixtures("one_intra_op_thread")


def repeating(seed: int, rows: int = 1) -> torch.Tensor:
    """Prompts made of a random phrase said `REPEATS` times (tokens from 3 up: no BOS/EOS), one per row."""
    gen = torch.Generator().manual_seed(seed)
    phrases = torch.randint(3, 256, (rows, PHRASE), generator=gen)
    return phrases.repeat(1, REPEATS)


def estimates(acceptance: float, cost: float, verify: dict[int, float], max_draft: int) -> DraftEstimates:
    """Estimates with fixed acceptance and costs (plain step 1 s)."""
    est = DraftEstimates.start(cost, acceptance, max_draft=max_draft)
    est.plain_s, est.draft_s = 1.0, cost
    est.verify_s = dict(verify)
    return est


# -- the choice ----------------------------------------------------------------------------------------
def test_policy_drafts_from_the_source_with_the_best_optimum():
    flat = {w: 1.45 for w in range(2, LOOKUP_MAX_TOKENS + 2)}  # a CPU-like verification
    early, lookup = estimates(0.8, 0.4, flat, 8), estimates(0.9, 0.0, flat, LOOKUP_MAX_TOKENS)
    policy = SourcePolicy({EARLY_EXIT_ARM: early, LOOKUP_ARM: lookup})
    gains = {arm: best_draft_length(est.acceptance, est.cost, interpolated_verify(flat), est.max_draft)
             for arm, est in policy.estimates.items()}
    assert gains[LOOKUP_ARM][1] > gains[EARLY_EXIT_ARM][1] > 1.0  # precondition: both pay, lookup more
    assert policy.choose({EARLY_EXIT_ARM: 50, LOOKUP_ARM: 50}) == (LOOKUP_ARM, gains[LOOKUP_ARM][0], False)
    assert policy.choose({EARLY_EXIT_ARM: 50}) == (EARLY_EXIT_ARM, gains[EARLY_EXIT_ARM][0], False)  # no match
    k, _ = best_draft_length(0.9, 0.0, interpolated_verify(flat), 3)
    assert policy.choose({EARLY_EXIT_ARM: 50, LOOKUP_ARM: 3})[1:] == (k, False)  # a short match caps the draft
    for _ in range(40):  # lookup drafts keep failing: its estimate falls below a plain step
        lookup.observe_round(proposed=LOOKUP_MAX_TOKENS, accepted=0)
    assert policy.choose({EARLY_EXIT_ARM: 50, LOOKUP_ARM: 50})[0] == EARLY_EXIT_ARM


def test_policy_takes_plain_steps_and_probes_while_no_source_pays():
    flat = {w: 1.45 for w in range(2, LOOKUP_MAX_TOKENS + 2)}
    lookup = estimates(0.05, 0.0, flat, LOOKUP_MAX_TOKENS)
    policy = SourcePolicy({EARLY_EXIT_ARM: estimates(0.05, 0.4, flat, 8), LOOKUP_ARM: lookup})
    interval = lookup.probe_interval()
    assert interval > 1
    choices = [policy.choose({LOOKUP_ARM: 50}) for _ in range(3 * interval)]
    assert choices.count((LOOKUP_ARM, 1, True)) == 3  # one one-token probe per interval of plain steps
    assert choices.count((None, 0, False)) == 3 * (interval - 1)


def test_the_context_is_scanned_only_where_a_lookup_draft_could_pay_or_its_probe_is_due():
    """The scan and the choice keep one count: rounds not scanned count as declined, so the probe still comes
    once per interval, as it does when every round is scanned (the test above)."""
    flat = {w: 1.45 for w in range(2, LOOKUP_MAX_TOKENS + 2)}
    losing = estimates(0.05, 0.0, flat, LOOKUP_MAX_TOKENS)
    policy = SourcePolicy({EARLY_EXIT_ARM: estimates(0.05, 0.4, flat, 8), LOOKUP_ARM: losing})
    interval = losing.probe_interval()
    rounds = [policy.worth_looking(LOOKUP, LOOKUP_MAX_TOKENS) and policy.choose({LOOKUP_ARM: LOOKUP_MAX_TOKENS})
              for _ in range(3 * interval)]
    assert rounds.count((LOOKUP_ARM, 1, True)) == 3 and rounds.count(False) == 3 * (interval - 1)
    paying = SourcePolicy({LOOKUP_ARM: estimates(0.9, 0.0, flat, LOOKUP_MAX_TOKENS)})
    assert all(paying.worth_looking(LOOKUP, LOOKUP_MAX_TOKENS) for _ in range(3 * interval))


def test_the_policy_trusts_a_lookup_draft_by_its_match_length():
    """Each class of match length keeps its own acceptance: long matches that keep being right are drafted in full
    while 1-token matches that keep failing take plain steps, on the same costs."""
    flat = {w: 1.45 for w in range(2, LOOKUP_MAX_TOKENS + 2)}
    short, long = (LOOKUP, 0), (LOOKUP, MATCH_CLASSES - 1)
    policy = SourcePolicy({short: estimates(0.05, 0.0, flat, LOOKUP_MAX_TOKENS),
                           long: estimates(0.95, 0.0, flat, LOOKUP_MAX_TOKENS)})
    assert policy.choose({long: LOOKUP_MAX_TOKENS}) == (long, LOOKUP_MAX_TOKENS, False)
    assert policy.choose({short: LOOKUP_MAX_TOKENS}) == (None, 0, False)
    assert policy.arms(LOOKUP) == [short, long] and policy.arms(EARLY_EXIT) == []


def test_match_classes_and_their_priors():
    assert [match_class(n) for n in (1, 2, 3, 4, 7, 8, 15, 16, 1000)] == [0, 1, 1, 2, 2, 3, 3, 4, 4]
    # a match longer than LONGEST_MATCH is reported as LONGEST_MATCH, in the last class
    phrase = torch.arange(3, 3 + 2 * LONGEST_MATCH)
    found, length = ContextLookup(None).draft(torch.cat([phrase, torch.tensor([1]), phrase])[None], 4)
    assert length == LONGEST_MATCH and match_class(length) == MATCH_CLASSES - 1
    assert torch.equal(found, torch.tensor([[1, 3, 4, 5]]))  # what followed the phrase's first occurrence
    # Laplace's rule of succession: after n matched tokens, the next one matches with probability (n + 1) / (n + 2)
    assert [succession_prior(c) for c in range(3)] == pytest.approx([2 / 3, 3 / 4, 5 / 6])


def longest_suffix_match(ids: list[int]) -> tuple[int, int] | None:
    """Brute force: (start of the continuation, match length) of the first earlier occurrence with the longest
    common suffix with the whole context (capped at `LONGEST_MATCH`)."""
    best = None
    for end in range(len(ids) - 1):
        length = 0
        while length < min(LONGEST_MATCH, end + 1) and ids[end - length] == ids[len(ids) - 1 - length]:
            length += 1
        if length and (best is None or length > best[1]):
            best = (end + 1, length)
    return best


@pytest.mark.parametrize("seed", range(20))
def test_lookup_drafts_what_followed_the_longest_repeated_suffix(seed):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 4, (1, 40), generator=gen)  # 4 symbols: many matches of every length
    ids[0, 25:40] = ids[0, 3:18]  # and one long one
    found = ContextLookup(None).draft(ids, 6)
    start, length = longest_suffix_match(ids[0].tolist())
    assert found[1] == length
    assert torch.equal(found[0], ids[:, start : start + 6])


def test_lookup_prefers_the_longest_match_to_the_first_3_gram():
    """transformers' prompt lookup drafts after the first occurrence of the last 3-gram; the place being copied is
    where the longest suffix occurred."""
    ids = torch.tensor([[1, 2, 3, 9, 9, 5, 1, 2, 3, 4, 5, 6, 7, 0, 5, 1, 2, 3]])
    assert torch.equal(ContextLookup(None).draft(ids, 3)[0], torch.tensor([[4, 5, 6]]))  # after "5 1 2 3"
    assert ContextLookup(None).draft(ids, 3)[1] == 4
    assert ContextLookup(None).draft(torch.tensor([[5, 6, 7, 8]]), 4) == (None, 0)  # nothing occurs twice
    eos = ContextLookup(torch.tensor([6]))
    assert torch.equal(eos.draft(ids, 4)[0], torch.tensor([[4, 5]]))  # a draft stops before an EOS id


# -- lossless, with drafts from the context -------------------------------------------------------------
@pytest.mark.parametrize("gate", ["never", "always"])
def test_greedy_identical_to_stock_with_lookup_drafts(gate, monkeypatch):
    """A closed gate leaves lookup alone (its drafts are accepted); an open one lets both sources compete (early
    exit, nearly always right on this model, drafts where lookup's match is short). Either way stock's tokens. Costs
    are fixed: a draft
    forward costs its prior, a verification of w tokens 1 + (w - 1) / 10 plain steps (measured timings of a loaded
    machine decided the competition at random). Which source wins at which estimates: the policy tests above."""
    monkeypatch.setattr(DraftEstimates, "cost", property(lambda self: self.prior_cost))
    monkeypatch.setattr(DraftEstimates, "verify_costs", property(
        lambda self: {w: 1.0 + (w - 1) / 10 for w in range(2, LOOKUP_MAX_TOKENS + 2)}))
    model = speculative_model("random" if gate == "never" else "shallow")
    router = speculative_router(model, gate)
    totals = dict.fromkeys((EARLY_EXIT, LOOKUP), 0)
    for seed in range(3):
        ids = repeating(seed)
        with torch.no_grad():
            stock = model.generate(ids, max_new_tokens=32, do_sample=False, eos_token_id=None)
        out, stats = speculative(model, router, ids, max_new_tokens=32, do_sample=False, eos_token_id=None)
        assert torch.equal(out, stock)
        sources = stats.speculative["sources"]
        for name in totals:
            totals[name] += sources[name]["accepted"]
        assert sum(s["drafted"] for s in sources.values()) == stats.speculative["drafted"]
        by_match = stats.speculative["lookup_matches"].values()  # lookup's rounds split by match length
        assert [sum(c[k] for c in by_match) for k in ("rounds", "accepted")] == [sources[LOOKUP][k]
                                                                                 for k in ("rounds", "accepted")]
    assert totals[LOOKUP] > 0  # the repeated phrase is drafted from the context
    assert (totals[EARLY_EXIT] > 0) == (gate == "always")


def test_batch_of_8_identical_per_row():
    model = speculative_model("shallow")
    router = speculative_router(model, "mixed")
    ids = repeating(5, rows=8)
    mask = torch.ones_like(ids)
    for row in range(8):  # left padding of different widths
        mask[row, : row % 4] = 0
        ids[row, : row % 4] = 0
    call = {"max_new_tokens": 24, "do_sample": False, "eos_token_id": None, "pad_token_id": 0}
    with torch.no_grad():
        stock = model.generate(ids, attention_mask=mask, **call)
    out, stats = speculative(model, router, ids, attention_mask=mask, **call)
    for row in range(8):
        assert torch.equal(out[row], stock[row]), row
    assert stats.speculative["sources"][LOOKUP]["rounds"] > 0 and stats.speculative["fallback"] is None


def test_sampling_with_lookup_drafts_returns_valid_tokens():
    model = speculative_model("random")
    router = speculative_router(model, "never")  # lookup drafts only: rounds without draft logits
    ids = repeating(2)
    torch.manual_seed(0)
    out, stats = speculative(model, router, ids, max_new_tokens=24, do_sample=True, top_k=4, temperature=0.3,
                             eos_token_id=None)
    assert out.shape == (1, ids.shape[1] + 24) and torch.equal(out[:, : ids.shape[1]], ids)
    assert ((out >= 0) & (out < model.config.vocab_size)).all()
    assert stats.speculative["sources"][LOOKUP]["rounds"] > 0


def test_smollm2_grounded_prompt_identical_to_stock(smollm2):
    """SmolLM2 asked to repeat a passage (an input-grounded chat prompt): lookup drafts, stock's tokens."""
    from tide_bench.modes import grounded_prompts

    model, tok = smollm2
    passage = torch.tensor(tok("We the people of the United States, in order to form a more perfect union, "
                               "establish justice, insure domestic tranquility, provide for the common defense, "
                               "promote the general welfare, and secure the blessings of liberty.")["input_ids"])
    ids = grounded_prompts(tok, [passage])[0][None]
    with torch.no_grad():
        stock = model.generate(ids, max_new_tokens=32, do_sample=False)
    out, stats = speculative(model, speculative_router(model, "always", prior=False), ids, max_new_tokens=32,
                             do_sample=False, draft_layer=None)
    assert torch.equal(out, stock)
    assert stats.speculative["sources"][LOOKUP]["accepted"] > 0


def test_only_sources_restricts_the_draft_sources_in_this_thread_and_keeps_the_tokens() -> None:
    """`only_sources` (the bench's ablation): with lookup alone no early-exit round runs, with early exit alone no
    lookup round runs; tokens stay stock's either way; the setting ends with the block; bad names are refused."""
    import tide_hf
    from tide_hf.errors import TideArgumentError
    from tide_hf.integrations.speculative import only_sources

    model = speculative_model("shallow")  # layer-4 drafts mostly right: early-exit rounds run where allowed
    router = speculative_router(model, "always")
    ids = torch.tensor([[5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7]])  # repeats: lookup has matches
    stock = model.generate(ids, max_new_tokens=12, do_sample=False)
    with tide_hf.attach(model, router, mode="speculative", draft_layer=4) as handle:
        for sources, absent in ((("lookup",), "early_exit"), (("early_exit",), "lookup")):
            with only_sources(*sources):
                assert torch.equal(model.generate(ids, max_new_tokens=12, do_sample=False), stock)
            counts = handle.last_stats.speculative["sources"]
            assert counts.get(absent, {}).get("rounds", 0) == 0, sources
            assert counts.get(sources[0], {}).get("rounds", 0) > 0, sources
    for bad in ((), ("tree",)):
        with pytest.raises(TideArgumentError, match="only_sources takes some of"):
            with only_sources(*bad):
                pass
