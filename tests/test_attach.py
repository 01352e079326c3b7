"""attach / detach / TideHandle on plain forwards: identity, exit semantics, per-row decisions, stats, errors.

Every expectation is computed a second way: from an `output_hidden_states=True` run of the stock model
(hidden_states[k] is the output of layer k for k < num_layers) and the router applied by hand.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from helpers import (
    HOOK_DICTS,
    NUM_LAYERS,
    constant_router,
    hooks,
    left_padded,
    make_model,
    mixed_router,
    new_router,
    positions,
    reference,
)

import tide_hf
from tide_hf.errors import TideCompatibilityError

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


# -- helpers ------------------------------------------------------------------------------------------


def batch(seed: int = 0, lengths=(7, 5, 3)) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A left-padded batch: input_ids (pad 0), attention_mask, position_ids as generate builds them."""
    ids, mask = left_padded(seed, lengths)
    return ids, mask, positions(mask)


def hook_count(model) -> int:
    return sum(len(getattr(mod, attr)) for mod in model.modules() for attr in HOOK_DICTS)


def by_hand(exit_layers: torch.Tensor) -> tuple[Counter, float, float]:
    """Counter, exit rate and mean layers of a 1-D tensor of exit layers, computed directly."""
    values = exit_layers.tolist()
    rate = sum(v < NUM_LAYERS for v in values) / len(values)
    return Counter(values), rate, sum(values) / len(values)


def assert_phase(phase, exit_layers: torch.Tensor) -> None:
    counter, rate, mean = by_hand(exit_layers)
    assert phase.exits == counter
    assert phase.tokens == len(exit_layers)
    assert phase.exit_rate == pytest.approx(rate)
    assert phase.mean_layers == pytest.approx(mean)


# -- identity -----------------------------------------------------------------------------------------
@torch.no_grad()
def test_threshold_one_is_identity_even_for_a_saturated_router():
    model = make_model()
    ids, mask, pos = batch()
    stock = model(ids, attention_mask=mask, position_ids=pos).logits
    router = constant_router(model, 30.0)  # score == 1.0 exactly: exits if threshold 1.0 were not special
    assert torch.sigmoid(torch.tensor(30.0)).item() == 1.0
    handle = tide_hf.attach(model, router, exit_threshold=1.0, mode="select")
    try:
        assert torch.equal(model(ids, attention_mask=mask, position_ids=pos).logits, stock)
        assert handle.last_stats.prefill.exits == Counter({NUM_LAYERS: int(mask.sum())})
    finally:
        handle.detach()
    handle = tide_hf.attach(model, router, exit_threshold=0.99,
                            mode="select")  # control: the same router does exit below 1.0
    try:
        assert not torch.allclose(model(ids, attention_mask=mask, position_ids=pos).logits, stock)
    finally:
        handle.detach()


@torch.no_grad()
def test_never_exit_router_leaves_logits_unchanged():
    model = make_model()
    ids, mask, pos = batch()
    stock = model(ids, attention_mask=mask, position_ids=pos).logits
    with_handle = tide_hf.attach(model, constant_router(model, -30.0), exit_threshold=0.5, mode="select")
    try:
        assert torch.equal(model(ids, attention_mask=mask, position_ids=pos).logits, stock)
        assert_phase(with_handle.last_stats.prefill, torch.full((int(mask.sum()),), NUM_LAYERS))
    finally:
        with_handle.detach()


# -- exit semantics -----------------------------------------------------------------------------------
@pytest.mark.parametrize("min_layers, exit_at", [(1, 4), (4, 4), (5, 8), (8, 8)])
@torch.no_grad()
def test_always_exit_equals_head_on_checkpoint_hidden_state(min_layers, exit_at):
    model = make_model()
    ids, mask, pos = batch()
    hidden = model(ids, attention_mask=mask, position_ids=pos, output_hidden_states=True).hidden_states
    expected = model.lm_head(model.model.norm(hidden[exit_at]))
    handle = tide_hf.attach(model, constant_router(model, 30.0), exit_threshold=0.5, min_layers=min_layers,
                            mode="select")
    try:
        got = model(ids, attention_mask=mask, position_ids=pos).logits
        assert torch.equal(got, expected)
        assert handle.last_stats.prefill.exits == Counter({exit_at: int(mask.sum())})  # padding not counted
        assert handle.last_stats.decode.tokens == 0
    finally:
        handle.detach()


@torch.no_grad()
def test_min_layers_past_every_checkpoint_disables_exits():
    model = make_model()
    ids, mask, pos = batch()
    stock = model(ids, attention_mask=mask, position_ids=pos).logits
    handle = tide_hf.attach(model, constant_router(model, 30.0), exit_threshold=0.5, min_layers=NUM_LAYERS,
                            mode="select")
    try:
        assert torch.equal(model(ids, attention_mask=mask, position_ids=pos).logits, stock)
    finally:
        handle.detach()


@torch.no_grad()
@pytest.mark.parametrize("exit_head", ["lens", "linear", "linear-rank-4"])
def test_mixed_router_matches_per_position_reference(exit_head: str):
    model = make_model()
    ids, mask, pos = batch()
    rank = {"exit_head_rank": 4} if exit_head == "linear-rank-4" else {}
    router = mixed_router(model, ids, mask, exit_head=exit_head.removesuffix("-rank-4"), **rank)
    exit_layer, expected = reference(model, router, ids, mask, threshold=0.5, min_layers=4)
    valid = mask.bool()
    assert set(exit_layer[valid].tolist()) == {4, 8, NUM_LAYERS}, "the test needs every kind of decision"
    if exit_head != "lens":  # the exit heads change the exited positions' logits: the check is not vacuous
        _, lens = reference(model, mixed_router(model, ids, mask), ids, mask, threshold=0.5, min_layers=4)
        exited = valid & (exit_layer < NUM_LAYERS)
        assert (expected[exited] - lens[exited]).abs().max() > 0.1
    handle = tide_hf.attach(model, router, exit_threshold=0.5, min_layers=4, mode="select")
    try:
        got = model(ids, attention_mask=mask, position_ids=pos).logits
        assert torch.equal(got[valid], expected[valid])
        assert_phase(handle.last_stats.prefill, exit_layer[valid])
    finally:
        handle.detach()


@torch.no_grad()
def test_decisions_are_per_row_not_batch_global():
    model = make_model()
    ids, mask, pos = batch(seed=3, lengths=(8, 6, 4, 7))
    router = mixed_router(model, ids, mask)
    exit_layer, _ = reference(model, router, ids, mask, threshold=0.5, min_layers=4)
    last = exit_layer[:, -1]  # decision of each row's last prompt token
    assert len(set(last.tolist())) > 1, "rows must get different decisions for the test to mean anything"
    handle = tide_hf.attach(model, router, exit_threshold=0.5, min_layers=4, mode="select")
    try:
        batched = model(ids, attention_mask=mask, position_ids=pos).logits
        batch_stats = handle.last_stats.prefill.exits
        alone_total = Counter()
        for row in range(ids.shape[0]):
            valid = mask[row].bool()
            alone = model(ids[row:row + 1, valid]).logits[0]
            torch.testing.assert_close(batched[row, valid], alone, rtol=1e-4, atol=1e-5)
            alone_total += handle.last_stats.prefill.exits
            assert handle.last_stats.prefill.exits == Counter(exit_layer[row, valid].tolist())
        assert batch_stats == alone_total
    finally:
        handle.detach()


@torch.no_grad()
def test_inputs_embeds_forward_exits_like_input_ids():
    model = make_model()
    ids, mask, pos = batch()
    router = mixed_router(model, ids, mask)
    handle = tide_hf.attach(model, router, exit_threshold=0.5, mode="select")
    try:
        by_ids = model(ids, attention_mask=mask, position_ids=pos).logits
        stats_ids = handle.last_stats.as_dict()
        embeds = model.get_input_embeddings()(ids)
        by_embeds = model(inputs_embeds=embeds, attention_mask=mask, position_ids=pos).logits
        assert torch.equal(by_ids, by_embeds)
        assert handle.last_stats.as_dict() == stats_ids
    finally:
        handle.detach()


# -- detach -------------------------------------------------------------------------------------------
@torch.no_grad()
def test_detach_restores_the_model_exactly():
    model = make_model()
    ids, mask, pos = batch()
    user_hook = model.model.layers[3].register_forward_hook(lambda *_: None)  # someone else's hook survives
    before_hooks = hooks(model)
    before_state = {k: v.clone() for k, v in model.state_dict().items()}
    stock = model(ids, attention_mask=mask, position_ids=pos).logits
    stock_gen = model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False)

    handle = tide_hf.attach(model, constant_router(model, 30.0), exit_threshold=0.5, mode="select")
    assert tide_hf.get_handle(model) is handle
    assert hooks(model) != before_hooks
    assert not torch.equal(model(ids, attention_mask=mask, position_ids=pos).logits, stock)
    model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False)
    handle.detach()

    assert tide_hf.get_handle(model) is None
    assert hooks(model) == before_hooks
    after_state = model.state_dict()
    assert after_state.keys() == before_state.keys()
    assert all(torch.equal(after_state[k], v) for k, v in before_state.items())
    assert torch.equal(model(ids, attention_mask=mask, position_ids=pos).logits, stock)
    assert torch.equal(model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False), stock_gen)
    user_hook.remove()
    assert hook_count(model) == 0

    # module-level detach, detach without a router (no-op), and attaching again all work
    handle = tide_hf.attach(model, constant_router(model, 30.0), exit_threshold=0.5, mode="select")
    tide_hf.detach(model)
    tide_hf.detach(model)
    handle.detach()
    assert hook_count(model) == 0 and tide_hf.get_handle(model) is None
    tide_hf.attach(model, constant_router(model, 30.0), mode="select").detach()
    assert hook_count(model) == 0


def test_attached_model_can_be_garbage_collected_and_handle_lives_with_it():
    import gc
    import weakref

    model = make_model()
    handle = tide_hf.attach(model, constant_router(model, 30.0), exit_threshold=0.5, mode="select")
    handle_ref = weakref.ref(handle)
    del handle
    gc.collect()
    assert tide_hf.get_handle(model) is handle_ref(), "the model's hooks keep its handle alive"
    with torch.no_grad():
        model(torch.tensor([[5, 6, 7]]))
    assert tide_hf.last_stats(model).prefill.exits == Counter({4: 3})
    model_ref = weakref.ref(model)
    del model
    gc.collect()
    assert model_ref() is None, "an attached model must not be kept alive by tide_hf's registry"
    assert handle_ref() is None


# -- errors before any work ---------------------------------------------------------------------------
@pytest.mark.parametrize("options, message", [
    ({"exit_threshold": -0.1}, "exit_threshold"),
    ({"exit_threshold": 1.5}, "exit_threshold"),
    ({"min_layers": 0}, "min_layers"),
    ({"min_layers": NUM_LAYERS + 1}, "min_layers"),
    ({"mode": "skip-everything"}, "mode"),
])
def test_bad_options_raise_before_hooks(options, message):
    model = make_model()
    with pytest.raises(ValueError, match=message):
        tide_hf.attach(model, constant_router(model, 30.0), **options)
    assert hook_count(model) == 0 and tide_hf.get_handle(model) is None


@pytest.mark.parametrize("other, differs", [
    ({"layers": 6}, ["number of layers: router 6, model 9"]),
    ({"hidden": 32}, ["hidden size: router 32, model 64"]),
    ({"layers": 6, "hidden": 32}, ["number of layers", "hidden size"]),
])
def test_router_of_another_model_is_refused(other, differs):
    model = make_model()
    router = new_router(make_model(**other))
    with pytest.raises(TideCompatibilityError) as err:
        tide_hf.attach(model, router, mode="select")
    for text in differs:
        assert text in str(err.value)
    assert hook_count(model) == 0 and tide_hf.get_handle(model) is None


def test_router_for_other_weights_needs_ignore_fingerprint():
    model = make_model(seed=0)
    router = constant_router(make_model(seed=1), 30.0)
    with pytest.raises(TideCompatibilityError, match="fingerprint"):
        tide_hf.attach(model, router, mode="select")
    assert hook_count(model) == 0
    tide_hf.attach(model, router, ignore_fingerprint=True, mode="select").detach()
    assert hook_count(model) == 0


def test_attaching_twice_is_refused_and_keeps_the_first_router():
    model = make_model()
    first = tide_hf.attach(model, constant_router(model, 30.0), exit_threshold=0.5, mode="select")
    try:
        attached = hooks(model)
        with pytest.raises(ValueError, match="already has a TIDE router"):
            tide_hf.attach(model, constant_router(model, -30.0), mode="select")
        assert hooks(model) == attached and tide_hf.get_handle(model) is first
    finally:
        first.detach()
    assert hook_count(model) == 0


# -- stats --------------------------------------------------------------------------------------------
@torch.no_grad()
def test_each_plain_forward_has_its_own_stats():
    model = make_model()
    ids, mask, pos = batch()
    handle = tide_hf.attach(model, constant_router(model, 30.0), exit_threshold=0.5, mode="select")
    try:
        model(ids, attention_mask=mask, position_ids=pos)
        first = handle.last_stats
        model(ids[:1])
        second = handle.last_stats
        assert first is not second and tide_hf.last_stats(model) is second
        assert first.prefill.exits == Counter({4: int(mask.sum())})
        assert second.prefill.exits == Counter({4: ids.shape[1]})
    finally:
        handle.detach()


@torch.no_grad()
def test_two_attached_models_keep_separate_stats():
    model_a, model_b = make_model(seed=0), make_model(seed=1)
    ids, mask, pos = batch()
    handle_a = tide_hf.attach(model_a, constant_router(model_a, 30.0), exit_threshold=0.5, min_layers=5, mode="select")
    handle_b = tide_hf.attach(model_b, constant_router(model_b, -30.0), exit_threshold=0.5, mode="select")
    try:
        model_a(ids, attention_mask=mask, position_ids=pos)
        model_b(ids[:1])
        model_a(ids[:1, :2])  # a later call on A replaces only A's stats
        assert handle_a.last_stats.prefill.exits == Counter({8: 2})
        assert handle_b.last_stats.prefill.exits == Counter({NUM_LAYERS: ids.shape[1]})
        assert tide_hf.last_stats(model_b) is handle_b.last_stats
    finally:
        handle_a.detach()
        handle_b.detach()


@torch.no_grad()
def test_summary_and_plot(tmp_path):
    model = make_model()
    ids, mask, pos = batch()
    router = mixed_router(model, ids, mask)
    exit_layer, _ = reference(model, router, ids, mask, threshold=0.5, min_layers=4)
    handle = tide_hf.attach(model, router, exit_threshold=0.5, mode="select")
    try:
        model(ids, attention_mask=mask, position_ids=pos)
        stats = handle.last_stats
    finally:
        handle.detach()
    counter, rate, mean = by_hand(exit_layer[mask.bool()])
    mode, *lines = stats.summary().splitlines()
    assert mode == "mode    select: asked for" and stats.as_dict()["mode"] == "select"
    assert lines[0].startswith("prefill") and lines[1].startswith("decode")
    assert f"{int(mask.sum())} tokens" in lines[0] and f"exit rate {rate:6.1%}" in lines[0]
    assert f"mean layers {mean:5.2f}/{NUM_LAYERS}" in lines[0]
    assert f"L4: {counter[4]}, L8: {counter[8]}" in lines[0]
    assert stats.as_dict()["prefill"]["exits"] == dict(sorted(counter.items()))
    pytest.importorskip("matplotlib")
    path = stats.plot(tmp_path / "exits.png")
    data = path.read_bytes()
    assert data.startswith(PNG_SIGNATURE) and len(data) > 1000
    # the path returned is the file written: a bare name ("exits" wrote exits.png and returned "exits"), a folder
    # (wrote folder.png beside it), another suffix (wrote a JPEG) or a missing folder are refused, nothing written
    for bad, message in (("exits", "ending in .png"), ("x.jpg", "ending in .png"), ("", "ending in .png"),
                         ("dir.png", "is a folder"), ("missing/x.png", "not an existing folder")):
        (tmp_path / "dir.png").mkdir(exist_ok=True)
        with pytest.raises(tide_hf.errors.TideArgumentError, match=message):
            stats.plot(tmp_path / bad if bad else bad)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dir.png", "exits.png"]


def test_attaching_again_reuses_the_model_checks_until_the_weights_change():
    """Skip mode's probe forward and speculative mode's depth check run once per model state: attaching again to
    the same weights runs no model forward; an in-place edit or a cast of the weights runs them again."""
    model = make_model()
    router = constant_router(model, -30.0)
    forwards = Counter()
    model.model.embed_tokens.register_forward_hook(lambda *_: forwards.update(["embed"]))
    for mode in ("skip", "speculative"):
        tide_hf.attach(model, router, mode=mode, exit_threshold=0.5).detach()
        first = forwards["embed"]
        assert first >= 1, mode  # the check ran a forward
        tide_hf.attach(model, router, mode=mode, exit_threshold=0.5).detach()
        assert forwards["embed"] == first, mode  # remembered
        with torch.no_grad():
            model.model.layers[-1].mlp.down_proj.weight.mul_(1.0)  # same values, a new version: checked again
        tide_hf.attach(model, router, mode=mode, exit_threshold=0.5, ignore_fingerprint=True).detach()
        assert forwards["embed"] > first, mode
        forwards.clear()


def test_a_router_config_edited_after_a_passing_attach_is_still_refused():
    """attach reuses a router's consistency check only while its config and weight shapes are unchanged."""
    model = make_model()
    router = constant_router(model, -30.0)
    tide_hf.attach(model, router, mode="select").detach()
    router.config.router_bottleneck_dim = 8  # the weights hold routers of width 16
    with pytest.raises(tide_hf.TideError, match="config and its weights do not agree"):
        tide_hf.attach(model, router, mode="select")
    assert tide_hf.get_handle(model) is None


def test_on_the_cpu_a_checkpoint_where_nothing_exits_makes_no_exit_state(monkeypatch):
    """Select mode with a router that scores every checkpoint and never passes: on the CPU no exit state is made
    (the exit head is work that saves nothing where no position exits) and the logits are stock's; as on an
    accelerator (`host_reads_free` False) every checkpoint makes one, without reading the device; a router that
    always passes makes them either way."""
    model = make_model()
    ids, mask = left_padded()
    with torch.no_grad():
        stock = model(input_ids=ids, attention_mask=mask).logits
    calls = Counter()
    real = tide_hf.TideRouter.exit_state

    def counted(self, *args, **kwargs):
        calls["exit_state"] += 1
        return real(self, *args, **kwargs)

    monkeypatch.setattr(tide_hf.TideRouter, "exit_state", counted)
    for free, made in ((True, False), (False, True)):
        calls.clear()
        with tide_hf.attach(model, constant_router(model, -30.0), exit_threshold=0.5, mode="select") as handle:
            assert handle.host_reads_free and handle.open_checkpoints  # scored, never passed
            handle.host_reads_free = free
            with torch.no_grad():
                logits = model(input_ids=ids, attention_mask=mask).logits
        assert (calls["exit_state"] > 0) == made, free
        torch.testing.assert_close(logits, stock, rtol=0, atol=0)
    calls.clear()
    with tide_hf.attach(model, constant_router(model, 30.0), exit_threshold=0.5, mode="select"):
        with torch.no_grad():
            model(input_ids=ids, attention_mask=mask)
    assert calls["exit_state"] > 0
