"""generate() features tide_hf's other tests never touch, in every mode: select, skip (kv="propagate" and
kv="recompute") and speculative.

Each feature runs twice per mode. Calm (exit threshold 1.0, nothing exits): the output must equal stock
generate's with the same arguments (and seed). Exiting (threshold 0.0: every token exits at the first
checkpoint; speculative mode drafts at every round): the call must run and show its exits or drafts, and keep
the feature's own contract (banned words never emitted, a sampled token inside the warper's support, greedy
tokens the argmax of the scores returned, ...). Where stock itself refuses a setting, TIDE must refuse it the
same way; where TIDE cannot serve one it must raise a `TideError` naming it. Greedy speculative decoding is
lossless, so there it is compared to stock with drafts too; speculative sampling draws differently from stock
once it drafts, so its calm run uses a router whose gate never opens (batch 1: then it draws stock's tokens).
"""

from __future__ import annotations

import threading
import warnings

import pytest
import torch
from helpers import constant_router, left_padded, make_model, new_router
from transformers import GenerationMixin, TextIteratorStreamer

import tide_hf
from tide_hf.errors import TideArgumentError
from tide_hf.integrations import SpeculativeFallbackWarning, draft

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")
LAYERS, HIDDEN, NEW = 6, 32, 5  # checkpoints every 2 layers: [2, 4]
STREAM_TIMEOUT_S = 900  # a stalled stream fails the test; a slow first call (kernel build) does not
MODES = {
    "select": {"mode": "select"},
    "skip-propagate": {"mode": "skip", "kv": "propagate"},
    "skip-recompute": {"mode": "skip", "kv": "recompute"},
    "speculative": {"mode": "speculative", "draft_layer": 2},
}
CALM, EXITING = 1.0, 0.0
RUNS = [pytest.param(mode, exits, id=f"{mode}-{'exiting' if exits else 'calm'}")
        for mode in MODES for exits in (False, True)]


@pytest.fixture(scope="module")
def model():
    return make_model(seed=3, hidden=HIDDEN, layers=LAYERS)


@pytest.fixture(scope="module")
def routers(model):
    """'live': scores near 0.5 (never 1.0), with a calibration prior that makes drafting pay; 'shut': never
    converged (speculative mode's gate stays shut: nothing is drafted)."""
    metrics = {"2": {"label_rates": {"top1": 0.9}}, "4": {"label_rates": {"top1": 0.9}}}
    return {"live": new_router(model, checkpoint_interval=2, metrics=metrics),
            "shut": constant_router(model, -30.0, checkpoint_interval=2)}


@pytest.fixture(autouse=True)
def always_draft(monkeypatch):
    """Speculative mode drafts 3 tokens at every round its gate opens, whatever its timings say (CPU timings of
    a shared box would make the draft-length policy, and so the test, random)."""
    monkeypatch.setattr(draft.DraftEstimates, "plan", lambda _self, room: (min(room, 3), 2.0))


class DigitTokenizer:
    """What a text streamer needs of a tokenizer: `decode` (each id as a number and a space)."""

    def decode(self, ids, **_kwargs) -> str:
        return "".join(f"{int(i)} " for i in ids)


# -- helpers ------------------------------------------------------------------------------------------
def attach(model, routers, mode: str, exits: bool, sampling: bool = False):
    """The handle of `mode`; speculative sampling in a calm run gets the shut router (see the module doc)."""
    shut = mode == "speculative" and sampling and not exits
    return tide_hf.attach(model, routers["shut" if shut else "live"], exit_threshold=EXITING if exits else CALM,
                          **MODES[mode])


def prompt(batch: int, seed: int = 0) -> dict:
    """A prompt of `batch` rows: one unpadded row, or left-padded rows with their mask."""
    if batch == 1:
        return {"input_ids": torch.randint(3, 256, (1, 6), generator=torch.Generator().manual_seed(seed))}
    ids, mask = left_padded(seed, lengths=(6, 4, 3)[:batch])
    return {"input_ids": ids, "attention_mask": mask}


def call(model, seed: int = 0, **kwargs):
    torch.manual_seed(seed)
    with torch.no_grad():
        return model.generate(**{"max_new_tokens": NEW, "do_sample": False, **kwargs})


def run(model, routers, mode: str, exits: bool, sampling: bool = False, **kwargs):
    """(output, last_stats, fallback warnings) of one generate call with the router attached."""
    with warnings.catch_warnings(record=True) as caught, attach(model, routers, mode, exits, sampling) as handle:
        warnings.simplefilter("always")
        out = call(model, **kwargs)
        stats = handle.last_stats
    return out, stats, [w for w in caught if issubclass(w.category, SpeculativeFallbackWarning)]


def check_stats(stats, mode: str, exits: bool, fallback: str | None = None, warned: list | None = None) -> None:
    """Calm: nothing exited (speculative: drafted or fell back as expected). Exiting: tokens exited, or drafts
    were made; a speculative fallback is named in the stats and warned about."""
    if mode == "speculative":
        spec = stats.speculative
        if fallback is not None:
            assert spec["fallback"] is not None and fallback in spec["fallback"], spec["fallback"]
            assert len(warned) == 1 and fallback in str(warned[0].message)  # one warning per attach and reason
        else:
            assert spec["fallback"] is None, spec["fallback"]
            assert not warned
            assert not exits or spec["drafted"] > 0
        assert stats.decode.exit_rate == 0.0  # every emitted token came from the full model
    elif exits:
        assert stats.decode.exit_rate > 0.0 and stats.prefill.exit_rate > 0.0
    else:
        assert stats.decode.exit_rate == 0.0 and stats.prefill.exit_rate == 0.0


def outcome(fn):
    """(True, result) or (False, (exception type, message)): what a call did, to compare with stock's."""
    try:
        return True, fn()
    except Exception as err:  # noqa: BLE001 - compared, not swallowed
        return False, (type(err), str(err))


def supported(out, scores) -> None:
    """Every sampled token (`out.sequences` after the prompt) has a finite processed score at its step: it lies in
    the support the warpers left (for speculative sampling: the verifier's, the full model's)."""
    new = out.sequences[:, -len(scores):]
    for step, score in enumerate(scores):
        assert torch.isfinite(score.gather(1, new[:, step: step + 1])).all(), step


# -- streamer ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode,exits", RUNS)
def test_text_iterator_streamer_in_a_thread(model, routers, mode, exits):
    def streamed(run_call) -> tuple[str, torch.Tensor]:
        """The streamed text and the output. A worker that raises still ends the stream; its error is raised
        here, and no worker outlives the test (a first call may wait minutes for a kernel build held by
        another process)."""
        streamer = TextIteratorStreamer(DigitTokenizer(), skip_prompt=True, timeout=STREAM_TIMEOUT_S)
        result = {}

        def work() -> None:
            try:
                result["out"] = run_call(streamer)
            except BaseException as err:  # noqa: BLE001 - re-raised in the test's thread
                result["error"] = err
                streamer.end()

        worker = threading.Thread(target=work)
        worker.start()
        try:
            text = "".join(streamer)
        finally:
            worker.join()
        if "error" in result:
            raise result["error"]
        return text, result["out"]

    ids = prompt(1)
    stock_text, stock = streamed(lambda s: call(model, streamer=s, **ids))
    holder = {}

    def tide_call(streamer):
        out, holder["stats"], holder["warned"] = run(model, routers, mode, exits, streamer=streamer, **ids)
        return out

    text, out = streamed(tide_call)
    assert text == DigitTokenizer().decode(out[0, ids["input_ids"].shape[1]:])  # the streamer saw what was returned
    if not exits:
        assert torch.equal(out, stock) and text == stock_text
    check_stats(holder["stats"], mode, exits, warned=holder["warned"])


# -- logits_to_keep -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode,exits", RUNS)
def test_logits_to_keep(model, routers, mode, exits):
    """`logits_to_keep=0`: every position's logits in each forward (generate then reads the last one)."""
    ids = prompt(3)
    stock = call(model, logits_to_keep=0, **ids)
    out, stats, warned = run(model, routers, mode, exits, logits_to_keep=0, **ids)
    assert out.shape == stock.shape
    if not exits or mode == "speculative":
        assert torch.equal(out, stock)
    check_stats(stats, mode, exits, warned=warned)


# -- min_p / typical_p sampling ---------------------------------------------------------------------------------
@pytest.mark.parametrize("warper", ["min_p", "typical_p"])
@pytest.mark.parametrize("mode,exits", RUNS)
def test_min_p_and_typical_p_sampling(model, routers, mode, exits, warper):
    setting = {"min_p": 0.2} if warper == "min_p" else {"typical_p": 0.5}
    ids = prompt(1, seed=4)
    kwargs = {"do_sample": True, "temperature": 1.5, "return_dict_in_generate": True, "output_scores": True,
              "seed": 7, **setting, **ids}
    stock = call(model, **kwargs)
    out, stats, warned = run(model, routers, mode, exits, sampling=True, **kwargs)
    if not exits:  # the same seed, nothing exited nor drafted: stock's draws
        assert torch.equal(out.sequences, stock.sequences)
    # the scores returned are the processed ones (temperature, then the warper): each token must be inside what
    # the warper kept; and the warper must have cut (else the test would not see a token outside it)
    supported(out, out.scores)
    assert all(bool(torch.isinf(s).any()) for s in out.scores)
    check_stats(stats, mode, exits, warned=warned)


# -- bad_words_ids / sequence_bias ------------------------------------------------------------------------------
@pytest.mark.parametrize("mode,exits", RUNS)
def test_bad_words_ids(model, routers, mode, exits):
    ids = prompt(2, seed=1)
    width = ids["input_ids"].shape[1]
    free = call(model, **ids)
    banned = [[int(free[0, width])], [int(free[1, width]), int(free[1, width + 1])]]  # one token, a pair
    stock = call(model, bad_words_ids=banned, **ids)
    assert not torch.equal(stock, free)  # precondition: the ban changes stock's output
    out, stats, warned = run(model, routers, mode, exits, bad_words_ids=banned, **ids)
    assert banned[0][0] not in out[:, width:].tolist()[0] + out[:, width:].tolist()[1]
    if not exits or mode == "speculative":
        assert torch.equal(out, stock)
    check_stats(stats, mode, exits, warned=warned)


@pytest.mark.parametrize("mode,exits", RUNS)
def test_sequence_bias(model, routers, mode, exits):
    ids = prompt(2, seed=2)
    width = ids["input_ids"].shape[1]
    free = call(model, **ids)
    bias = [[[int(free[0, width])], -100.0], [[int(free[1, width]), 7], 50.0]]  # a banned token, a favoured pair
    stock = call(model, sequence_bias=bias, **ids)
    assert not torch.equal(stock, free)
    out, stats, warned = run(model, routers, mode, exits, sequence_bias=bias, **ids)
    assert int(free[0, width]) not in out[:, width:].reshape(-1).tolist()
    if not exits or mode == "speculative":
        assert torch.equal(out, stock)
    check_stats(stats, mode, exits, warned=warned)


# -- num_return_sequences ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode,exits", RUNS)
def test_num_return_sequences(model, routers, mode, exits):
    """Sampling, two sequences per prompt. Speculative mode cannot draft them (stock assisted decoding takes one
    row): it runs stock generate, says so in its stats and warns, and so draws stock's tokens even with drafts on."""
    ids = prompt(2, seed=3)
    kwargs = {"do_sample": True, "num_return_sequences": 2, "seed": 11, **ids}
    stock = call(model, **kwargs)
    out, stats, warned = run(model, routers, mode, exits, sampling=True, **kwargs)
    assert out.shape == stock.shape == (4, ids["input_ids"].shape[1] + NEW)
    if not exits or mode == "speculative":
        assert torch.equal(out, stock)
    if mode == "speculative":
        check_stats(stats, mode, exits, fallback="several sequences per prompt", warned=warned)
    else:
        check_stats(stats, mode, exits)


# -- output_scores / output_logits ------------------------------------------------------------------------------
@pytest.mark.parametrize("mode,exits", RUNS)
def test_output_scores_and_logits(model, routers, mode, exits):
    """A left-padded batch of 3 (speculative mode decodes it row by row and re-assembles stock's layout)."""
    ids = prompt(3, seed=5)
    width = ids["input_ids"].shape[1]
    kwargs = {"return_dict_in_generate": True, "output_scores": True, "output_logits": True, "eos_token_id": None,
              **ids}  # (no row ends early: rows ending early are test_speculative_outputs.py's)
    stock = call(model, **kwargs)
    out, stats, warned = run(model, routers, mode, exits, **kwargs)
    assert len(out.scores) == len(out.logits) == NEW
    assert all(s.shape == (3, 256) for s in (*out.scores, *out.logits))
    for step, score in enumerate(out.scores):  # greedy: each token is the argmax of its step's scores
        assert torch.equal(score.argmax(-1), out.sequences[:, width + step])
    if not exits or mode == "speculative":
        assert torch.equal(out.sequences, stock.sequences)
        for mine, theirs in ((out.scores, stock.scores), (out.logits, stock.logits)):
            assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(mine, theirs))
    if mode == "speculative":  # the rows' caches as one, as long as stock's and holding its keys
        assert [layer.keys.shape for layer in out.cache.layers] == [layer.keys.shape for layer in stock.cache.layers]
        assert all(torch.allclose(a.keys, b.keys, atol=1e-5) for a, b in zip(out.cache.layers, stock.cache.layers))
    check_stats(stats, mode, exits, warned=warned)


# -- caches -----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode,exits", RUNS)
def test_quantized_cache(model, routers, mode, exits):
    pytest.importorskip("optimum.quanto")
    ids = prompt(1, seed=6)
    kwargs = {"cache_implementation": "quantized", "cache_config": {"backend": "quanto", "nbits": 4}, **ids}
    stock = call(model, **kwargs)
    out, stats, warned = run(model, routers, mode, exits, **kwargs)
    if not exits or mode == "speculative":
        assert torch.equal(out, stock)
    check_stats(stats, mode, exits, fallback="cache settings" if mode == "speculative" else None, warned=warned)


@pytest.mark.parametrize("mode,exits", RUNS)
def test_offloaded_cache(model, routers, mode, exits):
    """transformers offloads a cache to the CPU with CUDA streams: on a machine without CUDA stock refuses the
    call (a raw AssertionError of torch's), and so must the call with TIDE attached; with CUDA, equal outputs."""
    ids = prompt(1, seed=7)
    kwargs = {"cache_implementation": "offloaded", **ids}
    ok, stock = outcome(lambda: call(model, **kwargs))
    tide_ok, out = outcome(lambda: run(model, routers, mode, exits, **kwargs))
    assert tide_ok == ok, out
    if not ok:
        assert out == stock  # the same error, not one of TIDE's making
        return
    out, stats, warned = out
    if not exits or mode == "speculative":
        assert torch.equal(out, stock)
    check_stats(stats, mode, exits, fallback="cache settings" if mode == "speculative" else None, warned=warned)


# -- low_memory -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode,exits", RUNS)
def test_low_memory(model, routers, mode, exits):
    """Greedy ignores `low_memory`; beam search refuses it (stock: a ValueError since its refactor). With TIDE:
    the same output, and a ValueError for beams too (kv="recompute" refuses beams first, a TideArgumentError)."""
    ids = prompt(2, seed=8)
    stock = call(model, low_memory=True, **ids)
    out, stats, warned = run(model, routers, mode, exits, low_memory=True, **ids)
    if not exits or mode == "speculative":
        assert torch.equal(out, stock)
    check_stats(stats, mode, exits, warned=warned)
    with pytest.raises(ValueError, match="low_memory"):
        call(model, low_memory=True, num_beams=2, **ids)
    expected = TideArgumentError if MODES[mode].get("kv") == "recompute" else ValueError
    with pytest.raises(expected, match="recompute" if expected is TideArgumentError else "low_memory"):
        run(model, routers, mode, exits, low_memory=True, num_beams=2, **ids)


# -- custom_generate (contrastive search, DoLa) ------------------------------------------------------------------
def custom_greedy(model, input_ids, logits_processor, stopping_criteria, generation_config, synced_gpus=False,
                  streamer=None, **model_kwargs):
    """A decoding method passed as `custom_generate` (what the Hub's contrastive search and DoLa are, loaded from
    their repos): here stock's own sampling loop, so its output is stock greedy's."""
    return GenerationMixin._sample(model, input_ids, logits_processor, stopping_criteria, generation_config,
                                   synced_gpus, streamer, **model_kwargs)


@pytest.mark.parametrize("mode,exits", RUNS)
def test_custom_generate_callable(model, routers, mode, exits):
    """Contrastive search and DoLa live on the Hub (`custom_generate="transformers-community/..."`, with
    trust_remote_code): not reachable offline. What is testable here: a callable `custom_generate`, and the
    deprecated settings that name those repos, which must fail as stock fails (they need trust_remote_code)."""
    ids = prompt(2, seed=9)
    for deprecated, reason in (({"penalty_alpha": 0.6, "top_k": 4}, "contrastive"), ({"dola_layers": "low"}, "DoLa")):
        with pytest.raises(ValueError, match="trust_remote_code"):
            call(model, **deprecated, **ids)
        with attach(model, routers, mode, exits) as handle:
            with pytest.raises(ValueError, match="trust_remote_code"):
                call(model, **deprecated, **ids)
            if mode == "speculative":  # stock ran (and refused): named in the stats
                assert reason in handle.last_stats.speculative["fallback"]
    stock = call(model, custom_generate=custom_greedy, **ids)
    if MODES[mode].get("kv") == "recompute":  # its waiting tokens live outside the cache a custom loop manages
        with pytest.raises(TideArgumentError, match="custom_generate"):
            run(model, routers, mode, exits, custom_generate=custom_greedy, **ids)
        return
    out, stats, warned = run(model, routers, mode, exits, custom_generate=custom_greedy, **ids)
    if not exits or mode == "speculative":
        assert torch.equal(out, stock)
    check_stats(stats, mode, exits, fallback="custom_generate" if mode == "speculative" else None, warned=warned)
