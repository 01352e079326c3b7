"""The draft vocabulary: calibration ranks the model's own top-1 tokens, speculative drafts slice the head to them.

References: the model's final-layer argmax over the calibration samples counted with `collections.Counter`
(ranking and held-out coverage), the model's own LM head (the sliced logits), the speculative-decoding
arithmetic written out by hand (the size speculative mode picks), and stock greedy generate (output unchanged
while drafts can only propose part of the vocabulary).
"""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch
from helpers import make_tiny_llama, new_router
from torch import nn

import tide_hf
from tide_bench.easy import make_near_identity
from tide_hf import TideRouter
from tide_hf.calibration import calibrate_tokens
from tide_hf.calibration.vocab import candidate_sizes
from tide_hf.errors import TideRouterFileError
from tide_hf.integrations.draft import MAX_DRAFT_TOKENS, draft_plan
from tide_hf.integrations.speculative import draft_estimates
from tide_hf.integrations.vocab import DraftHead, sliceable
from tide_hf.modeling import ModelAdapter, get_adapter

VOCAB = 1024  # candidate sizes 256 and 512


def ranked_router(model, ranking: torch.Tensor, coverage: dict[str, float], top1: float = 1.0) -> TideRouter:
    router = new_router(model, label="top1", metrics={"4": {"label_rates": {"top1": top1}}})
    router.set_draft_vocab(ranking, coverage)
    return router


def test_calibration_ranks_the_final_top1_of_training_tokens_and_measures_held_out_coverage() -> None:
    model = make_tiny_llama(vocab=VOCAB)
    gen = torch.Generator().manual_seed(0)
    samples = [torch.randint(3, VOCAB, (24,), generator=gen) for _ in range(20)]
    router = calibrate_tokens(model, samples, label="top1", num_epochs=2, router_bottleneck_dim=8,
                              max_train_tokens=10**6, progress=False)  # every token kept
    cfg = router.config
    held = math.ceil(cfg.threshold_fraction * 20) + math.ceil(cfg.validation_fraction * 20)
    with torch.no_grad():
        top1 = [model(input_ids=s[None]).logits[0].argmax(-1).tolist() for s in samples]
    counts = Counter(t for row in top1[:-held] for t in row)
    expected = sorted(range(VOCAB), key=lambda t: (-counts[t], t))
    assert candidate_sizes(VOCAB) == [256, 512]
    assert router.draft_vocab.tolist() == expected[:512]
    held_tokens = [t for row in top1[-held:] for t in row]
    for n in (256, 512):
        share = sum(t in set(expected[:n]) for t in held_tokens) / len(held_tokens)
        assert cfg.draft_vocab_coverage[str(n)] == pytest.approx(share)
    assert 0 < cfg.draft_vocab_coverage["256"] < 1  # random text: neither size covers nothing or everything
    # the cosine label labels only held-out tokens with the head, but ranks the training tokens all the same
    with pytest.warns(UserWarning, match="label 'cosine'"):
        cosine = calibrate_tokens(model, samples, label="cosine", num_epochs=2, router_bottleneck_dim=8,
                                  max_train_tokens=10**6, progress=False)
    assert torch.equal(cosine.draft_vocab, router.draft_vocab)
    assert calibrate_tokens(make_tiny_llama(), [s % 256 for s in samples], num_epochs=1,
                            progress=False).config.draft_vocab_coverage == {}  # 256 tokens: nothing to slice


@pytest.mark.parametrize("bias, softcap", [(False, None), (True, 3.0)])
def test_draft_head_is_the_model_head_on_the_draft_vocabulary(bias, softcap) -> None:
    torch.manual_seed(0)
    head = nn.Linear(16, 600, bias=bias)
    adapter = ModelAdapter(layers=nn.ModuleList(), final_norm=nn.Identity(), pre_head=None, lm_head=head,
                           embeddings=nn.Identity(), logit_softcap=softcap)
    model = make_tiny_llama(hidden=16)
    ranking = torch.randperm(600)[:512]
    router = ranked_router(model, ranking, {"256": 0.5, "512": 0.9})
    normed = torch.randn(3, 16)
    got = DraftHead(adapter, router, 256)(normed)
    full = adapter.head(normed)
    ids = ranking[:256]
    assert got.shape == (3, 600)
    torch.testing.assert_close(got[:, ids], full[:, ids])
    outside = torch.ones(600, dtype=torch.bool)
    outside[ids] = False
    assert torch.isneginf(got[:, outside]).all()
    assert torch.equal(got.argmax(-1), ids[full[:, ids].argmax(-1)])


@pytest.mark.parametrize("family", ["granite", "cohere"])
def test_draft_head_scales_logits_like_the_model(family: str) -> None:
    """Granite divides its logits by `logits_scaling`, Cohere multiplies them by `logit_scale`: sampled drafts
    need the model's own distribution. Reference: the model's own logits from its forward."""
    from helpers import scaled_logit_model

    model = scaled_logit_model(family, 4.0 if family == "granite" else 0.3, vocab=600, layers=5)
    adapter = get_adapter(model)
    router = ranked_router(model, torch.randperm(600)[:512], {"256": 0.5, "512": 0.9})
    ids = torch.randint(3, 600, (1, 6), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        normed = model.model(input_ids=ids).last_hidden_state[0]  # what a draft forward hands the draft head
        got = DraftHead(adapter, router, 256)(normed)
        own = model(input_ids=ids).logits[0]
    covered = router.draft_vocab[:256]
    torch.testing.assert_close(got[:, covered], own[:, covered], atol=1e-5, rtol=1e-5)


def test_only_plain_linear_heads_are_sliced() -> None:
    adapter = get_adapter(make_tiny_llama())
    assert sliceable(adapter)
    assert not sliceable(ModelAdapter(adapter.layers, adapter.final_norm, nn.Identity(), adapter.lm_head,
                                      adapter.embeddings, None))  # a projection before the head

    class Quantized(nn.Linear):
        pass
    assert not sliceable(ModelAdapter(adapter.layers, adapter.final_norm, None, Quantized(32, 256),
                                      adapter.embeddings, None))
    offloaded = nn.Linear(32, 256, bias=False, device="meta")  # accelerate's offloaded head: loaded per forward
    assert not sliceable(ModelAdapter(adapter.layers, adapter.final_norm, None, offloaded, adapter.embeddings, None))


def test_draft_plan_weighs_the_cheaper_head_against_lost_acceptance() -> None:
    """E(k) = (1 - a^(k+1)) / ((1 - a)(c k + 1)) with c from parameter counts, written out here."""
    model = make_tiny_llama(vocab=VOCAB)
    adapter = get_adapter(model)
    layers = sum(p.numel() for p in model.model.layers.parameters())
    head = model.lm_head.weight.numel()

    def by_hand(acceptance: float, vocab: int) -> float:
        cost = (4 / 9 * layers + head * vocab / VOCAB) / (layers + head)
        return max((1 - acceptance ** (k + 1)) / (1 - acceptance) / (cost * k + 1) for k in range(9))

    ranking = torch.arange(512)
    for top1, coverage in ((0.9, {"256": 0.99, "512": 1.0}), (0.9, {"256": 0.5, "512": 0.6}),
                           (0.6, {"256": 0.97, "512": 0.98})):
        router = ranked_router(model, ranking, coverage, top1)
        gains = {None: by_hand(top1, VOCAB), **{int(n): by_hand(top1 * s, int(n)) for n, s in coverage.items()}}
        best = max(gains, key=lambda n: gains[n])
        assert draft_plan(router, adapter, 4) == (best, pytest.approx(gains[best]))
    assert draft_plan(ranked_router(model, ranking, {"256": 0.2, "512": 0.3}), adapter, 4)[0] is None
    assert draft_plan(new_router(model), adapter, 4) == (None, None)  # no metrics: the whole vocabulary


@pytest.mark.parametrize("do_sample", [False, True])
def test_drafts_propose_draft_vocabulary_tokens_and_output_stays_stock(monkeypatch, do_sample) -> None:
    """The drafts of a shallow model are right unless the right token is outside the draft vocabulary: half
    of the tokens stock emits are left out, so drafts are both accepted and rejected, and the output is
    still stock's (greedy; sampled: valid tokens)."""
    model = make_near_identity(make_tiny_llama(vocab=VOCAB, hidden=64), 4, scale=1e-3)
    gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(3, VOCAB, (1, 6), generator=gen)
    call = {"max_new_tokens": 24, "do_sample": do_sample, "eos_token_id": None}
    with torch.no_grad():
        stock = model.generate(prompt, **{**call, "do_sample": False})
    emitted = list(dict.fromkeys(stock[0, 6:].tolist()))
    left_out = emitted[1::2]
    ranking = torch.tensor([t for t in range(VOCAB) if t not in left_out][:512])
    router = ranked_router(model, ranking, {"256": 1.0, "512": 1.0})
    for mlp in router.routers.values():  # the gate is always open
        mlp.fc2.weight.data.zero_()
        mlp.fc2.bias.data.fill_(30.0)
    proposals = []
    original = DraftHead.__call__

    def spy(self, normed):
        logits = original(self, normed)
        reference = model.lm_head(normed)[:, self.ids]
        torch.testing.assert_close(logits[:, self.ids], reference)
        proposals.extend(logits.argmax(-1).tolist())
        return logits
    monkeypatch.setattr(DraftHead, "__call__", spy)
    handle = tide_hf.attach(model, router, mode="speculative", draft_layer=4)
    est = draft_estimates(handle, 4, 256)  # fixed costs: the plan depends on acceptance, not on machine load
    est.plain_s, est.draft_s, est.verify_s = 1.0, 0.3, {w: 1.0 for w in range(2, MAX_DRAFT_TOKENS + 2)}
    for name in ("observe_plain", "observe_draft", "observe_verify"):
        monkeypatch.setattr(est, name, lambda *a: None)
    try:
        torch.manual_seed(0)
        with torch.no_grad():
            out = model.generate(prompt, **call)
        spec = handle.last_stats.speculative
    finally:
        handle.detach()
    assert spec["draft_vocab"] == 256 and proposals
    assert set(proposals) <= set(ranking[:256].tolist())
    if do_sample:
        assert out.shape == stock.shape and ((out >= 0) & (out < VOCAB)).all()
        return
    assert torch.equal(out, stock)
    assert 0 < spec["accepted"] < spec["drafted"]


def test_draft_vocabulary_round_trips_and_is_checked(tmp_path) -> None:
    model = make_tiny_llama(vocab=VOCAB)
    router = ranked_router(model, torch.randperm(VOCAB)[:512], {"256": 0.8, "512": 0.9})
    router.save_pretrained(tmp_path / "r")
    loaded = TideRouter.from_pretrained(tmp_path / "r")
    assert torch.equal(loaded.draft_vocab, router.draft_vocab)
    assert loaded.config.draft_vocab_coverage == {"256": 0.8, "512": 0.9}
    card = (tmp_path / "r" / "README.md").read_text()
    assert "held-out coverage of its top-1 by size: 256: 80.0%, 512: 90.0%." in card
    old = new_router(model)  # a router from before draft vocabularies: none, and drafts use the whole head
    old.save_pretrained(tmp_path / "old")
    assert not hasattr(TideRouter.from_pretrained(tmp_path / "old"), "draft_vocab")
    config = (tmp_path / "r" / "config.json").read_text().replace('"512": 0.9', '"768": 0.9')
    (tmp_path / "r" / "config.json").write_text(config)  # says 768 ranked tokens, the weights hold 512
    with pytest.raises(TideRouterFileError):
        TideRouter.from_pretrained(tmp_path / "r")
    small = make_tiny_llama(vocab=512)  # a head with fewer rows than the ranking's token ids
    with pytest.raises(ValueError, match="draft vocabulary: token ids up to"):
        router.check_compatible(small, ignore_fingerprint=True)
    for bad, match in (({"256": 1.5}, "draft_vocab_coverage"), ({"x": 0.5}, "positive integers"),
                       ([0.5], "must be a dict")):
        with pytest.raises((ValueError, TypeError), match=match):
            new_router(model, draft_vocab_coverage=bad)
    with pytest.raises(ValueError, match="draft vocabulary of 100 tokens"):
        router.set_draft_vocab(torch.arange(100), {"256": 0.5})


def test_sampled_drafts_stop_when_processors_remove_the_whole_draft_vocabulary() -> None:
    """suppress_tokens covering every draft-vocabulary token leaves the draft no token to sample: it stops
    drafting instead of sampling from NaN, and the output is stock's sampled output."""
    from tide_bench.easy import make_near_identity

    model = make_near_identity(make_tiny_llama(vocab=VOCAB, hidden=64), 4, scale=1e-3)
    prompt = torch.randint(3, VOCAB, (1, 6), generator=torch.Generator().manual_seed(1))
    ranking = torch.arange(3, 3 + 512)
    router = ranked_router(model, ranking, {"256": 0.99, "512": 1.0})
    for mlp in router.routers.values():
        mlp.fc2.weight.data.zero_()
        mlp.fc2.bias.data.fill_(30.0)  # the gate always open: drafts are attempted at every step
    call = {"max_new_tokens": 12, "do_sample": True, "eos_token_id": None, "suppress_tokens": ranking[:256].tolist()}
    torch.manual_seed(0)
    with torch.no_grad():
        stock = model.generate(prompt, **call)
    with tide_hf.attach(model, router, mode="speculative", draft_layer=4) as handle:
        torch.manual_seed(0)
        with torch.no_grad():
            ours = model.generate(prompt, **call)
        assert handle.last_stats.speculative["drafted"] == 0
    assert torch.equal(ours, stock)
