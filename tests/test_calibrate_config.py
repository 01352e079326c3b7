"""The configs of the public API: `CalibrationConfig` (what calibrate reads), `TideConfig` (what attach serves), their
defaults against the router file's, and a router folder saved by release 0.1.0 still loading and attaching."""

from __future__ import annotations

import dataclasses
import warnings
from pathlib import Path

import pytest
import torch
from helpers import make_model, mixed_router, new_router

import tide_hf
from tide_hf import CalibrationConfig, TideConfig, TideRouter, TideRouterConfig
from tide_hf.errors import TideArgumentError, TideArgumentTypeError
from tide_hf.modeling import model_fingerprint

FIXTURE = Path(__file__).parent / "fixtures" / "router-0.1.0"  # saved by release 0.1.0 (tests/fixtures/README.md)


def test_the_router_config_takes_its_fields_defaults_and_help_from_the_settings() -> None:
    """TideRouterConfig has no defaults of its own: with no arguments each field is its `tide_hf.settings` default
    (the checkpoints and min_layers derived from them), and its docstring's Args are the fields' help."""
    from tide_hf.config import ROUTER_FIELDS, default_checkpoints

    config, defaults = TideRouterConfig(), CalibrationConfig()
    assert {f.name for f in dataclasses.fields(CalibrationConfig)} - config.field_names() == {"batch_size"}
    for name, field in ROUTER_FIELDS.items():
        if name not in ("checkpoint_layers", "min_layers"):
            want = field.default if field.default_factory is dataclasses.MISSING else field.default_factory()
            assert getattr(config, name) == want, name
        assert f"{name}: {field.metadata['help']}" in TideRouterConfig.__doc__, name
    assert config.checkpoint_layers == default_checkpoints(config.num_hidden_layers, defaults.checkpoint_interval)
    assert config.min_layers == defaults.checkpoint_interval and config.exit_head == defaults.exit_head == "linear"
    assert config.num_samples is None and defaults.num_samples > 0  # a record of what ran vs. what to run
    assert TideRouterConfig(metrics=None).metrics == {}  # a dict field given None is empty


def test_calibrate_reads_a_config_like_its_keywords(text_folder, byte_tokenizer, tiny_llama) -> None:
    """`calibrate(model, tok, text, CalibrationConfig(...))` makes the router the same keywords make; keywords lay
    over the config; an unknown keyword is named with the field it resembles."""
    settings = {"num_samples": 8, "seq_len": 32, "num_epochs": 2, "router_bottleneck_dim": 8, "exit_head": "lens"}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        by_config = tide_hf.calibrate(tiny_llama, byte_tokenizer, str(text_folder), CalibrationConfig(**settings),
                                      progress=False)
        by_keywords = tide_hf.calibrate(tiny_llama, byte_tokenizer, str(text_folder), progress=False, **settings)
        laid_over = tide_hf.calibrate(tiny_llama, byte_tokenizer, str(text_folder),
                                      CalibrationConfig(**{**settings, "seed": 5}), seed=0, progress=False)
    for other in (by_keywords, laid_over):
        a, b = by_config.state_dict(), other.state_dict()
        assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)
    assert by_config.config.num_samples == 8 and by_config.config.router_bottleneck_dim == 8
    resolved = {"checkpoint_layers": by_config.checkpoint_layers, "min_layers": by_config.config.min_layers}
    assert CalibrationConfig.of_router(by_config.config) == CalibrationConfig(**settings, **resolved)  # as read
    assert by_config.config.exit_head == "lens" and laid_over.config.seed == 0
    with pytest.raises(TideArgumentTypeError,
                       match="unexpected keyword argument 'num_epoch' .did you mean 'num_epochs'"):
        tide_hf.calibrate(tiny_llama, byte_tokenizer, str(text_folder), num_epoch=2)
    with pytest.raises(TideArgumentTypeError, match="config must be a CalibrationConfig, got dict"):
        tide_hf.calibrate(tiny_llama, byte_tokenizer, str(text_folder), settings)


def test_calibrate_has_no_default_text(byte_tokenizer, tiny_llama) -> None:
    """No hidden corpus: calibrate reads the text it is given, and None is named as missing."""
    with pytest.raises(TypeError, match="dataset"):
        tide_hf.calibrate(tiny_llama, byte_tokenizer)  # type: ignore[call-arg]
    with pytest.raises(TideArgumentError, match="dataset is required"):
        tide_hf.calibrate(tiny_llama, byte_tokenizer, None, num_samples=4, seq_len=16)


def test_attach_reads_a_config_like_its_keywords() -> None:
    """`attach(model, router, TideConfig(...))` serves what the same keywords serve (same tokens, same exits);
    keywords lay over the config; an unknown one is named."""
    model = make_model()
    ids = torch.randint(3, 256, (2, 7), generator=torch.Generator().manual_seed(0))
    router = mixed_router(model, ids, exit_threshold=0.5)
    runs = []
    for config, options in ((TideConfig(mode="select", exit_threshold=0.5, min_layers=4), {}),
                            (None, {"mode": "select", "exit_threshold": 0.5, "min_layers": 4}),
                            (TideConfig(mode="skip", exit_threshold=0.5, min_layers=8), {"mode": "select",
                                                                                         "min_layers": 4})):
        with tide_hf.attach(model, router, config, **options) as handle:
            out = model.generate(input_ids=ids, max_new_tokens=5, do_sample=False, pad_token_id=0)
            runs.append((out, handle.last_stats.as_dict(), handle.options))
    assert all(torch.equal(runs[0][0], out) and list(runs[0][1:]) == rest for out, *rest in runs[1:])
    assert runs[0][2].mode == "select" and 0 < runs[0][1]["decode"]["exit_rate"] < 1
    with pytest.raises(TideArgumentTypeError, match="unknown option 'exit_treshold'; did you mean 'exit_threshold'"):
        tide_hf.attach(model, router, exit_treshold=0.5)
    with pytest.raises(TideArgumentTypeError, match="config must be a TideConfig, got dict"):
        tide_hf.attach(model, router, {"mode": "select"})
    assert tide_hf.get_handle(model) is None


def test_attach_defaults_to_speculative_mode_and_to_skip_mode_with_an_exit_setting() -> None:
    """No options: speculative mode, stock's tokens, the reason in `last_stats`. An exit setting given alone (here
    `exit_threshold`): skip mode with kv="recompute" (the policy that keeps the quality target), which runs fewer
    layers than stock and gives the tokens select mode gives at the same thresholds (the exact cache). In a
    batch, the default runs stock generate (rows drafted one at a time would cost a step each)."""
    model = make_model()
    ids = torch.randint(3, 256, (1, 7), generator=torch.Generator().manual_seed(0))
    router = mixed_router(model, ids, exit_threshold=0.5)
    stock = model.generate(input_ids=ids, max_new_tokens=6, do_sample=False, pad_token_id=0)
    with tide_hf.attach(model, router) as handle:
        default = model.generate(input_ids=ids, max_new_tokens=6, do_sample=False, pad_token_id=0)
        assert handle.options.mode == handle.last_stats.mode == "speculative" and handle.options.auto
        assert "no exit setting given" in handle.last_stats.reason
        assert handle.last_stats.speculative["fallback"] is None
        with pytest.warns(tide_hf.integrations.SpeculativeFallbackWarning, match="a batch of 2 rows"):
            rows = model.generate(input_ids=ids.repeat(2, 1), max_new_tokens=6, do_sample=False, pad_token_id=0)
        assert torch.equal(rows, stock.repeat(2, 1)) and "batch of 2 rows" in handle.last_stats.speculative["fallback"]
    assert torch.equal(default, stock)
    with tide_hf.attach(model, router, mode="speculative") as handle:  # asked for: drafted row by row
        rows = model.generate(input_ids=ids.repeat(2, 1), max_new_tokens=6, do_sample=False, pad_token_id=0)
        assert handle.last_stats.speculative["fallback"] is None and torch.equal(rows, stock.repeat(2, 1))
    with tide_hf.attach(model, router, mode="select") as handle:
        select = model.generate(input_ids=ids, max_new_tokens=6, do_sample=False, pad_token_id=0)
    with tide_hf.attach(model, router, exit_threshold=0.5) as handle:
        skipped = model.generate(input_ids=ids, max_new_tokens=6, do_sample=False, pad_token_id=0)
        assert (handle.options.mode, handle.options.kv) == ("skip", "recompute")
        assert handle.last_stats.reason == "attach's default with exit_threshold given: tokens exit at a quality target"
        assert handle.last_stats.decode.mean_executed < model.config.num_hidden_layers
    assert torch.equal(skipped, select) and not torch.equal(skipped, stock)


def test_auto_mode_falls_back_to_select_mode_with_a_warning() -> None:
    """Where skip mode cannot serve the model (GPT-2's fused q/k/v), the default runs select mode and says why;
    asking for skip mode explicitly is refused."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=9, n_head=4)).eval()
    router = TideRouter(TideRouterConfig(hidden_size=32, num_hidden_layers=9, router_bottleneck_dim=8,
                                         exit_head="lens", base_architecture="GPT2LMHeadModel",
                                         base_fingerprint=model_fingerprint(model)))
    with pytest.warns(tide_hf.runtime.ModeFallbackWarning, match="runs mode='select'.*GPT2LMHeadModel") as record:
        handle = tide_hf.attach(model, router, exit_threshold=0.5)
    assert record[0].filename == __file__  # the warning names the user's attach call
    assert handle.options.mode == "select"
    handle.detach()
    with pytest.raises(tide_hf.errors.TideUnsupportedError):
        tide_hf.attach(model, router, exit_threshold=0.5, mode="skip")


def test_a_router_saved_by_release_0_1_0_loads_and_attaches() -> None:
    """The fixture's files load as they were written (fields, exit heads, exit paths), and attach serves it: at
    threshold 1.0 stock's tokens, at its default target in the default mode."""
    model = make_model()
    router = TideRouter.from_pretrained(FIXTURE)
    assert router.config.exit_head == "linear" and router.exit_heads and router.config.exit_paths
    assert router.config.metrics and router.config.base_fingerprint == model_fingerprint(model)
    ids = torch.randint(3, 256, (2, 9), generator=torch.Generator().manual_seed(1))
    stock = model.generate(input_ids=ids, max_new_tokens=5, do_sample=False, pad_token_id=0)
    with tide_hf.attach(model, FIXTURE, exit_threshold=1.0) as handle:
        assert torch.equal(model.generate(input_ids=ids, max_new_tokens=5, do_sample=False, pad_token_id=0), stock)
    with tide_hf.attach(model, router) as handle:
        model.generate(input_ids=ids, max_new_tokens=5, do_sample=False, pad_token_id=0)
        assert handle.options.target == {"min_agreement": router.config.min_agreement,
                                         "confidence": router.config.confidence}
        assert handle.last_stats.decode.tokens == 2 * 4


def test_a_file_without_exit_head_reads_as_the_lens(tmp_path: Path) -> None:
    """Router files from before exit heads existed have no `exit_head`: they read as the lens, not as the default
    the config now has."""
    import json

    new_router(make_model()).save_pretrained(tmp_path / "r")
    path = tmp_path / "r" / "config.json"
    config = json.loads(path.read_text())
    assert config.pop("exit_head") == "lens"
    path.write_text(json.dumps(config))
    assert TideRouter.from_pretrained(tmp_path / "r").config.exit_head == "lens"


@pytest.mark.slow
def test_skip_mode_runs_fewer_layers_on_smollm2(smollm2) -> None:
    """Skip mode as a user gets it on the real model: routers calibrated as the demo calibrates them,
    `attach(model, router, mode="skip")`, one chat prompt. Skip mode at the router's default target runs fewer
    layers per decode step than the model has (stock runs them all), with the exact cache."""
    from tide_hf.cli.demo import DEMO_CALIBRATION

    model, tok = smollm2
    fields = {f.name for f in dataclasses.fields(CalibrationConfig)}
    settings = CalibrationConfig(**{k: v for k, v in DEMO_CALIBRATION.items() if k in fields})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        router = tide_hf.calibrate(model, tok, "sotu", settings, progress=False)
    inputs = tok.apply_chat_template([{"role": "user", "content": "What should Congress do about the economy?"}],
                                     add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with tide_hf.attach(model, router, mode="skip") as handle:
        model.generate(**inputs, max_new_tokens=32, do_sample=False)
        stats = handle.last_stats.decode
    assert (handle.options.mode, handle.options.kv) == ("skip", "recompute")
    assert handle.options.target == {"min_agreement": router.config.min_agreement,
                                     "confidence": router.config.confidence}
    assert stats.tokens == 31 and stats.mean_executed < model.config.num_hidden_layers, stats.as_dict()
