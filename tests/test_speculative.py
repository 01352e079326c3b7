"""mode="speculative": router-gated self-speculative decoding inside stock generate().

References: stock generate on the same model (greedy token identity, batch 1 and left-padded batches),
forward hooks counting full-depth and draft forwards, and the model's own attributes and hooks before
the call (nothing may be left behind).
"""

from __future__ import annotations

import pytest
import torch
from helpers import make_tiny_llama
from transformers import GPT2Config, GPT2LMHeadModel, LogitsProcessor, LogitsProcessorList

import tide_hf
from tide_hf import TideRouter, TideRouterConfig
from tide_hf.integrations.draft import MAX_DRAFT_TOKENS, choose_draft_layer, draft_cost, expected_speedup

NUM_LAYERS = 9  # router checkpoints [4, 8]
HIDDEN = 64
NEW = 16
HOOK_DICTS = ("_forward_hooks", "_forward_pre_hooks", "_forward_hooks_with_kwargs", "_forward_pre_hooks_with_kwargs")


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny models run fastest on one thread, and the CI runners are shared."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# -- helpers ------------------------------------------------------------------------------------------
def make_model(kind: str = "random", seed: int = 0):
    """'random': drafts at layer 4 rarely agree with the full model. 'shallow': layers 5-9 barely write to
    the residual stream (o_proj / down_proj scaled by 1e-3), so layer-4 drafts are almost always right."""
    model = make_tiny_llama(num_layers=NUM_LAYERS, hidden=HIDDEN, seed=seed)
    if kind == "shallow":
        with torch.no_grad():
            for layer in model.model.layers[4:]:
                layer.self_attn.o_proj.weight.mul_(1e-3)
                layer.mlp.down_proj.weight.mul_(1e-3)
    return model


@torch.no_grad()
def make_router(model, gate: str, seed: int = 0, prior: bool = True) -> TideRouter:
    """'always' (+30: converged everywhere), 'never' (-30), 'mixed' (saturated random scores around 0.5).

    `prior`: calibration metrics that promise a gain (the first probe of a call is then on credit).
    """
    torch.manual_seed(seed)
    rate = {"always": 1.0, "never": 0.0, "mixed": 0.5}[gate]
    router = TideRouter(TideRouterConfig(
        hidden_size=model.config.hidden_size, num_hidden_layers=model.config.num_hidden_layers,
        router_bottleneck_dim=16, base_architecture=type(model).__name__, label="top1",
        base_fingerprint=tide_hf.model_fingerprint(model),
        metrics={"4": {"predicted_rate": rate, "precision": 1.0}} if prior else None))
    for mlp in router.routers.values():
        if gate == "mixed":
            mlp.fc2.weight.mul_(40.0)
            mlp.fc2.bias.zero_()
        else:
            mlp.fc2.weight.zero_()
            mlp.fc2.bias.fill_(30.0 if gate == "always" else -30.0)
    return router


def prompts(seed: int, lengths=(7, 5, 3)) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded ids (pad 0; tokens from 3 up, so no BOS/EOS) and their attention mask."""
    gen = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.zeros(len(lengths), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, n in enumerate(lengths):
        ids[row, width - n:] = torch.randint(3, 256, (n,), generator=gen)
        mask[row, width - n:] = 1
    return ids, mask


def snapshot(model) -> tuple:
    hooks = {name: {attr: dict(getattr(mod, attr)) for attr in HOOK_DICTS} for name, mod in model.named_modules()}
    return set(model.__dict__), hooks, model.config.to_dict(), model.generation_config.to_dict()


def counter(module) -> list[int]:
    calls = [0]
    module.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    return calls


@torch.no_grad()
def speculative(model, router, *args, draft_layer: int = 4, threshold: float = 0.5, **kwargs):
    handle = tide_hf.attach(model, router, mode="speculative", exit_threshold=threshold, draft_layer=draft_layer)
    try:
        out = model.generate(*args, **kwargs)
        return out, handle.last_stats
    finally:
        handle.detach()


# -- greedy identity ----------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["random", "shallow"])
@pytest.mark.parametrize("gate", ["always", "never", "mixed"])
def test_greedy_identical_to_stock(kind, gate):
    model = make_model(kind)
    router = make_router(model, gate)
    before = snapshot(model)
    drafted = 0
    for seed in range(3):
        ids, mask = prompts(seed)
        call = {"max_new_tokens": NEW, "do_sample": False}
        with torch.no_grad():
            stock_batch = model.generate(ids, attention_mask=mask, **call)
            stock_rows = [model.generate(ids[i:i + 1, -int(mask[i].sum()):], **call) for i in range(3)]
        for i in range(3):  # batch 1, unpadded prompt
            out, stats = speculative(model, router, ids[i:i + 1, -int(mask[i].sum()):], **call)
            assert torch.equal(out, stock_rows[i])
            drafted += stats.speculative["drafted"]
        out, stats = speculative(model, router, ids, attention_mask=mask, **call)  # left-padded batch of 3
        assert torch.equal(out, stock_batch)
        assert stats.decode.tokens == 3 * (NEW - 1) and stats.prefill.tokens == int(mask.sum())
        assert stats.speculative["fallback"] is None
    assert snapshot(model) == before
    assert (drafted > 0) == (gate != "never")


def test_batch_rows_finishing_early_are_padded_like_stock():
    model = make_model("shallow")
    router = make_router(model, "always")
    ids, mask = prompts(3)
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
def test_drafts_are_accepted_and_save_full_forwards():
    model = make_model("shallow")
    router = make_router(model, "always")
    ids, mask = prompts(0)
    prompt = ids[:1, -int(mask[0].sum()):]
    full, draft = counter(model.model.layers[-1]), counter(model.model.layers[3])
    with torch.no_grad():
        stock = model.generate(prompt, max_new_tokens=32, do_sample=False)
    assert full[0] == 32
    full[0] = draft[0] = 0
    out, stats = speculative(model, router, prompt, max_new_tokens=32, do_sample=False)
    spec = stats.speculative
    assert torch.equal(out, stock)
    assert spec["accepted"] > 0 and spec["acceptance_rate"] > 0.5
    assert full[0] < 32  # fewer full-depth forwards than generated tokens
    assert full[0] == spec["rounds"] + spec["plain_steps"]
    assert draft[0] == full[0] + spec["draft_forwards"]  # every forward runs layer 4, drafts stop there
    assert spec["accepted"] <= spec["drafted"] <= spec["draft_forwards"]
    assert spec["mean_draft_length"] == pytest.approx(spec["drafted"] / spec["rounds"])


def test_sampling_returns_valid_tokens():
    model = make_model("shallow")
    router = make_router(model, "always")
    ids, mask = prompts(1)
    torch.manual_seed(0)
    out, stats = speculative(model, router, ids, attention_mask=mask, max_new_tokens=NEW, do_sample=True,
                             top_k=20, temperature=0.8, eos_token_id=None)
    assert out.shape == (3, ids.shape[1] + NEW)
    assert torch.equal(out[:, :ids.shape[1]], ids)
    assert ((out >= 0) & (out < model.config.vocab_size)).all()
    assert stats.speculative["rounds"] > 0 and stats.speculative["accepted"] > 0


# -- the gate and the controller ----------------------------------------------------------------------
def test_closed_gate_drafts_nothing():
    model = make_model("shallow")
    router = make_router(model, "never")
    ids, mask = prompts(0)
    out, stats = speculative(model, router, ids[:1], max_new_tokens=32, do_sample=False)
    spec = stats.speculative
    # the previous token's score (free, from the full-depth forward) keeps every round from drafting
    assert spec["drafted"] == spec["draft_forwards"] == spec["budget_skips"] == 0
    # 32 plain forwards: the prefill, the first (timed) step, the gate's skips, the last step (no room left)
    assert spec["gate_skips"] == 32 - 3 and spec["plain_steps"] == 32


def test_without_a_prior_the_first_probe_is_paid_from_the_budget():
    model = make_model("shallow")
    router = make_router(model, "always", prior=False)
    prompt = prompts(0)[0][:1]
    # warm-up: one-time costs (first kernel use, lazy inits) would land in the first call's prefill time,
    # and the budget is a share of the call's time
    speculative(model, router, prompt, max_new_tokens=2, do_sample=False, eos_token_id=None)
    short, stats = speculative(model, router, prompt, max_new_tokens=NEW, do_sample=False, eos_token_id=None)
    assert stats.speculative["expected_speedup"] is None
    assert stats.speculative["draft_forwards"] == 0 and stats.speculative["budget_skips"] > 0
    full = counter(model.model.layers[-1])
    long, stats = speculative(model, router, prompt, max_new_tokens=96, do_sample=False, eos_token_id=None)
    assert torch.equal(long[:, :short.shape[1]], short)
    # a probe fits once LOSS_BUDGET of the elapsed time covers one draft forward; accepted drafts then
    # earn the credit for more
    assert stats.speculative["accepted"] > 0 and full[0] < 96


def test_drafting_stops_when_it_never_pays():
    model = make_model("random")
    router = make_router(model, "always")
    ids, _ = prompts(2)
    new = 64
    out, stats = speculative(model, router, ids[:1], max_new_tokens=new, do_sample=False, eos_token_id=None)
    spec = stats.speculative
    assert spec["accepted"] == 0  # precondition: layer-4 drafts of this model are always wrong
    # without the controller every round would draft: the loss budget lets only a few probes through
    assert spec["draft_forwards"] <= 6 and spec["budget_skips"] >= new - 10
    assert spec["plain_steps"] >= new - 6 and spec["net_loss_s"] > 0


# -- the model is left exactly as before ---------------------------------------------------------------
class Boom(LogitsProcessor):
    def __init__(self, after: int) -> None:
        self.calls, self.after = 0, after

    def __call__(self, input_ids, scores):
        self.calls += 1
        if self.calls > self.after:
            raise RuntimeError("boom")
        return scores


@pytest.mark.parametrize("after", [1, 5])  # in the verification pass / inside a draft
def test_model_restored_after_errors(after):
    model = make_model("shallow")
    router = make_router(model, "always")
    before = snapshot(model)
    handle = tide_hf.attach(model, router, mode="speculative", exit_threshold=0.5, draft_layer=4)
    try:
        with pytest.raises(RuntimeError, match="boom"):
            model.generate(prompts(0)[0][:1], max_new_tokens=NEW, logits_processor=LogitsProcessorList([Boom(after)]))
        assert "_get_candidate_generator" not in model.__dict__
        assert model.config.num_hidden_layers == NUM_LAYERS
    finally:
        handle.detach()
    assert snapshot(model) == before


def test_model_without_layer_truncation_is_refused_and_restored():
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=256, n_embd=32, n_layer=5, n_head=4, n_positions=64,
                                       bos_token_id=1, eos_token_id=2)).eval()
    router = TideRouter(TideRouterConfig(hidden_size=32, num_hidden_layers=5, router_bottleneck_dim=8,
                                         checkpoint_layers=[2], base_architecture=type(model).__name__,
                                         label="top1", metrics={"2": {"predicted_rate": 1.0, "precision": 1.0}}))
    with torch.no_grad():
        router.routers["2"].fc2.bias.fill_(30.0)
        router.routers["2"].fc2.weight.zero_()
    before = snapshot(model)
    with pytest.raises(NotImplementedError, match="num_hidden_layers"):
        speculative(model, router, torch.tensor([[5, 6, 7]]), draft_layer=2, max_new_tokens=6, do_sample=False)
    assert snapshot(model) == before


# -- options and fallbacks ----------------------------------------------------------------------------
def test_draft_layer_must_be_a_router_checkpoint():
    model = make_model()
    with pytest.raises(ValueError, match="draft_layer=3 has no router"):
        speculative(model, make_router(model, "always"), prompts(0)[0][:1], draft_layer=3, max_new_tokens=2)


def test_default_draft_layer_from_metrics():
    model = make_model()
    router = make_router(model, "always", prior=False)
    adapter = tide_hf.get_adapter(model)
    assert choose_draft_layer(router, adapter, [4, 8]) == 4  # no metrics: nearest half depth
    cost4, cost8 = draft_cost(adapter, 4), draft_cost(adapter, 8)
    assert 4 / 9 < cost4 < cost8 < 1.0  # the LM head is a share of every forward
    router.config.label = "top1"
    router.config.metrics = {"4": {"predicted_rate": 0.1, "precision": 0.5},  # a shallow draft that rarely helps
                             "8": {"predicted_rate": 0.95, "precision": 0.99}}
    assert choose_draft_layer(router, adapter, [4, 8]) == 8
    router.config.metrics["4"] = {"predicted_rate": 0.9, "precision": 0.9}
    assert choose_draft_layer(router, adapter, [4, 8]) == 4
    assert expected_speedup(0.0, 0.0, 0.5) == 1.0  # the gate never opens: plain steps
    assert expected_speedup(1.0, 1.0, 0.0) == MAX_DRAFT_TOKENS + 1  # free, always-right drafts


def test_beam_search_falls_back_to_stock():
    model = make_model("shallow")
    router = make_router(model, "always")
    ids, mask = prompts(0)
    call = {"max_new_tokens": 6, "do_sample": False, "num_beams": 2}
    with torch.no_grad():
        stock = model.generate(ids, attention_mask=mask, **call)
    out, stats = speculative(model, router, ids, attention_mask=mask, **call)
    assert torch.equal(out, stock) and "beam" in stats.speculative["fallback"]


def test_return_dict_batch_one():
    model = make_model("shallow")
    router = make_router(model, "always")
    ids = prompts(0)[0][:1]
    call = {"max_new_tokens": NEW, "do_sample": False, "return_dict_in_generate": True, "output_scores": True}
    with torch.no_grad():
        stock = model.generate(ids, **call)
    out, _ = speculative(model, router, ids, **call)
    assert torch.equal(out.sequences, stock.sequences)
    assert len(out.scores) == NEW
    assert all(torch.equal(a.argmax(-1), b.argmax(-1)) for a, b in zip(out.scores, stock.scores))


# -- SmolLM2 --------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_smollm2_greedy_identical_to_stock(monkeypatch):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tide_hf.assets import smollm2_path, sotu_path
    from tide_hf.integrations import speculative as spec_module

    try:
        path = smollm2_path()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(path)
    router = tide_hf.calibrate(model, tok, str(sotu_path()), num_samples=24, seq_len=64, num_epochs=3,
                               label="top1", progress=False)
    texts = ["The state of the union is", "Our nation will build", "In the year 1900 the Congress",
             "The most important thing about peace is"]
    before = snapshot(model)
    stock = {t: model.generate(**tok(t, return_tensors="pt"), max_new_tokens=24, do_sample=False) for t in texts}
    # 1. the default draft layer and controller; 2. drafting every round at layer 28 (~half the drafts right)
    for options, budget in ((dict(exit_threshold=0.5), spec_module.LOSS_BUDGET),
                            (dict(exit_threshold=0.0, draft_layer=28), float("inf"))):
        monkeypatch.setattr(spec_module, "LOSS_BUDGET", budget)
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
