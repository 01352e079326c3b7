"""Skip mode under transformers' compiled decoding: segment graphs between checkpoints, chosen per step.

Each decoding step runs one compiled graph per segment of layers it reaches (a finish graph when every row
exited at a checkpoint); dynamo's recompile log must stay silent after a warm-up call, the graph count
stays within the design's bound, and the tokens equal eager TIDE skip mode on the same static cache.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
from helpers import NUM_LAYERS, compiled, constant_router, greedy, left_padded, make_model, mixed_router
from torch._dynamo.utils import counters

import tide_hf

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")
NEW_TOKENS = 32
MIXED = (0.3, 0.3)  # router quantiles whose decode steps skip at 4, skip at 8 and run every layer


@contextmanager
def recompile_log() -> Iterator[list[str]]:
    """Messages of dynamo's `recompiles` log (one per recompilation of an already compiled function)."""
    messages: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if "recompiles" in record.name:
                messages.append(record.getMessage())

    handler = Collect()
    logger = logging.getLogger("torch._dynamo")
    torch._logging.set_logs(recompiles=True)
    logger.addHandler(handler)
    try:
        yield messages
    finally:
        logger.removeHandler(handler)
        torch._logging.set_logs()


def test_recompile_log_sees_a_recompile() -> None:
    """The log these tests rely on really reports recompilations (a new static shape recompiles)."""
    fn = torch.compile(lambda x: x * 2, backend="eager", dynamic=False)
    with recompile_log() as recompiles:
        fn(torch.ones(2))
        assert not recompiles
        fn(torch.ones(3))
    assert len(recompiles) == 1


def static(**kwargs) -> dict:
    return {"cache_implementation": "static", **kwargs}


@pytest.mark.parametrize("kv", ["propagate", "recompute"])
@pytest.mark.parametrize("decisions", ["forced", "mixed", "mixed-heads"])
def test_skip_mode_compiles_into_bounded_segment_graphs(kv: str, decisions: str) -> None:
    """`mixed-heads`: a router with linear exit heads, whose maps run inside the segment graphs."""
    model = make_model()
    ids, mask = left_padded()
    later_ids, later_mask = left_padded(seed=1)  # same shapes, other tokens: other exit decisions
    heads = {"exit_head": "linear"} if decisions == "mixed-heads" else {}
    router = constant_router(model, 30.0) if decisions == "forced" else \
        mixed_router(model, ids, mask, quantiles=MIXED, **heads)
    with tide_hf.attach(model, router, exit_threshold=0.5, min_layers=4, mode="skip", kv=kv) as handle:
        eager = [greedy(model, i, m, NEW_TOKENS, **static()) for i, m in ((ids, mask), (later_ids, later_mask))]
        executed = dict(handle.last_stats.decode.executed)
        recomputed = handle.last_stats.decode.recomputed
        torch._dynamo.reset()
        counters.clear()
        first = greedy(model, ids, mask, NEW_TOKENS, **static(compile_config=compiled()))
        with recompile_log() as recompiles:
            later = greedy(model, later_ids, later_mask, NEW_TOKENS, **static(compile_config=compiled()))
        assert dict(handle.last_stats.decode.executed) == executed  # the compiled steps skipped what eager skipped
        assert handle.last_stats.decode.recomputed == recomputed  # ... and made up what eager made up
    assert (recomputed > 0) == (kv == "recompute" and decisions != "forced")
    assert torch.equal(first, eager[0]) and torch.equal(later, eager[1])
    if decisions == "forced":  # every row exits at layer 4: the later layers never ran
        assert executed == {4: ids.shape[0] * (NEW_TOKENS - 1)}
    elif decisions == "mixed":  # steps skipping at 4, at 8, and running every layer (rows exiting elsewhere)
        assert set(executed) == {4, 8, NUM_LAYERS}
    else:  # other exit logits, other tokens, other decisions: still steps of more than one depth
        assert len(set(executed)) >= 2, executed
    assert not counters["graph_break"]
    assert not recompiles, recompiles
    checkpoints = len(handle.open_checkpoints)
    segments = checkpoints + 1
    catch_up = segments - 1 if kv == "recompute" else 0  # one graph of dynamic query length per later segment
    assert 1 <= counters["stats"]["unique_graphs"] <= segments + checkpoints + catch_up
    if decisions == "forced":  # exactly the first segment and its finish
        assert counters["stats"]["unique_graphs"] == 2


def test_compiled_skip_mode_keeps_the_static_cache_as_eager_does() -> None:
    """Both kv policies leave every layer's static cache (lengths, keys, values) compiled as in eager.

    Values agree to float rounding only: the compiled layers round differently from eager (every layer
    differs by ~1e-7, also those that always run); a wrong or missing write differs by orders of magnitude.
    """
    model = make_model()
    ids, mask = left_padded()
    router = mixed_router(model, ids, mask, quantiles=MIXED)
    for kv in ("propagate", "recompute"):
        caches = []
        with tide_hf.attach(model, router, exit_threshold=0.5, min_layers=4, mode="skip", kv=kv):
            for config in ({}, {"compile_config": compiled()}):
                out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=12, min_new_tokens=12,
                                     do_sample=False, pad_token_id=0, return_dict_in_generate=True, **static(**config))
                caches.append([(int(layer.cumulative_length), layer.keys.clone(), layer.values.clone())
                               for layer in out.past_key_values.layers])
        for eager, compiled_ in zip(*caches):
            assert eager[0] == compiled_[0]
            torch.testing.assert_close(compiled_[1:], eager[1:], rtol=1e-5, atol=1e-6)


def test_dynamic_compile_configs_get_segment_graphs_too() -> None:
    """`CompileConfig(dynamic=True)` traced the checkpoint numbers as symbols and failed at `str(layer)` with
    fullgraph; segment graphs now compile with automatic dynamic shapes."""
    model = make_model()
    ids, mask = left_padded()
    router = mixed_router(model, ids, mask, quantiles=MIXED)
    config = compiled()
    config.dynamic = True
    with tide_hf.attach(model, router, exit_threshold=0.5, min_layers=4, mode="skip", kv="propagate"):
        eager = greedy(model, ids, mask, 8, **static())
        torch._dynamo.reset()
        counters.clear()
        assert torch.equal(greedy(model, ids, mask, 8, **static(compile_config=config)), eager)
    assert not counters["graph_break"]


def test_models_mixing_attention_kinds_keep_the_whole_step_compile() -> None:
    """Gemma 2 alternates sliding and full attention layers, which take different masks: segments (one set of
    layer arguments per graph) crashed on it. They fall back to the whole-step graph (graph breaks at the
    checkpoints' flags, so fullgraph is not possible there), with the eager tokens and no recompile of TIDE's
    skipped-layer forwards."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    from tide_hf.runtime.skip.segments import SegmentedDecoding

    torch.manual_seed(0)
    model = Gemma2ForCausalLM(Gemma2Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=9,
                                           num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                           sliding_window=6, pad_token_id=0)).eval()
    assert SegmentedDecoding.unsupported(model.model.layers) is not None
    ids, mask = left_padded()
    router = mixed_router(model, ids, mask, quantiles=MIXED)
    config = compiled()
    config.fullgraph = False
    with tide_hf.attach(model, router, exit_threshold=0.5, min_layers=4, mode="skip", kv="propagate") as handle:
        eager = greedy(model, ids, mask, 12, **static())
        assert len(handle.last_stats.decode.executed) > 1  # the steps skipped at different depths
        skipped = [layer.forward for layer in model.model.layers[4:]]  # replaced after the first checkpoint
        assert len({forward.__code__ for forward in skipped}) == len(skipped)  # dynamo counts per code object
        torch._dynamo.reset()
        with recompile_log() as recompiles:
            assert torch.equal(greedy(model, ids, mask, 12, **static(compile_config=config)), eager)
    # the graph breaks compile the skipped layers' forwards as frames of their own: one code object per layer
    # (they shared one, whose recompiles reached dynamo's limit, and the skipped layers' K/V writes ran uncompiled)
    ours = Counter(m.split()[2] for m in recompiles if "tide_hf/runtime/skip/skipper.py" in m.splitlines()[0])
    assert all(n < torch._dynamo.config.recompile_limit // 2 for n in ours.values()), ours


def mixed_windows(family: str) -> torch.nn.Module:
    """A tiny random model whose layers mix sliding-window and full attention: Gemma 2 here slides on the layers
    before the first checkpoint only (those kv='recompute' never skips), Qwen 2 with `use_sliding_window` slides
    from `max_window_layers` on."""
    from transformers import Gemma2Config, Gemma2ForCausalLM, Qwen2Config, Qwen2ForCausalLM

    sizes = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=9, num_attention_heads=4,
                 num_key_value_heads=2, sliding_window=6, pad_token_id=0, eos_token_id=2)
    torch.manual_seed(0)
    if family == "gemma2":
        layer_types = ["sliding_attention"] * 4 + ["full_attention"] * 5
        return Gemma2ForCausalLM(Gemma2Config(**sizes, head_dim=16, layer_types=layer_types)).eval()
    return Qwen2ForCausalLM(Qwen2Config(**sizes, use_sliding_window=True, max_window_layers=5)).eval()


@pytest.mark.parametrize("kv", ["propagate", "recompute"])
@pytest.mark.parametrize("family", ["gemma2", "qwen2"])
def test_fullgraph_is_refused_before_the_prefill_where_segments_cannot_run(family: str, kv: str) -> None:
    """Skip mode on layers mixing attention kinds compiles the whole step, whose graph breaks at each checkpoint's
    flag read: `fullgraph=True` raised dynamo's raw `UserError` (data-dependent guard) from inside the first
    compiled step. Now a `TideUnsupportedError` naming fullgraph and the way out, before any forward runs; where
    kv='recompute' cannot serve the sliding layers, attach itself refuses. Select mode keeps fullgraph."""
    from tide_hf.errors import TideError, TideUnsupportedError

    model = mixed_windows(family)
    ids, mask = left_padded()
    router = constant_router(model, 30.0)
    try:
        handle = tide_hf.attach(model, router, exit_threshold=0.5, min_layers=4, mode="skip", kv=kv)
    except TideError as err:  # Qwen 2 slides on layers after the first checkpoint
        assert (family, kv) == ("qwen2", "recompute") and "sliding-window attention" in str(err), err
        return
    forwards: list[int] = []
    with handle:
        counting = model.register_forward_pre_hook(lambda *_: forwards.append(1))
        with pytest.raises(TideUnsupportedError, match=r"fullgraph=True in mode='skip' on .*mix attention kinds.*"
                                                       r"CompileConfig\(fullgraph=False\).*mode='select'"):
            greedy(model, ids, mask, 4, **static(compile_config=compiled()))
        counting.remove()
        assert not forwards  # refused when transformers asks for the compiled step, before the prefill
        config = compiled()
        config.fullgraph = False  # the way out it names (test_models_mixing_attention_kinds_... runs it)
        assert callable(model.get_compiled_call(config))
    with tide_hf.attach(model, router, exit_threshold=0.5, min_layers=4, mode="select"):
        assert callable(model.get_compiled_call(compiled()))  # no host read in select mode: fullgraph stays


def test_fullgraph_is_refused_on_layers_under_accelerate_hooks() -> None:
    """A dispatched model's layers run behind accelerate's hooks (`_old_forward`), which segments do not call:
    its skip-mode step compiles whole and cannot be one graph."""
    from accelerate.hooks import ModelHook, add_hook_to_module

    from tide_hf.errors import TideUnsupportedError

    model = make_model()
    for layer in model.model.layers:
        add_hook_to_module(layer, ModelHook())
    with tide_hf.attach(model, constant_router(model, 30.0), exit_threshold=0.5, min_layers=4, mode="skip",
                        kv="propagate"):
        with pytest.raises(TideUnsupportedError, match=r"fullgraph=True.*accelerate's device hooks"):
            model.get_compiled_call(compiled())
