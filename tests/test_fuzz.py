"""Fuzzing (hypothesis) of what users pass: attach options, calibrate arguments, router configs. Every input
either works or raises a TideError / ValueError / TypeError that names the argument; nothing hangs, crashes or
silently misbehaves. Few examples, tiny models: well under a minute on one core."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from helpers import ByteTokenizer, hooks, make_model, make_tiny_llama, new_router

import tide_hf
from tide_hf import TideError, TideRouterConfig

hypothesis = pytest.importorskip("hypothesis")  # the `test` extra; without it the module skips, collection goes on
st = pytest.importorskip("hypothesis.strategies")
HealthCheck, given, settings = hypothesis.HealthCheck, hypothesis.given, hypothesis.settings

FUZZ = settings(max_examples=25, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
ACCEPTED = (TideError, ValueError, TypeError)

# A mix of good values, edge values and junk, for any argument.
junk = st.one_of(st.none(), st.booleans(), st.text(max_size=3), st.just([1]), st.just(float("nan")),
                 st.just(float("inf")))
numbers = st.one_of(st.integers(-3, 12), st.floats(-1.5, 1.5, allow_nan=False), junk)
ints = st.one_of(st.integers(-2, 12), st.sampled_from([2.5, 4.0]), junk)


def _named(err: BaseException, names: list[str]) -> bool:
    return any(name in str(err) for name in names)


@pytest.fixture(scope="module")
def model():
    return make_model()


@pytest.fixture(scope="module")
def router(model):
    return new_router(model)


@FUZZ
@given(options=st.fixed_dictionaries({}, optional={
    "exit_threshold": numbers, "min_layers": ints, "mode": st.one_of(st.sampled_from(["select", "skip",
    "speculative", "SKIP", ""]), junk), "kv": st.one_of(st.sampled_from(["propagate", "recompute", "x"]), junk),
    "draft_layer": ints}))
def test_fuzz_attach_options(model, router, options) -> None:
    before = hooks(model)
    ids = torch.randint(3, 256, (2, 5))
    try:
        handle = tide_hf.attach(model, router, **options)
    except ACCEPTED as err:
        assert _named(err, list(options)), f"{err!r} names none of {list(options)}"
        assert hooks(model) == before and tide_hf.get_handle(model) is None
        return
    try:
        out = model.generate(ids, max_new_tokens=3, do_sample=False, pad_token_id=0)
        assert out.shape == (2, 8)
        assert handle.last_stats.prefill.tokens == 10
    finally:
        handle.detach()
    assert hooks(model) == before


@FUZZ
@given(config=st.fixed_dictionaries({}, optional={
    "checkpoint_interval": ints, "checkpoint_layers": st.one_of(st.lists(st.integers(-1, 10), max_size=3), junk),
    "router_bottleneck_dim": ints, "exit_threshold": numbers, "min_layers": ints,
    "label": st.one_of(st.sampled_from(["cosine", "top1", "kl", "Top1"]), junk), "learning_rate": numbers,
    "validation_fraction": numbers, "early_stopping_patience": ints}))
def test_fuzz_router_config(model, config) -> None:
    try:
        cfg = TideRouterConfig(hidden_size=model.config.hidden_size, num_hidden_layers=9,
                               base_architecture=type(model).__name__, **config)
    except ACCEPTED as err:
        assert _named(err, list(config) + ["checkpoint"]), f"{err!r} names none of {list(config)}"
        return
    router = tide_hf.TideRouter(cfg)
    assert all(1 <= k < 9 for k in router.checkpoint_layers)
    with tide_hf.attach(model, router, mode="select") as handle:  # a valid config serves
        with torch.no_grad():
            model(torch.randint(3, 256, (1, 4)))
        assert handle.last_stats.prefill.tokens == 4


@pytest.fixture(scope="module")
def tiny():
    return make_tiny_llama(num_layers=5, hidden=16)


@settings(max_examples=20, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(args=st.fixed_dictionaries({}, optional={
    "num_samples": ints, "seq_len": st.one_of(st.integers(-1, 40), junk), "batch_size": ints, "num_epochs": ints,
    "label": st.sampled_from(["top1", "kl", "cosine", "lable"]), "lable": st.just("top1"),
    "checkpoint_interval": ints, "max_train_tokens": st.one_of(st.integers(0, 64), junk)}))
def test_fuzz_calibrate_args(tiny, text_folder, args) -> None:
    args = {"num_samples": 6, "seq_len": 16, "num_epochs": 1, **args}
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            router = tide_hf.calibrate(tiny, ByteTokenizer(), str(text_folder), progress=False,
                                       early_stopping_patience=0, **args)
    except ACCEPTED as err:
        assert _named(err, list(args) + ["checkpoint"]), f"{err!r} names none of {list(args)}"
        return
    assert router.config.num_samples <= args["num_samples"]
    for m in router.config.metrics.values():
        assert m["auc"] is None or not math.isnan(m["auc"])
