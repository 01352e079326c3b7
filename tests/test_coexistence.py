"""Attach beside the rest of a user's setup: weights changed while attached, accelerate hooks added or removed
after attach, forward pre-hooks, training with gradient checkpointing, caches passed back to stock calls, and
other threads during a speculative call. Each test compares with the stock model or a fresh attach."""

from __future__ import annotations

import copy
import threading

import pytest
import torch
from accelerate.hooks import ModelHook, add_hook_to_module, remove_hook_from_module
from helpers import constant_router, left_padded, make_model, mixed_router, new_router

import tide_hf
from tide_bench.easy import make_near_identity


def generate(model, ids, mask, **kwargs):
    with torch.no_grad():
        return model.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False, **kwargs)


@pytest.mark.parametrize("change", ["dtype", "load_state_dict"])
def test_propagate_follows_weights_changed_while_attached(change):
    """Skip mode's fused K/V projection is a copy: a cast or new weights while attached must give what an attach
    after the change gives (it crashed after a cast, and wrote the old weights' K/V after load_state_dict)."""
    ids, mask = left_padded()
    model = make_model(seed=0)
    changed = copy.deepcopy(model)
    if change == "dtype":
        changed.to(torch.float64)
    else:
        changed.load_state_dict(make_model(seed=3).state_dict())
    router = mixed_router(changed, ids, mask, quantiles=(0.3, 0.3))  # some steps skip, some run deep layers
    with tide_hf.attach(changed, router, exit_threshold=0.5, mode="skip", ignore_fingerprint=True,
                        kv="propagate") as handle:
        expected = generate(changed, ids, mask, return_dict_in_generate=True)
        assert handle._skipper.fused is not None and handle.last_stats.decode.mean_executed < 9
    with tide_hf.attach(model, router, exit_threshold=0.5, mode="skip", ignore_fingerprint=True, kv="propagate"):
        generate(model, ids, mask)  # folded from the weights of the attach
        if change == "dtype":
            model.to(torch.float64)
        else:
            model.load_state_dict(changed.state_dict())
        out = generate(model, ids, mask, return_dict_in_generate=True)
    assert torch.equal(out.sequences, expected.sequences)
    for got, want in zip(out.past_key_values.layers, expected.past_key_values.layers):
        torch.testing.assert_close(got.keys, want.keys, rtol=1e-6, atol=1e-6)


def test_router_scores_follow_a_cast_of_the_final_norm_while_attached():
    """OLMo-2's RMSNorm scales in fp32 before it rounds: in fp32 that formula ties with Llama's, so an attach in
    fp32 probes Llama's; after a cast to bf16 while attached, scores must be a fresh bf16 attach's (they kept the
    fp32 attach's formula: off by up to 7e-4, flipping exit decisions)."""
    from transformers import AutoModelForCausalLM, Olmo2Config

    torch.manual_seed(0)
    config = Olmo2Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=9,
                         num_attention_heads=4, num_key_value_heads=2, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        model.model.norm.weight.copy_(torch.randn(64) * 0.3 + 1.0)
    router = new_router(model)
    states = (torch.randn(4096, 64, generator=torch.Generator().manual_seed(1)) * 4).to(torch.bfloat16)
    ids = torch.tensor([[5, 6, 7]])
    with torch.no_grad(), tide_hf.attach(model, router, exit_threshold=0.5, mode="select") as handle:
        model.to(torch.bfloat16)
        model(ids)  # the first call after the cast
        served = handle.score(4, states)
    with torch.no_grad(), tide_hf.attach(model, router, exit_threshold=0.5, mode="select") as fresh:
        expected = fresh.score(4, states)
        by_hand = torch.sigmoid(router.logit(4, model.model.norm(states).float()))
    torch.testing.assert_close(expected, by_hand, rtol=0, atol=1e-6)  # the fresh attach reproduces the norm
    assert torch.equal(served, expected)

def test_recompute_cache_caught_up_with_padding_in_a_stock_call():
    """A kv="recompute" cache handed back to `generate(..., tide=False)` while attached catches its waiting tokens
    up; left-padded rows must not attend to their padding there (logits off by up to 0.18 before)."""
    model = make_model()
    ids, mask = left_padded()
    with tide_hf.attach(model, constant_router(model, 30.0), exit_threshold=0.5, mode="skip", kv="recompute"):
        first = generate(model, ids, mask, return_dict_in_generate=True)
        more = torch.cat([first.sequences, torch.full((3, 2), 77)], 1)
        more_mask = torch.cat([mask, torch.ones(3, more.shape[1] - mask.shape[1], dtype=mask.dtype)], 1)
        call = {"max_new_tokens": 1, "do_sample": False, "return_dict_in_generate": True, "output_logits": True,
                "tide": False}
        with torch.no_grad():
            cont = model.generate(more, attention_mask=more_mask, past_key_values=first.past_key_values, **call)
            stock = model.generate(more, attention_mask=more_mask, **call)
    assert mask[1:].eq(0).any()  # rows 1 and 2 are padded
    torch.testing.assert_close(cont.logits[0], stock.logits[0], rtol=1e-5, atol=1e-5)


class Counter(ModelHook):
    def __init__(self) -> None:
        self.calls = 0

    def pre_forward(self, module, *args, **kwargs):
        self.calls += 1
        return args, kwargs


@pytest.mark.parametrize("mode", ["select", "skip"])
def test_accelerate_hook_added_after_attach_survives_detach(mode):
    """`add_hook_to_module` after attach keeps TIDE's forward as `_old_forward`: detach puts the layer's own
    forward there, so the accelerate hook keeps running (it was dropped), and removing it leaves the layer as
    accelerate leaves a layer it never wrapped."""
    model = make_model()
    ids, mask = left_padded()
    stock = generate(model, ids, mask)
    layer = model.model.layers[6]
    handle = tide_hf.attach(model, constant_router(model, -30.0), exit_threshold=0.5, mode=mode)
    counter = Counter()
    add_hook_to_module(layer, counter)
    handle.detach()
    assert torch.equal(generate(model, ids, mask), stock)
    assert counter.calls > 0 and layer._old_forward.__func__ is type(layer).forward
    remove_hook_from_module(layer)
    assert "_old_forward" not in vars(layer) and layer.forward.__func__ is type(layer).forward
    assert torch.equal(generate(model, ids, mask), stock)


def test_accelerate_hook_removed_before_detach_leaves_no_wrapper():
    """A layer hooked by accelerate before attach, unhooked while attached: detach must not bring back
    `_old_forward` nor leave TIDE's wrapper as the layer's forward."""
    model = make_model()
    ids, mask = left_padded()
    stock = generate(model, ids, mask)
    layer = model.model.layers[6]
    add_hook_to_module(layer, Counter())
    handle = tide_hf.attach(model, constant_router(model, -30.0), exit_threshold=0.5, mode="skip", kv="propagate")
    remove_hook_from_module(layer)
    handle.detach()
    assert "_old_forward" not in vars(layer) and layer.forward.__func__ is type(layer).forward
    assert torch.equal(generate(model, ids, mask), stock)


def test_pre_hook_registered_after_attach_that_changes_inputs_is_named():
    model = make_model()
    ids, mask = left_padded()

    def prefix(_module, args, kwargs):
        tokens = kwargs.pop("input_ids", args[0] if args else None)
        kwargs["input_ids"] = torch.cat([torch.full((tokens.shape[0], 2), 5), tokens], 1)
        kwargs["attention_mask"] = torch.cat([torch.ones(tokens.shape[0], 2, dtype=mask.dtype),
                                              kwargs["attention_mask"]], 1)
        return (), kwargs

    with tide_hf.attach(model, mixed_router(model, ids, mask), exit_threshold=0.5, mode="select"):
        hook = model.register_forward_pre_hook(prefix, with_kwargs=True)
        with pytest.raises(tide_hf.errors.TideUnsupportedError, match="pre-hook registered on the model after attach"):
            model(ids, attention_mask=mask)
        hook.remove()


def test_propagate_attach_in_training_with_gradient_checkpointing():
    """Training with gradient checkpointing turns the cache off; attach's probe forward runs as served (eval) and
    leaves every module's training flag as found."""
    model = make_model()
    ids, mask = left_padded()
    getattr(model, "activation_checkpointing_enable", model.gradient_checkpointing_enable)()
    model.train()
    model.model.layers[2].eval()  # a mixed state, restored as found
    modes = {name: module.training for name, module in model.named_modules()}
    router = mixed_router(model, ids, mask)
    handle = tide_hf.attach(model, router, exit_threshold=0.5, mode="skip", kv="propagate")
    assert {name: module.training for name, module in model.named_modules()} == modes
    handle.detach()


def drafting_model(monkeypatch):
    """A model whose layers after 8 are near-identity, with drafting forced every round (the policy would time
    plain steps first under load), and two prompts of different lengths."""
    from tide_hf.integrations import draft

    monkeypatch.setattr(draft.DraftEstimates, "plan", lambda _self, room: (min(room, 4), 1.0))
    torch.manual_seed(0)
    model = make_model()
    make_near_identity(model, 8)
    ids, _ = left_padded()
    return model, ids[:1], ids[1:2, 2:]


def test_other_threads_wait_during_a_speculative_call(monkeypatch):
    """A speculative call's drafts lower the shared `config.num_hidden_layers`: a stock call (`tide=False`) in
    another thread meanwhile must still run every layer (it failed, or ran a truncated model). Drafting is forced
    every round (the policy would time it first)."""
    model, one, other = drafting_model(monkeypatch)
    call = {"max_new_tokens": 24, "do_sample": False}
    with torch.no_grad():
        stock_one, stock_other = model.generate(one, **call), model.generate(other, **call)
    results: dict[str, list] = {"spec": [], "stock": [], "errors": [], "drafted": []}

    def run(name, tokens, **extra):
        for _ in range(4):
            try:
                with torch.no_grad():
                    results[name].append(model.generate(tokens, **call, **extra))
                if name == "spec":
                    results["drafted"].append(tide_hf.last_stats(model).speculative["drafted"])
            except Exception as err:  # noqa: BLE001 - reported below
                results["errors"].append(f"{name}: {err!r}")

    with tide_hf.attach(model, constant_router(model, 30.0), exit_threshold=0.5, mode="speculative",
                        draft_layer=8):
        generate(model, one, None)
        threads = [threading.Thread(target=run, args=("spec", one)),
                   threading.Thread(target=run, args=("stock", other), kwargs={"tide": False})]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    assert results["errors"] == []
    assert all(torch.equal(out, stock_one) for out in results["spec"]) and len(results["spec"]) == 4
    assert min(results["drafted"]) > 0  # every speculative call drafted while the other thread ran
    assert all(torch.equal(out, stock_other) for out in results["stock"]) and len(results["stock"]) == 4


def test_a_speculative_call_waits_for_a_call_in_flight(monkeypatch):
    """A stock call of another thread already running (held inside its first logits processor call) when a
    speculative call starts: the speculative call waits for it (its drafts would truncate the model under it), then
    both give stock output."""
    from transformers import LogitsProcessor, LogitsProcessorList

    model, one, other = drafting_model(monkeypatch)
    call = {"max_new_tokens": 16, "do_sample": False}
    started, release = threading.Event(), threading.Event()

    class Hold(LogitsProcessor):
        def __call__(self, input_ids, scores):
            started.set()
            assert release.wait(60)
            return scores

    with torch.no_grad():
        stock_one, stock_other = model.generate(one, **call), model.generate(other, **call)
    out: dict[str, torch.Tensor] = {}
    with tide_hf.attach(model, constant_router(model, 30.0), exit_threshold=0.5, mode="speculative",
                        draft_layer=8) as handle:
        held = threading.Thread(target=lambda: out.setdefault("other", model.generate(
            other, **call, logits_processor=LogitsProcessorList([Hold()]), tide=False)))
        held.start()
        assert started.wait(60)
        speculative = threading.Thread(target=lambda: out.setdefault("one", model.generate(one, **call)))
        speculative.start()
        speculative.join(0.5)
        assert speculative.is_alive() and handle.turns.owner is None  # waiting for the call in flight
        release.set()
        held.join()
        speculative.join()
        assert tide_hf.last_stats(model).speculative["drafted"] > 0
    assert torch.equal(out["other"], stock_other) and torch.equal(out["one"], stock_one)


def test_compiled_forwards_beside_an_exclusive_turn():
    """The hooks are traced into compiled forwards. The thread holding a speculative call's turn compiles with
    `fullgraph=True` (asking for `threading.get_ident()` there failed to trace), and another thread's compiled
    forward waits for the turn's end (a graph break: the wait runs eagerly), so it never sees the depth a draft
    lowered meanwhile and gives stock logits."""
    model = make_model()
    ids, mask = left_padded()
    depth = model.config.num_hidden_layers
    with torch.no_grad():
        stock = model(input_ids=ids, attention_mask=mask).logits
    with tide_hf.attach(model, constant_router(model, 30.0), exit_threshold=0.5, mode="speculative",
                        draft_layer=8) as handle, torch.no_grad():
        torch._dynamo.reset()
        with handle.turns.exclusive():
            own = torch.compile(model, fullgraph=True, backend="eager")(input_ids=ids, attention_mask=mask).logits
        torch.testing.assert_close(own, stock)
        other = torch.compile(model, backend="eager")
        other(input_ids=ids, attention_mask=mask)  # warm
        out, started, release = {}, threading.Event(), threading.Event()

        def draft():  # a speculative call's draft holds the turn with the depth lowered
            with handle.turns.exclusive():
                model.config.num_hidden_layers = 3
                started.set()
                assert release.wait(60)
                model.config.num_hidden_layers = depth

        holder = threading.Thread(target=draft)
        holder.start()
        assert started.wait(60)
        waiting = threading.Thread(target=lambda: out.setdefault("logits", other(input_ids=ids,
                                                                                  attention_mask=mask).logits))
        waiting.start()
        waiting.join(5.0)
        assert "logits" not in out  # still waiting for the turn
        release.set()
        holder.join()
        waiting.join(60)
    torch.testing.assert_close(out["logits"], stock)
