"""Speculative verification that reuses the draft's first layers (`tide_hf.integrations.reuse`).

References: stock greedy generate on the same model (tokens and per-step logits), and forward hooks on the
first layer's attention (its real work; a reusing verification passes that layer through).
"""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import NEW, counter, left_padded, snapshot, speculative, speculative_model, speculative_router

from tide_bench.easy import make_near_identity
from tide_hf import TideRouter, TideRouterConfig
from tide_hf.integrations.draft import DraftEstimates
from tide_hf.modeling import model_fingerprint

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")


@pytest.mark.usefixtures("early_exit_only")
def test_reused_verification_logits_match_stock_steps():
    """The deep layers run on the draft's layer-4 states: every emitted position's logits are stock's."""
    model = speculative_model("shallow")
    router = speculative_router(model, "always")
    ids = left_padded(1)[0][:1]
    call = {"max_new_tokens": NEW, "do_sample": False, "return_dict_in_generate": True, "output_logits": True}
    with torch.no_grad():
        stock = model.generate(ids, **call)
    out, stats = speculative(model, router, ids, **call)
    assert stats.speculative["reused"] >= stats.speculative["rounds"] > 0 and stats.speculative["accepted"] > 0
    assert torch.equal(out.sequences, stock.sequences)
    assert len(out.logits) == NEW
    for ours, ref in zip(out.logits, stock.logits):
        torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-4)


@pytest.mark.usefixtures("early_exit_only")
def test_per_layer_outputs_turn_reuse_off():
    """Requested hidden states must come from real layers: verification then recomputes every layer."""
    model = speculative_model("shallow")
    router = speculative_router(model, "always")
    ids = left_padded(2)[0][:1]
    call = {"max_new_tokens": NEW, "do_sample": False, "return_dict_in_generate": True,
            "output_hidden_states": True}
    computed = counter(model.model.layers[0].self_attn)
    with torch.no_grad():
        stock = model.generate(ids, **call)
    computed[0] = 0
    out, stats = speculative(model, router, ids, **call)
    spec = stats.speculative
    assert torch.equal(out.sequences, stock.sequences) and spec["accepted"] > 0
    assert spec["reused"] == spec["tail_forwards"] == 0
    # every verification, and attach's one-forward check that the model follows a lowered depth
    assert computed[0] == spec["rounds"] + spec["plain_steps"] + spec["draft_forwards"] + 1


@pytest.mark.slow
def test_smollm2_easy_model_greedy_identical_with_reuse(monkeypatch, smollm2):
    """SmolLM2 with layers after 16 near-identity, drafting 4 tokens at 16 every round: batch 1 and
    left-padded batches equal stock greedy, and the verifications reuse the drafts."""
    monkeypatch.setattr(DraftEstimates, "plan", lambda _self, room: (min(room, 4), 1.0))
    model = make_near_identity(copy.deepcopy(smollm2[0]), 16)  # a copy: the shared model stays as loaded
    tok = smollm2[1]
    assert tok.padding_side == "left"
    router = TideRouter(TideRouterConfig(hidden_size=model.config.hidden_size, num_hidden_layers=30,
                                         router_bottleneck_dim=16, base_architecture=type(model).__name__,
                                         base_fingerprint=model_fingerprint(model), exit_head="lens"))
    with torch.no_grad():
        for mlp in router.routers.values():  # converged everywhere: the policy alone decides the draft length
            mlp.fc2.weight.zero_()
            mlp.fc2.bias.fill_(30.0)
    texts = ["The state of the union is", "Our nation will build", "In the year 1900 the Congress"]
    call = {"max_new_tokens": 24, "do_sample": False}
    before = snapshot(model)
    batch = tok(texts, return_tensors="pt", padding=True)
    with torch.no_grad():
        stock_rows = [model.generate(**tok(t, return_tensors="pt"), **call) for t in texts]
        stock_batch = model.generate(**batch, **call)
    reused = 0
    for text, stock in zip(texts, stock_rows):
        out, stats = speculative(model, router, **tok(text, return_tensors="pt"), draft_layer=16, **call)
        assert torch.equal(out, stock), text
        reused += stats.speculative["reused"]
    out, stats = speculative(model, router, **batch, draft_layer=16, **call)
    assert torch.equal(out, stock_batch)
    assert reused + stats.speculative["reused"] >= 4 * 3  # drafts accepted, verifications reusing them
    assert snapshot(model) == before


@pytest.mark.usefixtures("early_exit_only")
def test_verify_timings_come_from_rounds_with_a_tail(monkeypatch):
    """A draft the gate stopped ran its last position through the first layers in a draft forward, so its
    verification costs less than the model's v(k + 1) (less than a plain step when nothing was proposed):
    only rounds whose tail ran in the verification time V(w), and zero-token rounds no plain step."""
    widths: list[int] = []
    plain: dict[int, int] = {}  # per estimates object (every draft source's sees each plain step)

    def observe_plain(self: DraftEstimates, _seconds: float) -> None:
        plain[id(self)] = plain.get(id(self), 0) + 1
        self.plain_s = 1.0  # the policy drafts once a plain step is timed

    monkeypatch.setattr(DraftEstimates, "observe_verify", lambda _self, _s, tokens: widths.append(tokens))
    monkeypatch.setattr(DraftEstimates, "observe_plain", observe_plain)
    monkeypatch.setattr(DraftEstimates, "plan", lambda _self, room: (1, 1.0))  # one token: the gate stops some
    model = speculative_model("shallow")
    router = speculative_router(model, "mixed")
    out, stats = speculative(model, router, left_padded(0)[0][:1], max_new_tokens=48, do_sample=False,
                             eos_token_id=None)
    spec = stats.speculative
    assert spec["gate_stops"] > 0 and spec["tail_forwards"] > 0  # precondition: both kinds of drafted rounds
    assert spec["tail_forwards"] - 1 <= len(widths) <= spec["tail_forwards"]  # the last round is never closed
    assert set(widths) == {2}
    # a stopped one-token draft proposed nothing; its verification (of the reused position) is no plain step
    assert len(set(plain.values())) == 1  # the plain-step time is every source's cost unit
    steps = next(iter(plain.values()))
    assert 0 < steps <= spec["plain_steps"] - spec["gate_stops"] - 1  # the prefill is no plain step either
