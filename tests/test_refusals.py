"""Bad input is refused with an error naming the problem, before anything changes; odd but valid input (numpy
numbers, paths, symbolic links, 0-d tensors) is served as stock transformers would serve it."""

from __future__ import annotations

import json
import math
import os
import stat
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import ByteTokenizer, constant_router, hooks, left_padded, make_model, mixed_router, new_router
from transformers import (
    Gemma2Config,
    Gemma2ForCausalLM,
    GenerationConfig,
    LogitsProcessorList,
    MistralConfig,
    MistralForCausalLM,
    RepetitionPenaltyLogitsProcessor,
)

import tide_hf
from tide_hf import TideRouter, TideRouterConfig
from tide_hf.errors import (
    TideArgumentError,
    TideArgumentTypeError,
    TideCompatibilityError,
    TideError,
    TideRouterFileError,
    TideTargetError,
    TideUnsupportedError,
)

CLOSED_PATH = {"thresholds": [[1.0, 1.0], [0.9, 1.0]], "errors": [0, 2], "n": 100, "nll_sum": [0.0, 0.5],
               "nll_sumsq": [0.0, 0.5], "n_next": 90}


def config(**fields) -> TideRouterConfig:
    return TideRouterConfig(hidden_size=64, num_hidden_layers=9, router_bottleneck_dim=8, **{"exit_head": "lens",
                                                                                             **fields})


@pytest.mark.parametrize("paths,message", [
    ("abc", "exit_paths must be a dict"),
    ({"speed": CLOSED_PATH}, "kinds must be among"),
    ({"agreement": {**CLOSED_PATH, "thresholds": [[1.0], [0.5]]}}, "one value per checkpoint"),
    ({"agreement": {**CLOSED_PATH, "thresholds": [[0.9, 1.0], [0.5, 1.0]]}}, "first threshold vector must close"),
    ({"agreement": {**CLOSED_PATH, "errors": [0]}}, r"\['errors'\] must be a list with one entry"),
    ({"agreement": {**CLOSED_PATH, "errors": [0, 200]}}, "200 errors out of n=100"),
    ({"agreement": {**CLOSED_PATH, "n": -5}}, r"\['n'\] must be >= 0"),
    ({"agreement": {k: v for k, v in CLOSED_PATH.items() if k != "nll_sum"}}, r"lacks \['nll_sum'\]"),
    ({"agreement": {**CLOSED_PATH, "thresholds": [[1.0, 1.0], [1.5, 1.0]]}}, "threshold must be a finite number"),
])
def test_a_hand_edited_exit_path_is_refused_at_load(tmp_path: Path, paths, message) -> None:
    model = make_model()
    router = new_router(model, exit_paths={"agreement": CLOSED_PATH})
    router.save_pretrained(tmp_path / "r")
    saved = json.loads((tmp_path / "r" / "config.json").read_text())
    saved["calibration"]["results"]["exit_paths"] = paths  # where config.json keeps the results
    (tmp_path / "r" / "config.json").write_text(json.dumps(saved))
    with pytest.raises(TideError, match=message):
        TideRouter.from_pretrained(tmp_path / "r")


def test_numpy_numbers_and_paths_are_stored_as_plain_values(tmp_path: Path) -> None:
    """What a script computes (numpy ints and floats, a pathlib dataset) saves as JSON and reloads equal."""
    cfg = config(seq_len=np.int64(32), learning_rate=np.float32(0.5), seed=np.int64(3),
                 dataset=tmp_path / "texts", checkpoint_layers=[np.int64(4), np.int64(8)])
    assert type(cfg.seq_len) is int and type(cfg.learning_rate) is float and type(cfg.seed) is int
    assert cfg.dataset == str(tmp_path / "texts") and all(type(k) is int for k in cfg.checkpoint_layers)
    TideRouter(cfg).save_pretrained(tmp_path / "r")
    loaded = TideRouter.from_pretrained(tmp_path / "r").config
    assert (loaded.seq_len, loaded.learning_rate, loaded.seed) == (32, 0.5, 3)
    with pytest.raises(TideArgumentError, match="seed must be in"):
        config(seed=2**70)
    with pytest.raises(TideArgumentTypeError, match="dataset must be a string"):
        config(dataset=3)


def test_load_time_keywords_are_checked_like_the_file(tmp_path: Path) -> None:
    new_router(make_model()).save_pretrained(tmp_path / "r")
    for bad, message in ((dict(exit_threshold=math.nan), "exit_threshold"), (dict(min_layers=100), "min_layers"),
                         (dict(label="bogus"), "label")):
        with pytest.raises(TideArgumentError, match=message):
            TideRouter.from_pretrained(tmp_path / "r", **bad)
    loaded = TideRouter.from_pretrained(tmp_path / "r", exit_threshold=np.float32(0.5), seed=np.int64(3),
                                        dataset=tmp_path / "texts")  # crashed inside transformers' config repr
    cfg = loaded.config
    assert (cfg.exit_threshold, cfg.seed, cfg.dataset) == (0.5, 3, str(tmp_path / "texts"))
    assert type(loaded.config.exit_threshold) is float and type(loaded.config.seed) is int


def test_unreadable_weights_and_negative_draft_ids_are_router_file_errors(tmp_path: Path) -> None:
    model = make_model()
    router = new_router(model)
    router.set_draft_vocab(torch.arange(256), {"256": 1.0})
    router.save_pretrained(tmp_path / "r")
    weights = tmp_path / "r" / "model.safetensors"
    data = weights.read_bytes()
    from safetensors.torch import load_file, save_file

    tensors = load_file(weights)
    tensors["draft_vocab"][3] = -7
    save_file(tensors, weights, metadata={"format": "pt"})
    with pytest.raises(TideRouterFileError, match="negative token ids"):
        TideRouter.from_pretrained(tmp_path / "r")
    weights.write_bytes(data[: len(data) // 2])
    with pytest.raises(TideRouterFileError, match="weights file cannot be read"):
        TideRouter.from_pretrained(tmp_path / "r")


def test_saving_through_a_link_replaces_the_linked_router_with_the_umask_permissions(tmp_path: Path) -> None:
    model = make_model()
    new_router(model, seed=0).save_pretrained(tmp_path / "real")
    (tmp_path / "link").symlink_to(tmp_path / "real")
    newer = new_router(model, seed=1)
    old_umask = os.umask(0o022)
    try:
        newer.save_pretrained(tmp_path / "link", overwrite=True)
    finally:
        os.umask(old_umask)
    assert (tmp_path / "link").is_symlink()
    loaded = TideRouter.from_pretrained(tmp_path / "real")
    torch.testing.assert_close(loaded.routers["4"].fc1.weight, newer.routers["4"].fc1.weight)
    assert stat.S_IMODE((tmp_path / "real").stat().st_mode) == 0o755


def test_model_card_shows_the_default_target_and_keeps_local_paths_out_of_metadata(tmp_path: Path) -> None:
    model = make_model()
    router = new_router(model, exit_paths={"agreement": CLOSED_PATH}, base_model_name_or_path=str(tmp_path),
                        dataset=str(tmp_path / "texts"))
    card = router.model_card()
    assert card.data.base_model is None and not card.data.datasets
    assert "tide_hf.attach(model, router)  # top-1 agreement >= 0.95" in card.text
    assert "exit_threshold" not in card.text.split("```")[1]
    hub = new_router(model, base_model_name_or_path="org/base", dataset="org/texts").model_card()
    assert hub.data.base_model == "org/base" and hub.data.datasets == ["org/texts"]
    assert "attach(model, router, exit_threshold=0.85)" in hub.text  # no exit paths: the global threshold


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


def test_confidence_without_a_target_is_refused() -> None:
    model = make_model()
    with pytest.raises(TideArgumentError, match="confidence applies only with a quality target"):
        tide_hf.attach(model, new_router(model), confidence=0.9,
                       mode="select")  # no exit paths: no target to apply it to


def test_a_target_whose_thresholds_open_checkpoints_below_min_layers_is_refused() -> None:
    model = make_model()
    path = {**CLOSED_PATH, "thresholds": [[1.0, 1.0], [0.9, 0.8]]}
    router = new_router(model, exit_paths={"agreement": path})
    with pytest.raises(TideTargetError, match=r"open checkpoints \[4\], below min_layers=8"):
        tide_hf.attach(model, router, min_agreement=0.5, min_layers=8,
                       mode="select")
    with tide_hf.attach(model, router, min_agreement=0.5, mode="select") as handle:  # the calibrated min_layers
        assert handle.options.thresholds == {4: 0.9, 8: 0.8}


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


def test_empty_dataset_name_is_refused_not_replaced() -> None:
    model = make_model()
    with pytest.raises(TideArgumentError, match="dataset is an empty name"):
        tide_hf.calibrate(model, ByteTokenizer(), "", num_samples=4, seq_len=8)


def test_recompute_refuses_decoding_that_edits_the_cache() -> None:
    model = make_model()
    ids, mask = left_padded()
    router = mixed_router(model, ids, mask)
    with tide_hf.attach(model, router, exit_threshold=0.5, mode="skip", kv="recompute"):
        with pytest.raises(TideArgumentError, match="kv='recompute' cannot serve num_beams=2"):
            model.generate(ids, attention_mask=mask, max_new_tokens=3, num_beams=2, do_sample=False)
        with pytest.raises(TideArgumentError, match="prompt_lookup_num_tokens"):
            model.generate(ids[:1], max_new_tokens=3, prompt_lookup_num_tokens=2, do_sample=False)
    with tide_hf.attach(model, router, exit_threshold=0.5, mode="skip", kv="propagate"):
        model.generate(ids, attention_mask=mask, max_new_tokens=3, num_beams=2, do_sample=False)


def test_recompute_refuses_a_window_kept_in_the_config() -> None:
    """Mistral keeps its sliding window in the config, not on the attention module."""
    torch.manual_seed(0)
    model = MistralForCausalLM(MistralConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                                             num_hidden_layers=9, num_attention_heads=4, num_key_value_heads=2,
                                             sliding_window=4, pad_token_id=0, eos_token_id=2)).eval()
    assert not getattr(model.model.layers[0].self_attn, "sliding_window", None)
    with pytest.raises(TideUnsupportedError, match="sliding-window attention") as info:
        tide_hf.attach(model, constant_router(model, 30.0), exit_threshold=0.5, mode="skip", kv="recompute")
    assert isinstance(info.value, NotImplementedError)  # what it raised before it was a TideError


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


def test_eos_as_a_0d_tensor_is_served_like_stock() -> None:
    model = make_model()
    ids, mask = left_padded()
    stock = model.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False, eos_token_id=torch.tensor(2))
    with tide_hf.attach(model, constant_router(model, -30.0), mode="select"):
        ours = model.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False,
                              eos_token_id=torch.tensor(2))
    assert torch.equal(stock, ours)


def test_compatibility_errors_are_tide_errors() -> None:
    class NoLayers(torch.nn.Module):
        config = make_model().config

    with pytest.raises(TideCompatibilityError):
        tide_hf.attach(NoLayers(), new_router(make_model()), mode="select")


def test_calibration_warns_when_its_default_target_opens_nothing() -> None:
    from tide_hf.calibration.pipeline import warn_if_closed

    closed = {"thresholds": [[1.0, 1.0], [0.5, 0.5]], "errors": [0, 50], "n": 100, "nll_sum": [0.0, 1.0],
              "nll_sumsq": [0.0, 1.0], "n_next": 100}
    with pytest.warns(UserWarning, match="lets no token exit: 100 threshold-split tokens certify no exit"):
        warn_if_closed(config(exit_paths={"agreement": closed}))
    opened = {**closed, "errors": [0, 0], "n": 1000}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warn_if_closed(config(exit_paths={"agreement": opened}))


def test_records_that_are_not_text_are_refused_not_dropped(tmp_path: Path) -> None:
    from tide_hf.calibration import load_texts
    from tide_hf.errors import TideDataError

    data = tmp_path / "data.jsonl"
    data.write_text("\n".join(json.dumps({"text": value}) for value in (1, 2, 3)) + "\n")
    with pytest.raises(TideDataError, match="3 'text' values are not strings"):
        load_texts(str(data))


def test_held_out_fractions_that_leave_no_training_samples_are_refused_naming_both() -> None:
    with pytest.raises(TideArgumentError, match=r"validation_fraction \(0.95\) \+ threshold_fraction \(0.1\)"):
        config(validation_fraction=0.95)


@pytest.mark.parametrize("samples,pad_id,error,message", [
    ([torch.tensor([5, 300])], 0, TideArgumentError, r"in \[0, 256\).*5\.\.300"),
    ([torch.tensor([-1, 5])], 0, TideArgumentError, r"-1\.\.5"),
    ([torch.tensor([5, 6])], 999, TideArgumentError, "pad_id is 999"),
    ([torch.tensor([5, 6])], 2.5, TideArgumentTypeError, "pad_id must be an int"),
    ([torch.tensor([True, False])], 0, TideArgumentTypeError, "integer token tensors"),
])
def test_calibrate_tokens_refuses_ids_the_model_cannot_embed(samples, pad_id, error, message) -> None:
    with pytest.raises(error, match=message):
        tide_hf.calibration.calibrate_tokens(make_model(), samples, pad_id=pad_id)


def test_missing_or_wrong_folders_are_named(tmp_path: Path) -> None:
    from tide_hf.assets import load_model

    with pytest.raises(FileNotFoundError, match="model folder not found"):
        load_model(str(tmp_path / "nowhere"))
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "a.txt").write_text("x")
    with pytest.raises(TideCompatibilityError, match="cannot be loaded as a causal LM"):
        load_model(str(tmp_path / "notes"))
    with pytest.raises(TideRouterFileError, match="no TIDE router folder at"):
        TideRouter.from_pretrained(tmp_path / "no-router")


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


def test_the_working_directory_is_never_replaced(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    router = new_router(make_model())
    for target in (".", "..", str(work)):
        with pytest.raises(TideRouterFileError, match="working directory"):
            router.save_pretrained(target)
    router.save_pretrained("inside")  # a folder in it is fine
    assert (work / "inside" / "config.json").is_file() and Path.cwd() == work


def test_numbers_nested_in_tables_are_stored_as_plain_values(tmp_path: Path) -> None:
    path = {**CLOSED_PATH, "thresholds": [[1.0, 1.0], [np.float32(0.5), 1.0]], "errors": [0, np.int64(2)],
            "n": np.int64(100)}
    cfg = config(exit_paths={"agreement": path}, metrics={"4": {"auc": np.float64(0.8)}},
                 seed=2**64 - 1)
    json.loads(cfg.to_json_string())  # would raise on a numpy number
    assert type(cfg.exit_paths["agreement"]["n"]) is int and type(cfg.metrics["4"]["auc"]) is float


def test_patch_layers_are_removed_by_identity_not_equality() -> None:
    from tide_hf.runtime import Patches

    class Box:
        pass

    box = Box()
    first, second = Patches(), Patches()
    mine, theirs = torch.zeros(2), torch.zeros(2)
    first.set_attr(box, "value", mine)  # tensors' == is elementwise: removal must not compare them
    second.set_attr(box, "value", theirs)
    first.restore()
    assert box.value is theirs
    second.restore()
    assert "value" not in vars(box)
    first.set_attr(box, "flag", 1)
    second.set_attr(box, "flag", True)  # equal to 1, but the other owner's
    first.restore()
    assert box.flag is True
    second.restore()
    assert "flag" not in vars(box)


def test_old_routers_whose_paths_open_checkpoints_below_their_min_layers_are_told_to_recalibrate() -> None:
    model = make_model()
    path = {**CLOSED_PATH, "thresholds": [[1.0, 1.0], [0.9, 0.8]]}
    router = new_router(model, exit_paths={"agreement": path}, min_layers=8)
    with pytest.raises(TideTargetError, match="a tide_hf older than the fix that keeps them closed calibrated"):
        tide_hf.attach(model, router, min_agreement=0.5, mode="select")
    with tide_hf.attach(model, router, exit_threshold=0.9, mode="select"):
        pass


def test_misspelled_fields_are_refused_not_left_at_their_defaults(tmp_path: Path) -> None:
    """transformers keeps unknown config keys: a hand-edited `exit_treshold` loaded with the default threshold
    and no word. A key close to a field is now refused, naming the field; other unknown keys stay allowed."""
    new_router(make_model()).save_pretrained(tmp_path / "r")
    path = tmp_path / "r" / "config.json"
    good = json.loads(path.read_text())
    path.write_text(json.dumps({**good, "exit_treshold": 0.5}))
    with pytest.raises(TideRouterFileError, match="'exit_treshold' is not a TIDE router field; did you mean "
                                                  "'exit_threshold'"):
        TideRouter.from_pretrained(tmp_path / "r")
    path.write_text(json.dumps({**good, "my_notes": "calibrated on Tuesday"}))
    assert TideRouter.from_pretrained(tmp_path / "r").config.my_notes == "calibrated on Tuesday"
    with pytest.raises(TideRouterFileError, match="from_pretrained: 'min_layer' is not a TIDE router field"):
        TideRouter.from_pretrained(tmp_path / "r", min_layer=8)
    with pytest.raises(TideRouterFileError, match="TideRouterConfig: 'exit_treshold' is not a TIDE router field"):
        TideRouter(config(exit_treshold=0.5))  # was built and saved, then refused at load


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


def test_positional_arguments_pass_through_another_librarys_generate_wrapper() -> None:
    """Under a `(self, *args, **kwargs)` wrapper of generate (another library's patch without functools.wraps)
    the positional arguments were bound to its `*args` and sent on as a keyword `args=`."""
    from transformers import GenerationMixin

    model = make_model()
    ids, mask = left_padded()
    config = GenerationConfig(max_new_tokens=4, do_sample=False, pad_token_id=0)
    stock = model.generate(ids, config, attention_mask=mask)
    tide_hf.integrations.disable_generate_keyword()
    plain = GenerationMixin.generate
    GenerationMixin.generate = lambda self, *args, **kwargs: plain(self, *args, **kwargs)
    tide_hf.integrations.enable_generate_keyword()
    try:
        with tide_hf.attach(model, constant_router(model, -30.0), exit_threshold=0.5, mode="select") as handle:
            assert torch.equal(model.generate(ids, config, attention_mask=mask), stock)
            assert handle.last_stats.prefill.tokens == int(mask.sum())
    finally:
        tide_hf.integrations.disable_generate_keyword()
        GenerationMixin.generate = plain
        tide_hf.integrations.enable_generate_keyword()


def test_a_head_tide_hf_does_not_reproduce_is_refused_where_tide_hf_computes_logits(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Granite divides its logits by `logits_scaling`; with that entry gone the adapter's head is not the model's.
    Where tide_hf computes logits itself (calibration labels, analyze, drafts over the draft vocabulary) the model
    is refused before anything changes; speculative drafts through the model's own head still attach."""
    from helpers import ByteTokenizer, make_documents
    from transformers import GraniteConfig, GraniteForCausalLM

    import tide_hf.modeling.adapters as adapters_mod
    from tide_hf.eval.analyze import convergence

    torch.manual_seed(0)
    model = GraniteForCausalLM(GraniteConfig(vocab_size=600, hidden_size=64, intermediate_size=128,
                                             num_hidden_layers=9, num_attention_heads=4, num_key_value_heads=2,
                                             max_position_embeddings=64, logits_scaling=4.0)).eval()
    drafting = new_router(model)
    drafting.set_draft_vocab(torch.arange(512), {"256": 0.5, "512": 0.9})
    tide_hf.attach(model, drafting, mode="speculative", draft_layer=4).detach()  # the scale known: accepted
    monkeypatch.delitem(adapters_mod._LOGIT_SCALES, "granite")
    before = hooks(model)
    refused = pytest.raises(TideCompatibilityError, match=r"GraniteForCausalLM .* does not reproduce")
    with refused:
        tide_hf.calibration.calibrate_tokens(model, [torch.arange(3, 40)] * 8, progress=False)
    with refused:
        convergence(model, ByteTokenizer(), make_documents(4, 30), num_samples=2, seq_len=16, batch_size=2,
                    checkpoint_interval=4, convergence_threshold=0.5, agreements=[0.9], bins=4, seed=0,
                    progress=False)
    with refused:
        tide_hf.attach(model, drafting, mode="speculative", draft_layer=4)
    assert hooks(model) == before and tide_hf.get_handle(model) is None
    tide_hf.attach(model, new_router(model), mode="speculative", draft_layer=4).detach()  # the model's own head


def test_the_fingerprint_covers_every_layer_and_older_routers_still_pair() -> None:
    """A model whose middle layers alone differ (a fine-tune of some layers) had the same fingerprint: attach
    accepted it and reported a quality target certified on other weights. Routers calibrated before keep their
    fingerprint of the embeddings, first and last layer, checked that way."""
    import copy

    model, other = make_model(seed=0), make_model(seed=1)
    changed = copy.deepcopy(model)
    changed.model.layers[4].load_state_dict(other.model.layers[4].state_dict())
    fingerprint = tide_hf.modeling.model_fingerprint
    assert fingerprint(changed) != fingerprint(model)
    assert fingerprint(changed, version=1) == fingerprint(model, version=1)  # what the first version missed
    with pytest.raises(TideCompatibilityError, match="weights fingerprint"):
        tide_hf.attach(changed, new_router(model), mode="select")
    older = new_router(model)
    older.config.base_fingerprint = fingerprint(model, version=1)
    tide_hf.attach(model, older, mode="select").detach()
    with pytest.raises(TideCompatibilityError, match="weights fingerprint"):
        tide_hf.attach(other, older, mode="select")
    newer = new_router(model)
    newer.config.base_fingerprint = "v3:" + fingerprint(model).split(":")[1]  # made by a later tide_hf
    with pytest.raises(TideCompatibilityError, match="cannot check: a newer tide_hf made it; upgrade tide_hf"):
        tide_hf.attach(model, newer, mode="select")


def test_a_target_served_on_other_weights_warns() -> None:
    """`ignore_fingerprint=True` lets a fine-tune through; its quality target was certified on other weights."""
    model, other = make_model(seed=0), make_model(seed=1)
    router = new_router(model, exit_paths={"agreement": CLOSED_PATH}, min_agreement=0.9)
    with pytest.warns(UserWarning, match="is certified for the weights the router was calibrated on"):
        tide_hf.attach(other, router, ignore_fingerprint=True, mode="select").detach()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tide_hf.attach(model, router, ignore_fingerprint=True, mode="select").detach()  # the same weights
        tide_hf.attach(other, router, ignore_fingerprint=True, exit_threshold=0.5, mode="select").detach()  # no target


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


def test_a_numpy_bool_for_tide_is_named_with_its_value() -> None:
    """`tide=np.bool_(True)` was refused as 'takes True/False ...; got bool', contradicting itself."""
    model = make_model()
    with pytest.raises(TideArgumentTypeError, match=r"got np\.True_ \(bool\)"):
        model.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=2, tide=np.bool_(True))
