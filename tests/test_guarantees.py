"""Issue 13: nothing lost, nothing leaked, no silent wrong answers. Regression tests of the misuse, fault and
thread cases (arguments, router files, NaN states, stale caches, inputs_embeds, the CLI's error line)."""

from __future__ import annotations

import threading

import pytest
import torch
from helpers import ByteTokenizer, constant_router, hooks, make_model, make_tiny_llama, new_router
from transformers import LogitsProcessor, LogitsProcessorList

import tide_hf
from tide_hf import TideError, TideRouterConfig
from tide_hf.cli import main as cli_main
from tide_hf.errors import TideArgumentError, TideArgumentTypeError, TideCompatibilityError
from tide_hf.runtime import TideHandle

FAST = {"num_epochs": 2, "early_stopping_patience": 0}


@pytest.fixture(scope="module")
def model():
    return make_model()


# --- 7. argument checks --------------------------------------------------------------------------------------
@pytest.mark.parametrize(("kwargs", "name"), [
    ({"num_samples": -5}, "num_samples"), ({"num_samples": 0}, "num_samples"), ({"seq_len": 0}, "seq_len"),
    ({"batch_size": 0}, "batch_size"), ({"num_epochs": 0}, "num_epochs"), ({"num_samples": 2.5}, "num_samples"),
])
def test_calibrate_rejects_bad_sizes(model, text_folder, kwargs, name) -> None:
    with pytest.raises((ValueError, TypeError), match=name) as info:
        tide_hf.calibrate(model, ByteTokenizer(), str(text_folder), **{"num_samples": 8, **kwargs})
    assert isinstance(info.value, TideError)


def test_calibrate_rejects_misspelled_keyword(model, text_folder) -> None:
    with pytest.raises(TypeError, match="lable.*did you mean 'label'"):
        tide_hf.calibrate(model, ByteTokenizer(), str(text_folder), num_samples=8, lable="top1")


@pytest.mark.parametrize(("kwargs", "error", "name"), [
    ({"exit_threshold": "0.5"}, TypeError, "exit_threshold"),
    ({"exit_threshold": float("nan")}, ValueError, "exit_threshold"),
    ({"exit_threshold": True}, TypeError, "exit_threshold"),
    ({"min_layers": 2.5}, TypeError, "min_layers"),
    ({"min_layers": 0}, ValueError, "min_layers"),
    ({"mode": ["select"]}, ValueError, "mode"),
    ({"mode": "speculative", "draft_layer": 1.5}, TypeError, "draft_layer"),
])
def test_attach_rejects_bad_options(model, kwargs, error, name) -> None:
    router = new_router(model)
    with pytest.raises(error, match=name):
        tide_hf.attach(model, router, **kwargs)
    assert tide_hf.get_handle(model) is None


@pytest.mark.parametrize(("kwargs", "error", "name"), [
    ({"exit_threshold": "0.5"}, TypeError, "exit_threshold"), ({"min_layers": 2.5}, TypeError, "min_layers"),
    ({"num_epochs": 0}, ValueError, "num_epochs"), ({"learning_rate": -1.0}, ValueError, "learning_rate"),
    ({"checkpoint_layers": [4.5]}, TypeError, "checkpoint_layers"),
    ({"router_bottleneck_dim": 0}, ValueError, "router_bottleneck_dim"),
])
def test_config_rejects_bad_fields(kwargs, error, name) -> None:
    with pytest.raises(error, match=name) as info:
        TideRouterConfig(hidden_size=32, num_hidden_layers=9, **kwargs)
    assert isinstance(info.value, (TideArgumentError, TideArgumentTypeError))


def test_cli_prints_one_line_for_tide_errors(tmp_path, text_folder, capsys) -> None:
    with pytest.raises(SystemExit) as info:
        cli_main(["calibrate", "--model", str(tmp_path / "m"), "--dataset", str(text_folder), "--num-samples", "0",
                  "--output", str(tmp_path / "out")])
    assert info.value.code == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err and "num_samples" in err, err


# --- 4. a NaN / inf hidden state never exits -----------------------------------------------------------------
class AlwaysConfident(TideHandle):
    """A backend that (like the old CUDA kernel) scores every position 1.0, broken states included."""

    def score(self, layer: int, hidden: torch.Tensor) -> torch.Tensor:
        return torch.ones(hidden.shape[:-1])


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
@pytest.mark.parametrize("handle_class", [TideHandle, AlwaysConfident])
def test_nonfinite_state_never_exits(bad, handle_class) -> None:
    model = make_model()
    router = constant_router(model, 30.0)  # every finite position exits at the first checkpoint
    ids = torch.randint(3, 256, (2, 5))
    poison = model.model.layers[3].register_forward_hook(  # row 0, position 2 broken from layer 4 on
        lambda _m, _a, out: (out[0].index_put((torch.tensor([0]), torch.tensor([2])), torch.tensor(bad)),
                             *out[1:]) if isinstance(out, tuple) else out.index_put(
            (torch.tensor([0]), torch.tensor([2])), torch.tensor(bad)))
    try:
        with tide_hf.integrations.attach_with(handle_class, model, router, exit_threshold=0.5, min_layers=4,
                                         mode="select") as handle:
            with torch.no_grad():
                model(ids)
            stats = handle.last_stats.prefill
    finally:
        poison.remove()
    assert stats.tokens == 10
    assert stats.exits[4] == 9 and stats.exits[8] == 0 and stats.exits[9] == 1, stats.exits


def test_exit_mask_uses_finite_scores_only(model) -> None:
    with tide_hf.attach(model, new_router(model), exit_threshold=0.5, mode="select") as handle:
        hidden = torch.zeros(4, 8)
        hidden[3, 1] = float("nan")
        mask = handle.exit_mask(torch.tensor([0.9, float("nan"), float("inf"), 0.9]), hidden, 0.5)
    assert mask.tolist() == [True, False, False, False]


# --- 6. inputs_embeds and a re-saved / deleted router folder ---------------------------------------------
def test_generate_with_inputs_embeds_only() -> None:
    model = make_tiny_llama()
    router = constant_router(model, -30.0)  # never exits: TIDE output equals stock
    embeds = model.get_input_embeddings()(torch.randint(3, 256, (2, 4)))
    kwargs = {"inputs_embeds": embeds, "max_new_tokens": 4, "do_sample": False, "pad_token_id": 0}
    stock = model.generate(**kwargs)
    out = model.generate(**kwargs, tide=router)
    assert torch.equal(out, stock)
    with tide_hf.attach(model, constant_router(model, 30.0), exit_threshold=0.5, mode="select"):
        model.generate(**kwargs)  # exits happen; no IndexError
    assert tide_hf.last_stats(model).decode.tokens > 0


def test_tide_folder_is_never_stale(tmp_path) -> None:
    model = make_tiny_llama()
    folder = tmp_path / "router"
    ids = torch.randint(3, 256, (1, 4))
    kwargs = {"max_new_tokens": 3, "do_sample": False, "pad_token_id": 0,
              "tide_config": tide_hf.TideConfig(mode="skip")}  # (attach's default, speculative, exits nothing)
    constant_router(model, 30.0).save_pretrained(folder)
    model.generate(ids, **kwargs, tide=str(folder))
    assert tide_hf.last_stats(model).decode.exit_rate == 1.0
    constant_router(model, -30.0).save_pretrained(folder, overwrite=True)
    model.generate(ids, **kwargs, tide=str(folder))
    assert tide_hf.last_stats(model).decode.exit_rate == 0.0
    for f in folder.iterdir():
        f.unlink()
    folder.rmdir()
    with pytest.raises(Exception):  # noqa: B017 - gone: no cached router answers (the Hub lookup fails)
        model.generate(ids, **kwargs, tide=str(folder))


# --- 1. never overwrite a model; atomic router saves ------------------------------------------------------------
def test_calibrate_refuses_to_overwrite_a_model(tmp_path, text_folder, capsys) -> None:
    model_dir = tmp_path / "m"
    make_tiny_llama().save_pretrained(model_dir)
    before = {p.name: p.read_bytes() for p in model_dir.iterdir()}
    with pytest.raises(SystemExit) as info:
        cli_main(["calibrate", "--model", str(model_dir), "--dataset", str(text_folder), "--num-samples", "4",
                  "--seq-len", "16", "--num-epochs", "1", "--output", str(model_dir), "--overwrite"])
    assert info.value.code == 1 and "not a TIDE router" in capsys.readouterr().err
    assert {p.name: p.read_bytes() for p in model_dir.iterdir()} == before


def test_save_pretrained_replaces_routers_only_and_atomically(tmp_path, model) -> None:
    folder = tmp_path / "router"
    first, second = new_router(model, seed=1), new_router(model, seed=2)
    first.save_pretrained(folder)
    with pytest.raises(tide_hf.errors.TideRouterFileError, match="overwrite=True"):
        second.save_pretrained(folder)
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    with pytest.raises(tide_hf.errors.TideRouterFileError, match="notes.txt"):
        second.save_pretrained(tmp_path / "other", overwrite=True)
    assert (tmp_path / "other" / "notes.txt").read_text() == "mine"

    def crash(*_args, **_kwargs):
        raise KeyboardInterrupt  # a crash in the middle of the write

    original = torch.nn.Module.state_dict
    torch.nn.Module.state_dict = crash
    try:
        with pytest.raises(KeyboardInterrupt):
            second.save_pretrained(folder, overwrite=True)
    finally:
        torch.nn.Module.state_dict = original
    loaded = tide_hf.TideRouter.from_pretrained(folder)  # the old router, whole
    assert torch.equal(loaded.routers["4"].fc1.weight, first.routers["4"].fc1.weight)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["other", "router"]  # no staging folder left
    second.save_pretrained(folder, overwrite=True)
    loaded = tide_hf.TideRouter.from_pretrained(folder)
    assert torch.equal(loaded.routers["4"].fc1.weight, second.routers["4"].fc1.weight)


# --- 3. a router folder loads whole or not at all ----------------------------------------------------------------
def _rewrite_weights(folder, edit) -> None:
    from safetensors.torch import load_file, save_file

    weights = edit(load_file(folder / "model.safetensors"))
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})


def test_router_load_checks_weights_against_config(tmp_path, model) -> None:
    folder = tmp_path / "router"
    new_router(model).save_pretrained(folder)
    _rewrite_weights(folder, lambda w: {k: v for k, v in w.items() if not k.startswith("routers.8.")})
    with pytest.raises(tide_hf.errors.TideRouterFileError, match=r"missing tensors.*routers\.8\.fc1\.weight"):
        tide_hf.TideRouter.from_pretrained(folder)
    new_router(model).save_pretrained(folder, overwrite=True)
    _rewrite_weights(folder, lambda w: {**w, "routers.12.fc1.weight": torch.zeros(1)})
    with pytest.raises(tide_hf.errors.TideRouterFileError, match=r"extra tensors.*routers\.12\.fc1\.weight"):
        tide_hf.TideRouter.from_pretrained(folder)
    new_router(model).save_pretrained(folder, overwrite=True)
    _rewrite_weights(folder, lambda w: {**w, "routers.4.fc1.weight": torch.zeros(3, 3)})
    with pytest.raises(tide_hf.errors.TideRouterFileError, match=r"wrong shape.*routers\.4\.fc1\.weight"):
        tide_hf.TideRouter.from_pretrained(folder)


def test_router_load_needs_its_config(tmp_path, model) -> None:
    folder = tmp_path / "router"
    new_router(model).save_pretrained(folder)
    (folder / "config.json").unlink()
    with pytest.raises(tide_hf.errors.TideRouterFileError, match="no config.json"):
        tide_hf.TideRouter.from_pretrained(folder)
    model_dir = tmp_path / "model"
    make_tiny_llama().save_pretrained(model_dir)
    with pytest.raises(tide_hf.errors.TideRouterFileError, match="model_type 'llama'"):
        tide_hf.TideRouter.from_pretrained(model_dir)


# --- 2. a per-call tide= is invisible to other threads -----------------------------------------------------------
class PauseOnce(LogitsProcessor):
    """Pauses its generate call at the first step (hooks attached, mid-generation) until released."""

    def __init__(self) -> None:
        self.paused, self.resume = threading.Event(), threading.Event()

    def __call__(self, input_ids, scores):
        if not self.paused.is_set():
            self.paused.set()
            assert self.resume.wait(120), "never released"
        return scores


def _in_thread(fn):
    result: dict = {}

    def target():
        try:
            result["value"] = fn()
        except BaseException as err:  # reported in the main thread
            result["error"] = err

    thread = threading.Thread(target=target)
    thread.start()
    return thread, result


def test_per_call_tide_is_scoped_to_its_thread() -> None:
    model = make_model()
    ids = torch.randint(3, 256, (2, 5))
    kwargs = {"max_new_tokens": 6, "do_sample": False, "pad_token_id": 0}
    always, never = constant_router(model, 30.0), constant_router(model, -30.0)
    stock = model.generate(ids, **kwargs)
    skip = tide_hf.TideConfig(mode="skip")  # (attach's default, speculative, gives stock's tokens: no leak would show)
    alone = model.generate(ids, **kwargs, tide=always, tide_config=skip)
    alone_stats = tide_hf.last_stats(model).as_dict()
    assert not torch.equal(alone, stock)  # the router changes the output: a leak would show
    before = hooks(model)

    pause = PauseOnce()
    thread, result = _in_thread(lambda: model.generate(
        ids, **kwargs, tide=always, tide_config=skip, logits_processor=LogitsProcessorList([pause])))
    assert pause.paused.wait(120)
    try:
        assert torch.equal(model.generate(ids, **kwargs), stock)  # another thread: stock, although A is attached
        with torch.no_grad():  # a plain forward in another thread: stock too, and no stats of its own
            assert tide_hf.get_handle(model) is None
        # a second router meanwhile: no "already attached"
        other = model.generate(ids, **kwargs, tide=never, tide_config=skip)
        assert torch.equal(other, stock)  # never exits = stock, and A's hooks did not act here
    finally:
        pause.resume.set()
        thread.join(120)
    assert "error" not in result, result.get("error")
    assert torch.equal(result["value"], alone)  # B's detach left A's hooks in place
    assert tide_hf.last_stats(model).as_dict() == alone_stats
    assert hooks(model) == before and tide_hf.get_handle(model) is None


def test_attach_waits_for_running_per_call_tide() -> None:
    model = make_model()
    ids = torch.randint(3, 256, (1, 4))
    pause = PauseOnce()
    thread, result = _in_thread(lambda: model.generate(
        ids, max_new_tokens=3, do_sample=False, pad_token_id=0, tide=constant_router(model, 30.0),
        logits_processor=LogitsProcessorList([pause])))
    assert pause.paused.wait(120)
    try:
        with pytest.raises(tide_hf.errors.TideConcurrencyError, match="generate"):
            tide_hf.attach(model, constant_router(model, 30.0), mode="select")
    finally:
        pause.resume.set()
        thread.join(120)
    assert "error" not in result
    tide_hf.attach(model, constant_router(model, 30.0), mode="select").detach()  # after it ended: fine


# --- 5. the fingerprint is dtype-independent and still tells a fine-tune ----------------------------------------
def _fine_tuned(model, scale: float, seed: int = 0):
    """A copy of `model` whose weights moved by `scale` x each tensor's std (random directions, like a short
    full fine-tune; real ones move weights by 1e-3 .. 1e-2 of their spread and more)."""
    copy = type(model)(model.config).eval()
    copy.load_state_dict(model.state_dict())
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in copy.parameters():
            noise = torch.randn(param.shape, generator=gen, dtype=torch.float32)
            param.add_((noise * scale * param.float().std().clamp(min=1e-3)).to(param.dtype))
    return copy


def _dtype_copies(model):
    import copy

    return [copy.deepcopy(model).to(dtype) for dtype in (torch.bfloat16, torch.float16)]


def test_fingerprint_is_dtype_independent_tiny() -> None:
    for seed in range(3):
        model = make_tiny_llama(seed=seed)
        fp = tide_hf.modeling.model_fingerprint(model)
        assert [tide_hf.modeling.model_fingerprint(m) for m in _dtype_copies(model)] == [fp, fp]
        assert tide_hf.modeling.model_fingerprint(_fine_tuned(model, 1e-3)) != fp


@pytest.mark.slow
def test_fingerprint_is_dtype_independent_smollm2(smollm2) -> None:
    model = smollm2[0]  # fp32
    fp = tide_hf.modeling.model_fingerprint(model)
    copies = _dtype_copies(model)
    assert [tide_hf.modeling.model_fingerprint(m) for m in copies] == [fp, fp]
    router = new_router(model)  # calibrated (fingerprinted) in fp32, served in bf16 / fp16
    for served in copies:
        router.check_compatible(served)
    del copies
    assert tide_hf.modeling.model_fingerprint(_fine_tuned(model, 1e-3)) != fp


# -- refusals and odd but valid input ---------------------------------------------------------------------------
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
