"""The one reversible patching mechanism (`Patches`), the handle as a context manager, and the reversible
`generate(tide=...)` keyword."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import constant_router, hooks, left_padded, make_model, mixed_router
from transformers import GenerationConfig, GenerationMixin, GPT2Config

import tide_hf
from tide_hf.integrations import disable_generate_keyword, enable_generate_keyword
from tide_hf.runtime import Patches


class Layer(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + 1


def test_instance_attribute_is_deleted_again() -> None:
    layer = Layer()
    with Patches() as patches:
        patches.replace_forward(layer, lambda original: lambda x: original(x) * 10)
        assert "forward" in vars(layer) and layer(torch.zeros(1)).item() == 10.0
    assert "forward" not in vars(layer) and layer(torch.zeros(1)).item() == 1.0


def test_patches_of_one_attribute_may_end_in_any_order() -> None:
    """Two owners patch one attribute (overlapping generate(tide=...) calls in two threads): whichever ends
    first, the other's value stays while it lives, and the object ends exactly as found."""
    for first_out in (0, 1):
        layer = Layer()
        owners = [Patches(), Patches()]
        owners[0].set_attr(layer, "scale", "a")
        owners[1].set_attr(layer, "scale", "b")
        owners[first_out].restore()
        assert layer.scale == ("b" if first_out == 0 else "a")
        owners[1 - first_out].restore()
        assert "scale" not in vars(layer)


def test_overlapping_calls_leave_the_model_as_found() -> None:
    """Per-call attaches that end in the order they started (what two threads' generate(tide=router) calls
    do) remove the compiled-call patch and every hook."""
    model = make_model()
    router = constant_router(model, -30.0)
    before = hooks(model)
    first = tide_hf.runtime.attach_for_call(model, router)
    second = tide_hf.runtime.attach_for_call(model, router)
    first.detach()
    assert "get_compiled_call" in vars(model)  # the second call's patch is still in place
    second.detach()
    assert "get_compiled_call" not in vars(model) and hooks(model) == before


def test_accelerate_old_forward_is_the_one_replaced() -> None:
    layer = Layer()
    layer._old_forward = layer.forward  # what accelerate's add_hook_to_module leaves on the instance
    saved = layer._old_forward
    patches = Patches()
    patches.replace_forward(layer, lambda original: lambda x: original(x) * 10)
    assert "forward" not in vars(layer) and layer._old_forward(torch.zeros(1)).item() == 10.0
    patches.restore()
    assert layer._old_forward is saved and len(patches) == 0


def test_config_values_and_aliases_come_back() -> None:
    config = GPT2Config(n_layer=6)  # num_hidden_layers is an alias of n_layer (attribute_map)
    with Patches() as patches:
        patches.set_attr(config, "num_hidden_layers", 2)
        patches.set_attr(config, "num_hidden_layers", 1)  # nested changes undo newest first
        assert config.n_layer == 1
    assert config.n_layer == 6 and config.num_hidden_layers == 6


def test_class_attribute_comes_back() -> None:
    original = Layer.forward
    with Patches() as patches:
        patches.set_attr(Layer, "forward", lambda self, x: x)
        assert Layer()(torch.zeros(1)).item() == 0.0
    assert Layer.forward is original


def test_handle_is_a_context_manager_that_detaches_on_errors() -> None:
    model = make_model()
    before = hooks(model)
    ids, mask = left_padded()
    with pytest.raises(RuntimeError, match="boom"), tide_hf.attach(model, constant_router(model, 30.0),
                                                                   mode="skip", kv="propagate") as handle:
        assert tide_hf.get_handle(model) is handle and hooks(model) != before
        model(input_ids=ids, attention_mask=mask)
        raise RuntimeError("boom")
    assert tide_hf.get_handle(model) is None and hooks(model) == before
    assert not any("forward" in vars(layer) for layer in model.model.layers), "skip-mode forwards left behind"


def test_class_descriptors_are_restored() -> None:
    """A staticmethod / classmethod patched on a class is put back: `getattr` returns the function inside the
    descriptor, so comparing it with the stored patch found nothing to restore."""
    class Holder:
        @staticmethod
        def build() -> str:
            return "stock"

        @classmethod
        def name(cls) -> str:
            return "stock"

    found = dict(vars(Holder))
    with Patches() as patches:
        patches.set_attr(Holder, "build", staticmethod(lambda: "patched"))
        patches.set_attr(Holder, "name", classmethod(lambda cls: "patched"))
        assert Holder.build() == Holder.name() == "patched"
    assert Holder.build() == Holder.name() == "stock"
    assert vars(Holder)["build"] is found["build"] and vars(Holder)["name"] is found["name"]


def test_uninstall_under_another_wrapper_passes_through() -> None:
    """Another library wrapped `generate` after tide_hf: `disable_generate_keyword()` cannot unwrap theirs, so
    tide_hf's wrapper stays inside it and must pass through (stock refuses `tide=`, an attached router runs no exits
    in generate's statistics), and `enable_generate_keyword()` again must count a call once (two nested wrappers
    reset each other's stats)."""
    model = make_model()
    ids, mask = left_padded()
    router = constant_router(model, 30.0)
    call = {"input_ids": ids, "attention_mask": mask, "max_new_tokens": 3, "do_sample": False}
    with tide_hf.attach(model, router, exit_threshold=0.5, mode="select") as handle:
        model.generate(**call)
        expected = handle.last_stats
    disable_generate_keyword()
    stock = GenerationMixin.generate
    enable_generate_keyword()
    inner = GenerationMixin.generate

    def theirs(self, *args, **kwargs):  # e.g. a tracing library's wrapper
        return inner(self, *args, **kwargs)

    try:
        GenerationMixin.generate = theirs
        disable_generate_keyword()
        assert GenerationMixin.generate is theirs
        with pytest.raises((TypeError, ValueError), match="tide"):
            model.generate(**call, tide=router)
        enable_generate_keyword()
        with tide_hf.attach(model, router, exit_threshold=0.5, mode="select") as handle:
            model.generate(**call)
            assert handle.last_stats.prefill.tokens == expected.prefill.tokens > 0
            assert handle.last_stats.decode.exits == expected.decode.exits != {}
    finally:
        disable_generate_keyword()
        GenerationMixin.generate = stock
        enable_generate_keyword()


def test_generate_keyword_can_be_uninstalled_and_installed_again() -> None:
    model = make_model()
    ids, mask = left_padded()
    wrapped = GenerationMixin.generate
    try:
        disable_generate_keyword()
        assert GenerationMixin.generate is not wrapped and "tide" not in GenerationMixin.generate.__code__.co_varnames
        with pytest.raises((TypeError, ValueError)):  # stock generate rejects the unknown keyword
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=2, tide=True)
    finally:
        enable_generate_keyword()
    assert GenerationMixin.generate is not None and GenerationMixin.generate.__wrapped__ is not None
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=2, do_sample=False,
                         tide=constant_router(model, 30.0))
    assert out.shape == (3, ids.shape[1] + 2)


IMPORT_CHECK = """
import sys
{first}
import transformers.generation.utils as g
from transformers.models.auto.configuration_auto import CONFIG_MAPPING
before = (list(sys.meta_path), g.GenerationMixin.generate, g.GenerationMixin.init_continuous_batching)
{second}
after = (list(sys.meta_path), g.GenerationMixin.generate, g.GenerationMixin.init_continuous_batching)
print(before == after, "tide_router" in CONFIG_MAPPING, len(tide_hf.__all__))
tide_hf.enable_generate_keyword()
print(g.GenerationMixin.generate is before[1])
"""


@pytest.mark.parametrize("tide_first", [True, False])
def test_import_changes_nothing_in_transformers(tide_first: bool) -> None:
    """`import tide_hf` (before or after transformers) leaves `sys.meta_path`, `generate` and continuous batching as
    they were; `enable_generate_keyword()` is what wraps `generate`. After transformers it registers the router's
    model type with the Auto classes (so `AutoModel.from_pretrained` reads a router folder); before, it imports no
    transformers. A fresh process: this one enabled the keyword long ago."""
    first, second = ("import tide_hf", "") if tide_first else ("", "import tide_hf")
    script = IMPORT_CHECK.format(first=first, second=second)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["True", str(not tide_first), str(len(tide_hf.__all__)), "False"]
    assert len(tide_hf.__all__) <= 14 and "__version__" in tide_hf.__all__


def test_every_error_class_is_in_the_errors_room() -> None:
    """The top level keeps the base class only; every error class any room defines is importable from
    `tide_hf.errors` (a class defined elsewhere would be out of the hierarchy's one place)."""
    import importlib

    import tide_hf.errors as errors

    rooms = ("calibration", "eval.analyze", "eval.demo", "integrations", "kernels", "modeling", "plotting", "runtime")
    for room in rooms:
        importlib.import_module(f"tide_hf.{room}")
    found, todo = set(), [errors.TideError]
    while todo:
        cls = todo.pop()
        found.add(cls)
        todo.extend(c for c in cls.__subclasses__() if c.__module__.startswith("tide_hf"))
    assert len(found) >= 10
    assert all(getattr(errors, c.__name__, None) is c for c in found), sorted(c.__qualname__ for c in found)
    assert tide_hf.TideError is errors.TideError


WIRED_CHECK = """
import json, sys, torch, tide_hf
sys.path.insert(0, {tests!r})
from helpers import make_model, mixed_router
model = make_model()
ids = torch.randint(3, 256, (2, 7), generator=torch.Generator().manual_seed(0))
router = mixed_router(model, ids, exit_threshold=0.5)
runs = {{}}
for mode in ("select", "skip", "speculative"):
    with tide_hf.attach(model, router, mode=mode, exit_threshold=0.5) as handle:
        out = model.generate(input_ids=ids, max_new_tokens=5, do_sample=False, pad_token_id=0)
        runs[mode] = [out.tolist(), handle.last_stats.as_dict()["decode"]]
print(json.dumps({{"runs": runs, "left": "generate" in vars(model)}}))
"""


def test_attach_alone_wires_the_models_generate() -> None:
    """Without the generate keyword enabled, an attached model's own generate runs TIDE: the same tokens and decode
    statistics as with the keyword (this process has it enabled), in every mode; detach takes the wiring back.
    A fresh process: this one enabled the keyword long ago."""


    script = WIRED_CHECK.format(tests=str(Path(__file__).parent))
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = json.loads(proc.stdout.splitlines()[-1])
    model = make_model()
    ids = torch.randint(3, 256, (2, 7), generator=torch.Generator().manual_seed(0))
    router = mixed_router(model, ids, exit_threshold=0.5)
    for mode in ("select", "skip", "speculative"):
        with tide_hf.attach(model, router, mode=mode, exit_threshold=0.5) as handle:
            out = model.generate(input_ids=ids, max_new_tokens=5, do_sample=False, pad_token_id=0)
            decode = json.loads(json.dumps(handle.last_stats.as_dict()["decode"]))
        assert got["runs"][mode] == [out.tolist(), decode], mode
        assert decode["tokens"] > 0
    assert got["left"] is False and "generate" not in vars(model)


# -- refusals and odd but valid input ---------------------------------------------------------------------------
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
