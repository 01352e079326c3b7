"""Speculative mode's outputs beyond plain sequences, and its fallbacks to stock generate.

References: stock generate on the same model and arguments. A batch decoded row by row must come back in stock
batched generate's layout (`return_dict_in_generate`: sequences, per-step scores / logits / hidden states, the
cache), equal to stock at every step a row was still generating; a prompt given as `inputs_embeds` is drafted
and answered as stock answers it; every call says in `last_stats.speculative["fallback"]` whether it fell back
(and why), with one `SpeculativeFallbackWarning` per reason and attach.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from helpers import make_tiny_llama
from transformers import TextIteratorStreamer

import tide_hf
from tide_hf import TideRouter, TideRouterConfig
from tide_hf.compat import CACHE_KWARG
from tide_hf.integrations import SpeculativeFallbackWarning, draft

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")
LAYERS, NEW = 6, 8


@pytest.fixture(scope="module")
def model():
    """A tiny Llama whose layers after 2 barely write to the residual stream: layer-2 drafts are mostly right."""
    model = make_tiny_llama(num_layers=LAYERS, hidden=32, seed=1)
    with torch.no_grad():
        for layer in model.model.layers[2:]:
            layer.self_attn.o_proj.weight.mul_(1e-3)
            layer.mlp.down_proj.weight.mul_(1e-3)
    return model


@pytest.fixture(scope="module")
def router(model) -> TideRouter:
    """Converged everywhere (the gate always open), with a prior that makes drafting pay."""
    router = TideRouter(TideRouterConfig(
        hidden_size=model.config.hidden_size, num_hidden_layers=LAYERS, router_bottleneck_dim=8, checkpoint_interval=2,
        base_architecture=type(model).__name__, base_fingerprint=tide_hf.modeling.model_fingerprint(model),
        metrics={"2": {"label_rates": {"top1": 0.9}}}, exit_head="lens"))
    with torch.no_grad():
        for mlp in router.routers.values():
            mlp.fc2.weight.zero_()
            mlp.fc2.bias.fill_(30.0)
    return router


@pytest.fixture(autouse=True)
def always_draft(monkeypatch):
    """Draft 3 tokens every round (the timing-driven policy would make these tests depend on the machine)."""
    monkeypatch.setattr(draft.DraftEstimates, "plan", lambda _self, room: (min(room, 3), 2.0))


def prompts(seed: int = 0, lengths=(7, 5, 3)) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids, mask = torch.zeros(len(lengths), width, dtype=torch.long), torch.zeros(len(lengths), width, dtype=torch.long)
    for row, n in enumerate(lengths):
        ids[row, width - n:] = torch.randint(3, 256, (n,), generator=gen)
        mask[row, width - n:] = 1
    return ids, mask


def stock(model, *args, **kwargs):
    with torch.no_grad():
        return model.generate(*args, **{"max_new_tokens": NEW, "do_sample": False, **kwargs})


def speculative(model, router, *args, **kwargs):
    """(output, last_stats.speculative, fallback warnings) of one speculative call."""
    with warnings.catch_warnings(record=True) as caught, \
            tide_hf.attach(model, router, mode="speculative", draft_layer=2, exit_threshold=0.5) as handle:
        warnings.simplefilter("always")
        out = stock(model, *args, **kwargs)
        spec = handle.last_stats.speculative
    return out, spec, [w for w in caught if issubclass(w.category, SpeculativeFallbackWarning)]


# -- return_dict_in_generate with several rows ------------------------------------------------------------------
def test_a_batch_with_rows_ending_early_is_laid_out_like_stock(model, router):
    ids, mask = prompts(3)
    width = ids.shape[1]
    free = stock(model, ids, attention_mask=mask, eos_token_id=None)
    eos = int(free[1, width + 2])  # row 1 ends after 3 new tokens (earlier if the id comes before)
    kwargs = {"attention_mask": mask, "eos_token_id": eos, "pad_token_id": 0, "return_dict_in_generate": True,
              "output_scores": True, "output_logits": True, "output_hidden_states": True}
    want = stock(model, ids, **kwargs)
    out, spec, warned = speculative(model, router, ids, **kwargs)
    assert spec["fallback"] is None and not warned and spec["drafted"] > 0
    assert type(out) is type(want) and set(out.keys()) == set(want.keys())
    assert torch.equal(out.sequences, want.sequences)
    new = want.sequences[:, width:]
    ended = torch.isin(new, torch.tensor([eos])).cumsum(1)
    alive = torch.cat([torch.ones(3, 1, dtype=torch.bool), ended[:, :-1] == 0], dim=1)  # generating at step t
    assert not alive[1].all() and alive[0].all()  # precondition: row 1 ended early, row 0 did not
    for name in ("scores", "logits"):
        assert len(out[name]) == len(want[name])
        for t, (a, b) in enumerate(zip(out[name], want[name])):
            assert a.shape == b.shape
            assert torch.allclose(a[alive[:, t]], b[alive[:, t]], atol=1e-5), (name, t)
            if not alive[:, t].all():  # a row that ended emits the pad id with certainty
                filled = a[~alive[:, t]]
                assert (filled[:, 0] == 0).all() and torch.isinf(filled[:, 1:]).all()
    assert len(out.hidden_states) == len(want.hidden_states)
    for t, (mine, theirs) in enumerate(zip(out.hidden_states, want.hidden_states)):
        assert len(mine) == len(theirs) == LAYERS + 1
        for a, b in zip(mine, theirs):
            assert a.shape == b.shape and torch.allclose(a[alive[:, t]], b[alive[:, t]], atol=1e-5), t
    # the cache: every layer as long as stock's, stock's keys and values where a row was still generating, zeros after
    lengths = {layer.keys.shape for layer in out.cache.layers}
    assert lengths == {layer.keys.shape for layer in want.cache.layers} and len(lengths) == 1
    fed = width + alive.sum(1) - 1  # positions each row fed
    for mine, theirs in zip(out.cache.layers, want.cache.layers):
        for row in range(3):
            n = int(fed[row])
            assert torch.allclose(mine.keys[row, :, :n], theirs.keys[row, :, :n], atol=1e-5)
            assert torch.allclose(mine.values[row, :, :n], theirs.values[row, :, :n], atol=1e-5)
            assert not mine.keys[row, :, n:].any()


def test_the_returned_cache_continues_like_stocks(model, router):
    """Rows that all run to the end: the re-assembled cache is stock's, so a stock call continuing from it (the
    sequences and the cache given back) gives stock's continuation."""
    ids, mask = prompts(1)
    kwargs = {"attention_mask": mask, "eos_token_id": None, "return_dict_in_generate": True}
    want = stock(model, ids, **kwargs)
    out, spec, _ = speculative(model, router, ids, **kwargs)
    assert spec["fallback"] is None and torch.equal(out.sequences, want.sequences)
    grown = torch.cat([mask, torch.ones(3, NEW, dtype=mask.dtype)], dim=1)
    go_on = {"attention_mask": grown, "eos_token_id": None, "max_new_tokens": 4}
    assert torch.equal(stock(model, out.sequences, **{CACHE_KWARG: out.cache}, **go_on),
                       stock(model, want.sequences, **{CACHE_KWARG: want.cache}, **go_on))


# -- inputs_embeds -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("rows", [1, 3])
def test_inputs_embeds_are_drafted_and_equal_stock(model, router, rows):
    ids, mask = prompts(2)
    ids, mask = ids[:rows], mask[:rows]
    if rows == 1:
        ids, mask = ids[:, -int(mask.sum()):], None
    embeds = model.get_input_embeddings()(ids).detach()
    masked = {} if mask is None else {"attention_mask": mask}
    for extra in ({}, {"return_dict_in_generate": True, "output_scores": True}):
        want = stock(model, inputs_embeds=embeds, **masked, **extra)
        out, spec, warned = speculative(model, router, inputs_embeds=embeds, **masked, **extra)
        assert spec["fallback"] is None and not warned and spec["drafted"] > 0
        if extra:
            assert torch.equal(out.sequences, want.sequences) and len(out.scores) == len(want.scores)
            assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(out.scores, want.scores))
        else:
            assert out.shape == (rows, NEW) and torch.equal(out, want)  # the new tokens only, as stock returns them
    # input_ids beside the embeddings (a soft prompt): stock keeps the ids as the sequences' prompt
    want = stock(model, ids, inputs_embeds=embeds, **masked)
    out, spec, _ = speculative(model, router, ids, inputs_embeds=embeds, **masked)
    assert spec["fallback"] is None and torch.equal(out, want)


def test_inputs_embeds_streamer_gets_no_prompt(model, router):
    class Digits:
        def decode(self, ids, **_kwargs):
            return "".join(f"{int(i)} " for i in ids)

    ids = prompts(4)[0][:1]
    embeds = model.get_input_embeddings()(ids).detach()
    texts = []
    for run in (stock, lambda *a, **k: speculative(model, router, *a, **k)[0]):
        streamer = TextIteratorStreamer(Digits(), skip_prompt=False)  # a placeholder prompt would be printed
        out = run(model, inputs_embeds=embeds, streamer=streamer) if run is stock else \
            run(inputs_embeds=embeds, streamer=streamer)
        texts.append(("".join(streamer), out))
    assert texts[0][0] == texts[1][0] == Digits().decode(texts[0][1][0])
    assert torch.equal(texts[0][1], texts[1][1])


def test_inputs_embeds_with_settings_reading_prompt_ids_fall_back(model, router):
    ids = prompts(5)[0][:1]
    embeds = model.get_input_embeddings()(ids).detach()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # stock warns that the penalty sees no prompt
        want = stock(model, inputs_embeds=embeds, repetition_penalty=1.3)
    out, spec, warned = speculative(model, router, inputs_embeds=embeds, repetition_penalty=1.3)
    assert torch.equal(out, want) and "repetition_penalty" in spec["fallback"]
    assert len(warned) == 1 and "repetition_penalty" in str(warned[0].message)


# -- fallbacks: named on every call, warned once per reason --------------------------------------------------------
def test_every_call_records_whether_it_fell_back_and_warns_once_per_reason(model, router):
    ids, mask = prompts(6)
    calls = [  # (kwargs, the reason's words or None for a drafted call)
        ({"num_beams": 2}, "beam search"),
        ({"num_beams": 2}, "beam search"),  # the same reason: no second warning
        ({}, None),
        ({"output_attentions": True, "return_dict_in_generate": True}, "output_attentions"),
        ({"assistant_early_exit": 4, "rows": 1}, "another assisted-decoding method"),  # (stock takes 1 row)
        ({"num_beams": 2}, "beam search"),
    ]
    with warnings.catch_warnings(record=True) as caught, \
            tide_hf.attach(model, router, mode="speculative", draft_layer=2, exit_threshold=0.5) as handle:
        warnings.simplefilter("always")
        for kwargs, reason in calls:
            rows = kwargs.pop("rows", 3)
            stock(model, ids[:rows], attention_mask=mask[:rows], **kwargs)
            fallback = handle.last_stats.speculative["fallback"]
            assert (fallback is None) == (reason is None) and (reason is None or reason in fallback), fallback
    messages = [str(w.message) for w in caught if issubclass(w.category, SpeculativeFallbackWarning)]
    assert len(messages) == 3 and [any(r in m for m in messages) for r in
                                   ("beam search", "output_attentions", "another assisted")] == [True] * 3
    assert all(w.filename == __file__ for w in caught if issubclass(w.category, SpeculativeFallbackWarning))
    with warnings.catch_warnings(record=True) as caught:  # a new attach: told again
        warnings.simplefilter("always")
        _, spec, warned = speculative(model, router, ids, attention_mask=mask, num_beams=2)
    assert "beam search" in spec["fallback"] and len(warned) == 1

