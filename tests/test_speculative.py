"""mode="speculative": router-gated self-speculative decoding inside stock generate().

References: stock generate on the same model (greedy token identity, batch 1 and left-padded batches),
forward hooks counting full-depth and draft forwards, and the model's own attributes and hooks before
the call (nothing may be left behind).
"""

from __future__ import annotations

import logging
import math

import pytest
import torch
from helpers import (
    NEW,
    NUM_LAYERS,
    counter,
    left_padded,
    make_tiny_llama,
    snapshot,
    speculative,
    speculative_model,
    speculative_router,
)
from transformers import (
    DynamicCache,
    GPT2Config,
    GPT2LMHeadModel,
    LogitsProcessor,
    LogitsProcessorList,
    StoppingCriteria,
    StoppingCriteriaList,
)

import tide_hf
from tide_hf import TideRouter, TideRouterConfig
from tide_hf.compat import CACHE_KWARG
from tide_hf.errors import TideUnsupportedError
from tide_hf.integrations.draft import (
    DEFAULT_ACCEPTANCE,
    MAX_DRAFT_TOKENS,
    MEMORY_BOUND,
    PROBE_LOSS,
    DraftEstimates,
    VerifyCost,
    best_draft_length,
    choose_draft_layer,
    draft_cost,
    interpolated_verify,
    linear_verify,
)
from tide_hf.integrations.speculative import draft_estimates

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")
HIDDEN = 64


# -- greedy identity ----------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["random", "shallow"])
@pytest.mark.parametrize("gate", ["always", "never", "mixed"])
def test_greedy_identical_to_stock(kind, gate):
    model = speculative_model(kind)
    router = speculative_router(model, gate)
    before = snapshot(model)
    drafted = 0
    for seed in range(3):
        ids, mask = left_padded(seed)
        call = {"max_new_tokens": NEW, "do_sample": False}
        with torch.no_grad():
            stock_batch = model.generate(ids, attention_mask=mask, **call)
            stock_rows = [model.generate(ids[i:i + 1, -int(mask[i].sum()):], **call) for i in range(3)]
        for i in range(3):  # batch 1, unpadded prompt
            out, stats = speculative(model, router, ids[i:i + 1, -int(mask[i].sum()):], **call)
            assert torch.equal(out, stock_rows[i])
            drafted += stats.speculative["sources"]["early_exit"]["drafted"]
        out, stats = speculative(model, router, ids, attention_mask=mask, **call)  # left-padded batch of 3
        assert torch.equal(out, stock_batch)
        assert stats.decode.tokens == 3 * (NEW - 1) and stats.prefill.tokens == int(mask.sum())
        assert stats.speculative["fallback"] is None
    assert snapshot(model) == before
    assert (drafted > 0) == (gate != "never")  # early-exit drafts (lookup drafts need no gate)


def test_batch_rows_finishing_early_are_padded_like_stock():
    model = speculative_model("shallow")
    router = speculative_router(model, "always")
    ids, mask = left_padded(3)
    with torch.no_grad():
        free = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, eos_token_id=None)
    eos = int(free[1, ids.shape[1] + 3])  # row 1 stops after 4 new tokens, the others later or never
    call = {"max_new_tokens": NEW, "do_sample": False, "eos_token_id": eos, "pad_token_id": 0}
    with torch.no_grad():
        stock = model.generate(ids, attention_mask=mask, **call)
    out, stats = speculative(model, router, ids, attention_mask=mask, **call)
    assert torch.equal(out, stock)
    assert (stock[1, ids.shape[1] + 4:] == 0).all() and stats.speculative["accepted"] > 0


# -- speculation really happens, and pays in forwards -------------------------------------------------
def test_drafts_are_accepted_and_save_full_forwards(early_exit_only):
    model = speculative_model("shallow")
    router = speculative_router(model, "always")
    ids, mask = left_padded(0)
    prompt = ids[:1, -int(mask[0].sum()):]
    full, draft = counter(model.model.layers[-1]), counter(model.model.layers[3])
    computed = counter(model.model.layers[0].self_attn)  # layer 1's real work (reusing verifications skip it)
    with torch.no_grad():
        stock = model.generate(prompt, max_new_tokens=32, do_sample=False)
    assert full[0] == 32
    full[0] = draft[0] = computed[0] = 0
    out, stats = speculative(model, router, prompt, max_new_tokens=32, do_sample=False)
    spec = stats.speculative
    assert torch.equal(out, stock)
    assert spec["accepted"] > 0 and spec["acceptance_rate"] > 0.5
    assert full[0] < 32  # fewer full-depth forwards than generated tokens
    assert full[0] == spec["rounds"] + spec["plain_steps"]
    # all reach layer 4, drafts stop there; attach's check that the model follows a lowered depth runs one more
    assert draft[0] == full[0] + spec["draft_forwards"] + spec["tail_forwards"] + 1
    # verifications after a draft reuse its first layers: those ran for the prefill, the verifications
    # without a draft, and the draft and tail forwards only
    assert spec["reused"] >= spec["rounds"] > 0
    assert computed[0] == 1 + (full[0] - 1 - spec["reused"]) + spec["draft_forwards"] + spec["tail_forwards"] + 1
    assert spec["accepted"] <= spec["drafted"] <= spec["draft_forwards"]
    assert spec["mean_draft_length"] == pytest.approx(spec["drafted"] / spec["rounds"])


def test_drafts_come_from_the_exit_head_and_stay_lossless(early_exit_only):
    """A router with random exit heads drafts through them: on the shallow model, whose layer-4 lens already
    predicts the final tokens, its drafts are rejected far more often, and the output is still stock's."""
    model = speculative_model("shallow")
    ids, mask = left_padded(0)
    prompt = ids[:1, -int(mask[0].sum()):]
    with torch.no_grad():
        stock = model.generate(prompt, max_new_tokens=32, do_sample=False)
    rates = {}
    for head in ("lens", "linear"):
        out, stats = speculative(model, speculative_router(model, "always", exit_head=head), prompt, max_new_tokens=32,
                                 do_sample=False)
        assert torch.equal(out, stock)
        rates[head] = stats.speculative["accepted"] / max(stats.speculative["drafted"], 1)
    assert rates["lens"] > 0.5 and rates["linear"] < rates["lens"] - 0.3, rates


def test_sampling_returns_valid_tokens():
    model = speculative_model("shallow")
    router = speculative_router(model, "always")
    ids, mask = left_padded(1)
    torch.manual_seed(0)
    out, stats = speculative(model, router, ids, attention_mask=mask, max_new_tokens=NEW, do_sample=True,
                             top_k=20, temperature=0.8, eos_token_id=None)
    assert out.shape == (3, ids.shape[1] + NEW)
    assert torch.equal(out[:, :ids.shape[1]], ids)
    assert ((out >= 0) & (out < model.config.vocab_size)).all()
    assert stats.speculative["rounds"] > 0 and stats.speculative["accepted"] > 0


# -- the gate and the drafting policy -------------------------------------------------------------------
def test_closed_gate_drafts_nothing(early_exit_only):
    model = speculative_model("shallow")
    router = speculative_router(model, "never")
    ids, mask = left_padded(0)
    out, stats = speculative(model, router, ids[:1], max_new_tokens=32, do_sample=False)
    spec = stats.speculative
    # the previous token's score (free, from the full-depth forward) keeps every round from drafting
    assert spec["drafted"] == spec["draft_forwards"] == spec["plan_skips"] == spec["probes"] == 0
    # 32 plain forwards: the prefill, the gate's skips, the last step (no room left to draft)
    assert spec["gate_skips"] == 32 - 2 and spec["plain_steps"] == 32


def simulated_speedup(acceptance: float, k: int, cost: float, verify: VerifyCost, rounds: int = 20000) -> float:
    """Tokens per plain-step time of `rounds` simulated rounds: k Bernoulli(acceptance) drafts, the accepted
    prefix plus the verifier's token emitted, each round costing cost * k + verify(k + 1) plain steps."""
    gen = torch.Generator().manual_seed(0)
    right = torch.rand(rounds, k, generator=gen) < acceptance
    prefix = right.int().cumprod(dim=1).sum(dim=1) if k else torch.zeros(rounds)
    return float((prefix + 1).sum()) / (rounds * (cost * k + verify(k + 1)))


def flat_verify(width: int) -> float:
    """A CPU-like verification: any width from 2 on costs 1.45 plain steps."""
    return 1.0 if width == 1 else 1.45


@pytest.mark.parametrize("acceptance, cost, verify", [
    (0.9, 0.47, linear_verify(0.0)), (0.8, 0.63, linear_verify(0.1)), (0.6, 0.05, linear_verify(0.0)),
    (0.3, 0.6, linear_verify(0.2)), (0.99, 0.2, linear_verify(0.05)), (0.95, 0.5, flat_verify),
    (0.876, 0.667, flat_verify)])
def test_draft_length_is_the_simulated_optimum(acceptance, cost, verify):
    simulated = [simulated_speedup(acceptance, k, cost, verify) for k in range(MAX_DRAFT_TOKENS + 1)]
    k, gain = best_draft_length(acceptance, cost, verify)
    assert gain == pytest.approx(simulated[k], rel=0.02)
    assert gain >= max(simulated) * 0.98  # no other length does better, up to simulation noise
    assert (k == 0) == (max(simulated) <= 1.0 + 0.02 and gain == 1.0)


def test_flat_verification_is_not_extrapolated_as_a_line():
    """On a CPU whose verification costs ~1.45 plain steps at any width, a line through V(1) and V(2) says
    drafting loses at a = 0.95, c = 0.5, while long drafts pay ~1.3x: the per-width costs find them."""
    line = linear_verify(flat_verify(2) - 1.0)
    assert best_draft_length(0.95, 0.5, line)[0] == 0
    k, gain = best_draft_length(0.95, 0.5, flat_verify)
    assert k >= 4 and gain > 1.25


def test_verify_costs_are_interpolated_between_measured_widths():
    verify = interpolated_verify({3: 1.4, 7: 1.8})
    assert verify(1) == 1.0 and verify(2) == pytest.approx(1.2)  # between the known V(1) = 1 and V(3)
    assert verify(3) == pytest.approx(1.4) and verify(5) == pytest.approx(1.6)
    assert verify(9) == pytest.approx(1.8)  # beyond the widest: as costly, so a plan tries it and then knows
    assert interpolated_verify({})(6) == 1.0  # nothing measured: memory-bound


def test_estimates_drop_one_time_costs_and_follow_acceptance():
    est = DraftEstimates.start(prior_cost=0.5, acceptance=None)
    assert est.acceptance == DEFAULT_ACCEPTANCE and est.cost == 0.5  # priors until measured
    est.observe_plain(5.0)  # first plain step: lazy allocation, first kernel use... never charged
    est.observe_draft(9.0)
    assert est.plain_s is None and est.draft_s is None and est.cost == 0.5
    est.observe_plain(0.10)
    est.observe_draft(0.03)
    assert est.cost == pytest.approx(0.3)
    est.observe_verify(0.5, 3)  # first verification of several tokens: dropped too
    est.observe_verify(0.12, 3)
    assert est.verify_costs == {3: pytest.approx(1.2)} and est.verify(2) == pytest.approx(1.1)
    for _ in range(40):  # drafts keep being rejected at the first token: drafting loses, probes are rare
        est.observe_round(proposed=1, accepted=0)
    assert est.acceptance < 0.1 and est.plan(8)[0] == 0
    assert est.probe_interval() == math.ceil((0.1 + 0.3 - est.acceptance) / PROBE_LOSS)
    for _ in range(10):  # probes find the drafts right again: drafting resumes
        est.observe_round(proposed=1, accepted=1)
    assert est.plan(8) == best_draft_length(est.acceptance, 0.3, est.verify) and est.plan(8)[0] > 0


@pytest.fixture
def frozen_costs(monkeypatch):
    """Fixed draft and verify costs (c, s) for a model: plans then depend on acceptance only, not on the
    timings of a shared test machine."""
    def freeze(model, router, cost: float, slope: float) -> DraftEstimates:
        handle = tide_hf.attach(model, router, mode="speculative", exit_threshold=0.5, draft_layer=4)
        est = draft_estimates(handle, 4, None)
        handle.detach()
        est.plain_s, est.draft_s = 1.0, cost
        est.verify_s = {w: linear_verify(slope)(w) for w in range(2, MAX_DRAFT_TOKENS + 2)}
        for name in ("observe_plain", "observe_draft", "observe_verify"):
            monkeypatch.setattr(est, name, lambda *a: None)
        return est
    return freeze


def test_policy_drafts_the_optimal_length_when_drafts_are_right(frozen_costs, early_exit_only):
    model = speculative_model("shallow")
    router = speculative_router(model, "always")
    est = frozen_costs(model, router, cost=0.3, slope=0.05)
    prompt = left_padded(0)[0][:1]
    full = counter(model.model.layers[-1])
    with torch.no_grad():
        stock = model.generate(prompt, max_new_tokens=64, do_sample=False, eos_token_id=None)
    full[0] = 0
    out, stats = speculative(model, router, prompt, max_new_tokens=64, do_sample=False, eos_token_id=None)
    spec = stats.speculative
    assert torch.equal(out, stock) and spec["acceptance_per_token"] == 1.0  # precondition: drafts always right
    assert best_draft_length(1.0, 0.3, linear_verify(0.05))[0] == MAX_DRAFT_TOKENS
    # the prior (0.5, no metrics) plans short drafts; accepted ones raise the estimate to the optimum
    assert spec["planned"] >= MAX_DRAFT_TOKENS * (spec["rounds"] - 3) and spec["plan_skips"] == spec["probes"] == 0
    assert spec["optimal_draft_length"] == MAX_DRAFT_TOKENS and est.acceptance > 0.9
    assert spec["verify_costs"] == pytest.approx({w: 1.0 + 0.05 * (w - 1) for w in range(2, MAX_DRAFT_TOKENS + 2)})
    assert full[0] == spec["rounds"] + spec["plain_steps"] <= 64 // 4


def test_policy_falls_back_while_drafts_lose_and_probes(frozen_costs, early_exit_only):
    model = speculative_model("random")
    router = speculative_router(model, "always")
    est = frozen_costs(model, router, cost=0.5, slope=0.1)
    ids, _ = left_padded(2)
    new = 96
    out, stats = speculative(model, router, ids[:1], max_new_tokens=new, do_sample=False, eos_token_id=None)
    spec = stats.speculative
    assert spec["accepted"] <= spec["drafted"] // 4  # precondition: layer-4 drafts of this model are mostly wrong
    assert spec["optimal_draft_length"] == 0 and est.plan(8)[0] == 0
    # the prior (the router's metrics promise top-1 agreement 1.0) drafts a few rounds, then the measured
    # acceptance says drafting loses: plain steps and now and then a probe; with the acceptance
    # estimate near 0.25, the probe interval ceil((s + c - a) / PROBE_LOSS) stays above 10 plain steps
    assert est.acceptance < 0.3 and est.probe_interval() > 10
    assert spec["plan_skips"] >= new - 20 and 1 <= spec["probes"] <= spec["plan_skips"] // 10
    assert spec["draft_forwards"] <= 3 * MAX_DRAFT_TOKENS + spec["probes"]  # drafting every round: ~8 x 20


# -- the model is left exactly as before ---------------------------------------------------------------
@pytest.mark.parametrize("where", ["verification", "draft"])
def test_model_restored_after_errors(where, early_exit_only):
    """An error raised in a full-depth forward (a hook on the last layer) or inside a draft (a hook on the draft
    layer while `config.num_hidden_layers` is lowered) leaves the model exactly as before."""
    model = speculative_model("shallow")
    router = speculative_router(model, "always")
    before = snapshot(model)
    handle = tide_hf.attach(model, router, mode="speculative", exit_threshold=0.5, draft_layer=4)
    layer = model.model.layers[-1 if where == "verification" else 3]
    calls = []

    def boom(*_):
        if where == "verification" or model.config.num_hidden_layers == 4:
            calls.append(1)
            if len(calls) > 2:
                raise RuntimeError("boom")

    hook = layer.register_forward_hook(boom)
    try:
        with pytest.raises(RuntimeError, match="boom"):
            model.generate(left_padded(0)[0][:1], max_new_tokens=NEW, do_sample=False)
        assert "_get_candidate_generator" not in model.__dict__
        assert model.config.num_hidden_layers == NUM_LAYERS
    finally:
        hook.remove()
        handle.detach()
    assert snapshot(model) == before


def test_model_without_layer_truncation_is_refused_and_restored():
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=256, n_embd=32, n_layer=5, n_head=4, n_positions=64,
                                       bos_token_id=1, eos_token_id=2)).eval()
    router = TideRouter(TideRouterConfig(hidden_size=32, num_hidden_layers=5, router_bottleneck_dim=8,
                                         checkpoint_layers=[2], base_architecture=type(model).__name__,
                                         label="top1", metrics={"2": {"predicted_rate": 1.0,
                                                                      "precision": 1.0}}, exit_head="lens"))
    with torch.no_grad():
        router.routers["2"].fc2.bias.fill_(30.0)
        router.routers["2"].fc2.weight.zero_()
    before = snapshot(model)
    with pytest.raises(NotImplementedError, match="num_hidden_layers"):
        speculative(model, router, torch.tensor([[5, 6, 7]]), draft_layer=2, max_new_tokens=6, do_sample=False)
    assert snapshot(model) == before
    # at attach, whatever the router would decide: a router that never drafts passed attach and the calls it
    # happened not to draft in, and failed in the middle of the first call that drafted
    with torch.no_grad():
        router.routers["2"].fc2.bias.fill_(-30.0)
    with pytest.raises(TideUnsupportedError, match="ignores config.num_hidden_layers"):
        tide_hf.attach(model, router, mode="speculative", exit_threshold=0.5)
    assert snapshot(model) == before and tide_hf.get_handle(model) is None


# -- options and fallbacks ----------------------------------------------------------------------------
def test_draft_layer_must_be_a_router_checkpoint():
    model = speculative_model()
    with pytest.raises(ValueError, match="draft_layer=3 has no router"):
        speculative(model, speculative_router(model, "always"), left_padded(0)[0][:1], draft_layer=3, max_new_tokens=2)


def test_a_draft_layer_below_min_layers_is_refused():
    """min_layers says no token leaves before it: a draft at an earlier checkpoint would be accepted and ignored."""
    model = speculative_model()
    router = speculative_router(model, "always")
    with pytest.raises(tide_hf.errors.TideArgumentError, match="draft_layer=4 is below min_layers=8"):
        tide_hf.attach(model, router, mode="speculative", draft_layer=4, min_layers=8)
    assert tide_hf.get_handle(model) is None


def test_default_draft_layer_from_metrics():
    model = speculative_model()
    router = speculative_router(model, "always", prior=False)
    adapter = tide_hf.modeling.get_adapter(model)
    assert choose_draft_layer(router, adapter, [4, 8]) == 4  # no metrics: nearest half depth
    cost4, cost8 = draft_cost(adapter, 4), draft_cost(adapter, 8)
    assert 4 / 9 < cost4 < cost8 < 1.0  # the LM head is a share of every forward
    # the layer with the best optimum E from its top-1 agreement and cost, computed here by brute force
    for top1 in ((0.3, 0.97), (0.9, 0.95), (0.6, 0.7)):
        router.config.metrics = {str(k): {"label_rates": {"top1": a}} for k, a in zip((4, 8), top1)}
        best = {k: max(simulated_speedup(a, n, draft_cost(adapter, k), MEMORY_BOUND)
                       for n in range(MAX_DRAFT_TOKENS + 1)) for k, a in zip((4, 8), top1)}
        assert choose_draft_layer(router, adapter, [4, 8]) == max(best, key=best.get), (top1, best)


def test_the_draft_layer_follows_what_drafting_measured_on_this_model() -> None:
    """Priors choose the draft checkpoint until drafting was measured. Then a checkpoint whose drafts kept failing
    yields to one whose prior, priced at the verification costs measured on this path, promises more; once both
    lost, the tie goes back to the priors' choice. A draft_layer asked for never moves."""
    from tide_hf.integrations.draft import draft_plan
    from tide_hf.integrations.sources import resolve_draft_layer

    model = make_tiny_llama(num_layers=17, hidden=HIDDEN, seed=0)  # checkpoints 4, 8, 12, 16
    router = speculative_router(model, "always")
    router.config.metrics = {"4": {"label_rates": {"top1": 0.5}}, "8": {"label_rates": {"top1": 0.95}}}
    adapter = tide_hf.modeling.get_adapter(model)
    with tide_hf.attach(model, router, mode="speculative") as handle:
        prior = choose_draft_layer(router, adapter, handle.checkpoints)
        assert prior == 8 and resolve_draft_layer(handle) == prior
        for layer in (8, 4):
            vocab = draft_plan(router, adapter, layer)[0]
            est = draft_estimates(handle, layer, vocab)
            est.warm.update({"plain", "draft", "verify"})
            est.plain_s, est.draft_s = 1.0, draft_cost(adapter, layer, vocab)  # measured on this path
            est.verify_s = {w: linear_verify(0.05)(w) for w in range(2, MAX_DRAFT_TOKENS + 2)}
            for _ in range(40):  # its drafts kept being rejected at the first token
                est.observe_round(proposed=1, accepted=0)
            assert est.measured and est.plan(MAX_DRAFT_TOKENS)[1] == 1.0
            if layer == 8:  # checkpoint 4's prior, priced at the verification measured at 8, now promises more
                priced = best_draft_length(0.5, draft_cost(adapter, 4, draft_plan(router, adapter, 4)[0]),
                                           est.verify)[1]
                assert priced > 1.0 and resolve_draft_layer(handle) == 4
        assert resolve_draft_layer(handle) == prior
    with tide_hf.attach(model, router, mode="speculative", draft_layer=12) as handle:
        assert resolve_draft_layer(handle) == 12


def test_beam_search_falls_back_to_stock():
    model = speculative_model("shallow")
    router = speculative_router(model, "always")
    ids, mask = left_padded(0)
    call = {"max_new_tokens": 6, "do_sample": False, "num_beams": 2}
    with torch.no_grad():
        stock = model.generate(ids, attention_mask=mask, **call)
    out, stats = speculative(model, router, ids, attention_mask=mask, **call)
    assert torch.equal(out, stock) and "beam" in stats.speculative["fallback"]


def test_return_dict_batch_one():
    model = speculative_model("shallow")
    router = speculative_router(model, "always")
    ids = left_padded(0)[0][:1]
    call = {"max_new_tokens": NEW, "do_sample": False, "return_dict_in_generate": True, "output_scores": True}
    with torch.no_grad():
        stock = model.generate(ids, **call)
    out, _ = speculative(model, router, ids, **call)
    assert torch.equal(out.sequences, stock.sequences)
    assert len(out.scores) == NEW
    assert all(torch.equal(a.argmax(-1), b.argmax(-1)) for a, b in zip(out.scores, stock.scores))


# -- SmolLM2 --------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_smollm2_greedy_identical_to_stock(monkeypatch, smollm2, smollm2_calibration):
    model, tok = smollm2
    router, _ = smollm2_calibration
    texts = ["The state of the union is", "Our nation will build", "In the year 1900 the Congress",
             "The most important thing about peace is"]
    before = snapshot(model)
    stock = {t: model.generate(**tok(t, return_tensors="pt"), max_new_tokens=24, do_sample=False) for t in texts}
    # 1. the default draft layer and policy; 2. drafting every round at layer 28 (~half the drafts right)
    plan = DraftEstimates.plan
    for options, planner in ((dict(exit_threshold=0.5), plan),
                             (dict(exit_threshold=0.0, draft_layer=28), lambda _self, room: (min(room, 4), 1.0))):
        monkeypatch.setattr(DraftEstimates, "plan", planner)
        handle = tide_hf.attach(model, router, mode="speculative", **options)
        totals = {"drafted": 0, "accepted": 0, "draft_forwards": 0}
        try:
            for text in texts:
                out = model.generate(**tok(text, return_tensors="pt"), max_new_tokens=24, do_sample=False)
                assert torch.equal(out, stock[text]), (options, text)
                totals = {k: v + handle.last_stats.speculative[k] for k, v in totals.items()}
        finally:
            handle.detach()
    assert totals["accepted"] > 0 and totals["drafted"] >= 4 * 10  # the drafting-every-round pass
    assert snapshot(model) == before


def test_a_generation_config_object_is_merged_with_the_models_defaults_like_stock():
    """A `generation_config=` that sets EOS but no pad id: stock pads finished rows with the model's default pad
    id; so must the row-by-row re-assembly."""
    from transformers import GenerationConfig

    model = speculative_model("shallow")
    router = speculative_router(model, "always")
    ids, mask = left_padded(3)
    with torch.no_grad():
        free = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, eos_token_id=None)
    eos = int(free[1, ids.shape[1] + 1])  # row 1 stops after 2 new tokens
    model.generation_config.pad_token_id = 0
    call = {"generation_config": GenerationConfig(max_new_tokens=NEW, do_sample=False, eos_token_id=eos)}
    with torch.no_grad():
        stock = model.generate(ids, attention_mask=mask, **call)
    out, stats = speculative(model, router, ids, attention_mask=mask, **call)
    assert torch.equal(out, stock) and stats.speculative["fallback"] is None


def test_fallbacks_count_their_tokens_and_an_eos_tensor_pads_batches():
    model = speculative_model("shallow")
    router = speculative_router(model, "always")
    ids, mask = left_padded(0)
    out, stats = speculative(model, router, ids, attention_mask=mask, max_new_tokens=6, do_sample=False, num_beams=2)
    # per beam, as select mode counts them: each beam fed the prompt, then 5 decode steps
    assert stats.speculative["fallback"] and stats.prefill.tokens == 2 * int(mask.sum())
    assert stats.decode.tokens == 5 * 2 * ids.shape[0]
    call = {"max_new_tokens": NEW, "do_sample": False, "eos_token_id": torch.tensor([131, 7]), "pad_token_id": None}
    with torch.no_grad():
        stock = model.generate(ids, attention_mask=mask, **call)
    out, _ = speculative(model, router, ids, attention_mask=mask, **call)
    assert torch.equal(out, stock)



def test_eos_ids_as_a_tensor_the_size_of_the_batch_end_every_row_like_stock():
    """Generation settings hold for every row, whatever their shape: three EOS ids in a tensor of a 3-row batch
    are not one EOS id per row (slicing them per row let row 0 run past its stock end)."""
    model = speculative_model("shallow")
    router = speculative_router(model, "always")
    ids, mask = left_padded(0)
    with torch.no_grad():
        free = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, eos_token_id=None)
    row0 = free[0, ids.shape[1]:].tolist()
    early, late = row0[2], next(t for t in range(3, 256) if t not in row0)
    call = {"max_new_tokens": NEW, "do_sample": False, "eos_token_id": torch.tensor([late, early, 255]),
            "pad_token_id": 0}
    with torch.no_grad():
        stock = model.generate(ids, attention_mask=mask, **call)
    assert early in stock[0, ids.shape[1]:].tolist()  # precondition: row 0 ends on the row-1-positioned id
    out, stats = speculative(model, router, ids, attention_mask=mask, **call)
    assert stats.speculative["fallback"] is None and torch.equal(out, stock)

# -- arguments per batch row, time budgets, statistics --------------------------------------------------
class PerRowBan(LogitsProcessor):
    """Bans a different set of tokens in each row: a processor keeping per-row state, as constrained decoding
    libraries do (it only fits the whole batch)."""

    def __init__(self, banned: list[list[int]], vocab: int) -> None:
        self.mask = torch.zeros(len(banned), vocab, dtype=torch.bool)
        for row, tokens in enumerate(banned):
            self.mask[row, tokens] = True

    def __call__(self, input_ids, scores):
        return scores.masked_fill(self.mask, -math.inf)


class PerRowStop(StoppingCriteria):
    """Stops row r after r + 2 new tokens (per-row state, sized for the whole batch)."""

    def __init__(self, prompt: int, rows: int) -> None:
        self.prompt, self.limits = prompt, torch.arange(rows) + 2

    def __call__(self, input_ids, scores, **kwargs):
        return input_ids.shape[1] - self.prompt >= self.limits


def test_batch_arguments_meant_per_row_equal_stock():
    """prefix_allowed_tokens_fn is asked with each row's own batch index (drafting goes on); a logits processor or
    stopping criteria sized for the batch make the call run stock generate (the rows are decoded one at a time)."""
    model = speculative_model("shallow")
    router = speculative_router(model, "always")
    ids, mask = left_padded(1)
    allowed = {row: list(range(10 + 60 * row, 30 + 60 * row)) for row in range(3)}
    call = {"attention_mask": mask, "max_new_tokens": 6, "do_sample": False}
    with torch.no_grad():
        free = model.generate(ids, **call)
    banned = [free[row, ids.shape[1]: ids.shape[1] + 3].tolist() for row in range(3)]
    cases = {"prefix": {"prefix_allowed_tokens_fn": lambda row, _ids: allowed[row]},
             "processor": {"logits_processor": LogitsProcessorList([PerRowBan(banned, 256)])},
             "criteria": {"stopping_criteria": StoppingCriteriaList([PerRowStop(ids.shape[1], 3)])}}
    for name, extra in cases.items():
        with torch.no_grad():
            stock = model.generate(ids, **call, **extra)
        out, stats = speculative(model, router, ids, **call, **extra)
        assert torch.equal(out, stock), name
        assert (stats.speculative["fallback"] is None) == (name == "prefix"), name
        if name == "prefix":  # each row within its own allowed tokens, drafted
            assert all(set(out[row, ids.shape[1]:].tolist()) <= set(allowed[row]) for row in range(3))
            assert stats.speculative["drafted"] > 0


def test_max_time_bounds_the_whole_batch(monkeypatch):
    """A clock that advances one second per forward: stock stops the batch once max_time has passed; decoded row
    by row, each row would get the whole time (three times the forwards)."""
    from transformers.generation import stopping_criteria

    model = speculative_model("shallow")
    router = speculative_router(model, "never")
    clock = [0.0]
    model.register_forward_hook(lambda *_: clock.__setitem__(0, clock[0] + 1.0))
    monkeypatch.setattr(stopping_criteria, "time", type("Clock", (), {"time": staticmethod(lambda: clock[0])}))
    ids, mask = left_padded(2)
    call = {"attention_mask": mask, "max_new_tokens": NEW, "do_sample": False, "max_time": 4.5}
    with torch.no_grad():
        stock = model.generate(ids, **call)
    stock_seconds, clock[0] = clock[0], 0.0
    out, stats = speculative(model, router, ids, **call)
    assert torch.equal(out, stock) and clock[0] == stock_seconds + 1 < NEW  # + attach's one-forward depth check
    assert "max_time" in stats.speculative["fallback"]


@pytest.mark.parametrize("case", ["mask", "inferred mask", "return_dict", "beams"])
def test_statistics_count_like_select_mode(case):
    """Every token of speculative mode runs every layer; its counts must be select mode's with a router that never
    exits (prompt positions generate attends to, tokens fed while a row still generates, per beam), drafting or
    falling back to stock, and record no exit (the router says "converged" everywhere)."""
    model = speculative_model("shallow")
    ids, mask = left_padded(3)
    width = ids.shape[1]
    with torch.no_grad():
        free = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, eos_token_id=None)
    eos = int(free[1, width + 1])  # row 1 stops after 2 new tokens, the others go on
    assert eos not in free[[0, 2], width:].tolist() and eos != int(free[1, width])
    call = {"max_new_tokens": 8, "do_sample": False, "eos_token_id": eos, "pad_token_id": 0,
            **({} if case == "inferred mask" else {"attention_mask": mask}),
            **({"return_dict_in_generate": True} if case == "return_dict" else {}),
            **({"num_beams": 2} if case == "beams" else {})}
    counts = {}
    for mode, gate in (("select", "never"), ("speculative", "always")):
        drafting = {"draft_layer": 4} if mode == "speculative" else {}
        with torch.no_grad(), tide_hf.attach(model, speculative_router(model, gate), mode=mode, exit_threshold=0.5,
                                             **drafting) as handle:
            model.generate(ids, **call)
            stats = handle.last_stats
        counts[mode] = (stats.prefill.tokens, stats.decode.tokens)
        assert stats.decode.exit_rate == 0.0 and stats.prefill.exit_rate == 0.0
    assert counts["speculative"] == counts["select"]
    assert (stats.speculative["fallback"] is None) == (case != "beams")  # return_dict: drafted, rows re-assembled
    if case != "beams":  # written out: the prompt tokens; 7 fed tokens in rows 0 and 2, 1 in row 1 (then its EOS)
        assert counts["select"] == (int(mask.sum()), 7 + 1 + 7)
    else:  # two beams per row, each fed the prompt
        assert counts["select"][0] == 2 * int(mask.sum())


# -- model families -------------------------------------------------------------------------------------
def test_llama4_text_model_drafts_and_equals_stock():
    """Llama4ForCausalLM names its base model `language_model` but keeps its decoder under `model`: drafts must
    find the decoder that holds the layers."""
    from transformers import Llama4ForCausalLM, Llama4TextConfig

    torch.manual_seed(0)
    model = Llama4ForCausalLM(Llama4TextConfig(
        vocab_size=256, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, intermediate_size_mlp=2 * HIDDEN,
        num_hidden_layers=NUM_LAYERS, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        num_local_experts=2, num_experts_per_tok=1, pad_token_id=0, bos_token_id=1, eos_token_id=2)).eval()
    router = speculative_router(model, "always")
    ids, mask = left_padded(0)
    call = {"attention_mask": mask, "max_new_tokens": NEW, "do_sample": False}
    with torch.no_grad():
        stock = model.generate(ids, **call)
    before = snapshot(model)
    out, stats = speculative(model, router, ids, **call)
    assert torch.equal(out, stock) and stats.speculative["draft_forwards"] > 0
    assert snapshot(model) == before


@pytest.mark.parametrize("family", ["mamba", "jamba"])
def test_recurrent_state_models_are_refused_at_attach(family):
    """Assisted decoding cannot take a rejected draft back out of a recurrent state (transformers refuses these
    models only inside generate): attach refuses them, leaving the model untouched; select mode still attaches."""
    from transformers import JambaConfig, JambaForCausalLM, MambaConfig, MambaForCausalLM

    torch.manual_seed(0)
    if family == "mamba":
        model = MambaForCausalLM(MambaConfig(vocab_size=256, hidden_size=HIDDEN, num_hidden_layers=4, state_size=8))
    else:
        model = JambaForCausalLM(JambaConfig(
            vocab_size=256, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, num_experts=2, num_experts_per_tok=1, mamba_d_state=8,
            attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1))
    model.eval()
    router = TideRouter(TideRouterConfig(hidden_size=HIDDEN, num_hidden_layers=4, router_bottleneck_dim=8,
                                         checkpoint_layers=[2], base_architecture=type(model).__name__,
                                         exit_head="lens"))
    before = snapshot(model)
    with pytest.raises(tide_hf.errors.TideUnsupportedError, match="recurrent"):
        tide_hf.attach(model, router, mode="speculative", draft_layer=2)
    assert snapshot(model) == before and tide_hf.get_handle(model) is None
    tide_hf.attach(model, router, mode="select").detach()


# -- settings stock assisted decoding would not reproduce -------------------------------------------------
class ForceAtCall(LogitsProcessor):
    """Force token 77 at its 6th call: stock calls it once per emitted token, drafts would call it more often."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, input_ids, scores):
        self.calls += 1
        if self.calls == 6:
            scores = torch.full_like(scores, -float("inf"))
            scores[:, 77] = 0
        return scores


def test_settings_assisted_decoding_changes_run_stock(monkeypatch, smollm2):
    """Stop strings set in a generation config, a one-row logits processor that counts its calls, and
    `assistant_ensemble_weight` (stock sampling ignores it) run stock generate: equal output, fallback named.
    Drafting is forced every round, so a missed fallback would change the output."""
    from transformers import GenerationConfig

    monkeypatch.setattr(DraftEstimates, "plan", lambda _self, room: (min(room, 4), 1.0))
    model = speculative_model("shallow")
    router = speculative_router(model, "always")
    tok = smollm2[1]  # a real tokenizer: stop strings are matched on decoded text

    def stop_string(ids):  # an ASCII new token from the 3rd on, not generated before it (None: there is none)
        with torch.no_grad():
            new = model.generate(ids, max_new_tokens=NEW, do_sample=False)[0, ids.shape[1]:].tolist()
        return next((tok.decode([t]) for i, t in enumerate(new) if i >= 2 and t not in new[:i]
                     and tok.decode([t]).strip().isascii() and tok.decode([t]).strip().isalnum()), None)

    ids, stop = next((ids, stop) for ids in (left_padded(seed)[0][:1] for seed in range(8))
                     if (stop := stop_string(ids)) is not None)
    stop_config = GenerationConfig(max_new_tokens=NEW, do_sample=False, stop_strings=[stop])
    cases = {
        "stop_strings": ({"generation_config": stop_config, "tokenizer": tok}, "stop strings"),
        "processor": ({"max_new_tokens": NEW, "do_sample": False}, "user logits processors"),
        "ensemble": ({"max_new_tokens": NEW, "do_sample": False, "assistant_ensemble_weight": 0.5},
                     "assistant_ensemble_weight"),
    }
    for name, (call, reason) in cases.items():
        extra = {"logits_processor": LogitsProcessorList([ForceAtCall()])} if name == "processor" else {}
        with torch.no_grad():
            stock = model.generate(ids, **call, **extra)
        extra = {"logits_processor": LogitsProcessorList([ForceAtCall()])} if name == "processor" else {}
        out, stats = speculative(model, router, ids, **call, **extra)
        assert torch.equal(out, stock), name
        assert reason in (stats.speculative["fallback"] or ""), name
        if name == "stop_strings":
            assert out.shape[1] < ids.shape[1] + NEW  # stopped early, as stock did
    out, stats = speculative(model, router, ids, max_new_tokens=NEW, do_sample=False)
    assert stats.speculative["fallback"] is None and stats.speculative["drafted"] > 0  # the control drafts


def test_draft_ending_in_eos_counts_as_accepted(monkeypatch, early_exit_only):
    """Stock reports a fully matched draft whose last token is EOS one short (it emits that EOS as the
    verification's own token); the statistics and the policy's acceptance must count it accepted."""
    monkeypatch.setattr(DraftEstimates, "plan", lambda _self, room: (min(room, 4), 1.0))
    model = speculative_model("shallow")
    router = speculative_router(model, "always")

    def fresh(ids):  # a new token from the 4th on, not generated before it (None: there is none)
        with torch.no_grad():
            new = model.generate(ids, max_new_tokens=NEW, do_sample=False)[0, ids.shape[1]:].tolist()
        return next((t for i, t in enumerate(new) if i >= 3 and t not in new[:i]), None)

    ids, eos = next((ids, eos) for ids in (left_padded(seed)[0][:1] for seed in range(8))
                    if (eos := fresh(ids)) is not None)
    call = {"max_new_tokens": NEW, "do_sample": False, "eos_token_id": eos, "pad_token_id": 0}
    with torch.no_grad():
        stock = model.generate(ids, **call)
    out, stats = speculative(model, router, ids, **call)
    spec = stats.speculative
    assert torch.equal(out, stock) and out[0, -1] == eos
    assert spec["drafted"] > 0 and spec["accepted"] == spec["drafted"]  # every draft of the shallow model is right


def test_generation_config_with_speculative_logs_nothing_stock_does_not(caplog):
    """Speculative mode puts its draft layer into the given generation config, not beside it as a keyword
    (transformers warns about a generation_config given together with generation keywords)."""
    from transformers import GenerationConfig
    from transformers.utils import logging as hf_logging

    model = speculative_model("shallow")
    router = speculative_router(model, "always")
    config = GenerationConfig(max_new_tokens=8, do_sample=False)
    logging.Logger.warning_once.cache_clear()  # (transformers logs that warning once per process)
    hf_logging.enable_propagation()
    try:
        with caplog.at_level("WARNING"):
            out, _ = speculative(model, router, left_padded(0)[0][:1], generation_config=config)
    finally:
        hf_logging.disable_propagation()
    assert "generation_config" not in caplog.text and config.assistant_early_exit is None
    with torch.no_grad():
        assert torch.equal(out, model.generate(left_padded(0)[0][:1], generation_config=config))


@pytest.mark.skipif(CACHE_KWARG != "cache", reason="generate takes cache_params as the cache from transformers 5.24")
def test_a_cache_given_under_any_of_generates_names_falls_back_to_stock():
    """transformers 5.24's generate takes the cache as `cache`, `past_key_values` or `cache_params`; the last was
    not known as a user cache, so the batch was decoded row by row into the one cache object: rows 2-3 came out
    wrong and the cache held every row's tokens back to back."""
    model = speculative_model()
    router = speculative_router(model, "never")
    ids, mask = left_padded(0)
    call = {"attention_mask": mask, "max_new_tokens": 5, "do_sample": False}
    stock_cache = DynamicCache()
    with torch.no_grad():
        stock = model.generate(ids, cache=stock_cache, **call)
    for name in ("cache", "past_key_values", "cache_params"):
        cache = DynamicCache()
        out, stats = speculative(model, router, ids, **{name: cache}, **call)
        assert torch.equal(out, stock) and stats.speculative["fallback"] == f"{name}= given"
        assert cache.get_seq_length() == stock_cache.get_seq_length()


def test_a_prompt_prefilled_in_chunks_falls_back_to_stock():
    """Assisted decoding prefills the prompt in one forward: with `prefill_chunk_size` the memory bound the user
    asked for was not kept, and the logits were the unchunked run's."""
    model = speculative_model()
    router = speculative_router(model, "never")
    ids, mask = left_padded(0)
    call = {"attention_mask": mask[:1], "max_new_tokens": 6, "do_sample": False, "return_dict_in_generate": True,
            "output_logits": True, "prefill_chunk_size": 3}
    with torch.no_grad():
        stock = model.generate(ids[:1], **call)
    out, stats = speculative(model, router, ids[:1], **call)
    assert "prefill_chunk_size" in stats.speculative["fallback"]
    assert torch.equal(out.sequences, stock.sequences)
    assert all(torch.equal(a, b) for a, b in zip(out.logits, stock.logits, strict=True))
