"""The CPU fast path of linear layers (`tide_hf.fast_linears`): outputs as eager's within float rounding on every
family, every module exactly as found after `undo`, a packed copy never served stale, nothing added to the model's
state, training unchanged, accelerate's hooks kept, and one warning naming the layers left eager."""

from __future__ import annotations

import copy
import doctest
import pickle
import warnings

import pytest
import torch
import transformers
from helpers import FAMILIES, FAMILY_VOCAB, make_family
from torch import nn
from torch.profiler import profile
from transformers.pytorch_utils import Conv1D

import tide_hf
from tide_hf.compat import onednn_available, onednn_dtypes
from tide_hf.runtime import LinearPathWarning, linears

pytestmark = [pytest.mark.usefixtures("one_intra_op_thread"),
              pytest.mark.skipif(not onednn_available(), reason="this torch build has no oneDNN")]
PACKED_OP = "mkldnn::_linear_pointwise"
FP32_TOL = 1e-4  # of the logits' scale: oneDNN sums in another order than eager
BF16_TOL = 3e-2
PROMPT = torch.randint(3, FAMILY_VOCAB, (2, 6), generator=torch.Generator().manual_seed(1))


def packed_calls(model: nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(logits of a no-grad forward, how many matmuls in it ran oneDNN's packed op)."""
    with torch.no_grad(), profile() as prof:
        logits = model(ids).logits
    return logits, sum(event.name == PACKED_OP for event in prof.events())


def logits(model: nn.Module, ids: torch.Tensor = PROMPT) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits


def assert_close(actual: torch.Tensor, expected: torch.Tensor, tol: float = FP32_TOL) -> None:
    scale = float(expected.float().abs().max())
    torch.testing.assert_close(actual.float(), expected.float(), rtol=0, atol=tol * scale)


def snapshot(model: nn.Module) -> dict:
    """Every module's instance dict (its values by identity) and every state tensor (the object, its storage and
    a copy of its values), but an offloaded one (on meta; accelerate makes a new one at each forward)."""
    return {"dicts": {name: dict(vars(module)) for name, module in model.named_modules()},
            "state": {name: (t, t.data_ptr(), t.detach().clone())
                      for name, t in model.state_dict(keep_vars=True).items() if not t.is_meta}}


def assert_restored(model: nn.Module, before: dict) -> None:
    now = snapshot(model)
    for name, found in before["dicts"].items():
        assert now["dicts"][name].keys() == found.keys(), name
        assert all(now["dicts"][name][key] is value for key, value in found.items()), name
    assert now["state"].keys() == before["state"].keys()
    for name, (tensor, ptr, value) in before["state"].items():
        now_tensor, now_ptr, now_value = now["state"][name]
        assert now_tensor is tensor and now_ptr == ptr and torch.equal(now_value, value), name


def quiet_fast_linears(model: nn.Module) -> linears.LinearPath:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", LinearPathWarning)
        return tide_hf.fast_linears(model, rows_from=1)


def tied_llama() -> nn.Module:
    """A tiny random Llama whose LM head is its embedding (as SmolLM2's)."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=FAMILY_VOCAB, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=64, tie_word_embeddings=True)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    assert model.lm_head.weight is model.model.embed_tokens.weight
    return model


# -- every family ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_runs_fast_as_eager_and_is_restored(family: str) -> None:
    model = make_family(family)
    eager = logits(model)
    before = snapshot(model)
    plain = sum(type(m) is nn.Linear for m in model.modules())
    own_forward = sum(isinstance(m, nn.Linear) and type(m) is not nn.Linear for m in model.modules())
    conv1d = sum(isinstance(m, Conv1D) for m in model.modules())
    path = quiet_fast_linears(model)
    assert path.switched == plain > 0
    assert sum(path.left.values()) == own_forward + conv1d
    if conv1d:  # GPT-2: its projections are Conv1D, its head an nn.Linear
        assert path.left == {linears.CONV1D: conv1d}
    fast, calls = packed_calls(model, PROMPT)
    assert calls == path.switched  # each linear layer runs once per forward, every switched one on oneDNN
    assert_close(fast, eager)
    assert torch.equal(fast.argmax(-1), eager.argmax(-1))
    path.undo()
    assert_restored(model, before)
    again, calls = packed_calls(model, PROMPT)
    assert calls == 0 and torch.equal(again, eager)


def test_one_warning_names_each_reason_and_count() -> None:
    model = make_family("gpt2")
    with pytest.warns(LinearPathWarning) as record:
        path = tide_hf.fast_linears(model, rows_from=1)
    messages = [str(w.message) for w in record if issubclass(w.category, LinearPathWarning)]
    assert len(messages) == 1 and "Conv1D" in messages[0] and f": {path.left[linears.CONV1D]})" in messages[0]
    path.undo()
    with warnings.catch_warnings():
        warnings.simplefilter("error", LinearPathWarning)  # every layer switched: nothing to warn about
        tide_hf.fast_linears(make_family("llama"), rows_from=1).undo()


def test_layers_it_must_leave_alone() -> None:
    """Subclasses with a forward of their own (quantized, adapter layers), computed weights, and layers already
    switched stay as found; subclasses that keep nn.Linear's forward, and an adapter's base layer, switch."""
    class OwnForward(nn.Linear):  # as bitsandbytes' Linear8bitLt, Linear4bit
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return super().forward(x) * 2

    class Tagged(nn.Linear):
        pass

    class Adapter(nn.Module):  # as peft's lora.Linear: a wrapper around an nn.Linear base layer
        def __init__(self) -> None:
            super().__init__()
            self.base_layer, self.lora = nn.Linear(8, 8), nn.Linear(8, 8, bias=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.base_layer(x) + self.lora(x)

    torch.manual_seed(0)
    parametrized = nn.Linear(8, 8)
    torch.nn.utils.parametrize.register_parametrization(parametrized, "weight", nn.Identity())
    model = nn.Sequential(OwnForward(8, 8), Tagged(8, 8), Adapter(), parametrized).eval()
    x = torch.randn(3, 8)
    eager = model(x).detach()
    before = snapshot(model)
    with pytest.warns(LinearPathWarning, match="OwnForward has a forward of its own"):
        path = tide_hf.fast_linears(model, rows_from=1)
    assert path.switched == 3  # Tagged, the adapter's base layer and its lora layer
    assert path.left == {"OwnForward has a forward of its own (a quantized or adapter layer)": 1,
                         "weight computed from other tensors (parametrized or weight-normed)": 1}
    with torch.no_grad():
        assert_close(model(x), eager)
    again = quiet_fast_linears(model)  # a second call leaves the switched layers alone
    assert again.switched == 0 and again.left[linears.why_eager(model[1])] == path.switched
    again.undo()
    path.undo()
    assert_restored(model, before)


# -- a packed copy is never stale ----------------------------------------------------------------------------
def test_changed_weights_are_packed_again() -> None:
    """`load_state_dict`, in-place edits (the tied head through its embedding), a new weight and casts: each next
    call serves the new weights (an eager reference changed the same way); an edit through `.data`, which no
    version counter sees, after `repack()`."""
    model = tied_llama()
    reference = copy.deepcopy(model)
    path = tide_hf.fast_linears(model, rows_from=1)
    original = logits(model)

    def check(change, tol: float = FP32_TOL) -> None:
        with torch.no_grad():
            change(model)
            change(reference)
        fast, calls = packed_calls(model, PROMPT)
        assert calls == path.switched
        assert_close(fast, logits(reference), tol)
        assert not torch.allclose(fast.float(), original.float(), atol=0.1), "the change did not show"

    state = {k: v * 1.5 + 0.01 for k, v in model.state_dict().items()}
    down, query = torch.randn(32, 64), torch.randn(32, 32)
    check(lambda m: m.load_state_dict(state))
    check(lambda m: m.model.embed_tokens.weight.mul_(2))  # the tied head's weight, edited through the embedding
    check(lambda m: m.model.layers[0].mlp.down_proj.weight.copy_(down))
    check(lambda m: setattr(m.model.layers[1].self_attn.q_proj, "weight", nn.Parameter(query.clone())))
    with torch.no_grad():
        model.model.layers[0].mlp.up_proj.weight.data.mul_(3)
        reference.model.layers[0].mlp.up_proj.weight.data.mul_(3)
    path.repack()
    assert_close(logits(model), logits(reference))
    if torch.bfloat16 in onednn_dtypes():
        check(lambda m: m.to(torch.bfloat16), BF16_TOL)
        check(lambda m: m.to(torch.float32))
    path.undo()


def test_weights_it_cannot_pack_run_eagerly() -> None:
    """A weight cast to a dtype oneDNN does not compute (float64) runs eagerly: stock's logits bit for bit; cast
    back, the fast path serves it again. An input of another dtype, or under autocast, runs eagerly too."""
    model = tied_llama()
    reference = copy.deepcopy(model).to(torch.float64)
    path = tide_hf.fast_linears(model, rows_from=1)
    model.to(torch.float64)
    fast, calls = packed_calls(model, PROMPT)
    assert calls == 0 and torch.equal(fast, logits(reference))
    model.to(torch.float32)
    assert packed_calls(model, PROMPT)[1] == path.switched
    with torch.no_grad(), pytest.raises(RuntimeError, match="same dtype"):  # stock's error, not oneDNN's
        model.model.layers[0].mlp.up_proj(torch.randn(3, 32, dtype=torch.float64))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16), profile() as prof:
        autocast = model(PROMPT).logits
    assert not any(event.name == PACKED_OP for event in prof.events())
    path.undo()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.equal(autocast, model(PROMPT).logits)


def test_no_packed_copy_in_the_models_state(tmp_path) -> None:
    model = tied_llama()
    params, buffers = list(model.parameters()), list(model.buffers())
    state = model.state_dict()
    model.save_pretrained(tmp_path / "stock")
    with tide_hf.fast_linears(model, rows_from=1):
        assert [id(p) for p in model.parameters()] == [id(p) for p in params]
        assert [id(b) for b in model.buffers()] == [id(b) for b in buffers]
        assert {k: v.data_ptr() for k, v in model.state_dict().items()} == {k: v.data_ptr() for k, v in state.items()}
        model.save_pretrained(tmp_path / "fast")
    stock = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "stock").state_dict()
    fast = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "fast").state_dict()
    assert fast.keys() == stock.keys() == state.keys()
    assert all(torch.equal(fast[k], state[k]) for k in state)


def test_a_copy_of_the_model_computes_with_its_own_weights() -> None:
    """A deep copy or a pickle of a model on the fast path runs eagerly on its own weights (the packed copies
    belong to the original, which stays on the fast path)."""
    model, reference = tied_llama(), tied_llama()
    with torch.no_grad():
        reference.model.layers[0].mlp.up_proj.weight.mul_(2)
    with tide_hf.fast_linears(model, rows_from=1) as path:
        for copied in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
            with torch.no_grad():
                copied.model.layers[0].mlp.up_proj.weight.mul_(2)
            out, calls = packed_calls(copied, PROMPT)
            assert calls == 0 and torch.equal(out, logits(reference))
        assert packed_calls(model, PROMPT)[1] == path.switched


def test_inference_mode_runs_fast() -> None:
    model = tied_llama()
    eager = logits(model)
    with tide_hf.fast_linears(model, rows_from=1) as path, torch.inference_mode(), profile() as prof:
        fast = model(PROMPT).logits
    assert sum(event.name == PACKED_OP for event in prof.events()) == path.switched
    assert_close(fast, eager)


def test_training_keeps_eager_gradients() -> None:
    """Under autograd every call runs eagerly: the same loss and gradients bit for bit; an optimizer step edits the
    weights in place, and the next no-grad forward serves the updated weights."""
    model, reference = tied_llama(), tied_llama()
    path = tide_hf.fast_linears(model, rows_from=1)
    results = []
    for net in (model, reference):
        net.train()
        optimizer = torch.optim.SGD(net.parameters(), lr=0.5)
        loss = net(PROMPT, labels=PROMPT).loss
        loss.backward()
        results.append((loss.detach(), {n: p.grad.clone() for n, p in net.named_parameters()}))
        optimizer.step()
        net.eval()
    assert torch.equal(results[0][0], results[1][0])
    assert all(torch.equal(results[0][1][n], results[1][1][n]) for n in results[1][1])
    fast, calls = packed_calls(model, PROMPT)
    assert calls == path.switched
    assert_close(fast, logits(reference))
    path.undo()


def test_docstring_example_runs() -> None:
    finder, runner = doctest.DocTestFinder(), doctest.DocTestRunner()
    for test in finder.find(linears.fast_linears, "fast_linears", globs={}):
        runner.run(test)
    assert runner.summarize(verbose=False).failed == 0


# -- under accelerate ---------------------------------------------------------------------------------------
def test_offloaded_layers_stay_and_hooked_ones_switch(tmp_path) -> None:
    """A device map with one layer offloaded to disk: the CPU layers switch under accelerate's hooks
    (`_old_forward`), the offloaded ones (meta at rest) stay, named in `left`; logits as eager's."""
    from accelerate import dispatch_model

    model = tied_llama()
    model.tie_weights()
    device_map = {"model.embed_tokens": "cpu", "model.layers.0": "cpu", "model.layers.1": "disk",
                  "model.norm": "cpu", "model.rotary_emb": "cpu", "lm_head": "cpu"}
    dispatch_model(model, device_map=device_map, offload_dir=str(tmp_path))
    eager = logits(model)
    before = snapshot(model)
    with pytest.warns(LinearPathWarning, match="meta device"):
        path = tide_hf.fast_linears(model, rows_from=1)
    layer = model.model.layers[0].mlp.up_proj
    assert "_old_forward" in vars(layer) and vars(layer)["_old_forward"] is not before["dicts"][
        "model.layers.0.mlp.up_proj"]["_old_forward"]
    offloaded = sum(isinstance(m, nn.Linear) for m in model.model.layers[1].modules())
    assert path.switched == sum(isinstance(m, nn.Linear) for m in model.modules()) - offloaded
    assert sum(path.left.values()) == offloaded
    fast, calls = packed_calls(model, PROMPT)
    assert calls == path.switched
    assert_close(fast, eager)
    path.undo()
    assert_restored(model, before)


def test_cpu_offload_leaves_every_layer() -> None:
    from accelerate import cpu_offload

    model = tied_llama()
    cpu_offload(model, execution_device="cpu")
    eager = logits(model)
    before = snapshot(model)
    with pytest.warns(LinearPathWarning):
        path = tide_hf.fast_linears(model, rows_from=1)
    assert path.switched == 0 and sum(path.left.values()) == sum(isinstance(m, nn.Linear) for m in model.modules())
    assert torch.equal(logits(model), eager)
    path.undo()
    assert_restored(model, before)


# -- SmolLM2 (real weights: conftest's shared `smollm2`) ----------------------------------------------------------
@pytest.mark.slow
def test_smollm2_generates_eagers_tokens(smollm2) -> None:
    model, tok = smollm2
    enc = tok(["The state of the union is"], return_tensors="pt")
    with torch.no_grad():
        eager = model(**enc).logits
        stock = model.generate(**enc, max_new_tokens=16, do_sample=False)
        with tide_hf.fast_linears(model, rows_from=1) as path:
            assert path.switched == sum(isinstance(m, nn.Linear) for m in model.modules()) and not path.left
            assert_close(model(**enc).logits, eager)
            assert torch.equal(model.generate(**enc, max_new_tokens=16, do_sample=False), stock)


@pytest.mark.slow
@pytest.mark.skipif(torch.bfloat16 not in onednn_dtypes(), reason="oneDNN computes no bf16 on this CPU")
def test_smollm2_bf16_picks_eagers_tokens(smollm2) -> None:
    model = copy.deepcopy(smollm2[0]).to(torch.bfloat16)
    enc = smollm2[1](["The capital of France is"], return_tensors="pt")
    with torch.no_grad():
        eager = model(**enc).logits
        with tide_hf.fast_linears(model, rows_from=1):
            fast, calls = packed_calls(model, enc["input_ids"])
    assert calls > 0
    assert_close(fast, eager, BF16_TOL)
    assert torch.equal(fast[0, -1].argmax(), eager[0, -1].argmax())


@pytest.mark.parametrize("bad", [0, -1, True, 2.0, "4"])
def test_rows_from_must_be_a_positive_int(bad) -> None:
    model = tied_llama()
    with pytest.raises(tide_hf.TideError, match="rows_from must be a positive int"):
        tide_hf.fast_linears(model, rows_from=bad)
    assert all("forward" not in vars(m) for m in model.modules())


def test_calls_with_fewer_rows_than_rows_from_run_eagerly() -> None:
    """rows_from=4: a forward of 1 x 2 rows runs every layer eagerly (bit for bit as eager), one of 2 x 6 rows runs
    every switched layer on the packed copies."""
    model = tied_llama()
    eager_small = logits(model, PROMPT[:1, :2])
    with tide_hf.fast_linears(model, rows_from=4) as path:
        small, small_calls = packed_calls(model, PROMPT[:1, :2])
        large, large_calls = packed_calls(model, PROMPT)
    assert path.rows_from == 4 and small_calls == 0 and torch.equal(small, eager_small)
    assert large_calls == path.switched > 0
    assert_close(large, logits(model))


@pytest.mark.parametrize(("packed_wins", "expected"), [
    ({1: False, 2: False, 4: True, 8: True, 16: True}, 4),
    ({1: False, 2: True, 4: False, 8: True, 16: True}, 8),  # from where it wins at every larger count
    ({1: True, 2: True, 4: True, 8: True, 16: True}, 1),
    ({1: True, 2: True, 4: True, 8: True, 16: False}, None),  # eager at the largest count: nothing switched
])
def test_measured_rows_from_is_where_the_packed_sweep_wins_from_on(monkeypatch, packed_wins, expected) -> None:
    """The measured choice follows the sweep's timings (replaced here by given ones); it is measured once per model,
    dtype and thread count; where eager wins at the largest count no layer is switched and the warning says so."""
    sweeps = []

    def sweep(packs, rows, packed):
        sweeps.append((rows, packed))
        return 1.0 if packed == packed_wins[rows] else 2.0  # the winner takes less time

    monkeypatch.setattr(linears, "sweep_seconds", sweep)
    model = tied_llama()
    if expected is None:
        with pytest.warns(LinearPathWarning, match="oneDNN measured slower than eager"):
            path = tide_hf.fast_linears(model)
        assert path.switched == 0 and path.rows_from is None
        assert all("forward" not in vars(m) for m in model.modules())
        return
    path = tide_hf.fast_linears(model)
    assert path.rows_from == expected and path.switched > 0
    path.undo()
    measured = len(sweeps)
    assert measured == 2 * len(linears.ROW_COUNTS)
    tide_hf.fast_linears(model).undo()  # the same model, dtype and threads: not measured again
    assert len(sweeps) == measured


def test_the_sweep_times_both_paths_on_real_layers() -> None:
    """`sweep_seconds` runs (positive seconds on each path) and `measured_rows_from` returns a count it timed or
    None."""
    model = tied_llama()
    with tide_hf.fast_linears(model, rows_from=1) as path:
        assert linears.sweep_seconds(path.packs, 2, True) > 0 and linears.sweep_seconds(path.packs, 2, False) > 0
        assert linears.measured_rows_from(path.packs) in (*linears.ROW_COUNTS, None)
