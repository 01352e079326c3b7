"""Calibration: provenance, reproducibility, token-id input, labels against an independent forward pass, AUC,
bad input, the silent-label warning, the memory bound, and one real-model run (router training itself:
test_training.py)."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from helpers import ByteTokenizer, make_model, make_tiny_llama, router_config

import tide_hf
from tide_hf import TideRouter, TideRouterConfig, calibrate
from tide_hf.calibration import calibrate_tokens, make_samples
from tide_hf.calibration.labels import collect, label
from tide_hf.calibration.training import auc
from tide_hf.errors import TideArgumentError, TideArgumentTypeError, TideCompatibilityError, TideDataError
from tide_hf.modeling import get_adapter, model_fingerprint

FAST = dict(seq_len=32, num_epochs=3, router_bottleneck_dim=16, progress=False)
METRIC_KEYS = {"positive_rate", "predicted_rate", "precision", "recall", "auc", "best_epoch", "val_loss",
               "n_train", "n_val", "label_rates"}


def tide_warnings(record: list[warnings.WarningMessage]) -> list[str]:
    """The silent-label warnings among `record`."""
    return [str(w.message) for w in record if "TIDE calibration: label" in str(w.message)]


# --- calibrate() end to end on a tiny random Llama ------------------------------------------------------


@pytest.mark.parametrize("source", ["text_folder", "jsonl_file"])
def test_calibrate_records_provenance_and_metrics(source, request, tiny_llama, byte_tokenizer) -> None:
    path = request.getfixturevalue(source)
    tiny_llama.train()  # calibrate runs in eval mode and restores the caller's mode
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        router = calibrate(tiny_llama, byte_tokenizer, str(path), num_samples=24, label="top1", **FAST)
    assert tiny_llama.training
    tiny_llama.eval()
    assert tide_warnings(record) == []  # top1 fires on this model: no silent-label warning

    assert isinstance(router, TideRouter)
    cfg = router.config
    assert cfg.base_architecture == "LlamaForCausalLM" and cfg.base_model_type == "llama"
    assert (cfg.num_hidden_layers, cfg.hidden_size) == (9, 32)
    assert cfg.base_fingerprint == model_fingerprint(tiny_llama)
    assert (cfg.dataset, cfg.num_samples, cfg.seq_len, cfg.label) == (str(path), 24, 32, "top1")
    assert cfg.checkpoint_layers == [4, 8]
    assert sorted(router.routers) == ["4", "8"]  # no router after the final (9th) layer
    assert tuple(router.routers["4"].fc1.weight.shape) == (16, 32)
    assert set(cfg.calibration_seconds) == {"forward", "label", "train"}
    assert sorted(cfg.metrics) == ["4", "8"]
    for m in cfg.metrics.values():
        assert METRIC_KEYS <= set(m)
        assert 0.0 < m["positive_rate"] < 1.0 and m["auc"] is not None and 0.0 <= m["auc"] <= 1.0
        assert m["n_train"] > 0 and m["n_val"] > 0
        # 24 samples, validation_fraction 0.1: the last ceil(2.4) = 3 samples are held out, <= 32 tokens each
        assert m["n_val"] <= 3 * 32 and m["n_train"] + m["n_val"] <= 24 * 32
        assert set(m["label_rates"]) == {"cosine", "top1", "kl", "top1_kl"}
        assert m["label_rates"]["top1"] > 0.0


def test_calibrate_is_reproducible(tiny_llama, byte_tokenizer, text_folder) -> None:
    def run(seed: int) -> TideRouter:
        return calibrate(tiny_llama, byte_tokenizer, str(text_folder), num_samples=16, label="top1", seed=seed,
                         **FAST)

    first, second, other = run(0), run(0), run(1)
    a, b, c = first.state_dict(), second.state_dict(), other.state_dict()
    assert a.keys() == b.keys() == c.keys()
    assert all(torch.equal(a[name], b[name]) for name in a)
    assert first.config.metrics == second.config.metrics
    assert any(not torch.equal(a[name], c[name]) for name in a)


def test_calibrate_leaves_the_callers_random_state_and_each_modules_training_flag(byte_tokenizer, text_folder):
    """Calibration re-seeded torch's global RNG (a caller seeding 1 or 2 drew the same numbers after it) and put
    every submodule's training flag to the model's (a block in train mode inside an eval model came back in eval)."""
    model = make_tiny_llama()
    model.model.layers[2].train()
    flags = [m.training for m in model.modules()]
    draws = []
    for seed in (1, 2):
        torch.manual_seed(seed)
        expected = torch.rand(3, generator=torch.Generator().set_state(torch.get_rng_state()))
        calibrate(model, byte_tokenizer, str(text_folder), num_samples=8, **FAST)
        draws.append(torch.rand(3))
        assert torch.equal(draws[-1], expected)
    assert not torch.equal(*draws)
    assert [m.training for m in model.modules()] == flags


def test_output_fields_and_a_singular_exit_head_fit_are_refused(tiny_llama) -> None:
    """`metrics=` / `exit_paths=` were accepted as calibrate keywords (the card showed a row for a layer that is no
    checkpoint); a fit on one training token was a raw torch LinAlgError."""
    samples = [torch.tensor([5]), torch.arange(3, 19), torch.arange(20, 36)]  # only the 1-token sample trains
    for key in ("metrics", "exit_paths", "calibration_seconds"):
        with pytest.raises(TypeError, match=f"unexpected keyword argument '{key}'"):
            calibrate_tokens(tiny_llama, samples, progress=False, **{key: {}})
    with pytest.raises(ValueError, match=r"exit heads' least-squares fit is singular \(exit_head_ridge=0.01"):
        calibrate_tokens(tiny_llama, samples, num_epochs=1, progress=False)


def test_calibrate_tokens_equals_calibrate_on_the_same_samples(tiny_llama, byte_tokenizer, text_folder) -> None:
    """Token ids given directly give the router `calibrate` makes from text that tokenizes to them."""
    from tide_hf.calibration import calibrate_tokens, load_texts

    from_text = calibrate(tiny_llama, byte_tokenizer, str(text_folder), num_samples=16, label="top1", **FAST)
    fast = {k: v for k, v in FAST.items() if k != "seq_len"}
    samples = make_samples(byte_tokenizer, load_texts(str(text_folder)), 16, FAST["seq_len"], 0)
    from_ids = calibrate_tokens(tiny_llama, samples, label="top1", **fast)
    a, b = from_text.state_dict(), from_ids.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)
    assert from_ids.config.metrics == from_text.config.metrics
    assert (from_ids.config.num_samples, from_ids.config.seq_len, from_ids.config.dataset) == (16, 32, None)
    for bad in ([], [torch.tensor([1.5, 2.0])], [torch.ones(2, 3, dtype=torch.long)], "abc"):
        with pytest.raises(TypeError, match="1-D integer token tensors"):
            calibrate_tokens(tiny_llama, bad, **fast)


# --- collect() + label(): labels against an independent forward pass -------------------------------------


def collect_labelled(model, samples: list[torch.Tensor], cfg: TideRouterConfig, batch_size: int,
                     router: TideRouter | None = None):
    """collect() then label() with `router`'s exit heads (default: a router of `cfg`, the model's own head)."""
    adapter = get_adapter(model)
    data = collect(model, adapter, samples, cfg, batch_size=batch_size, pad_id=0, progress=False)
    label(data, adapter, router or TideRouter(cfg), device=torch.device("cpu"), progress=False)
    return data


def reference(model, samples: list[torch.Tensor], layers: list[int]):
    """Per-sample, unpadded, through the full CausalLM: hidden_states[k] is the k-th layer's output
    (pre-norm); the last entry of hidden_states is AFTER model.norm, so the pre-norm final output is
    taken with a hook on the last layer. Exit logits use the model's own norm and lm_head."""
    captured = []
    handle = model.model.layers[-1].register_forward_hook(
        lambda _m, _a, out: captured.append(out[0] if isinstance(out, tuple) else out))
    ref = {k: {"features": [], "cosine": [], "top1": [], "kl": [], "margin": [], "nll": []} for k in layers}
    try:
        with torch.no_grad():
            for s in samples:
                out = model(input_ids=s[None], output_hidden_states=True, use_cache=False)
                h_final = captured.pop()[0]
                assert torch.allclose(out.hidden_states[-1][0], model.model.norm(h_final), atol=1e-6)
                final_logits = out.logits[0]
                p_final = final_logits.log_softmax(-1)
                for k in layers:
                    h = out.hidden_states[k][0]
                    exit_logits = model.lm_head(model.model.norm(h))
                    q = exit_logits.log_softmax(-1)
                    top2_exit = exit_logits.topk(2).values
                    top2_final = final_logits.topk(2).values
                    r = ref[k]
                    r["features"].append(model.model.norm(h))
                    r["cosine"].append((h * h_final).sum(-1) / (h.norm(dim=-1) * h_final.norm(dim=-1)))
                    r["top1"].append(exit_logits.argmax(-1) == final_logits.argmax(-1))
                    r["kl"].append((p_final.exp() * (p_final - q)).sum(-1))
                    nxt = s[1:, None]  # the NLL change of each position's next token; none after the last
                    change = (p_final[:-1].gather(1, nxt) - q[:-1].gather(1, nxt)).squeeze(1)
                    r["nll"].append(torch.cat([change, torch.tensor([float("nan")])]))
                    r["margin"].append(torch.minimum(top2_exit[:, 0] - top2_exit[:, 1],
                                                     top2_final[:, 0] - top2_final[:, 1]))
    finally:
        handle.remove()
    return {k: {name: torch.cat(v) for name, v in r.items()} for k, r in ref.items()}


@pytest.fixture(scope="module")
def ragged_samples() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    return [torch.randint(3, 256, (n,), generator=gen) for n in (5, 32, 17, 9, 28, 12, 3, 21)]


def test_collect_labels_match_independent_forward(tiny_llama, ragged_samples) -> None:
    cfg = TideRouterConfig(hidden_size=32, num_hidden_layers=9, label="top1", max_train_tokens=10**6, exit_head="lens")
    data = collect_labelled(tiny_llama, ragged_samples, cfg, 3)
    total = sum(len(s) for s in ragged_samples)
    # every real token kept, in order; no padding token (batches of 3 ragged samples are right-padded)
    assert data.is_val.shape == (total,) and bool(data.labelled["top1"].all())
    # the KL is not the label: only held-out tokens get it (it is reported, not trained on)
    assert torch.equal(data.labelled["kl"], data.is_val) and bool(data.kl[4][~data.is_val].isnan().all())
    # held out: validation, the ceil(0.1 * 8) = 1 sample before the threshold split's last ceil(0.1 * 8) = 1
    held = len(ragged_samples[-1]) + len(ragged_samples[-2])
    assert data.is_val.tolist() == [False] * (total - held) + [True] * held
    assert data.is_test.tolist() == [False] * (total - len(ragged_samples[-1])) + [True] * len(ragged_samples[-1])
    ref = reference(tiny_llama, ragged_samples, [4, 8])
    for k in (4, 8):
        r = ref[k]
        assert data.features[k].shape == (total, 32)
        torch.testing.assert_close(data.features[k], r["features"], atol=2e-5, rtol=1e-4)
        torch.testing.assert_close(data.cosine[k], r["cosine"], atol=2e-5, rtol=1e-4)
        val = data.is_val
        torch.testing.assert_close(data.kl[k][val], r["kl"][val], atol=2e-5, rtol=1e-3)  # fp32 cancellation
        torch.testing.assert_close(data.nll[k][val], r["nll"][val], atol=2e-4, rtol=1e-3, equal_nan=True)
        assert bool(data.nll[k][~val].isnan().all()) and int(data.nll[k][val].isnan().sum()) == 2  # last positions
        clear = r["margin"] > 1e-4  # argmax is ill-defined under near-ties
        assert clear.float().mean() > 0.9
        assert torch.equal(data.top1[k][clear], r["top1"][clear])
        assert 0 < int(r["top1"].sum()) < total  # both classes present: the comparison is not vacuous
    # the label compares with the PRE-norm final state: the normed one (hidden_states[-1]) gives other values
    normed_final = reference_normed_final_cosine(tiny_llama, ragged_samples, 4)
    assert (normed_final - data.cosine[4]).abs().max() > 1e-3


def test_collect_kl_label_computes_kl_for_every_token(tiny_llama, ragged_samples) -> None:
    cfg = TideRouterConfig(hidden_size=32, num_hidden_layers=9, label="kl", max_train_tokens=10**6, exit_head="lens")
    data = collect_labelled(tiny_llama, ragged_samples, cfg, 3)
    assert bool(data.labelled["kl"].all()) and bool(data.labelled["top1"].all())
    ref = reference(tiny_llama, ragged_samples, [4])
    torch.testing.assert_close(data.kl[4], ref[4]["kl"], atol=2e-5, rtol=1e-3)
    cfg.kl_threshold = float(ref[4]["kl"].median())  # a random model's KLs are large: put the bound among them
    clear = (ref[4]["kl"] - cfg.kl_threshold).abs() > 1e-4  # rows on the bound may round either way
    assert torch.equal(data.labels(4, cfg)[clear], (ref[4]["kl"] < cfg.kl_threshold)[clear])
    assert 0 < int(data.labels(4, cfg).sum()) < len(clear)  # both classes: the comparison is not vacuous


@pytest.mark.parametrize("family", ["granite", "cohere"])
def test_labels_are_measured_on_the_logits_the_model_serves(family: str, ragged_samples) -> None:
    """Granite divides its logits by `logits_scaling` and Cohere multiplies them by `logit_scale` after the head:
    KL / NLL labels, the perplexity path and its certificate must see those logits. Reference: the model's own
    logits, stock and with every token served its exit at layer 4 (the model's forward through TIDE's hook)."""
    from helpers import scaled_logit_model

    import tide_hf

    model = scaled_logit_model(family, 0.25 if family == "granite" else 4.0, vocab=256, layers=9)
    with torch.no_grad():  # norms away from 1 and a peaked head: exits at layer 4 are far from the final layer
        for param in model.parameters():
            if param.dim() == 1:
                param.copy_(torch.randn_like(param) * 0.5 + 1.0)
        model.lm_head.weight.mul_(5.0)
    cfg = TideRouterConfig(hidden_size=32, num_hidden_layers=9, label="kl", max_train_tokens=10**6, exit_head="lens")
    data = collect_labelled(model, ragged_samples, cfg, 3)
    scale = 4.0  # both configs multiply the head's logits by 4
    kl, nll, unscaled = [], [], []
    with torch.no_grad():
        for s in ragged_samples:
            final = model(input_ids=s[None]).logits[0]
            with tide_hf.attach(model, TideRouter(cfg), exit_threshold=0.0, min_layers=4, ignore_fingerprint=True,
                                mode="select"):
                served = model(input_ids=s[None]).logits[0]
            for out, factor in ((kl, 1.0), (unscaled, scale)):  # the model's logits / without its scale
                p, q = (final / factor).log_softmax(-1), (served / factor).log_softmax(-1)
                out.append((p.exp() * (p - q)).sum(-1))
            p, q = final.log_softmax(-1), served.log_softmax(-1)
            change = (p[:-1].gather(1, s[1:, None]) - q[:-1].gather(1, s[1:, None])).squeeze(1)
            nll.append(torch.cat([change, torch.tensor([float("nan")])]))
    torch.testing.assert_close(data.kl[4], torch.cat(kl), atol=2e-5, rtol=1e-3)
    torch.testing.assert_close(data.nll[4], torch.cat(nll), atol=2e-4, rtol=1e-3, equal_nan=True)
    assert float((torch.cat(unscaled) - torch.cat(kl)).abs().max()) > 1e-2  # the scale matters here


def reference_normed_final_cosine(model, samples: list[torch.Tensor], layer: int) -> torch.Tensor:
    with torch.no_grad():
        outs = [model(input_ids=s[None], output_hidden_states=True, use_cache=False).hidden_states for s in samples]
    return torch.cat([F.cosine_similarity(hs[layer][0], hs[-1][0], dim=-1) for hs in outs])


def test_collect_subsample_keeps_only_real_tokens(tiny_llama, ragged_samples) -> None:
    total = sum(len(s) for s in ragged_samples)
    cfg = TideRouterConfig(hidden_size=32, num_hidden_layers=9, label="top1", max_train_tokens=total // 3,
                           exit_head="lens")
    data = collect_labelled(tiny_llama, ragged_samples, cfg, 4)
    n = data.is_val.numel()
    assert 0 < n < total
    ref = reference(tiny_llama, ragged_samples, [4, 8])
    # each kept row is one real token of the reference (matched by its features), in order, without repeats
    dist = torch.cdist(data.features[8], ref[8]["features"], compute_mode="donot_use_mm_for_euclid_dist")
    match = dist.argmin(1)
    assert float(dist.min(1).values.max()) < 1e-4
    assert bool((match[1:] > match[:-1]).all())
    for k in (4, 8):
        torch.testing.assert_close(data.cosine[k], ref[k]["cosine"][match], atol=2e-5, rtol=1e-4)
        clear = ref[k]["margin"][match] > 1e-4
        assert torch.equal(data.top1[k][clear], ref[k]["top1"][match][clear])


def test_memory_bound_does_not_scale_with_samples(tiny_llama, byte_tokenizer, text_folder) -> None:
    budget = 150
    kept = {}
    for num_samples in (16, 64):
        router = calibrate(tiny_llama, byte_tokenizer, str(text_folder), num_samples=num_samples, label="top1",
                           max_train_tokens=budget, **FAST)
        assert router.config.num_samples == num_samples
        m = router.config.metrics["8"]
        kept[num_samples] = m["n_train"] + m["n_val"]
    # 16 and 64 samples hold ~500 and ~2000 tokens; both keep ~budget (binomial, sd ~ 11)
    assert all(0.6 * budget <= n <= 1.4 * budget for n in kept.values()), kept
    # the unbounded run keeps everything: the bound is what makes the difference
    samples = make_samples(byte_tokenizer, [p.read_text() for p in sorted(text_folder.iterdir())],
                                         64, 32, seed=0)
    cfg = TideRouterConfig(hidden_size=32, num_hidden_layers=9, label="cosine", max_train_tokens=budget,
                           exit_head="lens")
    data = collect_labelled(tiny_llama, samples, cfg, 8)
    assert sum(len(s) for s in samples) > 10 * budget
    assert data.features[4].shape[0] == data.features[8].shape[0] == data.is_val.numel() <= 1.4 * budget
    # cosine label: head-based labels computed only on held-out rows
    assert torch.equal(data.labelled["top1"], data.is_val) and torch.equal(data.labelled["kl"], data.is_val)


# --- auc ----------------------------------------------------------------------------------------------


def brute_forceauc(scores: torch.Tensor, labels: torch.Tensor) -> float:
    """P(score of a positive > score of a negative), ties counting 1/2, over all pairs."""
    diff = scores[labels][:, None] - scores[~labels][None, :]
    return float((diff > 0).double().mean() + 0.5 * (diff == 0).double().mean())


@pytest.mark.parametrize("levels", [None, 5, 1], ids=["continuous", "ties", "all-equal"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_auc_matches_brute_force(levels: int | None, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    labels = torch.rand(257, generator=gen) < 0.3
    scores = torch.rand(257, generator=gen) + 0.3 * labels  # informative but overlapping
    if levels is not None:
        scores = (scores * levels).floor() / levels  # many exact ties (like sigmoids saturated at 1.0)
    assert auc(scores, labels) == pytest.approx(brute_forceauc(scores, labels), abs=1e-12)


def test_auc_edge_cases() -> None:
    assert auc(torch.rand(10), torch.zeros(10, dtype=torch.bool)) is None
    assert auc(torch.rand(10), torch.ones(10, dtype=torch.bool)) is None
    assert auc(torch.tensor([0.1, 0.2, 0.8, 0.9]), torch.tensor([False, False, True, True])) == 1.0
    assert auc(torch.tensor([0.9, 0.8, 0.2, 0.1]), torch.tensor([False, False, True, True])) == 0.0


# --- bad input ------------------------------------------------------------------------------------------


@pytest.fixture
def offline(monkeypatch) -> None:
    """Offline Hub for this test: the environment, and the constants libraries read at import time."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    import datasets.config
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True, raising=False)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True, raising=False)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_OFFLINE", True, raising=False)


@pytest.mark.parametrize("name", ["missing_dir", "tide-test-org/no-such-dataset"])
def test_unloadable_dataset_raises_naming_it(name, offline, tmp_path, tiny_llama, byte_tokenizer) -> None:
    dataset = str(tmp_path / name) if name == "missing_dir" else name
    with pytest.raises(TideDataError) as info:
        calibrate(tiny_llama, byte_tokenizer, dataset, num_samples=4, label="top1", **FAST)
    assert repr(dataset) in str(info.value)


def test_empty_or_wrong_local_dataset_raises(tmp_path, tiny_llama, byte_tokenizer) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(TideDataError, match=r"no text files"):
        calibrate(tiny_llama, byte_tokenizer, str(empty), num_samples=4, **FAST)
    records = tmp_path / "records.jsonl"
    records.write_text('{"body": "some words here"}\n')
    with pytest.raises(TideDataError, match=r"no column 'text'"):
        calibrate(tiny_llama, byte_tokenizer, str(records), num_samples=4, **FAST)


def test_invalid_label_raises(tiny_llama, byte_tokenizer, text_folder) -> None:
    with pytest.raises(ValueError, match=r"label must be one of \('cosine', 'top1', 'kl', 'top1_kl'\), got 'entropy'"):
        calibrate(tiny_llama, byte_tokenizer, str(text_folder), num_samples=4, label="entropy", **FAST)


def test_too_shallow_model_raises(byte_tokenizer, text_folder) -> None:
    shallow = make_tiny_llama(num_layers=4)
    with pytest.raises(ValueError, match=r"no checkpoint layers: a model with 4 layers and checkpoint_interval=4"):
        calibrate(shallow, byte_tokenizer, str(text_folder), num_samples=4, **FAST)
    # the same model calibrates with a finer interval
    router = calibrate(shallow, byte_tokenizer, str(text_folder), num_samples=8, checkpoint_interval=2,
                       label="top1", **FAST)
    assert router.config.checkpoint_layers == [2]


# --- the silent-label warning ---------------------------------------------------------------------------


def test_silent_label_warns_and_suggests_another(tiny_llama, byte_tokenizer, text_folder) -> None:
    with pytest.warns(UserWarning, match=r"TIDE calibration") as record:
        router = calibrate(tiny_llama, byte_tokenizer, str(text_folder), num_samples=16, label="cosine",
                           convergence_threshold=1.0, **FAST)
    rates = {k: m["label_rates"] for k, m in router.config.metrics.items()}
    assert all(r["cosine"] == 0.0 for r in rates.values())
    message = tide_warnings(record.list)
    assert len(message) == 1
    message = message[0]
    assert "label 'cosine' (threshold 1.0)" in message and "EVERY checkpoint" in message
    top1 = max(r["top1"] for r in rates.values())
    assert top1 > 0 and f"label='top1' fires for up to {top1:.1%}" in message
    assert "label='kl'" in message and "recalibrate" in message


def test_the_silent_label_warning_names_checkpoints_silent_on_the_training_tokens() -> None:
    """A checkpoint without a positive training token (a never-firing constant router) but with held-out positives
    was left out of the warning, which read the label rate over every kept token."""
    from tide_hf.calibration.pipeline import warn_if_silent

    def metrics(best_epoch, predicted, cosine):
        return {"best_epoch": best_epoch, "predicted_rate": predicted,
                "label_rates": {"cosine": cosine, "top1": 0.4, "kl": 0.2, "top1_kl": 0.1}}

    cfg = TideRouterConfig(hidden_size=32, num_hidden_layers=9, label="cosine", metrics={
        "4": metrics(None, 0.0, 0.0), "8": metrics(None, 0.0, 0.14)}, exit_head="lens")  # 8: silent in training only
    with pytest.warns(UserWarning, match=r"no positive training token at EVERY checkpoint"):
        warn_if_silent(cfg)
    cfg.metrics["4"] = metrics(3, 0.2, 0.3)  # trained: fires
    with pytest.warns(UserWarning, match=r"at checkpoints \[8\]: routers there will not fire"):
        warn_if_silent(cfg)


# --- the real model -------------------------------------------------------------------------------------


@pytest.mark.slow
def test_smollm2_sotu_end_to_end(tmp_path, smollm2, smollm2_calibration) -> None:
    """The shared calibration (default exit heads) and the same one with the model's own head (lens)."""
    from tide_hf.assets import sotu_path

    model, tokenizer = smollm2
    linear, linear_warnings = smollm2_calibration
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        router = calibrate(model, tokenizer, str(sotu_path()), num_samples=24, seq_len=64, num_epochs=3,
                           label="top1", exit_head="lens", progress=False)
    assert tide_warnings(record) == [] and [m for m in linear_warnings if "TIDE calibration: label" in m] == []
    # the default exit heads (fitted on other tokens than each one they label) agree with the final layer far
    # more often than the model's own head on the same state, most of all at the shallow checkpoints
    rates = {name: [r.config.metrics[str(k)]["label_rates"]["top1"] for k in r.config.checkpoint_layers]
             for name, r in (("lens", router), ("linear", linear))}
    assert linear.config.exit_head == "linear" and router.config.exit_head == "lens"
    assert all(b > a for a, b in zip(rates["lens"], rates["linear"])), rates
    assert rates["linear"][0] > 2 * rates["lens"][0], rates
    cfg = router.config
    assert (cfg.num_hidden_layers, cfg.hidden_size) == (30, 576)
    assert cfg.checkpoint_layers == [4, 8, 12, 16, 20, 24, 28]
    top1 = [cfg.metrics[str(k)]["label_rates"]["top1"] for k in cfg.checkpoint_layers]
    cosine = [cfg.metrics[str(k)]["label_rates"]["cosine"] for k in cfg.checkpoint_layers]
    # top-1 agreement with the final layer grows with depth; the pre-norm cosine never reaches 0.98 before
    # the last layer on this model (its residual stream keeps growing)
    assert all(rate > 0 for rate in top1), top1
    assert all(b >= a - 0.02 for a, b in zip(top1, top1[1:])), top1
    assert top1[-1] > 2 * top1[0] and top1[-1] > 0.3, top1
    assert cosine == [0.0] * len(cosine), cosine
    # the routers learn something real: held-out AUC well above chance at the middle checkpoints
    assert max(cfg.metrics[str(k)]["auc"] for k in (12, 16, 20)) > 0.75, cfg.metrics

    router.save_pretrained(tmp_path / "router")
    loaded = TideRouter.from_pretrained(tmp_path / "router")
    a, b = router.state_dict(), loaded.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)
    assert loaded.config.metrics == cfg.metrics and loaded.config.base_fingerprint == cfg.base_fingerprint
    loaded.check_compatible(model)

    with pytest.raises(TideCompatibilityError) as info:
        loaded.check_compatible(make_tiny_llama())
    assert "number of layers: router 30, model 9" in str(info.value)
    assert "hidden size: router 576, model 32" in str(info.value)

    weight = model.get_input_embeddings().weight
    with torch.no_grad():
        original = float(weight.view(-1)[0])
        weight.view(-1)[0] = 1.0 if original < 0 else -1.0  # a fingerprinted (sampled) value, across zero
    try:
        with pytest.raises(TideCompatibilityError, match=r"weights fingerprint: router v2:[0-9a-f]{16}, model"):
            loaded.check_compatible(model)
        loaded.check_compatible(model, ignore_fingerprint=True)
    finally:
        with torch.no_grad():
            weight.view(-1)[0] = original
    loaded.check_compatible(model)


# -- refusals and odd but valid input ---------------------------------------------------------------------------
def test_empty_dataset_name_is_refused_not_replaced() -> None:
    model = make_model()
    with pytest.raises(TideArgumentError, match="dataset is an empty name"):
        tide_hf.calibrate(model, ByteTokenizer(), "", num_samples=4, seq_len=8)



def test_calibration_warns_when_its_default_target_opens_nothing() -> None:
    from tide_hf.calibration.pipeline import warn_if_closed

    closed = {"thresholds": [[1.0, 1.0], [0.5, 0.5]], "errors": [0, 50], "n": 100, "nll_sum": [0.0, 1.0],
              "nll_sumsq": [0.0, 1.0], "n_next": 100}
    with pytest.warns(UserWarning, match="lets no token exit: 100 threshold-split tokens certify no exit"):
        warn_if_closed(router_config(exit_paths={"agreement": closed}))
    opened = {**closed, "errors": [0, 0], "n": 1000}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warn_if_closed(router_config(exit_paths={"agreement": opened}))



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
