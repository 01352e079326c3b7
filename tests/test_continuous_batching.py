"""Continuous batching (`model.generate_batch`) with a router attached, against TIDE's own `generate`.

transformers' continuous batching packs the requests of a step into one row over a paged cache. With TIDE
attached, each request must get exactly the tokens TIDE's `generate` gives it alone (greedy): exits are per
position, and in skip mode the positions that exited leave the packed row while their K/V are propagated.
The statistics must count the same exits and executed layers as those lone calls. What TIDE cannot serve there
is refused before any work.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from helpers import left_padded, make_model, mixed_router
from transformers import CompileConfig, ContinuousBatchingConfig, GenerationConfig

import tide_hf
from tide_hf.compat import PAGED_UPDATE_TAKES_KWARGS, paged_config
from tide_hf.errors import TideUnsupportedError
from tide_hf.runtime.batching import manager_refusal

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")
# transformers >= 5.24: the attention writes the paged cache through `update(..., kwargs=...)`, which TIDE serves
serves = pytest.mark.skipif(not PAGED_UPDATE_TAKES_KWARGS, reason="this transformers' paged cache is refused")
LAYERS, HIDDEN, NEW = 6, 32, 6  # checkpoints every 2 layers: [2, 4]
# a small paged cache (the default sizes it from free memory: seconds to start on a CPU); 16 tokens per step, so
# the 30-token prompt is prefilled in chunks, beside the other requests' decode tokens
SMALL = {"num_blocks": 32, "max_batch_tokens": 16}
SMALL_PAGE = 16  # tokens per page (`paged_config`: the keyword's name moved in transformers 5.24)
LENGTHS = (9, 6, 30, 4)
MODES = {"select": {"mode": "select"}, "skip": {"mode": "skip", "kv": "propagate"}}


def greedy() -> GenerationConfig:
    return GenerationConfig(max_new_tokens=NEW, do_sample=False, eos_token_id=-1, pad_token_id=0)


@pytest.fixture(scope="module")
def setup():
    """The model, a router whose scores are far from its threshold (exits mixed over 2 / 4 / none), the prompts."""
    model = make_model(seed=3, hidden=HIDDEN, layers=LAYERS)
    ids, mask = left_padded(seed=1, lengths=LENGTHS)
    router = mixed_router(model, ids, mask, checkpoint_interval=2, quantiles=(0.5, 0.4))
    prompts = [row[m.bool()].tolist() for row, m in zip(ids, mask)]
    return model, router, prompts


def run_batch(model, prompts: list[list[int]], **small) -> list[list[int]]:
    out = model.generate_batch(prompts, generation_config=greedy(), warmup=False, progress_bar=False,
                               continuous_batching_config=paged_config(SMALL_PAGE, **{**SMALL, **small}))
    assert all(r.error is None for r in out.values()), [r.error for r in out.values()]
    return [r.generated_tokens for r in out.values()]


def counts(phase) -> tuple[Counter, Counter]:
    return phase.exits, phase.executed


@serves
@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("mode", MODES)
def test_generate_batch_equals_generate_per_request(setup, mode, attention):
    """Each request's tokens equal TIDE's `generate` on it alone, and the exits and executed layers counted
    equal those of the lone calls (prefill and decode apart); exits happen in both phases, and skip mode runs
    fewer layers (eager attention: continuous batching switches it to paged eager)."""
    model, router, prompts = setup
    model.set_attn_implementation(attention)
    try:
        with tide_hf.attach(model, router, exit_threshold=0.5, min_layers=2, **MODES[mode]) as handle:
            alone, prefill, decode = [], tide_hf.ExitStats(LAYERS, [2, 4]), tide_hf.ExitStats(LAYERS, [2, 4])
            for prompt in prompts:
                alone.append(model.generate(torch.tensor([prompt]), generation_config=greedy())[0, len(prompt):]
                             .tolist())
                prefill.prefill.merge(handle.last_stats.prefill)
                decode.decode.merge(handle.last_stats.decode)
            packed = run_batch(model, prompts)
            stats = handle.last_stats
        stock = run_batch(model, prompts)
    finally:
        model.set_attn_implementation("sdpa")
    assert packed == alone
    assert packed != stock  # the exits changed tokens
    assert counts(stats.prefill) == counts(prefill.prefill)
    assert counts(stats.decode) == counts(decode.decode)
    assert stats.prefill.tokens == sum(LENGTHS) and stats.decode.tokens == len(LENGTHS) * (NEW - 1)
    assert stats.prefill.exit_rate > 0 and stats.decode.exit_rate > 0
    if mode == "skip":
        assert stats.prefill.mean_executed < LAYERS and stats.decode.mean_executed < LAYERS
    else:
        assert stats.prefill.mean_executed == stats.decode.mean_executed == LAYERS


@serves
def test_skip_mode_reads_only_the_keys_of_requests_still_running(setup):
    """In a packed step, a layer after a checkpoint reads the cache slots of the requests with a running position
    only: fewer keys than the first layer reads in the same forward, in some step (the tokens stay those of
    `generate` alone: the test above)."""
    model, router, prompts = setup
    forwards: list[dict[int, int]] = []  # per forward: layer -> keys read (steps that read the cache)

    def spy(number):
        def hook(_module, _args, kwargs):
            reads = kwargs.get("read_index")
            if reads is not None and len(reads[0]):
                forwards[-1][number] = len(reads[0])
        return hook

    layers = (0, LAYERS - 1)
    hooks = [model.register_forward_pre_hook(lambda *_: forwards.append({}))]
    hooks += [model.model.layers[n].self_attn.register_forward_pre_hook(spy(n), with_kwargs=True) for n in layers]
    try:
        with tide_hf.attach(model, router, exit_threshold=0.5, min_layers=2, mode="skip", kv="propagate"):
            run_batch(model, prompts)
    finally:
        for hook in hooks:
            hook.remove()
    deep = [(step[0], step[LAYERS - 1]) for step in forwards if LAYERS - 1 in step]
    assert deep and all(late <= first for first, late in deep)
    assert any(late < first for first, late in deep)


@serves
@pytest.mark.parametrize("mode", MODES)
def test_generate_batch_without_exits_equals_stock(setup, mode):
    """Exit threshold 1.0 (nothing exits): the tokens of stock continuous batching."""
    model, router, prompts = setup
    stock = run_batch(model, prompts)
    with tide_hf.attach(model, router, exit_threshold=1.0, **MODES[mode]) as handle:
        assert run_batch(model, prompts) == stock
        assert handle.last_stats.decode.exit_rate == 0


@serves
@pytest.mark.parametrize("options, match", [
    ({"mode": "speculative", "draft_layer": 2}, "mode='speculative'.*nothing would be drafted"),
    ({"mode": "skip", "kv": "recompute"}, "kv='recompute'.*kv='propagate'"),
    ({}, "mode='speculative'.*nothing would be drafted"),
    ({"min_agreement": None, "kv": "recompute"}, "kv='recompute'.*kv='propagate'"),
], ids=["speculative", "skip-recompute", "default", "default-with-kv"])
def test_modes_continuous_batching_cannot_serve_are_refused(setup, options, match):
    """Speculative mode (attach's default) and skip mode with kv="recompute" are refused before any work;
    detached, the model serves continuous batching again."""
    model, router, prompts = setup
    stock = run_batch(model, prompts)
    with tide_hf.attach(model, router, **options):
        with pytest.raises(TideUnsupportedError, match=match):
            run_batch(model, prompts)
        with pytest.raises(TideUnsupportedError, match=match):
            model.init_continuous_batching(generation_config=greedy())
    assert getattr(model, "_cached_continuous_batching_manager", None) is None
    assert run_batch(model, prompts) == stock


@serves
def test_a_compiled_forward_is_refused_and_the_attention_put_back(setup):
    """A compiled continuous-batching forward would replay without TIDE's hooks: refused once the manager is
    set up, with the attention implementation it switched to put back."""
    model, router, prompts = setup
    model.set_attn_implementation("eager")  # continuous batching switches it to "paged|eager"
    try:
        with tide_hf.attach(model, router, mode="select"):
            with pytest.raises(TideUnsupportedError, match="compiled forward.*use_cuda_graph=False"):
                run_batch(model, prompts, varlen_compile_config=CompileConfig())
        assert model.config._attn_implementation == "eager"
    finally:
        model.set_attn_implementation("sdpa")


@pytest.mark.parametrize("attention, refused", [("sdpa", False), ("paged|eager", False),
                                                ("flash_attention_2", True)])
def test_skip_mode_needs_attention_that_takes_a_gathered_row(attention, refused):
    """Skip mode gathers the running positions of the packed row: flash kernels (which read the packing from
    cumulative lengths) are refused, select mode takes any."""
    manager = SimpleNamespace(
        continuous_batching_config=ContinuousBatchingConfig(use_cuda_graph=(False, False)),
        model=SimpleNamespace(config=SimpleNamespace(_attn_implementation=attention)))
    reason = manager_refusal(SimpleNamespace(mode="skip", kv="propagate"), manager)
    assert (reason is not None and "auto_switch_to_flash=False" in reason) == refused
    assert manager_refusal(SimpleNamespace(mode="select", kv="propagate"), manager) is None


def test_refused_before_any_generate_call():
    """attach alone (no generate keyword enabled, no generate call before) guards continuous batching on the
    model it hooks; a fresh process, since this one enabled the keyword long ago."""
    code = (
        "import tide_hf, torch\n"
        "from transformers import GenerationConfig\n"
        "import helpers\n"
        "model = helpers.make_model(hidden=32, layers=5)\n"
        "tide_hf.attach(model, helpers.new_router(model), mode='speculative')\n"
        "try:\n"
        "    model.generate_batch([[5, 6]], generation_config=GenerationConfig(max_new_tokens=1), warmup=False)\n"
        "except tide_hf.TideError as err:\n"
        "    print('refused:', type(err).__name__)\n")
    here = Path(__file__).resolve().parent
    path = os.pathsep.join(filter(None, [str(here.parent), str(here), os.environ.get("PYTHONPATH")]))
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                            env={**os.environ, "PYTHONPATH": path})
    assert "refused: TideUnsupportedError" in result.stdout, result.stderr[-2000:]


@pytest.mark.skipif(PAGED_UPDATE_TAKES_KWARGS, reason="this transformers' paged cache is served")
def test_a_transformers_whose_attention_writes_the_paged_cache_is_refused(setup):
    """Before transformers 5.24 the paged attention function writes the cache itself, out of TIDE's reach:
    refused in every mode, before any work."""
    model, router, prompts = setup
    with tide_hf.attach(model, router, mode="select"):
        with pytest.raises(TideUnsupportedError, match="needs transformers >= 5.24"):
            model.generate_batch(prompts, generation_config=greedy(), warmup=False, progress_bar=False)

