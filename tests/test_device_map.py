"""Models dispatched by accelerate, with offloaded layers: TIDE behaves as on the same model undispatched.

On the CPU, part of the model is offloaded: its weights sit on the meta device and accelerate's hooks load
them around each forward, from an offload folder (`dispatch_model` with "disk" entries, or
`from_pretrained(device_map=..., offload_folder=...)`) or from a CPU weights map (`cpu_offload`). The
checkpoint layers 4 and 8, the last layer and the final norm are offloaded (with `cpu_offload`, everything).
"""

from __future__ import annotations

import copy

import pytest
import torch
from accelerate import cpu_offload, dispatch_model
from helpers import ByteTokenizer, make_model, new_router
from transformers import AutoModelForCausalLM

import tide_hf
from tide_hf.integrations.draft import DraftEstimates
from tide_hf.modeling.devices import execution_device

OFFLOADED_LAYERS = (3, 5, 7, 8)  # 0-based: checkpoint layers 4 and 8 and the last layer among them
NEW = 8
MODES = {"select": {"mode": "select"}, "skip-propagate": {"mode": "skip", "kv": "propagate"},
         "skip-recompute": {"mode": "skip", "kv": "recompute"},
         "speculative": {"mode": "speculative", "draft_layer": 4}}
HOOK_ATTRS = ("_hf_hook", "_old_forward", "forward")
HOOK_DICTS = ("_forward_hooks", "_forward_pre_hooks", "_forward_hooks_with_kwargs", "_forward_pre_hooks_with_kwargs")


pytestmark = pytest.mark.usefixtures("one_intra_op_thread")


def device_map(offload: str, main: str | int = "cpu") -> dict[str, str | int]:
    layers = {f"model.layers.{i}": offload if i in OFFLOADED_LAYERS else main for i in range(9)}
    return {"model.embed_tokens": main, "model.rotary_emb": main, **layers, "model.norm": offload, "lm_head": main}


@pytest.fixture(scope="module")
def reference():
    return make_model()


@pytest.fixture(scope="module", params=["dispatch_disk", "cpu_offload", "from_pretrained"])
def dispatched(request, reference, tmp_path_factory):
    """The reference model's weights, dispatched with offloaded modules (their parameters on meta)."""
    folder = tmp_path_factory.mktemp(request.param)
    if request.param == "dispatch_disk":
        model = dispatch_model(copy.deepcopy(reference), device_map("disk"), offload_dir=str(folder / "offload"))
    elif request.param == "cpu_offload":
        model = cpu_offload(copy.deepcopy(reference), execution_device="cpu")
    else:
        reference.save_pretrained(folder / "model")
        model = AutoModelForCausalLM.from_pretrained(folder / "model", device_map=device_map("disk"),
                                                     offload_folder=str(folder / "offload")).eval()
    layers = model.model.layers
    assert all(p.device.type == "meta" for i in OFFLOADED_LAYERS for p in layers[i].parameters())
    assert model.model.norm.weight.device.type == "meta"
    return model


@torch.no_grad()
def mixed_router(model) -> tide_hf.TideRouter:
    """Saturated random scores around 0.5: some tokens exit at 4, some at 8, some never. Its metrics promise
    speculative mode a gain, so a call's first draft goes ahead before any timing is known."""
    router = new_router(model, label="top1", metrics={"4": {"predicted_rate": 0.5, "precision": 1.0}})
    for mlp in router.routers.values():
        mlp.fc2.weight.mul_(40.0)
        mlp.fc2.bias.zero_()
    return router


def prompts() -> list[dict[str, torch.Tensor]]:
    """One row (skip mode skips whole steps) and a left-padded batch of two."""
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 256, (2, 7), generator=gen)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    return [{"input_ids": ids[:1]}, {"input_ids": ids, "attention_mask": mask}]


def generate(model, router, **options) -> list[tuple[torch.Tensor, dict]]:
    """Greedy continuations of `prompts()` with `router` attached, and their exit statistics."""
    device = execution_device(model.get_input_embeddings())
    handle = tide_hf.attach(model, router, exit_threshold=options.pop("exit_threshold", 0.5), **options)
    try:
        results = []
        for inputs in prompts():
            out = model.generate(**{k: v.to(device) for k, v in inputs.items()}, max_new_tokens=NEW, do_sample=False)
            results.append((out, handle.last_stats.as_dict()))
        return results
    finally:
        handle.detach()


def accelerate_state(model) -> dict:
    """What accelerate put on each module (hook objects, saved and wrapped forwards) and every hook dict."""
    return {name: ({a: module.__dict__.get(a) for a in HOOK_ATTRS}, {d: dict(getattr(module, d)) for d in HOOK_DICTS},
                   {n: p.device for n, p in module.named_parameters(recurse=False)})
            for name, module in model.named_modules()}


def test_fingerprint_reads_offloaded_weights(reference, dispatched) -> None:
    assert tide_hf.modeling.model_fingerprint(dispatched) == tide_hf.modeling.model_fingerprint(reference)
    tide_hf.TideRouter.check_compatible(new_router(reference), dispatched)  # no ignore_fingerprint needed


def test_routers_and_norm_sit_on_the_execution_device(reference, dispatched) -> None:
    router = mixed_router(reference)
    before = {k: v.clone() for k, v in router.state_dict().items()}
    handle = tide_hf.attach(dispatched, router, mode="select")
    try:
        assert all(p.device == torch.device("cpu") for p in router.parameters())  # not meta, where layers 4, 8 are
        assert all(torch.equal(before[k], v) for k, v in router.state_dict().items())
        spec = handle._norm_specs[4]  # the offloaded final norm was read for the fused kernel
        assert spec is not None and torch.equal(spec.weight, reference.model.norm.weight)
    finally:
        handle.detach()
    assert dispatched.model.norm.weight.device.type == "meta"  # and offloaded again


def test_threshold_one_is_stock(reference, dispatched) -> None:
    router = mixed_router(reference)
    for inputs, (out, _) in zip(prompts(), generate(dispatched, router, exit_threshold=1.0)):
        assert torch.equal(out, reference.generate(**inputs, max_new_tokens=NEW, do_sample=False))


@pytest.mark.parametrize("mode", list(MODES))
def test_every_mode_gives_the_undispatched_tokens(reference, dispatched, mode, monkeypatch) -> None:
    if mode == "speculative":  # drafting is what is checked here, not the policy: always plan two draft tokens
        monkeypatch.setattr(DraftEstimates, "plan", lambda self, room: (min(2, room), 2.0))
    router = mixed_router(reference)
    expected = generate(reference, router, **MODES[mode])
    got = generate(dispatched, router, **MODES[mode])
    for (out, stats), (ref_out, ref_stats) in zip(got, expected):
        assert torch.equal(out, ref_out)
        if mode != "speculative":  # speculative drafting depends on wall-clock timings; its output does not
            assert stats == ref_stats
    if mode.startswith("skip"):
        assert got[0][1]["decode"]["mean_executed"] < 9  # layers were really skipped
    if mode == "speculative":
        for inputs, (out, stats) in zip(prompts(), got):
            assert torch.equal(out, reference.generate(**inputs, max_new_tokens=NEW, do_sample=False))
            # stock assisted decoding moves tokens to `model.device`: all-offloaded models decode stock
            offloaded_first = dispatched.device.type == "meta"
            assert (stats["speculative"]["fallback"] is not None) == offloaded_first
            assert offloaded_first or stats["speculative"]["draft_forwards"] > 0


@pytest.mark.parametrize("mode", ["select", "skip-propagate", "skip-recompute", "speculative"])
def test_detach_leaves_accelerate_hooks_exactly_as_they_were(reference, dispatched, mode) -> None:
    before = accelerate_state(dispatched)
    generate(dispatched, mixed_router(reference), **MODES[mode])
    after = accelerate_state(dispatched)
    assert after.keys() == before.keys()
    for name in before:
        attrs, hooks, devices = before[name]
        assert all(after[name][0][a] is attrs[a] for a in HOOK_ATTRS), name
        assert after[name][1] == hooks and after[name][2] == devices, name


def test_skip_mode_patches_accelerates_saved_forward(reference, dispatched) -> None:
    """On a layer accelerate wrapped, skip mode replaces `_old_forward` and keeps accelerate's `forward`."""
    wrapped = [layer for layer in dispatched.model.layers[4:] if hasattr(layer, "_hf_hook")]
    assert wrapped or dispatched.device.type == "meta"  # cpu_offload hooks only the modules owning weights
    before = [(layer.__dict__["forward"], layer.__dict__["_old_forward"]) for layer in wrapped]
    handle = tide_hf.attach(dispatched, mixed_router(reference), mode="skip", kv="propagate")
    try:
        for layer, (forward, old_forward) in zip(wrapped, before):
            assert layer.__dict__["forward"] is forward and layer.__dict__["_old_forward"] is not old_forward
    finally:
        handle.detach()
    assert [(layer.__dict__["forward"], layer.__dict__["_old_forward"]) for layer in wrapped] == before


def test_calibration_on_the_dispatched_model_equals_undispatched(reference, dispatched, text_folder) -> None:
    settings = dict(num_samples=12, seq_len=48, batch_size=4, label="top1", num_epochs=3, progress=False)
    ours = tide_hf.calibrate(dispatched, ByteTokenizer(), str(text_folder), **settings)
    theirs = tide_hf.calibrate(reference, ByteTokenizer(), str(text_folder), **settings)
    # the same arithmetic on the same device, weights loaded from the offload map: exactly equal
    assert all(torch.equal(ours.state_dict()[key], value) for key, value in theirs.state_dict().items())
    assert ours.config.metrics == theirs.config.metrics
    assert ours.config.base_fingerprint == theirs.config.base_fingerprint


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("mode", list(MODES))
def test_cuda_with_cpu_offloaded_layers(reference, mode) -> None:
    """cuda:0 runs everything; the offloaded modules' weights live in CPU memory (device map entry "cpu")."""
    on_gpu = copy.deepcopy(reference).to("cuda:0")
    split = dispatch_model(copy.deepcopy(reference), device_map("cpu", main=0), main_device=0)
    assert all(p.device.type == "meta" for p in split.model.layers[3].parameters())
    router = mixed_router(reference)
    expected = generate(on_gpu, router, **MODES[mode])
    got = generate(split, router, **MODES[mode])
    assert all(p.device == torch.device("cuda:0") for p in router.parameters())
    for (out, _), (ref_out, _) in zip(got, expected):
        assert torch.equal(out.cpu(), ref_out.cpu())


def test_propagate_on_layers_offloaded_whole_gives_the_undispatched_tokens() -> None:
    """With `preload_module_classes` accelerate loads a whole decoder layer around its forward, so its norm and
    projections have no hook of their own: attach's check of propagate must bring the weights in like the
    forward does (it refused: 'Tensor on device cpu is not on the expected device meta')."""
    reference = make_model()
    router = new_router(reference)
    ids = torch.tensor([[5, 17, 99, 42, 7]])
    with tide_hf.attach(reference, router, mode="skip", kv="propagate", exit_threshold=0.0, min_layers=4):
        expected = reference.generate(ids, max_new_tokens=6, do_sample=False)
    model = cpu_offload(copy.deepcopy(reference), execution_device="cpu",
                        preload_module_classes=[type(reference.model.layers[0]).__name__])
    with tide_hf.attach(model, router, mode="skip", kv="propagate", exit_threshold=0.0, min_layers=4):
        assert torch.equal(model.generate(ids, max_new_tokens=6, do_sample=False), expected)


def test_offloaded_weights_brought_in_per_forward_are_not_a_change_of_weights(monkeypatch) -> None:
    """accelerate brings an offloaded weight in as a new tensor for each forward: the weights watch took that
    for new weights and computed the fingerprint again at every call (reading every offloaded tensor)."""
    from tide_hf.runtime import pairing

    model = make_model()
    router = new_router(model)
    offloaded = cpu_offload(copy.deepcopy(model), execution_device="cpu")
    checks = []
    monkeypatch.setattr(pairing, "same_weights", lambda *a, **k: checks.append(a) or True)
    with tide_hf.attach(offloaded, router, exit_threshold=0.5, mode="select"):
        for _ in range(3):
            offloaded.generate(torch.tensor([[5, 6, 7, 8]]), max_new_tokens=3, do_sample=False)
    assert checks == []
