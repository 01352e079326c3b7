"""`tide-hf analyze` and the bench baselines, each checked against a computation done another way."""

from __future__ import annotations

import copy
import itertools

import pytest
import torch
import torch.nn.functional as F
from helpers import ByteTokenizer, make_documents, make_tiny_llama, new_router
from torch import nn

import tide_hf
from tide_bench.baselines import ConfidenceHandle, dropped, greedy_drop_order, verdict
from tide_bench.modes import truncated
from tide_hf.calibration import make_samples
from tide_hf.eval.analyze import convergence, oracle, router_efficiency
from tide_hf.modeling import layer_output


def brute_force_oracle(match: torch.Tensor, checkpoints: list[int], n: int, agreement: float) -> float:
    """Fewest mean layers over every assignment of tokens to exits with at least `agreement` correct."""
    exits = [*checkpoints, n]
    correct = torch.cat([match, torch.ones(len(match), 1, dtype=torch.bool)], 1)
    best = float("inf")
    for choice in itertools.product(range(len(exits)), repeat=len(match)):
        ok = sum(bool(correct[i, c]) for i, c in enumerate(choice)) / len(match)
        if ok >= agreement - 1e-9:
            best = min(best, sum(exits[c] for c in choice) / len(match))
    return best


@pytest.mark.parametrize("seed", range(4))
def test_oracle_is_the_best_policy_at_each_agreement(seed) -> None:
    gen = torch.Generator().manual_seed(seed)
    match = torch.rand(7, 3, generator=gen) < 0.4
    checkpoints, n = [4, 8, 12], 16
    rows = oracle(match, checkpoints, n, [1.0, 0.85, 0.7, 0.5])
    for r, a in zip(rows, [1.0, 0.85, 0.7, 0.5]):
        assert r["agreement"] >= a - 1e-9
        assert r["mean_layers"] == pytest.approx(brute_force_oracle(match, checkpoints, n, a))
        assert r["layers_saved"] == pytest.approx(n - r["mean_layers"])


def test_convergence_matches_truncated_models_and_hidden_states() -> None:
    model = make_tiny_llama()
    tok = ByteTokenizer()
    texts = make_documents(6, 40, seed=1)
    res = convergence(model, tok, texts, num_samples=4, seq_len=24, batch_size=3, checkpoint_interval=4,
                      convergence_threshold=0.5, agreements=[1.0, 0.9], bins=10, seed=0, progress=False)
    samples = make_samples(tok, texts, 4, 24, 0, spread=True)  # what analyze measures on
    final_pre_norm = []
    hook = model.model.layers[-1].register_forward_hook(lambda _m, _a, out: final_pre_norm.append(layer_output(out)[0]))
    with torch.no_grad():
        outs = [model(input_ids=s[None], output_hidden_states=True) for s in samples]
    hook.remove()
    assert res["tokens"] == sum(len(s) for s in samples)
    for k in (2, 4, 7):
        with truncated(model, k), torch.no_grad():
            agree = torch.cat([model(input_ids=s[None]).logits[0].argmax(-1) == o.logits[0].argmax(-1)
                               for s, o in zip(samples, outs)])
        cos = torch.cat([F.cosine_similarity(o.hidden_states[k][0], f, dim=-1) for o, f in zip(outs, final_pre_norm)])
        row = res["layers"][k - 1]
        assert row["top1_agreement"] == pytest.approx(float(agree.float().mean()))
        assert row["mean_cosine"] == pytest.approx(float(cos.mean()), abs=1e-5)
        assert row["cosine_label_rate"] == pytest.approx(float((cos > 0.5).float().mean()))
    assert res["layers"][-1]["top1_agreement"] == 1.0 and res["layers"][-1]["mean_kl"] == pytest.approx(0, abs=1e-5)
    share = torch.tensor(res["cosine_histogram"]["share"])
    assert torch.allclose(share.sum(0), torch.ones(9))  # each layer's column covers every token
    assert 0 < res["layers"][3]["top1_agreement"] < 1  # not vacuous


@pytest.mark.parametrize("change,error,message", [
    ({"checkpoint_interval": 9}, tide_hf.errors.TideArgumentError, "checkpoint_interval=9 leaves no checkpoint"),
    ({"seq_len": 10_000}, tide_hf.errors.TideArgumentError, "longer than the model's context"),
    ({"convergence_threshold": float("nan")}, tide_hf.errors.TideArgumentError,
     "convergence_threshold must be a finite"),
    ({"convergence_threshold": 2.0}, tide_hf.errors.TideArgumentError, "convergence_threshold must be a finite"),
    ({"texts": [""]}, tide_hf.errors.TideDataError, "no text to analyze"),
])
def test_convergence_refuses_what_it_cannot_measure(change, error, message) -> None:
    """An interval past the last layer (was an IndexError deep in the oracle), samples beyond the positions (ran
    for minutes), a threshold that is no cosine (was accepted) and text without tokens (a torch.cat error)."""
    model = make_tiny_llama()  # 9 layers
    kwargs = {"texts": make_documents(2, 40, seed=1), "num_samples": 2, "seq_len": 24, "batch_size": 2,
              "checkpoint_interval": 4, "convergence_threshold": 0.5, "agreements": [1.0], "bins": 4, "seed": 0,
              "progress": False, **change}
    with pytest.raises(error, match=message.replace("(", r"\(")):
        convergence(model, ByteTokenizer(), **kwargs)


def test_router_efficiency_agrees_with_tide_attached() -> None:
    """Agreement and depth at each threshold equal what the real exit machinery does on the same text."""
    model = make_tiny_llama()
    router = new_router(model, seed=3)
    with torch.no_grad():  # scores spread around 0.5, so thresholds split the tokens
        for mlp in router.routers.values():
            mlp.fc2.weight.mul_(20.0)
    prompts = [torch.tensor([t]) for t in (5, 77, 140)]  # one-token prompts: every later position is generated
    thresholds = [0.9, 0.5, 0.1]
    res = router_efficiency(model, router, prompts, new_tokens=10, thresholds=thresholds, pad_id=0, progress=False)
    seqs = [model.generate(input_ids=p[None], max_new_tokens=10, do_sample=False)[0] for p in prompts]
    for t, row in zip(thresholds, res["router"]):
        agree, layers, count = 0.0, 0.0, 0
        handle = tide_hf.attach(model, router, exit_threshold=t, mode="select")
        try:
            for s in seqs:
                with torch.no_grad():
                    ours = model(input_ids=s[None, :-1]).logits[0].argmax(-1)
                    stats = handle.last_stats.prefill
                    with handle.disabled():
                        stock = model(input_ids=s[None, :-1]).logits[0].argmax(-1)
                agree += float((ours == stock).sum())
                layers += stats.mean_layers * stats.tokens
                count += stats.tokens
        finally:
            handle.detach()
        assert row["agreement"] == pytest.approx(agree / count)
        assert row["layers_saved"] == pytest.approx(9 - layers / count)
        assert row["oracle_layers_saved"] >= row["layers_saved"] - 1e-9
    assert len({r["layers_saved"] for r in res["router"]}) == 3  # the thresholds really differ


def model_without(model: nn.Module, drop: list[int]) -> nn.Module:
    """A copy whose layer list lacks the dropped layers (their cache slots simply stay unused)."""
    other = copy.deepcopy(model)
    other.model.layers = nn.ModuleList([layer for i, layer in enumerate(other.model.layers, 1) if i not in drop])
    return other


def test_dropped_layers_equal_a_model_without_them_and_restore_exactly() -> None:
    model = make_tiny_llama()
    before = {name: dict(m.__dict__) for name, m in model.named_modules()}
    ids = torch.randint(3, 256, (2, 7), generator=torch.Generator().manual_seed(0))
    reference = model_without(model, [3, 6])
    with dropped(model, [3, 6]), torch.no_grad():
        ours = model.generate(input_ids=ids, max_new_tokens=6, do_sample=False)
        logits = model(input_ids=ids).logits
    with torch.no_grad():
        torch.testing.assert_close(logits, reference(input_ids=ids).logits)
    assert torch.equal(ours, reference.generate(input_ids=ids, max_new_tokens=6, do_sample=False))
    assert {name: dict(m.__dict__) for name, m in model.named_modules()} == before
    with pytest.raises(ValueError, match="layer 1"):
        with dropped(model, [1]):
            pass


def test_greedy_drop_order_first_choice_is_the_best_single_drop() -> None:
    model = make_tiny_llama()
    samples = [torch.randint(3, 256, (16,), generator=torch.Generator().manual_seed(s)) for s in range(3)]
    order = greedy_drop_order(model, samples, 2, pad_id=0, progress=False)
    ids = torch.stack(samples)
    with torch.no_grad():
        ref = model(input_ids=ids).logits.argmax(-1)
        single = {c: float((model_without(model, [c])(input_ids=ids).logits.argmax(-1) == ref).float().mean())
                  for c in range(2, 10)}
    assert order[0]["layer"] == max(single, key=single.__getitem__)
    assert order[0]["agreement"] == pytest.approx(single[order[0]["layer"]])
    assert order[1]["layer"] != order[0]["layer"] and 1 not in (o["layer"] for o in order)


def test_confidence_exit_uses_the_top_probability_of_the_exit_logits() -> None:
    """Each position's logits are those of the model truncated at the first checkpoint whose exit
    distribution reaches the threshold, or the full model's."""
    model = make_tiny_llama()
    router = new_router(model)
    ids = torch.randint(3, 256, (1, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        full = model(input_ids=ids).logits[0]
        exits = {}
        for k in (4, 8):
            with truncated(model, k):
                exits[k] = model(input_ids=ids).logits[0]
    t = float(torch.softmax(exits[4], -1).amax(-1).median())  # half the positions exit at 4
    handle = tide_hf.integrations.attach_with(ConfidenceHandle, model, router, exit_threshold=t, mode="select")
    try:
        with torch.no_grad():
            ours = model(input_ids=ids).logits[0]
    finally:
        handle.detach()
    expected = full.clone()
    at8 = torch.softmax(exits[8], -1).amax(-1) >= t
    expected[at8] = exits[8][at8]
    at4 = torch.softmax(exits[4], -1).amax(-1) >= t
    expected[at4] = exits[4][at4]
    torch.testing.assert_close(ours, expected, atol=1e-4, rtol=1e-4)
    assert 0 < int(at4.sum()) < 12


def test_verdict_picks_the_cheapest_baseline_at_equal_or_better_quality() -> None:
    def row(method, param, layers, match, ppl):
        return {"method": method, "param": param, "decode_mean_layers": layers, "text_mean_layers": layers + 0.5,
                "greedy_prefix_match": match, "perplexity_change": ppl}
    rows = [row("tide", 0.9, 20.0, 0.8, 0.5), row("static_skip", 2, 28.0, 0.9, 0.1),
            row("fixed_depth", 24, 24.0, 0.85, 2.0), row("confidence", 0.4, 16.0, 0.5, 9.0)]
    match, ppl = verdict(rows)
    assert (match["quality"], match["best_baseline"], match["baseline_layers"]) == (
        "greedy_prefix_match", "fixed_depth=24", 24.0)
    assert match["tide_saves_more"]
    # perplexity: lower is better; only static skipping is as good, with more layers
    assert (ppl["quality"], ppl["best_baseline"], ppl["baseline_layers"]) == (
        "perplexity_change", "static_skip=2", 28.5)
    assert ppl["tide_layers"] == 20.5 and ppl["tide_saves_more"]
    rows[3].update(greedy_prefix_match=0.8, perplexity_change=0.4)  # confidence now as good with fewer layers
    match, ppl = verdict(rows)
    assert match["best_baseline"] == ppl["best_baseline"] == "confidence=0.4"
    assert not match["tide_saves_more"] and not ppl["tide_saves_more"]


def test_analyze_refuses_a_router_that_read_every_document_and_results_into_a_router_folder(tmp_path, monkeypatch):
    """A router calibrated on the only document there is has no held-out text (analyze died in torch.cat); a
    results folder that holds a router (or a model) would mix analyze's or bench's files with its own."""
    import tide_bench as bench
    from tide_hf.cli import build_parser
    from tide_hf.eval import analyze

    model, tok = make_tiny_llama(), ByteTokenizer()
    doc = tmp_path / "one.txt"
    doc.write_text(make_documents(1, 400, seed=2)[0])
    router = tide_hf.calibrate(model, tok, str(doc), num_samples=8, seq_len=32, num_epochs=1, progress=False)
    router.save_pretrained(tmp_path / "router")
    monkeypatch.setattr(analyze, "load_model", lambda *_: (model, tok))
    args = build_parser().parse_args(["analyze", "--router", str(tmp_path / "router"), "--dataset", str(doc),
                                      "--output", str(tmp_path / "out")])
    with pytest.raises(tide_hf.errors.TideDataError, match=r"calibration read every document \(1\) of"):
        analyze.run(args)
    for command, run in ((["analyze"], analyze.run), (["bench", "overhead"], bench.run)):
        args = build_parser().parse_args([*command, "--router", str(tmp_path / "router"), "--output",
                                          str(tmp_path / "router")])
        with pytest.raises(tide_hf.errors.TideArgumentError, match="holds a model or a TIDE router"):
            run(args)
    assert sorted(p.name for p in (tmp_path / "router").iterdir()) == ["README.md", "config.json", "model.safetensors"]


def test_analyze_keeps_files_it_did_not_write_and_refuses_before_its_forward_passes(tmp_path, monkeypatch):
    """Without --router, analyze deleted any efficiency.png in --output (a user's own plot too, also beside an
    analyze.json it did not write); a --prompt-len no held-out document reaches was refused after the forward
    passes, leaving their plots behind; an --output inside the --dataset folder was accepted; an interrupted run
    left its new plots beside the earlier run's tables."""
    from tide_hf.cli import build_parser
    from tide_hf.eval import analyze

    model, tok = make_tiny_llama(), ByteTokenizer()
    docs = tmp_path / "docs"
    docs.mkdir()
    for i, text in enumerate(make_documents(24, 20, seed=3)):  # ~120 bytes (tokens) each
        (docs / f"{i}.txt").write_text(text)
    monkeypatch.setattr(analyze, "load_model", lambda *_: (model, tok))
    small = ["--dataset", str(docs), "--num-samples", "4", "--seq-len", "32", "--batch-size", "4"]
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "efficiency.png").write_bytes(b"the user's own plot")
    analyze.run(build_parser().parse_args(["analyze", "--output", str(mine), *small]))
    assert (mine / "efficiency.png").read_bytes() == b"the user's own plot" and (mine / "analyze.json").is_file()
    analyze.run(build_parser().parse_args(["analyze", "--output", str(mine), *small]))  # an earlier run's folder
    assert not (mine / "efficiency.png").exists()

    router = tide_hf.calibrate(model, tok, str(docs), num_samples=8, seq_len=32, num_epochs=1, progress=False)
    router.save_pretrained(tmp_path / "router")
    args = build_parser().parse_args(["analyze", "--router", str(tmp_path / "router"), "--output",
                                      str(tmp_path / "out"), "--prompt-len", "200", "--new-tokens", "8", *small])
    with pytest.raises(tide_hf.errors.TideDataError, match="no held-out document is longer than --prompt-len 200"):
        analyze.run(args)
    assert not (tmp_path / "out").exists()

    # an analyze.json something else wrote does not make the folder analyze's (its efficiency.png was deleted)
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "analyze.json").write_text('{"mine": 1}')
    (theirs / "efficiency.png").write_bytes(b"the user's own plot")
    analyze.run(build_parser().parse_args(["analyze", "--output", str(theirs), *small]))
    assert (theirs / "efficiency.png").read_bytes() == b"the user's own plot"
    # results inside the text folder would be read back as text (its next read failed on a mix of file kinds)
    with pytest.raises(tide_hf.errors.TideArgumentError, match="is inside the text folder"):
        analyze.run(build_parser().parse_args(["analyze", "--output", str(docs / "out"), *small]))
    assert not (docs / "out").exists()
    # an interrupted run leaves the earlier run's files whole (it wrote its plots first: new plots, old tables)
    full = ["analyze", "--router", str(tmp_path / "router"), "--output", str(tmp_path / "full"), "--prompt-len", "8",
            "--new-tokens", "4", "--num-prompts", "2", *small]
    analyze.run(build_parser().parse_args(full))
    before = {f.name: f.read_bytes() for f in (tmp_path / "full").iterdir()}
    assert {"analyze.json", "convergence.png", "efficiency.png"} <= set(before)

    def interrupted(*_, **__):
        raise KeyboardInterrupt

    monkeypatch.setattr(analyze, "router_efficiency", interrupted)
    with pytest.raises(KeyboardInterrupt):
        analyze.run(build_parser().parse_args([*full, "--bins", "3"]))
    assert {f.name: f.read_bytes() for f in (tmp_path / "full").iterdir()} == before
