"""Skip mode: layers after an all-row exit are really not run, and the KV cache stays sound."""

from __future__ import annotations

import copy

import pytest
import torch
from accelerate.hooks import ModelHook, add_hook_to_module, remove_hook_from_module
from helpers import (
    NUM_LAYERS,
    constant_router,
    left_padded,
    make_model,
    mixed_router,
    router_for,
    skip_model,
    skip_prompts,
)
from transformers import (
    AutoModelForCausalLM,
    DynamicCache,
    GemmaConfig,
    GPT2Config,
    LlamaConfig,
    MistralConfig,
    MistralForCausalLM,
    NemotronConfig,
    PhiConfig,
    Qwen2Config,
    Qwen3Config,
    SmolLM3Config,
    StaticCache,
)

import tide_hf
from tide_hf.compat import CACHE_KWARG
from tide_hf.errors import TideArgumentError, TideUnsupportedError
from tide_hf.runtime.skip.kv import FusedPropagation, propagate_kv


def truncated(model, layers: int):
    """The same model with only its first `layers` layers: the speed and output skip mode must reach."""
    config = copy.deepcopy(model.config)
    config.num_hidden_layers = layers
    small = AutoModelForCausalLM.from_config(config).eval()
    small.load_state_dict(model.state_dict(), strict=False)
    return small


def count_mlp_calls(model) -> list[int]:
    calls = [0] * NUM_LAYERS
    for i, layer in enumerate(model.model.layers):
        layer.mlp.register_forward_hook(lambda *_, i=i: calls.__setitem__(i, calls[i] + 1))
    return calls


@pytest.mark.parametrize("exit_at", [4, 8])
def test_all_rows_exit_equals_truncated_model_and_layers_are_not_run(exit_at):
    model = skip_model()
    ids, mask = skip_prompts()
    expected = truncated(model, exit_at).generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
    handle = tide_hf.attach(model, router_for(model, 30.0), exit_threshold=0.5, min_layers=exit_at, mode="skip",
                            kv="propagate")
    calls = count_mlp_calls(model)  # (after attach: its check of the propagated K/V runs one forward)
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
    assert torch.equal(out, expected)
    forwards = 6  # prefill + 5 decode steps
    assert calls[:exit_at] == [forwards] * exit_at and calls[exit_at:] == [0] * (NUM_LAYERS - exit_at)
    stats = handle.last_stats
    assert stats.decode.mean_executed == exit_at and stats.prefill.mean_executed == exit_at
    handle.detach()


def test_mixed_rows_run_every_layer_like_select_mode():
    model = skip_model()
    ids, mask = skip_prompts()
    router = router_for(model, 0.0)
    with torch.no_grad():  # score depends on the state: rows differ, so not every row exits
        for mlp in router.routers.values():
            mlp.fc2.weight.normal_(0, 1.0, generator=torch.Generator().manual_seed(3))
    handle = tide_hf.attach(model, router, exit_threshold=0.5, mode="select")
    select = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=5, do_sample=False)
    select_stats = handle.last_stats
    handle.detach()
    handle = tide_hf.attach(model, router, exit_threshold=0.5, mode="skip", kv="propagate")
    skip = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=5, do_sample=False)
    assert 0 < select_stats.decode.exit_rate < 1  # a real mix
    assert torch.equal(skip, select)
    handle.detach()


def test_threshold_one_in_skip_mode_is_stock():
    model = skip_model()
    ids, mask = skip_prompts()
    stock = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=5, do_sample=False)
    handle = tide_hf.attach(model, router_for(model, 30.0), exit_threshold=1.0, mode="skip", kv="propagate")
    assert torch.equal(model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=5, do_sample=False), stock)
    assert handle.last_stats.decode.mean_executed == NUM_LAYERS
    handle.detach()


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_every_layer_cache_has_the_same_length_after_every_step(cache):
    model = skip_model()
    ids, mask = skip_prompts()
    tide_hf.attach(model, router_for(model, 30.0), exit_threshold=0.5, min_layers=4, mode="skip", kv="propagate")
    past = (DynamicCache(config=model.config) if cache == "dynamic"
            else StaticCache(config=model.config, max_cache_len=32))
    lengths = []

    def record(*_):
        lengths.append([int((layer.keys.abs().sum(dim=(0, 1, 3)) != 0).sum()) if cache == "static"
                        else layer.keys.shape[2] for layer in past.layers])
    model.register_forward_hook(record)
    model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False, past_key_values=past)
    assert len(lengths) == 4
    for step, per_layer in enumerate(lengths):
        assert len(set(per_layer)) == 1, f"step {step}: cache lengths differ across layers: {per_layer}"
        assert per_layer[0] == ids.shape[1] + step
    tide_hf.detach(model)


NO_ROPE_AT_6 = [1] * 6 + [0] + [1] * (NUM_LAYERS - 7)  # SmolLM3: the layer under test runs without rotary


@pytest.mark.parametrize("config_cls,extra", [(LlamaConfig, {}), (MistralConfig, {"sliding_window": 4}),
                                              (Qwen3Config, {"head_dim": 16}), (PhiConfig, {"qk_layernorm": True}),
                                              (SmolLM3Config, {"no_rope_layers": NO_ROPE_AT_6})])
def test_propagated_kv_equals_what_the_layer_itself_writes(config_cls, extra):
    """kv='propagate' must write exactly the K/V the layer's own attention computes for the exit state (Phi:
    partial rotary and a key LayerNorm; SmolLM3: a layer without rotary; both were written wrong)."""
    model = skip_model(config_cls, **extra)
    layer = model.model.layers[6]
    hidden = torch.randn(2, 3, 64, generator=torch.Generator().manual_seed(5))
    position_ids = torch.arange(3).expand(2, 3)
    kwargs = {"position_embeddings": model.model.rotary_emb(hidden, position_ids), "use_cache": True}
    own, ours = DynamicCache(config=model.config), DynamicCache(config=model.config)
    with torch.no_grad():
        layer(hidden, past_key_values=own, position_ids=position_ids, **kwargs)
        propagate_kv(layer, hidden, {**kwargs, "past_key_values": ours})
    torch.testing.assert_close(ours.layers[6].keys, own.layers[6].keys)
    torch.testing.assert_close(ours.layers[6].values, own.layers[6].values)


@pytest.mark.parametrize("config_cls,extra", [(LlamaConfig, {}), (Qwen2Config, {}), (GemmaConfig, {"head_dim": 16}),
                                              (PhiConfig, {})])
def test_fused_propagation_writes_what_propagate_writes_layer_by_layer(config_cls, extra):
    """Folding the input norms into one stacked K/V projection (Qwen2: K/V biases; Gemma: (1 + w) norms)
    changes only rounding: every skipped layer's cache gets the same K/V as `propagate_kv` writes."""
    model = skip_model(config_cls, **extra)
    with torch.no_grad():  # norm weights differ per layer, so a wrong fold cannot pass
        for layer in model.model.layers:
            layer.input_layernorm.weight.normal_(0.5, 0.3)
    layers = list(model.model.layers)[4:]
    fused = FusedPropagation.build(layers, 5)
    assert fused is not None
    hidden = torch.randn(2, 3, 64, generator=torch.Generator().manual_seed(5))
    position_ids = torch.arange(3).expand(2, 3)
    kwargs = {"position_embeddings": model.model.rotary_emb(hidden, position_ids), "use_cache": True}
    ours, reference = DynamicCache(config=model.config), DynamicCache(config=model.config)
    fused.write(6, hidden, {**kwargs, "past_key_values": ours})  # exit after layer 6: layers 7..9
    with torch.no_grad():
        for layer in model.model.layers[6:]:
            propagate_kv(layer, hidden, {**kwargs, "past_key_values": reference})
    for idx in range(NUM_LAYERS):
        assert ours.layers[idx].get_seq_length() == (3 if idx >= 6 else 0)
        if idx >= 6:
            torch.testing.assert_close(ours.layers[idx].keys, reference.layers[idx].keys, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(ours.layers[idx].values, reference.layers[idx].values, atol=1e-5, rtol=1e-5)


def test_fused_propagation_declines_layers_it_cannot_fold():
    qwen3 = skip_model(Qwen3Config, head_dim=16)  # per-head K norm after the projection
    assert FusedPropagation.build(list(qwen3.model.layers)[4:], 5) is None
    smollm3 = skip_model(SmolLM3Config, no_rope_layers=NO_ROPE_AT_6)  # one layer without rotary among rotary ones
    assert FusedPropagation.build(list(smollm3.model.layers)[4:], 5) is None
    llama = skip_model()
    layers = list(llama.model.layers)[4:]
    layers[2].input_layernorm.variance_epsilon = 1e-3  # a different eps than the others
    assert FusedPropagation.build(layers, 5) is None


def test_propagated_kv_of_a_layernorm_subclass_is_what_the_layers_write():
    """Nemotron's input norms are nn.LayerNorm subclasses scaling by (1 + w): folded as plain LayerNorms they
    wrote wrong deep K/V. Reference: the model's own layers run on the layer-4 state (pre-hooks feed it to every
    deeper layer) write their K/V into a stock cache."""
    model = skip_model(NemotronConfig)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.input_layernorm.weight.normal_(0.5, 0.3)
    ids = torch.randint(3, 128, (1, 6), generator=torch.Generator().manual_seed(3))
    ours = DynamicCache(config=model.config)
    with tide_hf.attach(model, router_for(model, 30.0), exit_threshold=0.5, min_layers=4, mode="skip",
                        kv="propagate"), torch.no_grad():
        model(input_ids=ids, past_key_values=ours, use_cache=True)  # every token exits at 4
    state: dict[str, torch.Tensor] = {}
    layers = model.model.layers
    hooks = [layers[3].register_forward_hook(lambda _m, _a, out: state.__setitem__("h", out[0] if isinstance(
        out, tuple) else out))]
    hooks += [layer.register_forward_pre_hook(lambda _m, args, kwargs: ((state["h"], *args[1:]), kwargs) if args
                                              else (args, {**kwargs, "hidden_states": state["h"]}), with_kwargs=True)
              for layer in layers[4:]]
    reference = DynamicCache(config=model.config)
    try:
        with torch.no_grad():
            model(input_ids=ids, past_key_values=reference, use_cache=True)
    finally:
        for hook in hooks:
            hook.remove()
    for mine, theirs in zip(ours.layers, reference.layers):
        torch.testing.assert_close(mine.keys, theirs.keys)
        torch.testing.assert_close(mine.values, theirs.values)
    assert FusedPropagation.build(list(model.model.layers)[4:], 5) is None  # norm_spec declines: not folded


def test_detach_restores_forward_and_keeps_accelerate_hooks():
    model = skip_model()
    ids, mask = skip_prompts()
    stock = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False)
    layer = model.model.layers[6]
    add_hook_to_module(layer, ModelHook())  # what accelerate's dispatch does: forward wraps _old_forward
    accelerate_forward = layer.forward
    handle = tide_hf.attach(model, router_for(model, 30.0), exit_threshold=0.5, min_layers=4, mode="skip",
                            kv="propagate")
    assert layer.forward is accelerate_forward  # accelerate's wrapper untouched, its _old_forward replaced
    expected = truncated(model, 4).generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False)
    assert torch.equal(model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False), expected)
    handle.detach()
    assert layer.forward is accelerate_forward and hasattr(layer, "_old_forward")
    assert layer._old_forward.__func__ is type(layer).forward  # accelerate's saved forward is the original again
    remove_hook_from_module(layer)
    assert all(m.forward.__func__ is type(m).forward for m in model.model.layers)
    assert torch.equal(model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False), stock)


def test_unsupported_attention_is_refused_before_any_patch():
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(GPT2Config(vocab_size=64, n_embd=32, n_layer=NUM_LAYERS, n_head=2)).eval()
    with pytest.raises(NotImplementedError, match="kv='propagate'"):
        tide_hf.attach(model, router_for(model, 30.0), mode="skip", kv="propagate")
    assert tide_hf.get_handle(model) is None
    assert all(not m._forward_hooks and not m._forward_pre_hooks and "forward" not in m.__dict__
               for m in model.modules())


@pytest.mark.parametrize("rows", [1, 2])
def test_recompute_a_plain_forward_returns_the_exact_deep_cache(rows):
    """kv='recompute': a skipped token's deep K/V are computed from its exit state, which is its true layer-k
    output. A plain forward (outside generate) writes them before it returns, so its cache equals the stock model's
    in every layer at once, and the next call, with TIDE or without, reads a complete cache."""
    model = skip_model()
    prompt = torch.randint(3, 128, (2, 5), generator=torch.Generator().manual_seed(1))[:rows]
    t1, t2 = torch.tensor([[7], [9]])[:rows], torch.tensor([[11], [13]])[:rows]
    stock_cache = DynamicCache(config=model.config)
    with torch.no_grad():
        for ids in (prompt, t1):
            model(input_ids=ids, past_key_values=stock_cache, use_cache=True)
        stock_after_t1 = [(layer.keys.clone(), layer.values.clone()) for layer in stock_cache.layers]
        stock_logits = model(input_ids=t2, past_key_values=stock_cache, use_cache=True).logits
    handle = tide_hf.attach(model, router_for(model, 30.0), exit_threshold=0.5, min_layers=4, mode="skip",
                            kv="recompute")
    calls = count_mlp_calls(model)
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        with handle.disabled():
            model(input_ids=prompt, past_key_values=cache, use_cache=True)
        model(input_ids=t1, past_key_values=cache, use_cache=True)  # every row exits at 4: layers 5-9 caught up
        assert handle.last_stats.prefill.exits[4] == rows  # (a plain forward counts as a prefill)
        for ours, (keys, values) in zip(cache.layers, stock_after_t1):
            torch.testing.assert_close(ours.keys, keys)
            torch.testing.assert_close(ours.values, values)
        with handle.disabled():
            logits = model(input_ids=t2, past_key_values=cache, use_cache=True).logits
    assert calls == [3] * NUM_LAYERS  # layers 5-9 ran for t1 once, before the forward returned
    assert [layer.keys.shape[2] for layer in cache.layers] == [7] * NUM_LAYERS
    for ours, theirs in zip(cache.layers, stock_cache.layers):
        torch.testing.assert_close(ours.keys, theirs.keys)
        torch.testing.assert_close(ours.values, theirs.values)
    torch.testing.assert_close(logits, stock_logits)
    handle.detach()


@pytest.mark.parametrize("given", [None, "cache", "past_key_values"])
def test_recompute_a_plain_prefill_whose_tokens_all_exit_returns_a_complete_cache(given):
    """Every prompt token exits at the first checkpoint: the cache a plain forward returns (made by the model, or
    given under either of transformers' cache keywords) equals a stock forward's in every layer (transformers'
    own `test_past_key_values_format` read None keys in the deep layers)."""
    if given == "cache" and CACHE_KWARG != "cache":
        pytest.skip("transformers < 5.24 names the cache keyword past_key_values only")
    model = skip_model()
    ids = torch.randint(3, 128, (2, 6), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        stock = model(input_ids=ids, use_cache=True)
        stock_cache = stock.past_key_values
        with tide_hf.attach(model, router_for(model, 30.0), exit_threshold=0.5, min_layers=4, mode="skip",
                            kv="recompute") as handle:
            kwargs = {} if given is None else {given: DynamicCache(config=model.config)}
            out = model(input_ids=ids, use_cache=True, **kwargs)
            assert handle.last_stats.prefill.exits[4] == ids.numel()
    cache = out.past_key_values if given is None else kwargs[given]
    assert len(cache.layers) == NUM_LAYERS
    for ours, theirs in zip(cache.layers, stock_cache.layers):
        torch.testing.assert_close(ours.keys, theirs.keys)
        torch.testing.assert_close(ours.values, theirs.values)


def test_recompute_generate_matches_select_outputs_and_keeps_lengths_consistent():
    """In generate, recompute skips whole steps yet every step's tokens equal an exact recomputation:
    with an always-exit router, outputs equal the truncated model (the deep cache never changes outputs)."""
    model = skip_model()
    ids, mask = skip_prompts()
    expected = truncated(model, 4).generate(input_ids=ids, attention_mask=mask, max_new_tokens=5, do_sample=False)
    handle = tide_hf.attach(model, router_for(model, 30.0), exit_threshold=0.5, min_layers=4, mode="skip",
                            kv="recompute")
    assert torch.equal(model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=5, do_sample=False), expected)
    assert handle.last_stats.decode.mean_executed == 4
    handle.detach()


@pytest.mark.parametrize("kv", ["propagate", "recompute"])
def test_recomputed_counts_the_catch_up_and_mean_executed_the_own_steps(kv: str) -> None:
    """Under recompute a skipped step's deep layers run later, with a later step: `mean_executed` (what a step
    ran for its own token) does not show that work, `recomputed` counts it. Checked against the positions each
    layer's MLP really processed in the decode forwards."""
    from helpers import left_padded, make_model, mixed_router

    model = make_model()
    ids, mask = left_padded()
    router = mixed_router(model, ids, mask, quantiles=(0.5, 0.4))
    one = ids[:1, -int(mask[0].sum()):]  # one row: every decode position is a kept token
    runs, positions = [], []
    with tide_hf.attach(model, router, exit_threshold=0.5, min_layers=4, mode="skip", kv=kv) as handle:
        model.register_forward_pre_hook(lambda *_: runs.append(len(runs)))  # after attach's own check forward
        for layer in model.model.layers:
            layer.mlp.register_forward_hook(
                lambda _m, args, _o: positions.append((len(runs), args[0].shape[:-1].numel())))
        model.generate(input_ids=one, attention_mask=torch.ones_like(one), max_new_tokens=16, min_new_tokens=16,
                       do_sample=False, pad_token_id=0)
        decode = handle.last_stats.decode
    computed = sum(n for forward, n in positions if forward > 1)  # forward 1 is the prefill
    assert decode.tokens == 15 and len(decode.executed) > 1  # steps of several depths
    own = sum(k * c for k, c in decode.executed.items())
    assert decode.mean_executed * decode.tokens == pytest.approx(own)
    assert (decode.recomputed > 0) == (kv == "recompute") and computed == own + decode.recomputed


@pytest.mark.parametrize("call", ["plain", "chunked prefill", "two sequences per prompt", "continued cache"])
def test_recompute_under_a_static_cache_keeps_padding_out_of_the_catch_up(call: str) -> None:
    """A static cache gives every forward a 4-D mask: the catch-up of parked tokens had no 2-D mask and let
    padded rows attend to their padding (logits off by ~0.1 on the most padded row), also when the prompt came
    in chunks, its rows were repeated, or the call continued a cache. Now the call's 2-D mask serves it: the
    logits equal the dynamic cache's."""
    from helpers import left_padded, make_model, mixed_router

    model = make_model()
    ids, mask = left_padded()
    router = mixed_router(model, ids, mask, quantiles=(0.5, 0.4))
    kwargs = dict(max_new_tokens=12, min_new_tokens=12, do_sample=False, pad_token_id=0, output_logits=True,
                  return_dict_in_generate=True)
    kwargs |= {"chunked prefill": {"prefill_chunk_size": 3},
               "two sequences per prompt": {"num_return_sequences": 2, "do_sample": True, "top_k": 1}}.get(call, {})
    logits = {}
    with tide_hf.attach(model, router, exit_threshold=0.5, min_layers=4, mode="skip", kv="recompute") as handle:
        for cache in ("dynamic", "static"):
            if call == "continued cache":  # a first call fills the cache, the second continues it
                past = DynamicCache(config=model.config) if cache == "dynamic" else \
                    StaticCache(config=model.config, max_cache_len=64)
                first = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, min_new_tokens=6,
                                       do_sample=False, pad_token_id=0, past_key_values=past)
                longer = torch.cat([mask, torch.ones(3, first.shape[1] - mask.shape[1], dtype=mask.dtype)], 1)
                out = model.generate(input_ids=first, attention_mask=longer, past_key_values=past, **kwargs)
            else:
                out = model.generate(input_ids=ids, attention_mask=mask, cache_implementation=cache, **kwargs)
            logits[cache] = torch.stack(out.logits, 1)
            assert handle.last_stats.decode.recomputed > 0  # tokens were parked and caught up
            stats = handle.last_stats.prefill.tokens
        assert call == "continued cache" or stats == int(mask.sum()) * (2 if "two" in call else 1)  # no padding
    torch.testing.assert_close(logits["static"], logits["dynamic"], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", sorted({CACHE_KWARG, "past_key_values"}))
def test_recompute_with_an_empty_dynamic_cache_of_the_users(name: str) -> None:
    """A `DynamicCache()` made without a config adds a layer when it is first written: the catch-up of tokens
    parked below layers never written yet read `cache.layers[i]` past its end (IndexError). Now it generates
    what generate's own cache gives, and the cache holds every layer, whole."""
    from helpers import left_padded, make_model, mixed_router

    model = make_model()
    prompt = torch.tensor([[5]])  # under this router it exits at 4, and the next step runs deeper
    router = mixed_router(model, *left_padded(lengths=(7, 5, 3)))
    call = dict(attention_mask=torch.ones_like(prompt), max_new_tokens=4, do_sample=False, pad_token_id=0)
    with tide_hf.attach(model, router, mode="skip", kv="recompute") as handle:
        own = model.generate(prompt, **call)
        assert handle.last_stats.decode.recomputed > 0  # parked tokens were caught up
        cache = DynamicCache()
        given = model.generate(prompt, **{name: cache}, **call)
    assert torch.equal(given, own)
    assert len(cache.layers) == model.config.num_hidden_layers


# -- refusals and odd but valid input ---------------------------------------------------------------------------
def test_recompute_refuses_decoding_that_edits_the_cache() -> None:
    model = make_model()
    ids, mask = left_padded()
    router = mixed_router(model, ids, mask)
    with tide_hf.attach(model, router, exit_threshold=0.5, mode="skip", kv="recompute"):
        with pytest.raises(TideArgumentError, match="kv='recompute' cannot serve num_beams=2"):
            model.generate(ids, attention_mask=mask, max_new_tokens=3, num_beams=2, do_sample=False)
        with pytest.raises(TideArgumentError, match="prompt_lookup_num_tokens"):
            model.generate(ids[:1], max_new_tokens=3, prompt_lookup_num_tokens=2, do_sample=False)
    with tide_hf.attach(model, router, exit_threshold=0.5, mode="skip", kv="propagate"):
        model.generate(ids, attention_mask=mask, max_new_tokens=3, num_beams=2, do_sample=False)



def test_recompute_refuses_a_window_kept_in_the_config() -> None:
    """Mistral keeps its sliding window in the config, not on the attention module."""
    torch.manual_seed(0)
    model = MistralForCausalLM(MistralConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                                             num_hidden_layers=9, num_attention_heads=4, num_key_value_heads=2,
                                             sliding_window=4, pad_token_id=0, eos_token_id=2)).eval()
    assert not getattr(model.model.layers[0].self_attn, "sliding_window", None)
    with pytest.raises(TideUnsupportedError, match="sliding-window attention") as info:
        tide_hf.attach(model, constant_router(model, 30.0), exit_threshold=0.5, mode="skip", kv="recompute")
    assert isinstance(info.value, NotImplementedError)  # what it raised before it was a TideError
