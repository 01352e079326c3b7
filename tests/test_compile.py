"""The fast GPU path, checked on the CPU: no host syncs in select mode, custom ops, torch.compile.

Host syncs are counted with torch.profiler (the ops that read a device value on the host); compiled
decoding is transformers' own (`cache_implementation="static"` + a `CompileConfig`), with dynamo's counters
for graph breaks and recompiles, and outputs compared with eager TIDE.
"""

from __future__ import annotations

import pytest
import torch
from helpers import NUM_LAYERS, compiled, constant_router, greedy, left_padded, make_model, mixed_router
from torch._dynamo.utils import counters
from torch.profiler import ProfilerActivity, profile

import tide_hf
from tide_hf.kernels import NORM_KINDS, NormSpec, norm_router_scores_reference
from tide_hf.kernels.ops import gather_rows_op, norm_router_scores_op, scatter_rows_op

SYNC_OPS = ("aten::item", "aten::is_nonzero", "aten::nonzero", "aten::_local_scalar_dense")
SHORT, LONG = 4, 12  # decode lengths whose difference gives the per-step count


@pytest.fixture(scope="module")
def setup():
    model = make_model()
    ids, mask = left_padded()
    return model, ids, mask, mixed_router(model, ids, mask)


def host_syncs(fn) -> int:
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return sum(1 for event in prof.events() if event.name in SYNC_OPS)


def syncs_per_step(model, ids, mask) -> float:
    short = host_syncs(lambda: greedy(model, ids, mask, SHORT))
    long = host_syncs(lambda: greedy(model, ids, mask, LONG))
    return (long - short) / (LONG - SHORT)


def test_select_mode_adds_no_host_sync_per_step(setup) -> None:
    model, ids, mask, router = setup
    stock = syncs_per_step(model, ids, mask)
    with tide_hf.attach(model, router, exit_threshold=0.5, min_layers=4, mode="select") as handle:
        handle.host_reads_free = False  # as on an accelerator (on the CPU a read of a flag costs nothing)
        select = syncs_per_step(model, ids, mask)
        assert 0 < handle.last_stats.decode.exit_rate < 1  # the steps really mixed exits and full depth
    assert stock > 0  # the profiler sees stock's own stopping-criteria syncs
    assert select == stock


def test_skip_mode_reads_one_flag_per_checkpoint(setup) -> None:
    model, ids, mask, router = setup
    stock = syncs_per_step(model, ids, mask)
    with tide_hf.attach(model, router, exit_threshold=0.5, min_layers=4, mode="skip", kv="propagate") as handle:
        handle.host_reads_free = False  # as on an accelerator
        skip = syncs_per_step(model, ids, mask)
    # each checkpoint reached costs one read (its `is_nonzero` runs `item` / `_local_scalar_dense` inside)
    per_read = len([op for op in SYNC_OPS if op != "aten::nonzero"])
    assert stock < skip <= stock + per_read * len(handle.open_checkpoints)


def test_stats_match_a_host_count(setup) -> None:
    """The device-side counters give what counting the reference exit layers on the host gives."""
    model, ids, mask, router = setup
    with tide_hf.attach(model, router, exit_threshold=0.5, min_layers=4, mode="select") as handle:
        model(input_ids=ids, attention_mask=mask)
        prefill = handle.last_stats.prefill
    from helpers import reference
    exit_layer, _ = reference(model, router, ids, mask)
    expected = torch.unique(exit_layer[mask.bool()], return_counts=True)
    assert dict(prefill.exits) == dict(zip(expected[0].tolist(), expected[1].tolist()))
    assert dict(prefill.executed) == {NUM_LAYERS: int(mask.sum())}


@pytest.mark.parametrize("mode", ["select", "skip"])
def test_a_static_cache_prefill_counts_no_padding(setup, mode: str) -> None:
    """A static cache gives the prefill a 4-D mask; padding is read from generate's own 2-D mask, so the
    prefill's statistics are those of the dynamic cache (they counted every left-padding position)."""
    model, ids, mask, router = setup
    stats = {}
    for cache in ("dynamic", "static"):
        with tide_hf.attach(model, router, exit_threshold=0.5, min_layers=4, mode=mode) as handle:
            greedy(model, ids, mask, 3, cache_implementation=cache)
            stats[cache] = handle.last_stats.prefill
    assert sum(stats["static"].executed.values()) == int(mask.sum()) < mask.numel()
    assert dict(stats["static"].exits) == dict(stats["dynamic"].exits)


@pytest.mark.parametrize("kind", sorted(NORM_KINDS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_custom_ops_pass_opcheck(kind: str, dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    hidden = torch.randn(5, 24).to(dtype)
    weight = None if kind in ("none", "rms") else torch.randn(24).to(dtype)
    bias = torch.randn(24).to(dtype) if kind == "layernorm" else None
    w1, b1, w2, b2 = torch.randn(8, 24), torch.randn(8), torch.randn(1, 8), torch.randn(1)
    args = (hidden, NORM_KINDS[kind], weight, bias, 1e-6, w1, b1, w2, b2)
    torch.library.opcheck(norm_router_scores_op, args)
    expected = norm_router_scores_reference(hidden, NormSpec(kind, weight, bias, 1e-6), w1, b1, w2, b2)
    torch.testing.assert_close(norm_router_scores_op(*args), expected, rtol=1e-4, atol=1e-5)
    index = torch.tensor([3, 0, 4])
    torch.library.opcheck(gather_rows_op, (hidden, index))
    torch.library.opcheck(scatter_rows_op, (hidden.clone(), index, torch.randn(3, 24).to(dtype)))


def test_select_mode_compiles_without_graph_breaks(setup) -> None:
    model, ids, mask, router = setup
    with tide_hf.attach(model, router, exit_threshold=0.5, min_layers=4, mode="select") as handle:
        eager = greedy(model, ids, mask, 32)
        torch._dynamo.reset()
        counters.clear()
        first = greedy(model, ids, mask, 32, cache_implementation="static", compile_config=compiled())
        assert 0 < handle.last_stats.decode.exit_rate < 1
        warm = dict(counters["stats"])
        second = greedy(model, ids, mask, 32, cache_implementation="static", compile_config=compiled())
    assert not counters["graph_break"]  # fullgraph=True would also have raised
    # one step graph, as stock: a mask growing per step (kept for kv="recompute" only) recompiled it
    assert warm.get("unique_graphs", 0) == 1
    assert dict(counters["stats"]) == warm  # no recompiles after the first call
    assert torch.equal(first, eager) and torch.equal(second, eager)


def test_select_mode_from_embeddings_compiles_one_step_graph(setup) -> None:
    """generate(inputs_embeds=...) feeds the prefill no token ids: the finished-rows state must still be a tensor
    from the first decode step on (it was None there, then a tensor: two step graphs)."""
    model, ids, mask, router = setup
    embeds = model.get_input_embeddings()(ids).detach()
    settings = dict(inputs_embeds=embeds, attention_mask=mask, max_new_tokens=10, min_new_tokens=10, do_sample=False,
                    pad_token_id=0, cache_implementation="static")
    with tide_hf.attach(model, router, exit_threshold=0.5, min_layers=4, mode="select"):
        eager = model.generate(**settings)
        torch._dynamo.reset()
        counters.clear()
        out = model.generate(**settings, compile_config=compiled())
    assert not counters["graph_break"] and counters["stats"].get("unique_graphs", 0) == 1
    assert torch.equal(out, eager)


def test_compiled_decoding_sees_attach_and_detach() -> None:
    """A graph compiled for the stock model must not keep running after attach (nor TIDE's after detach)."""
    model = make_model(seed=3)
    ids, mask = left_padded()
    router = constant_router(model, 30.0)  # every token exits at layer 4: the output differs from stock
    config = compiled()
    config.fullgraph = False
    torch._dynamo.reset()
    stock = greedy(model, ids, mask, 8)
    assert torch.equal(greedy(model, ids, mask, 8, cache_implementation="static", compile_config=config), stock)
    with tide_hf.attach(model, router, exit_threshold=0.5, min_layers=4, mode="select"):
        eager = greedy(model, ids, mask, 8)
        assert not torch.equal(eager, stock)
        assert torch.equal(greedy(model, ids, mask, 8, cache_implementation="static", compile_config=config), eager)
    assert torch.equal(greedy(model, ids, mask, 8, cache_implementation="static", compile_config=config), stock)


def test_a_per_call_router_compiles_without_graph_breaks_and_other_threads_stay_stock() -> None:
    """`greedy(tide=router)` scopes its hooks to the calling thread; that check read `threading.get_ident()`,
    which broke every compiled step graph (`fullgraph=True` raised). It is a thread-local flag now."""
    import threading

    from tide_hf.runtime.handle import attach_for_call

    model = make_model()
    ids, mask = left_padded()
    router = mixed_router(model, ids, mask)
    router.config.exit_threshold, router.config.exit_paths = 0.5, {}  # per-call options: this global threshold
    static = dict(cache_implementation="static")
    stock = greedy(model, ids, mask, 8, **static)
    skip = tide_hf.TideConfig(mode="skip")  # (attach's default, speculative, gives stock's tokens)
    eager = greedy(model, ids, mask, 8, tide=router, tide_config=skip, **static)
    assert not torch.equal(eager, stock)  # the router changes the output: the comparisons below mean something
    torch._dynamo.reset()
    counters.clear()
    assert torch.equal(greedy(model, ids, mask, 8, tide=router, tide_config=skip, compile_config=compiled(),
                              **static), eager)
    assert not counters["graph_break"]
    handle = attach_for_call(model, router, skip)  # as while a per-call generate runs in this thread
    try:
        other = {}
        thread = threading.Thread(target=lambda: other.setdefault(
            "out", greedy(model, ids, mask, 8, compile_config=compiled(), **static)))
        thread.start()
        thread.join()
    finally:
        handle.detach()
    assert torch.equal(other["out"], stock)  # another thread's compiled stock call does not see the hooks


@pytest.mark.parametrize("mode", ["select", "skip"])
def test_chunked_prefill_compiles_no_graph_per_chunk(setup, mode: str) -> None:
    """generate's chunked prefill sends every chunk through the compiled call: the chunks run uncompiled, as
    generate's usual prefill does (select mode traced a graph per chunk, guarding on the prompt offset, and
    `fullgraph=True` failed at dynamo's recompile limit after 8 chunks)."""
    model, _, _, _ = setup
    ids, mask = left_padded(lengths=(30, 27, 20))  # 10 chunks of 3
    router = mixed_router(model, ids, mask)
    options = dict(exit_threshold=0.5, min_layers=4, mode=mode)
    settings = dict(cache_implementation="static", prefill_chunk_size=3)
    with tide_hf.attach(model, router, **options) as handle:
        eager = greedy(model, ids, mask, 6, **settings)
        eager_stats = handle.last_stats
        torch._dynamo.reset()
        counters.clear()
        out = greedy(model, ids, mask, 6, compile_config=compiled(), **settings)
        assert torch.equal(out, eager)
        assert handle.last_stats.prefill.tokens == eager_stats.prefill.tokens == int(mask.sum())
        if mode == "select":
            assert counters["stats"].get("unique_graphs", 0) == 1


def test_per_call_routers_compile_past_the_recompile_limit() -> None:
    """Each `greedy(tide=router)` places new hooks, which the graphs of an earlier call guard against: all
    shared one code object, and the 9th call failed at dynamo's recompile limit under `fullgraph=True`."""
    model = make_model()
    ids, mask = left_padded()
    router = mixed_router(model, ids, mask)
    router.config.exit_threshold, router.config.exit_paths = 0.5, {}
    static = dict(cache_implementation="static")
    eager = greedy(model, ids, mask, 4, tide=router, **static)
    torch._dynamo.reset()
    with torch._dynamo.config.patch(recompile_limit=2):  # the limit lowered: past it in 4 calls, not 10
        for _ in range(torch._dynamo.config.recompile_limit + 2):
            assert torch.equal(greedy(model, ids, mask, 4, tide=router, compile_config=compiled(), **static),
                               eager)
