"""TIDE inside stock `generate()` and `pipeline("text-generation")`: the `tide=` keyword, decoding strategies,
per-row exits, step accounting, streamers, stopping criteria, threads.

References are computed a second way: stock generate, a truncated copy of the model, or a teacher-forced
`output_hidden_states=True` run of the stock model on the generated sequence with the router applied by hand.
"""

from __future__ import annotations

import copy
import threading
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import NUM_LAYERS, constant_router, hooks, left_padded, make_model, mixed_router, new_router, reference
from helpers import left_padded as batch
from transformers import (
    Gemma2Config,
    Gemma2ForCausalLM,
    GenerationConfig,
    LlamaForCausalLM,
    LogitsProcessorList,
    RepetitionPenaltyLogitsProcessor,
    StoppingCriteria,
    StoppingCriteriaList,
    pipeline,
)
from transformers.generation.streamers import BaseStreamer

import tide_hf
from tide_hf import TideRouter
from tide_hf.errors import TideArgumentError, TideArgumentTypeError, TideCompatibilityError

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")
NEW = 8  # new tokens per generate call

DECODING = {
    "greedy": {"do_sample": False},
    "sample": {"do_sample": True},
    "beam3": {"do_sample": False, "num_beams": 3},
    "top_k_top_p": {"do_sample": True, "top_k": 20, "top_p": 0.8, "temperature": 0.7},
    "repetition_penalty": {"do_sample": False, "repetition_penalty": 1.5},
}


# -- helpers ------------------------------------------------------------------------------------------


def truncated(model: LlamaForCausalLM, layers: int) -> LlamaForCausalLM:
    """The same weights with only the first `layers` decoder layers."""
    config = copy.deepcopy(model.config)
    config.num_hidden_layers = layers
    small = LlamaForCausalLM(config).eval()
    result = small.load_state_dict(model.state_dict(), strict=False)
    assert not result.missing_keys
    assert all(k.startswith("model.layers.") and int(k.split(".")[2]) >= layers for k in result.unexpected_keys)
    small.generation_config = copy.deepcopy(model.generation_config)
    return small


def generate(model, ids, mask, seed: int = 0, **kwargs) -> torch.Tensor:
    torch.manual_seed(seed)
    return model.generate(ids, attention_mask=mask, **{"max_new_tokens": NEW, "do_sample": False, **kwargs})


def expected_stats(model, router, ids, mask, sequences, eos: set[int], **ref):
    """Exit-layer Counters (prefill, decode) and the teacher-forced greedy tokens of a TIDE generate call.

    Prefill: every non-padding prompt position. Decode: the position fed at each later step, for rows that
    have not produced an EOS id yet.
    """
    prompt = ids.shape[1]
    full_mask = torch.cat([mask, torch.ones(ids.shape[0], sequences.shape[1] - prompt, dtype=mask.dtype)], dim=1)
    exit_layer, logits = reference(model, router, sequences, full_mask, **ref)
    prefill = Counter(exit_layer[:, :prompt][mask.bool()].tolist())
    decode, live_steps = Counter(), []
    for row in range(ids.shape[0]):
        new = sequences[row, prompt:].tolist()
        ended = next((i for i, t in enumerate(new) if t in eos), None)
        live = len(new) - 1 if ended is None else ended  # decode steps this row was still generating
        live_steps.append(live)
        decode.update(exit_layer[row, prompt:prompt + live].tolist())
    return prefill, decode, live_steps, logits


def assert_stats(stats, prefill: Counter, decode: Counter) -> None:
    for phase, counter in ((stats.prefill, prefill), (stats.decode, decode)):
        values = list(counter.elements())
        assert phase.exits == counter
        assert phase.tokens == len(values)
        if values:
            assert phase.exit_rate == pytest.approx(sum(v < NUM_LAYERS for v in values) / len(values))
            assert phase.mean_layers == pytest.approx(sum(values) / len(values))


# -- identity -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(DECODING))
def test_threshold_one_generate_is_stock(name):
    model = make_model()
    ids, mask = batch()
    options = {**DECODING[name], "output_scores": True, "return_dict_in_generate": True}
    stock = generate(model, ids, mask, **options)
    handle = tide_hf.attach(model, constant_router(model, 30.0), exit_threshold=1.0,
                            mode="select")  # score 1.0 everywhere
    try:
        for tide in (None, True):
            out = generate(model, ids, mask, tide=tide, **options)
            assert torch.equal(out.sequences, stock.sequences)
            assert len(out.scores) == len(stock.scores)
            assert all(torch.equal(a, b) for a, b in zip(out.scores, stock.scores))
        # beam search runs the prompt once per beam: every beam row is counted
        copies = DECODING[name].get("num_beams", 1)
        assert handle.last_stats.prefill.exits == Counter({NUM_LAYERS: copies * int(mask.sum())})
    finally:
        handle.detach()


@pytest.mark.parametrize("name", ["greedy", "sample", "beam3"])
def test_tide_false_on_attached_model_is_stock(name):
    model = make_model()
    ids, mask = batch()
    stock = generate(model, ids, mask, **DECODING[name])
    handle = tide_hf.attach(model, constant_router(model, 30.0), exit_threshold=0.5, mode="select")
    try:
        tide_out = generate(model, ids, mask, **DECODING[name])
        tide_stats = handle.last_stats
        assert not torch.equal(tide_out, stock), "the router must change the output for this test to mean anything"
        assert torch.equal(generate(model, ids, mask, tide=False, **DECODING[name]), stock)
        assert tide_hf.last_stats(model) is tide_stats, "a tide=False call must not replace the last TIDE stats"
        assert torch.equal(generate(model, ids, mask, **DECODING[name]), tide_out)  # still attached and active
    finally:
        handle.detach()


# -- exit semantics -----------------------------------------------------------------------------------
@pytest.mark.parametrize("min_layers, exit_at", [(4, 4), (5, 8)])
@pytest.mark.parametrize("name", ["greedy", "sample", "beam3"])
def test_always_exit_generate_equals_truncated_model(name, min_layers, exit_at):
    model = make_model()
    ids, mask = batch()
    expected = generate(truncated(model, exit_at), ids, mask, **DECODING[name])
    assert not torch.equal(expected, generate(model, ids, mask, **DECODING[name]))
    handle = tide_hf.attach(model, constant_router(model, 30.0), exit_threshold=0.5, min_layers=min_layers,
                            mode="select")
    try:
        assert torch.equal(generate(model, ids, mask, **DECODING[name]), expected)
        stats = handle.last_stats
        assert set(stats.prefill.exits) == {exit_at} and set(stats.decode.exits) == {exit_at}
        assert stats.prefill.tokens == DECODING[name].get("num_beams", 1) * int(mask.sum())  # one prompt per beam
    finally:
        handle.detach()


def test_mixed_generate_matches_teacher_forced_reference():
    """Greedy tokens are the argmax of the per-position TIDE logits computed by hand; stats match exactly."""
    model = make_model()
    model.generation_config.eos_token_id = None
    ids, mask = batch(seed=2, lengths=(6, 4, 5))
    router = mixed_router(model, ids, mask)
    handle = tide_hf.attach(model, router, exit_threshold=0.5, min_layers=4, mode="select")
    try:
        out = generate(model, ids, mask)
        stats = handle.last_stats
    finally:
        handle.detach()
    prefill, decode, live, logits = expected_stats(model, router, ids, mask, out, eos=set())
    assert live == [NEW - 1] * ids.shape[0]
    prompt = ids.shape[1]
    assert torch.equal(out[:, prompt:], logits[:, prompt - 1:-1].argmax(-1))
    assert {4, 8, NUM_LAYERS} <= set(decode) and {4, 8, NUM_LAYERS} <= set(prefill)
    assert_stats(stats, prefill, decode)


def test_decisions_are_per_row_in_generate():
    model = make_model()
    model.generation_config.eos_token_id = None
    ids, mask = batch(seed=3, lengths=(8, 6, 4, 7))
    router = mixed_router(model, ids, mask)
    handle = tide_hf.attach(model, router, exit_threshold=0.5, min_layers=4, mode="select")
    try:
        batched = generate(model, ids, mask)
        batch_stats = handle.last_stats
        per_row = []
        for row in range(ids.shape[0]):
            valid = mask[row].bool()
            alone = generate(model, ids[row:row + 1, valid], None)
            assert torch.equal(batched[row, ids.shape[1]:], alone[0, int(valid.sum()):]), f"row {row}"
            per_row.append(handle.last_stats)
    finally:
        handle.detach()
    # rows really decided differently: per-row exit counters differ, and so do the decisions at one step
    exit_layer, _ = reference(model, router, batched,
                              torch.cat([mask, torch.ones(ids.shape[0], NEW, dtype=mask.dtype)], dim=1))
    assert len({tuple(sorted(s.decode.exits.items())) for s in per_row}) > 1
    assert any(len(set(exit_layer[:, step].tolist())) > 1 for step in range(ids.shape[1], ids.shape[1] + NEW - 1))
    assert batch_stats.prefill.exits == sum((s.prefill.exits for s in per_row), Counter())
    assert batch_stats.decode.exits == sum((s.decode.exits for s in per_row), Counter())


# -- step accounting ----------------------------------------------------------------------------------
def test_rows_that_produced_eos_stop_being_counted():
    model = make_model()
    model.generation_config.eos_token_id = None
    ids, mask = batch(seed=4, lengths=(6, 6, 4))
    router = mixed_router(model, ids, mask)
    handle = tide_hf.attach(model, router, exit_threshold=0.5, min_layers=4, mode="select")
    try:
        free = generate(model, ids, mask)  # no EOS: every row runs NEW steps
        new = free[:, ids.shape[1]:].tolist()
        pad = model.generation_config.pad_token_id
        # a token one row produces early (not at its first step) and no other row produces at all
        choice = next(((row, j, tok) for j in range(1, NEW - 2) for row, toks in enumerate(new)
                       for tok in [toks[j]] if tok != pad and tok not in toks[:j]
                       and all(tok not in other for r, other in enumerate(new) if r != row)), None)
        assert choice is not None, "no row-specific early token to use as EOS"
        row, j, eos = choice
        model.generation_config.eos_token_id = eos
        out = generate(model, ids, mask)
        stats = handle.last_stats
    finally:
        handle.detach()
    prompt = ids.shape[1]
    assert torch.equal(out[row, prompt:prompt + j + 1], free[row, prompt:prompt + j + 1])
    assert (out[row, prompt + j + 1:] == pad).all()
    others = [r for r in range(ids.shape[0]) if r != row]
    assert torch.equal(out[others], free[others])
    prefill, decode, live, _ = expected_stats(model, router, ids, mask, out, eos={eos})
    assert live[row] == j and all(live[r] == NEW - 1 for r in others)
    assert stats.prefill.tokens == int(mask.sum())
    assert stats.decode.tokens == j + (NEW - 1) * len(others)
    assert_stats(stats, prefill, decode)


def test_consecutive_calls_have_independent_stats():
    model = make_model()
    model.generation_config.eos_token_id = None
    ids, mask = batch()
    handle = tide_hf.attach(model, constant_router(model, 30.0), exit_threshold=0.5, mode="select")
    try:
        generate(model, ids, mask)
        first = handle.last_stats
        generate(model, ids[:1], mask[:1], max_new_tokens=3)
        second = handle.last_stats
    finally:
        handle.detach()
    assert first is not second
    assert first.prefill.exits == Counter({4: int(mask.sum())})
    assert first.decode.exits == Counter({4: ids.shape[0] * (NEW - 1)})
    assert second.prefill.exits == Counter({4: int(mask[0].sum())})
    assert second.decode.exits == Counter({4: 2})
    assert "prefill" in second.summary() and "decode" in second.summary()


def test_two_attached_models_keep_separate_generate_stats():
    model_a, model_b = make_model(seed=0), make_model(seed=1)
    for model in (model_a, model_b):
        model.generation_config.eos_token_id = None
    ids, mask = batch()
    handle_a = tide_hf.attach(model_a, constant_router(model_a, 30.0), exit_threshold=0.5, min_layers=5, mode="select")
    handle_b = tide_hf.attach(model_b, constant_router(model_b, -30.0), exit_threshold=0.5, mode="select")
    try:
        generate(model_a, ids, mask)
        generate(model_b, ids[:1], mask[:1], max_new_tokens=2)
        assert handle_a.last_stats.decode.exits == Counter({8: ids.shape[0] * (NEW - 1)})
        assert handle_b.last_stats.prefill.exits == Counter({NUM_LAYERS: int(mask[0].sum())})
        assert handle_b.last_stats.decode.exits == Counter({NUM_LAYERS: 1})
    finally:
        handle_a.detach()
        handle_b.detach()


def _threaded(jobs) -> list:
    """Run the callables at once (after a barrier), each 3 times; return their results in order."""
    barrier = threading.Barrier(len(jobs))
    results: list = [None] * len(jobs)
    errors: list = []

    def work(i, job):
        try:
            barrier.wait()
            results[i] = [job() for _ in range(3)]
        except BaseException as exc:  # noqa: BLE001 - reported in the main thread
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i, job)) for i, job in enumerate(jobs)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=900)  # a first call may wait minutes for a kernel build
    assert not errors, errors
    return results


def test_threads_on_two_models_get_their_own_stats():
    models = [make_model(seed=0), make_model(seed=1)]
    inputs = [batch(seed=5), batch(seed=6, lengths=(4, 6))]
    handles, expected = [], []
    for model, (ids, mask) in zip(models, inputs):
        model.generation_config.eos_token_id = None
        handles.append(tide_hf.attach(model, mixed_router(model, ids, mask), exit_threshold=0.5, mode="select"))
        expected.append((generate(model, ids, mask), handles[-1].last_stats.as_dict()))
    assert expected[0][1] != expected[1][1]
    try:
        jobs = [lambda m=m, x=x: (generate(m, *x), tide_hf.last_stats(m).as_dict()) for m, x in zip(models, inputs)]
        results = _threaded(jobs)
    finally:
        for handle in handles:
            handle.detach()
    for runs, (tokens, stats) in zip(results, expected):
        for got_tokens, got_stats in runs:
            assert torch.equal(got_tokens, tokens)
            assert got_stats == stats


def test_tide_false_in_one_thread_does_not_disable_tide_in_another():
    model = make_model()
    model.generation_config.eos_token_id = None
    ids, mask = batch()
    stock = generate(model, ids, mask)
    handle = tide_hf.attach(model, constant_router(model, 30.0), exit_threshold=0.5, mode="select")
    try:
        tide_out = generate(model, ids, mask)
        tide_stats = handle.last_stats.as_dict()
        assert not torch.equal(tide_out, stock)
        results = _threaded([lambda: generate(model, ids, mask, tide=False),
                             lambda: (generate(model, ids, mask), tide_hf.last_stats(model).as_dict())])
    finally:
        handle.detach()
    assert all(torch.equal(out, stock) for out in results[0])
    for out, stats in results[1]:
        assert torch.equal(out, tide_out)
        assert stats == tide_stats


# -- streamers and stopping criteria ------------------------------------------------------------------
class Collector(BaseStreamer):
    def __init__(self) -> None:
        self.chunks: list[torch.Tensor] = []
        self.ended = False

    def put(self, value: torch.Tensor) -> None:
        self.chunks.append(value.reshape(-1).clone())

    def end(self) -> None:
        self.ended = True


class StopAfter(StoppingCriteria):
    def __init__(self, length: int) -> None:
        self.length = length

    def __call__(self, input_ids: torch.LongTensor, scores, **kwargs) -> torch.BoolTensor:
        return torch.full((input_ids.shape[0],), input_ids.shape[1] >= self.length, dtype=torch.bool)


def test_streamer_receives_the_returned_tokens():
    model = make_model()
    model.generation_config.eos_token_id = None
    ids, mask = batch(lengths=(6,))
    handle = tide_hf.attach(model, mixed_router(model, ids, mask), exit_threshold=0.5, mode="select")
    try:
        plain = generate(model, ids, mask)
        streamer = Collector()
        streamed = generate(model, ids, mask, streamer=streamer)
        stats = handle.last_stats
    finally:
        handle.detach()
    assert streamer.ended
    assert torch.equal(torch.cat(streamer.chunks), streamed[0])
    assert torch.equal(streamed, plain)
    assert stats.decode.tokens == NEW - 1 and stats.decode.exit_rate > 0


def test_custom_stopping_criterion_stops_early():
    model = make_model()
    model.generation_config.eos_token_id = None
    ids, mask = batch()
    handle = tide_hf.attach(model, constant_router(model, 30.0), exit_threshold=0.5, mode="select")
    try:
        full = generate(model, ids, mask)
        stopped = generate(model, ids, mask, stopping_criteria=StoppingCriteriaList([StopAfter(ids.shape[1] + 3)]))
        stats = handle.last_stats
    finally:
        handle.detach()
    assert stopped.shape[1] == ids.shape[1] + 3
    assert torch.equal(stopped, full[:, :ids.shape[1] + 3])
    assert stats.decode.exits == Counter({4: 2 * ids.shape[0]})


# -- errors before any work ---------------------------------------------------------------------------
def _no_work(model, call, error, match):
    before = hooks(model)
    forwards = []
    counter = model.register_forward_pre_hook(lambda *_: forwards.append(1))
    try:
        with pytest.raises(error, match=match):
            call()
    finally:
        counter.remove()
    assert forwards == [], "the error must come before any forward pass"
    assert hooks(model) == before and tide_hf.get_handle(model) is None


def test_generate_errors_come_before_any_work():
    model = make_model()
    ids, mask = batch()
    stock = hooks(model)
    _no_work(model, lambda: generate(model, ids, mask, tide=True), ValueError, "needs a router")
    _no_work(model, lambda: generate(model, ids, mask, tide=new_router(make_model(hidden=32))),
             TideCompatibilityError, "hidden size: router 32, model 64")
    _no_work(model, lambda: generate(model, ids, mask, tide=new_router(make_model(layers=6))),
             TideCompatibilityError, "number of layers: router 6, model 9")
    _no_work(model, lambda: generate(model, ids, mask, tide=3), TypeError, "tide=")
    handle = tide_hf.attach(model, constant_router(model, 30.0), mode="select")
    try:
        with pytest.raises(ValueError, match="different TIDE router"):
            generate(model, ids, mask, tide=constant_router(model, -30.0))
        assert tide_hf.get_handle(model) is handle
    finally:
        handle.detach()
    assert hooks(model) == stock


# -- pipeline -----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def word_tokenizer():
    """A 256-word WordLevel tokenizer built in code (ids line up with the tiny models' vocab)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<pad>", "<s>", "</s>", "<unk>"] + [f"w{i}" for i in range(4, 256)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>")


PROMPT = "w17 w200 w33 w150 w9"


def test_tide_config_chooses_the_options_a_per_call_router_is_attached_with(word_tokenizer):
    """`tide_config=` sets what `tide=<router>` attaches for the call (skip mode here: exits, unlike the default's
    stock tokens), in `generate` and through a pipeline; it is refused where nothing attaches for the call. (The
    keyword is enabled for the whole suite: conftest.)"""
    model = make_model()
    model.generation_config.eos_token_id = None
    enc = word_tokenizer(PROMPT, return_tensors="pt")
    router = mixed_router(model, enc["input_ids"], enc["attention_mask"], exit_threshold=0.5)
    skip = tide_hf.TideConfig(mode="skip")
    stock = model.generate(**enc, max_new_tokens=NEW, do_sample=False)
    with tide_hf.attach(model, router, config=skip):
        attached = model.generate(**enc, max_new_tokens=NEW, do_sample=False)
    assert not torch.equal(attached, stock)
    per_call = model.generate(**enc, max_new_tokens=NEW, do_sample=False, tide=router, tide_config=skip)
    assert torch.equal(per_call, attached) and tide_hf.last_stats(model).mode == "skip"
    assert tide_hf.get_handle(model) is None
    default = model.generate(**enc, max_new_tokens=NEW, do_sample=False, tide=router)
    assert torch.equal(default, stock) and tide_hf.last_stats(model).mode == "speculative"
    pipe = pipeline("text-generation", model=model, tokenizer=word_tokenizer)
    out = pipe(PROMPT, max_new_tokens=NEW, do_sample=False, return_tensors=True, tide=router, tide_config=skip)
    assert out[0]["generated_token_ids"] == attached[0].tolist()
    with pytest.raises(TideArgumentError, match="tide=None attaches nothing"):
        model.generate(**enc, max_new_tokens=NEW, tide_config=skip)
    with pytest.raises(TideArgumentTypeError, match="tide_config= takes a tide_hf.TideConfig, got dict"):
        model.generate(**enc, max_new_tokens=NEW, tide=router, tide_config={"mode": "skip"})
    with tide_hf.attach(model, router), pytest.raises(TideArgumentError, match="serves its own options"):
        model.generate(**enc, max_new_tokens=NEW, tide=router, tide_config=skip)


def test_pipeline_tide_keyword(word_tokenizer, tmp_path):
    model = make_model()
    model.generation_config.eos_token_id = None
    enc = word_tokenizer(PROMPT, return_tensors="pt")
    router = mixed_router(model, enc["input_ids"], enc["attention_mask"], exit_threshold=0.5)
    router.save_pretrained(tmp_path / "router")
    call = {"max_new_tokens": NEW, "do_sample": False, "return_tensors": True}
    stock_hooks = hooks(model)

    stock = model.generate(**enc, max_new_tokens=NEW, do_sample=False)
    handle = tide_hf.attach(model, router)  # attach's defaults, like tide= uses: speculative mode
    try:
        manual = model.generate(**enc, max_new_tokens=NEW, do_sample=False)
        manual_stats = served(handle.last_stats.as_dict())
    finally:
        handle.detach()
    assert torch.equal(manual, stock) and manual_stats["mode"] == "speculative"
    assert manual_stats["decode"]["tokens"] == NEW - 1 and manual_stats["speculative"]["fallback"] is None

    def check(output, expected, stats):
        assert output[0]["generated_token_ids"] == expected[0].tolist()
        assert hooks(model) == stock_hooks and tide_hf.get_handle(model) is None
        if stats is not None:
            assert served(tide_hf.last_stats(model).as_dict()) == stats

    tide_pipe = pipeline("text-generation", model=model, tokenizer=word_tokenizer, tide=router)
    check(tide_pipe(PROMPT, **call), manual, manual_stats)
    before = tide_hf.last_stats(model)
    check(tide_pipe(PROMPT, tide=False, **call), stock, None)
    assert tide_hf.last_stats(model) is before  # a stock call leaves the last TIDE stats alone

    plain_pipe = pipeline("text-generation", model=model, tokenizer=word_tokenizer)
    check(plain_pipe(PROMPT, **call), stock, None)
    check(plain_pipe(PROMPT, tide=router, **call), manual, manual_stats)
    check(plain_pipe(PROMPT, tide=str(tmp_path / "router"), **call), manual, manual_stats)
    # a model attached beforehand in another mode: the pipeline serves that mode (skip: the router's exits)
    handle = tide_hf.attach(model, router, mode="skip")
    try:
        skipped = model.generate(**enc, max_new_tokens=NEW, do_sample=False)
        text = plain_pipe(PROMPT, max_new_tokens=NEW, do_sample=False)[0]["generated_text"]
        assert tide_hf.last_stats(model).mode == "skip"
    finally:
        handle.detach()
    assert not torch.equal(skipped, stock)
    assert text.endswith(word_tokenizer.decode(skipped[0, enc["input_ids"].shape[1]:]))


def served(stats: dict) -> dict:
    """What a call served and counted, without the speculative policy's timings (they differ from run to run)."""
    spec = stats.get("speculative")
    return {**stats, "speculative": spec and {k: spec[k] for k in ("draft_layer", "fallback")}}


# -- SmolLM2 (real weights, real tokenizer: conftest's shared `smollm2`) ---------------------------------------
@pytest.mark.slow
@torch.no_grad()
def test_smollm2_identity_and_exit_semantics(smollm2):
    model, tokenizer = smollm2
    enc = tokenizer("The capital of France is", return_tensors="pt")
    stock = model.generate(**enc, max_new_tokens=4, do_sample=False)
    out = model(**enc, output_hidden_states=True)
    stock_hooks = hooks(model)  # after transformers installed its own output-capturing hooks
    router = new_router(model)
    for mlp in router.routers.values():
        mlp.fc2.weight.zero_()
        mlp.fc2.bias.fill_(30.0)
    handle = tide_hf.attach(model, router, exit_threshold=1.0, mode="select")
    try:
        assert torch.equal(model(**enc).logits, out.logits)
        assert torch.equal(model.generate(**enc, max_new_tokens=4, do_sample=False), stock)
    finally:
        handle.detach()
    handle = tide_hf.attach(model, router, exit_threshold=0.5, min_layers=12, mode="select")
    try:
        expected = model.lm_head(model.model.norm(out.hidden_states[12]))
        assert torch.equal(model(**enc).logits, expected)
        assert handle.last_stats.prefill.exits == Counter({12: enc["input_ids"].shape[1]})
    finally:
        handle.detach()
    assert hooks(model) == stock_hooks


def test_attaching_to_a_pipeline_points_to_its_model(word_tokenizer):
    """`attach(pipe, router)` was an AttributeError ('TextGenerationPipeline' object has no attribute 'config')."""
    from transformers import pipeline

    model = make_model()
    pipe = pipeline("text-generation", model=model, tokenizer=word_tokenizer)
    with pytest.raises(tide_hf.errors.TideArgumentTypeError,
                       match="TextGenerationPipeline; for a pipeline, pass pipe.model"):
        tide_hf.attach(pipe, new_router(model), mode="select")
    with tide_hf.attach(pipe.model, new_router(model), mode="select"):
        assert tide_hf.get_handle(model) is not None


# -- refusals and odd but valid input ---------------------------------------------------------------------------
def test_eos_as_a_0d_tensor_is_served_like_stock() -> None:
    model = make_model()
    ids, mask = left_padded()
    stock = model.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False, eos_token_id=torch.tensor(2))
    with tide_hf.attach(model, constant_router(model, -30.0), mode="select"):
        ours = model.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False,
                              eos_token_id=torch.tensor(2))
    assert torch.equal(stock, ours)



@pytest.mark.parametrize("cache", ["static", "sliding_window"])
def test_sliding_window_models_get_a_mask_per_layer_type_and_are_served_like_stock(cache: str) -> None:
    """Gemma2 (and Qwen2 with a window) receive `attention_mask` as a dict of masks per layer type under these
    caches: the hooks called `.dim()` on it and every attached call crashed."""
    torch.manual_seed(0)
    model = Gemma2ForCausalLM(Gemma2Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=9,
                                           num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                           sliding_window=4, pad_token_id=0)).eval()
    ids = torch.randint(3, 256, (2, 6), generator=torch.Generator().manual_seed(0))
    kwargs = dict(max_new_tokens=5, do_sample=False, cache_implementation=cache)
    stock = model.generate(input_ids=ids, **kwargs)
    assert torch.equal(model.generate(input_ids=ids, **kwargs, tide=constant_router(model, -30.0)), stock)
    with tide_hf.attach(model, constant_router(model, 30.0), exit_threshold=0.5, min_layers=4, mode="select") as handle:
        model.generate(input_ids=ids, **kwargs)
        assert dict(handle.last_stats.prefill.exits) == {4: ids.numel()}  # every position, no padding



def test_positional_generate_arguments_are_read_like_keywords() -> None:
    """`generate(ids, generation_config, logits_processor)` crashed (logits_processor given twice), and a
    positional config with beams slipped past recompute's refusal."""
    model = make_model()
    ids = torch.randint(3, 256, (1, 6), generator=torch.Generator().manual_seed(0))
    config = GenerationConfig(max_new_tokens=6, do_sample=False, pad_token_id=0)
    processors = LogitsProcessorList([RepetitionPenaltyLogitsProcessor(1.5)])
    stock = model.generate(ids, config, processors)
    assert torch.equal(model.generate(ids, config, processors, tide=constant_router(model, -30.0)), stock)
    beams = GenerationConfig(max_new_tokens=3, num_beams=2, do_sample=False, pad_token_id=0)
    with tide_hf.attach(model, constant_router(model, 30.0), exit_threshold=0.5, mode="skip", kv="recompute"):
        with pytest.raises(TideArgumentError, match="cannot serve num_beams=2"):
            model.generate(ids, beams)



def test_tide_naming_the_attached_routers_folder_uses_the_attached_router(tmp_path: Path) -> None:
    """A folder loads as a new object: it was refused as "a different router" although it is the same one."""
    model = make_model()
    ids, mask = left_padded()
    new_router(model, seed=1).save_pretrained(tmp_path / "same")
    new_router(model, seed=2).save_pretrained(tmp_path / "other")
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0)
    with tide_hf.attach(model, TideRouter.from_pretrained(tmp_path / "same"), exit_threshold=0.5,
                        mode="select") as handle:
        attached = model.generate(**kwargs)
        assert torch.equal(model.generate(**kwargs, tide=str(tmp_path / "same")), attached)
        assert handle.last_stats.decode.tokens > 0
        with pytest.raises(TideArgumentError, match="a different TIDE router is already attached"):
            model.generate(**kwargs, tide=str(tmp_path / "other"))



def test_a_numpy_bool_for_tide_is_named_with_its_value() -> None:
    """`tide=np.bool_(True)` was refused as 'takes True/False ...; got bool', contradicting itself."""
    model = make_model()
    with pytest.raises(TideArgumentTypeError, match=r"got np\.True_ \(bool\)"):
        model.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=2, tide=np.bool_(True))
