"""Calibration on the model's own text (`continuation`): continuations equal stock generate, end at the model's
end-of-sequence token, are seeded per batch (so a launcher's process split writes the same text), leave the
caller's random state alone, and calibrate() on them equals calibrate_tokens() on the same tokens written out."""

from __future__ import annotations

import pytest
import torch
from helpers import make_tiny_llama

from tide_hf import TideRouter, TideRouterConfig
from tide_hf.calibration import calibrate_tokens
from tide_hf.calibration import continuations as cont
from tide_hf.calibration.continuations import continue_samples
from tide_hf.errors import TideArgumentError

PROMPT = 6
FAST = dict(num_epochs=2, router_bottleneck_dim=8, label="top1", progress=False)


@pytest.fixture(scope="module")
def model():
    m = make_tiny_llama()
    m.generation_config.eos_token_id = None  # no early end unless a test sets one
    return m


def corpus(n: int = 7, seed: int = 0) -> list[torch.Tensor]:
    """Token samples of uneven lengths: two no longer than the prompt, the rest longer."""
    gen = torch.Generator().manual_seed(seed)
    lengths = [20, 4, 17, 20, PROMPT, 12, 20][:n]
    return [torch.randint(3, 256, (k,), generator=gen) for k in lengths]


def config(kind: str, **kw) -> TideRouterConfig:
    return TideRouterConfig(hidden_size=32, num_hidden_layers=9, continuation=kind, continuation_prompt_len=PROMPT,
                            **kw)


def stock_greedy(model, sample: torch.Tensor) -> torch.Tensor:
    """One prompt through stock generate, alone: the independent reference."""
    ids = sample[None, :PROMPT]
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=len(sample) - PROMPT,
                         do_sample=False, pad_token_id=0)
    return out[0]


def test_greedy_continuations_are_stock_generate_one_prompt_at_a_time(model) -> None:
    samples = corpus()
    written, seconds = continue_samples(model, samples, config("greedy"), batch_size=3, pad_id=0, progress=False)
    assert seconds > 0
    for s, w in zip(samples, written):
        if len(s) <= PROMPT:
            assert torch.equal(w, s)  # nothing to write
        else:
            assert len(w) == len(s) and torch.equal(w[:PROMPT], s[:PROMPT])
            assert torch.equal(w, stock_greedy(model, s))
            assert not torch.equal(w, s)  # the corpus tail really was replaced


def test_continuations_of_a_model_with_a_router_attached_are_stock(model) -> None:
    """With a router attached (exiting every token at layer 4) the continuations were written by the early-exiting
    model, so calibration labelled text stock generate never writes."""
    from helpers import constant_router

    import tide_hf

    samples = corpus()
    with tide_hf.attach(model, constant_router(model, 30.0), exit_threshold=0.5, mode="select"):
        written, _ = continue_samples(model, samples, config("greedy"), batch_size=3, pad_id=0, progress=False)
    for s, w in zip(samples, written):
        assert torch.equal(w, s if len(s) <= PROMPT else stock_greedy(model, s))


def test_a_continuation_ends_at_the_models_end_token(model) -> None:
    samples = corpus()
    written, _ = continue_samples(model, samples, config("greedy"), batch_size=8, pad_id=0, progress=False)
    end = int(written[0][PROMPT + 3])  # the 4th token the model writes after the first prompt
    model.generation_config.eos_token_id = [end, 255]
    try:
        ended, _ = continue_samples(model, samples, config("greedy"), batch_size=8, pad_id=0, progress=False)
    finally:
        model.generation_config.eos_token_id = None
    first = int((written[0][PROMPT:] == end).nonzero()[0])
    assert torch.equal(ended[0], written[0][: PROMPT + first + 1])  # up to and including the end token
    for w, e in zip(written, ended):  # every row is its uncut text, cut after its first end token if any
        tail = w[PROMPT:] if len(w) > PROMPT else w[:0]
        hits = torch.isin(tail, torch.tensor([end, 255])).nonzero()
        assert torch.equal(e, w if len(hits) == 0 else w[: PROMPT + int(hits[0]) + 1])


def test_sampled_continuations_are_seeded_per_batch_and_leave_the_callers_random_state(model, monkeypatch) -> None:
    samples = corpus()
    model.generation_config.top_k = 1  # the model's generation config would make sampling greedy: ignored
    try:
        state = torch.get_rng_state()
        first, _ = continue_samples(model, samples, config("sample"), batch_size=3, pad_id=0, progress=False)
        assert torch.equal(torch.get_rng_state(), state)
        again, _ = continue_samples(model, samples, config("sample"), batch_size=3, pad_id=0, progress=False)
        greedy, _ = continue_samples(model, samples, config("greedy"), batch_size=3, pad_id=0, progress=False)
        other_seed, _ = continue_samples(model, samples, config("sample", seed=1), batch_size=3, pad_id=0,
                                         progress=False)
        # a launcher's second process runs only the batch at sample 3: it writes what one process writes there
        monkeypatch.setattr(cont, "local_starts", lambda n, bs: range(3, n, bs)[:1])
        second, _ = continue_samples(model, samples, config("sample"), batch_size=3, pad_id=0, progress=False)
    finally:
        model.generation_config.top_k = 50
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    longer = [i for i, s in enumerate(samples) if len(s) > PROMPT]
    assert any(not torch.equal(first[i], greedy[i]) for i in longer)
    assert any(not torch.equal(first[i], other_seed[i]) for i in longer)
    for i in range(len(samples)):
        assert torch.equal(second[i], first[i] if 3 <= i < 6 else samples[i])


def test_calibrate_on_continuations_equals_calibrate_tokens_on_the_written_text(model, tmp_path) -> None:
    samples = corpus() * 4
    router = calibrate_tokens(model, samples, batch_size=4, continuation="greedy", continuation_prompt_len=PROMPT,
                              **FAST)
    written, _ = continue_samples(model, samples, router.config, batch_size=4, pad_id=0, progress=False)
    reference = calibrate_tokens(model, written, batch_size=4, **FAST)
    state, ref_state = router.state_dict(), reference.state_dict()
    assert state.keys() == ref_state.keys() and all(torch.equal(state[k], ref_state[k]) for k in state)
    assert router.config.metrics == reference.config.metrics
    assert router.config.exit_paths == reference.config.exit_paths
    assert set(router.config.calibration_seconds) == {"generate", "forward", "label", "train"}
    assert "generate" not in reference.config.calibration_seconds
    router.save_pretrained(tmp_path / "r")
    loaded = TideRouter.from_pretrained(tmp_path / "r")
    assert (loaded.config.continuation, loaded.config.continuation_prompt_len) == ("greedy", PROMPT)
    assert reference.config.continuation is None  # the corpus as written: what older routers read
    assert f"own greedy continuations of each sample's first {PROMPT} tokens" in router.model_card().content
    assert "continuations" not in reference.model_card().content


def test_bad_continuation_settings_are_refused_before_any_forward_pass(model) -> None:
    with pytest.raises(TideArgumentError, match="continuation must be None or one of"):
        calibrate_tokens(model, corpus(), continuation="beam", **FAST)
    with pytest.raises(TypeError, match="continuation_prompt_len must be an int"):
        calibrate_tokens(model, corpus(), continuation="greedy", continuation_prompt_len=2.5, **FAST)
    with pytest.raises(TideArgumentError, match="needs samples longer than continuation_prompt_len=20"):
        calibrate_tokens(model, corpus(), continuation="greedy", continuation_prompt_len=20, **FAST)


def argmax_text(model, sample: torch.Tensor) -> torch.Tensor:
    """The model's own argmax, one forward per token over the whole text (no generate, no cache)."""
    ids = sample[:PROMPT]
    with torch.no_grad():
        while len(ids) < len(sample):
            ids = torch.cat([ids, model(ids[None]).logits[0, -1].argmax()[None]])
    return ids


def test_greedy_continuations_ignore_decoding_settings_of_the_models_generation_config() -> None:
    """A generation config with a repetition penalty, beams, an n-gram ban or return_dict_in_generate made
    "greedy" continuations something else (or a crash); they are the model's argmax, and its config is left as
    it was."""
    model = make_tiny_llama()
    model.generation_config.eos_token_id = None
    samples = [s for s in corpus() if len(s) > PROMPT]
    for setting in (dict(repetition_penalty=5.0), dict(num_beams=3), dict(no_repeat_ngram_size=1),
                    dict(return_dict_in_generate=True, output_scores=True)):
        for key, value in setting.items():
            setattr(model.generation_config, key, value)
        before = model.generation_config.to_dict()
        written, _ = continue_samples(model, samples, config("greedy"), batch_size=3, pad_id=0, progress=False)
        assert model.generation_config.to_dict() == before
        for s, w in zip(samples, written):
            assert torch.equal(w, argmax_text(model, s)), setting
        for key in setting:
            setattr(model.generation_config, key, getattr(type(model.generation_config)(), key))
