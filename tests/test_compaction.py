"""Skip mode in a batch: rows and prefill positions that exited stop computing, and a row's tokens do not depend
on the other rows of its batch."""

from __future__ import annotations

import pytest
import torch
from helpers import NUM_LAYERS, router_for, skip_model, skip_prompts
from transformers import StaticCache

import tide_hf
from tide_bench.modes import forced_rows

EXIT_AT = 4  # the forced rows leave after this checkpoint
NEW_TOKENS = 6


def rows_per_layer(model, seen: list[int] | None = None) -> list[int]:
    """Rows (x positions) each layer's MLP runs, summed over a call into `seen`: what the layer really computed."""
    seen = [0] * NUM_LAYERS if seen is None else seen
    seen[:] = [0] * NUM_LAYERS
    for i, layer in enumerate(model.model.layers):
        layer.mlp.register_forward_hook(
            lambda _m, args, _o, i=i: seen.__setitem__(i, seen[i] + args[0].shape[0] * args[0].shape[1]))
    return seen


def state_router(model) -> tide_hf.TideRouter:
    """A router whose scores depend on the state: rows and positions exit at different steps and checkpoints."""
    router = router_for(model, 0.0)
    with torch.no_grad():
        for mlp in router.routers.values():
            mlp.fc2.weight.normal_(0, 1.0, generator=torch.Generator().manual_seed(3))
    return router


def generate_forced(model, rows: torch.Tensor, ids, mask, cache: str, kv: str = "propagate",
                    seen: list[int] | None = None):
    """Greedy tokens with the rows where `rows` is True exiting at `EXIT_AT` in every step, and the stats; the
    rows each layer ran added to `seen` (counted after attach: its probe forward runs the layers too)."""
    handle = tide_hf.integrations.attach_with(forced_rows(rows), model, router_for(model, 0.0), exit_threshold=0.5,
                                         min_layers=EXIT_AT, mode="skip", kv=kv)
    if seen is not None:
        rows_per_layer(model, seen)
    try:
        past = StaticCache(config=model.config, max_cache_len=32) if cache == "static" else None
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False,
                             past_key_values=past, return_dict_in_generate=True)
        return out, handle.last_stats
    finally:
        handle.detach()


@pytest.mark.parametrize("kv", ["propagate", "recompute"])
@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_forced_per_row_exits_give_each_row_its_tokens_alone_and_stop_its_layers(cache, kv):
    model = skip_model()
    ids, mask = skip_prompts()  # rows 1 and 2 left-padded
    rows = torch.tensor([True, False, True])
    seen: list[int] = []
    batched, stats = generate_forced(model, rows, ids, mask, cache, kv, seen=seen)
    deep = list(seen[EXIT_AT:])  # (before the rows alone add theirs)
    for r in range(3):
        alone, _ = generate_forced(model, rows[r : r + 1], ids[r : r + 1], mask[r : r + 1], cache, kv)
        assert torch.equal(alone.sequences, batched.sequences[r : r + 1]), f"row {r}"
    if kv == "recompute":  # the batch runs whole until every row has exited
        assert stats.decode.executed == {NUM_LAYERS: 3 * (NEW_TOKENS - 1)}
        assert stats.prefill.executed == {NUM_LAYERS: int(mask.sum())}
        return
    # layers executed per token: the exiting rows EXIT_AT, the other every layer
    assert stats.decode.executed == {EXIT_AT: 2 * (NEW_TOKENS - 1), NUM_LAYERS: NEW_TOKENS - 1}
    assert stats.prefill.executed == {EXIT_AT: int(mask[0].sum() + mask[2].sum()), NUM_LAYERS: int(mask[1].sum())}
    if kv == "propagate":
        # only row 1 runs the deep layers: its 4 prompt positions (padding stops too), then one per step
        assert deep == [int(mask[1].sum()) + NEW_TOKENS - 1] * (NUM_LAYERS - EXIT_AT)


@pytest.mark.parametrize("kv", ["propagate", "recompute"])
def test_forced_per_row_exits_return_a_complete_cache(kv):
    model = skip_model()
    ids, mask = skip_prompts()
    out, _ = generate_forced(model, torch.tensor([True, False, False]), ids, mask, "dynamic", kv)
    lengths = {layer.keys.shape[-2] for layer in out.past_key_values.layers}
    assert lengths == {ids.shape[1] + NEW_TOKENS - 1}  # every layer holds every position, every row
    assert all(torch.isfinite(layer.keys).all() for layer in out.past_key_values.layers)


def test_recompute_in_a_batch_returns_the_stock_models_cache_of_its_tokens():
    """kv='recompute' with rows exiting on their own: the cache generate returns holds, at every layer, the K/V
    the stock model computes for the same tokens."""
    model = skip_model()
    ids, mask = skip_prompts()
    out, _ = generate_forced(model, torch.tensor([True, False, True]), ids, mask, "dynamic", "recompute")
    full_mask = torch.cat([mask, torch.ones(3, NEW_TOKENS - 1, dtype=mask.dtype)], dim=1)
    with torch.no_grad():
        stock = model(input_ids=out.sequences[:, :-1], attention_mask=full_mask,
                      position_ids=(full_mask.cumsum(-1) - 1).clamp(min=0), use_cache=True).past_key_values
    keep = full_mask.bool()  # padding slots hold whatever a layer wrote there: never read
    for ours, theirs in zip(out.past_key_values.layers, stock.layers):
        torch.testing.assert_close(ours.keys.transpose(1, 2)[keep], theirs.keys.transpose(1, 2)[keep])
        torch.testing.assert_close(ours.values.transpose(1, 2)[keep], theirs.values.transpose(1, 2)[keep])


def test_recompute_in_a_batch_with_rows_exiting_on_their_own_gives_select_modes_tokens():
    """Real (state-dependent) decisions: rows exit at different steps and checkpoints, and every deep K/V is exact
    (the batch runs whole until every row has exited), so the tokens are select mode's (which runs every layer with
    the same exits)."""
    model = skip_model()
    ids, mask = skip_prompts()
    router = state_router(model)
    outputs, stats = {}, {}
    for mode, options in (("select", {}), ("skip", {"kv": "recompute"})):
        handle = tide_hf.attach(model, router, exit_threshold=0.5, mode=mode, **options)
        outputs[mode] = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False)
        stats[mode] = handle.last_stats
        handle.detach()
    assert torch.equal(outputs["skip"], outputs["select"])
    decode = stats["skip"].decode
    assert 0 < decode.exit_rate < 1


def test_the_propagated_cache_of_an_exited_row_is_what_the_layer_computes_from_its_exit_state():
    """The K/V an exited row gets for a skipped layer equal that layer's K/V on the state that exited (the row
    alone, where the whole step is skipped and `propagate_kv` writes them: the reference of single-row skip)."""
    model = skip_model()
    ids, mask = skip_prompts()
    rows = torch.tensor([True, False, True])
    batched, _ = generate_forced(model, rows, ids, mask, "dynamic")
    alone, _ = generate_forced(model, rows[:1], ids[:1], mask[:1], "dynamic")
    for layer_b, layer_a in zip(batched.past_key_values.layers, alone.past_key_values.layers):
        torch.testing.assert_close(layer_b.keys[:1], layer_a.keys, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(layer_b.values[:1], layer_a.values, atol=1e-5, rtol=1e-5)


def test_prefill_positions_that_exit_stop_and_match_the_same_positions_fed_one_by_one():
    """Positions of one prompt exit at different checkpoints (a router reading the state): prefilled in one
    forward, the exited positions stop computing, and the next-token logits equal those of the same prompt fed
    one token per forward (where a position that exits skips its whole step)."""
    model = skip_model()
    router = state_router(model)
    ids = torch.randint(3, 128, (1, 12), generator=torch.Generator().manual_seed(3))
    handle = tide_hf.attach(model, router, exit_threshold=0.7, mode="skip", kv="propagate")  # exits at both checkpoints
    seen = rows_per_layer(model)  # (after attach: its probe forward runs the layers too)
    try:
        with torch.no_grad():
            whole = model(input_ids=ids, use_cache=True)
        stats = handle.last_stats.prefill
        assert 0 < stats.exit_rate < 1 and len(stats.exits) == 3
        assert seen[-1] == ids.shape[1] - sum(c for k, c in stats.exits.items() if k < NUM_LAYERS)
        assert stats.mean_executed == pytest.approx(stats.mean_layers)
        with torch.no_grad():
            past, logits = None, []
            for t in range(ids.shape[1]):
                step = model(input_ids=ids[:, t : t + 1], past_key_values=past, use_cache=True)
                past = step.past_key_values
                logits.append(step.logits)
    finally:
        handle.detach()
    torch.testing.assert_close(whole.logits, torch.cat(logits, dim=1), atol=1e-4, rtol=1e-4)


def test_a_batch_of_rows_exiting_on_their_own_gives_each_row_its_tokens_alone():
    """Real (state-dependent) router decisions: each row of a left-padded batch exits when its own state says so,
    stops computing, and gets the tokens it gets alone."""
    model = skip_model()
    ids, mask = skip_prompts()
    router = state_router(model)
    handle = tide_hf.attach(model, router, exit_threshold=0.5, mode="skip", kv="propagate")
    try:
        batched = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=5, do_sample=False)
        stats = handle.last_stats
        assert 0 < stats.decode.exit_rate < 1
        assert stats.decode.mean_executed == pytest.approx(stats.decode.mean_layers)  # exited rows stopped
        for r in range(3):
            alone = model.generate(input_ids=ids[r : r + 1, mask[r].argmax():], max_new_tokens=5, do_sample=False)
            assert torch.equal(alone[0, -5:], batched[r, -5:]), f"row {r}"
    finally:
        handle.detach()


@pytest.mark.parametrize("rows", [1, 2])
@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_recompute_returns_a_complete_cache_when_every_row_exits_at_every_step(rows, cache):
    """Every token exits at layer 1 of 2 (kv='recompute'): the deep layer never runs during the call, yet the cache
    generate returns holds every layer, one length, the stock model's K/V of the returned tokens."""
    from helpers import new_router
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, pad_token_id=0, eos_token_id=63)
    model = AutoModelForCausalLM.from_config(config).eval()
    ids = torch.randint(1, 60, (2, 5), generator=torch.Generator().manual_seed(0))[:rows]
    handle = tide_hf.attach(model, new_router(model, checkpoint_interval=1), exit_threshold=0.0, mode="skip",
                            kv="recompute")
    try:
        extra = {"cache_implementation": "static"} if cache == "static" else {}
        out = model.generate(ids, max_new_tokens=3, do_sample=False, return_dict_in_generate=True, **extra)
        assert handle.last_stats.decode.mean_executed == 1
    finally:
        handle.detach()
    length = ids.shape[1] + 2
    layers = out.past_key_values.layers
    assert all(layer.keys is not None and layer.keys.shape[2] >= length for layer in layers)
    assert [int(out.past_key_values.get_seq_length(i)) for i in range(2)] == [length] * 2
    with torch.no_grad():
        stock = model(input_ids=out.sequences[:, :-1], use_cache=True).past_key_values
    for ours, theirs in zip(layers, stock.layers):
        torch.testing.assert_close(ours.keys[:, :, :length], theirs.keys)
        torch.testing.assert_close(ours.values[:, :, :length], theirs.values)
