"""attach / detach / TideHandle on plain forwards: identity, exit semantics, per-row decisions, stats, errors.

Every expectation is computed a second way: from an `output_hidden_states=True` run of the stock model
(hidden_states[k] is the output of layer k for k < num_layers) and the router applied by hand.
"""

from __future__ import annotations

import math
import warnings
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import (
    CLOSED_PATH,
    HOOK_DICTS,
    NUM_LAYERS,
    constant_router,
    hooks,
    left_behind,
    left_padded,
    make_model,
    mixed_router,
    new_router,
    positions,
    reference,
    stock_state,
)

import tide_hf
import tide_hf.calibration  # (not imported by `import tide_hf`: its lazy API loads it on first use)
from tide_hf import TideRouter
from tide_hf.errors import (
    TideArgumentError,
    TideArgumentTypeError,
    TideCompatibilityError,
    TideRouterFileError,
    TideTargetError,
    TideUnsupportedError,
)

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


# -- refusals and odd but valid input ---------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs,error,message", [
    (dict(min_agreement="0.9"), TideArgumentTypeError, "min_agreement must be a number"),
    (dict(min_agreement=True), TideArgumentTypeError, "min_agreement must be a number"),
    (dict(confidence="x", min_agreement=0.9), TideArgumentTypeError, "confidence must be a number"),
    (dict(max_perplexity_increase=math.inf), TideTargetError, "finite number"),
    (dict(exit_threshold=0.5, confidence=0.9), TideArgumentError, "not both"),
    (dict(ignore_fingerprint="no"), TideArgumentTypeError, "ignore_fingerprint must be True or False"),
    (dict(mode="speculative", draft_layer=5), TideArgumentError, "draft_layer=5 has no router"),
])
def test_attach_refuses_bad_targets_before_touching_the_model(kwargs, error, message) -> None:
    model = make_model()
    router = new_router(model, exit_paths={"agreement": CLOSED_PATH, "perplexity": CLOSED_PATH})
    before = hooks(model)
    with pytest.raises(error, match=message):
        tide_hf.attach(model, router, **kwargs)
    assert hooks(model) == before and tide_hf.runtime.get_handle(model) is None



def test_deliberate_errors_are_tide_errors() -> None:
    model = make_model()
    router = new_router(model)
    with tide_hf.attach(model, router, mode="select"):
        with pytest.raises(TideArgumentError, match="already has a TIDE router"):
            tide_hf.attach(model, router, mode="select")
    with pytest.raises(TideArgumentError, match="needs a router"):
        model.generate(torch.tensor([[5, 6]]), max_new_tokens=1, tide=True)
    with pytest.raises(TideArgumentTypeError, match="tide= takes"):
        model.generate(torch.tensor([[5, 6]]), max_new_tokens=1, tide=3)



def test_a_forward_that_raised_does_not_cost_the_next_call_its_stats() -> None:
    model = make_model()
    ids, mask = left_padded()
    with tide_hf.attach(model, constant_router(model, -30.0), mode="select") as handle:
        expected = None
        for attempt in range(2):
            if attempt:  # a plain forward that raises inside the model, before TIDE's end hook
                boom = model.model.layers[2].register_forward_hook(lambda *_: (_ for _ in ()).throw(KeyError("boom")))
                with pytest.raises(KeyError, match="boom"):
                    model(input_ids=ids, attention_mask=mask)
                boom.remove()
            model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False)
            counts = (handle.last_stats.prefill.tokens, handle.last_stats.decode.tokens)
            expected = expected or counts
            assert counts == expected and counts[1] > 0



def test_compatibility_errors_are_tide_errors() -> None:
    class NoLayers(torch.nn.Module):
        config = make_model().config

    with pytest.raises(TideCompatibilityError):
        tide_hf.attach(NoLayers(), new_router(make_model()), mode="select")



def test_copying_an_attached_model_is_refused_with_the_way_out() -> None:
    """torch.save(model), pickle and copy.copy failed on a hook's local function with an AttributeError."""
    import copy
    import io
    import pickle

    model = make_model()
    for mode in ("select", "skip"):
        with tide_hf.attach(model, constant_router(model, -30.0), mode=mode, exit_threshold=0.5):
            for copying in (copy.deepcopy, copy.copy, pickle.dumps, lambda m: torch.save(m, io.BytesIO())):
                with pytest.raises(TideArgumentError, match="cannot be deep-copied, copied or pickled"):
                    copying(model)
            copy.deepcopy(model.state_dict())  # its weights copy as they are
    assert isinstance(copy.deepcopy(model), type(model))  # detached: copies as stock
    assert isinstance(pickle.loads(pickle.dumps(model)), type(model)) and "__reduce_ex__" not in vars(model)



def test_weights_loaded_while_attached_are_served_as_a_new_attach_would_serve_them() -> None:
    """load_state_dict of a fine-tune while attached kept serving the router, and its certified target, on
    weights a fresh attach refuses; a cast keeps the weights (and the fingerprint)."""
    model, other = make_model(seed=0), make_model(seed=1)
    ids, mask = left_padded()
    own = {k: v.clone() for k, v in model.state_dict().items()}
    router = new_router(model, exit_paths={"agreement": CLOSED_PATH}, min_agreement=0.9)
    with tide_hf.attach(model, router, mode="select") as handle:
        expected = model.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False)
        model.load_state_dict(other.state_dict())
        before = hooks(model)
        for call in (lambda: model.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False),
                     lambda: model(ids, attention_mask=mask)):
            with pytest.raises(TideCompatibilityError, match="weights changed while the router was attached"):
                call()
        assert hooks(model) == before and tide_hf.get_handle(model) is handle
        model.load_state_dict(own)  # its own weights again (and a cast keeps them): served as before
        assert torch.equal(model.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False), expected)
        model.to(torch.float64)
        model.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False)
    model.to(torch.float32)
    with tide_hf.attach(model, router, ignore_fingerprint=True, mode="select"):
        model.load_state_dict(other.state_dict())
        with pytest.warns(UserWarning, match="weights changed while attached: the quality target"):
            model.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # said once per change
            model.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False)



def test_a_training_forward_while_attached_is_refused() -> None:
    """model.train() and a loss with gradients trained on TIDE's exit logits (loss and gradients not stock's)."""
    model = make_model()
    ids = torch.tensor([[17, 99, 45, 3, 200, 31, 7]])
    with tide_hf.attach(model, constant_router(model, 30.0), exit_threshold=0.5, min_layers=4, mode="select"):
        model.train()
        with pytest.raises(TideUnsupportedError, match="a training forward .* while TIDE is attached"):
            model(ids, labels=ids)
        with torch.no_grad():  # generate in train mode (no gradients) is served
            model.generate(ids, max_new_tokens=2, do_sample=False)
        model.eval()
        model(ids, labels=ids).loss.backward()  # eval mode with gradients (attributions): TIDE's logits
    model.train()
    model(ids, labels=ids).loss.backward()  # detached: stock
    model.eval()



def test_a_peft_style_wrapper_is_refused_with_the_model_to_attach_to() -> None:
    """peft's PeftModel holds the causal LM (`get_base_model()`): the error named a layer path that exists."""
    class Wrapper(torch.nn.Module):  # what PeftModel exposes to tide_hf (peft is not a dependency)
        def __init__(self, inner: torch.nn.Module) -> None:
            super().__init__()
            self.base_model, self.config = inner, inner.config

        def get_base_model(self) -> torch.nn.Module:
            return self.base_model

    model = make_model()
    router = new_router(model)
    with pytest.raises(TideCompatibilityError, match=r"attach to model.get_base_model\(\)"):
        tide_hf.attach(Wrapper(model), router, mode="select")
    with tide_hf.attach(Wrapper(model).get_base_model(), router, exit_threshold=1.0, mode="select"):
        assert tide_hf.get_handle(model) is not None



def test_attach_takes_a_router_folder_and_names_missing_paths(tmp_path: Path) -> None:
    """`attach(model, "my-router")` failed with a bare AttributeError (`tide="my-router"` took it); a router folder
    or a calibration file named as a path that does not exist is a FileNotFoundError, never a Hub lookup."""
    from tide_hf.errors import TideMissingError, TideMissingRouterError

    model = make_model()
    ids, mask = left_padded()
    router = constant_router(model, 30.0)
    router.save_pretrained(tmp_path / "r")
    with tide_hf.attach(model, router, exit_threshold=0.5, mode="select"):
        expected = model.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False)
    with tide_hf.attach(model, str(tmp_path / "r"), exit_threshold=0.5, mode="select") as handle:
        assert isinstance(handle.router, TideRouter)
        assert torch.equal(model.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False), expected)
    with pytest.raises(TideArgumentTypeError, match="router must be a TideRouter, a router folder or a Hub repo id"):
        tide_hf.attach(model, 123, mode="select")
    with pytest.raises(TideMissingRouterError, match="no TIDE router folder at") as caught:
        tide_hf.attach(model, str(tmp_path / "nothing"), mode="select")
    assert isinstance(caught.value, FileNotFoundError) and isinstance(caught.value, TideRouterFileError)
    with pytest.raises(TideMissingRouterError, match="no TIDE router folder at"):
        tide_hf.attach(model, tmp_path / "nothing", mode="select")  # a Path object is a path, whatever its spelling
    # a bare name is no Hub repo id: it went to the Hub (~25 s of retries offline, then transformers' OSError)
    with pytest.raises(TideMissingRouterError, match=r"no TIDE router folder named 'my-routr' here .*'owner/name'"):
        tide_hf.attach(model, "my-routr", mode="select")
    for missing in (str(tmp_path / "nofile.txt"), "./nofile.jsonl", "~/no/such/folder", tmp_path / "folder"):
        with pytest.raises(TideMissingError, match="no such file or folder"):
            tide_hf.calibration.load_texts(missing)



def test_what_is_not_a_model_is_named() -> None:
    """A model id or None was a raw TypeError from the registry's weak references (a pipeline: see
    test_generate.py); a bad handle_class was a TypeError from calling it."""
    model = make_model()
    router = new_router(model)
    for bad in (None, "HuggingFaceTB/SmolLM2-135M"):
        for call in (lambda: tide_hf.attach(bad, router, mode="select"), lambda: tide_hf.detach(bad),
                     lambda: tide_hf.last_stats(bad)):
            with pytest.raises(TideArgumentTypeError, match=r"model must be a torch.nn.Module .*got (NoneType|str)"):
                call()
    with pytest.raises(TideArgumentTypeError, match="handle_class must be a TideHandle subclass, got <class 'int'>"):
        tide_hf.integrations.attach_with(int, model, router)
    assert tide_hf.get_handle(model) is None and hooks(model) == hooks(make_model())



def test_any_real_exit_threshold_is_served_as_the_float():
    """`exit_threshold=Fraction(1, 2)` passed the number check, was kept as a Fraction, and the first forward
    failed comparing tensors with it."""
    from fractions import Fraction

    model = make_model()
    ids, mask = left_padded()
    router = mixed_router(model, ids, mask)
    runs = []
    for value in (0.5, Fraction(1, 2), np.float32(0.5)):
        with tide_hf.attach(model, router, exit_threshold=value, mode="select") as handle:
            assert type(handle.options.exit_threshold) is float
            runs.append((model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False),
                         handle.last_stats.as_dict()))
    assert all(torch.equal(out, runs[0][0]) and stats == runs[0][1] for out, stats in runs)



def test_a_model_without_weights_is_named_before_any_forward() -> None:
    """A model built under accelerate's `init_empty_weights` and never loaded: with ignore_fingerprint=True, select
    attach accepted it (generate then failed inside the model) and skip attach and calibration failed with a raw
    'Tensor.item() cannot be called on meta tensors'."""
    from accelerate import init_empty_weights

    model = make_model()
    router = new_router(model)
    with init_empty_weights():
        empty = type(model)(model.config).eval()
    message = r"parameter model\.embed_tokens\.weight is on the meta device and no accelerate offload hook"
    for mode in ("select", "skip", "speculative"):
        for ignore in (False, True):
            with pytest.raises(TideCompatibilityError, match=message):
                tide_hf.attach(empty, router, mode=mode, ignore_fingerprint=ignore)
            assert tide_hf.get_handle(empty) is None
    with pytest.raises(TideCompatibilityError, match=message):
        tide_hf.calibration.calibrate_tokens(empty, [torch.arange(3, 20)] * 4, progress=False, num_epochs=1)



@pytest.mark.parametrize(("options", "message"), [
    (dict(mode="select", kv="recompute"), r"kv='recompute' applies to mode='skip' only"),
    (dict(mode="speculative", kv="propagate"), r"kv='propagate' applies to mode='skip' only"),
    (dict(mode="select", draft_layer=4), r"draft_layer=4 applies to mode='speculative' only"),
    (dict(mode="skip", draft_layer=4), r"draft_layer=4 applies to mode='speculative' only"),
])
def test_an_option_the_mode_never_reads_is_refused(options: dict, message: str) -> None:
    """kv= in select / speculative mode and draft_layer= outside speculative mode were accepted and ignored."""
    model = make_model()
    with pytest.raises(TideArgumentError, match=message):
        tide_hf.attach(model, new_router(model), **options)
    assert tide_hf.get_handle(model) is None


def test_the_removed_park_rows_is_named_as_removed() -> None:
    """park_rows= (removed) is refused as removed, with why, not as an unknown option or silently ignored."""
    model = make_model()
    for value in (True, False):
        with pytest.raises(TideArgumentTypeError, match=r"option 'park_rows' was removed: .*kv='recompute'"):
            tide_hf.attach(model, new_router(model), mode="skip", park_rows=value)
    assert tide_hf.get_handle(model) is None


def test_the_shared_model_check_names_what_a_test_leaves_behind() -> None:
    """conftest's after-test check of the shared SmolLM2 (`helpers.left_behind`) names an attached router and its
    patches, a hook, train mode and a weight written in place, and nothing once each is undone (or detached)."""
    model = make_model()
    stock = stock_state(model)
    assert left_behind(model, stock) == []
    handle = tide_hf.attach(model, constant_router(model, -30.0), mode="skip", exit_threshold=0.5)
    found = left_behind(model, stock)
    assert found[0] == "a TIDE handle is still attached" and any("attributes added" in f for f in found[1:]), found
    handle.detach()
    assert left_behind(model, stock) == []
    hook = model.model.layers[0].mlp.register_forward_hook(lambda *_: None)
    assert [f.split(":")[0] for f in left_behind(model, stock)] == ["model.layers.0.mlp._forward_hooks"]
    hook.remove()
    model.model.norm.train()
    assert left_behind(model, stock) == ["model.norm left in train mode"]
    model.eval()
    weight = model.lm_head.weight
    original = float(weight[0, 0])
    with torch.no_grad():
        weight[0, 0] = original + 1.0
        assert left_behind(model, stock) == ["parameter lm_head.weight written in place and not restored"]
        weight[0, 0] = original
    assert left_behind(model, stock) == []
