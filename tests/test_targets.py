"""Quality targets: exit paths ordered on one split, tested on another, and the Learn-then-Test choice of
per-checkpoint thresholds, checked on synthetic problems whose true risk is known, and end to end."""

from __future__ import annotations

import json
import math
import warnings
from pathlib import Path

import pytest
import torch
from helpers import CLOSED_PATH, ByteTokenizer, inline_record, make_model, make_tiny_llama, new_router

import tide_hf
from tide_hf.calibration.thresholds import build_path, exit_index, path_losses
from tide_hf.errors import TideArgumentError, TideTargetError
from tide_hf.modeling.targets import binomial_pvalue, normal_pvalue, select

SAVED = torch.tensor([6.0, 2.0], dtype=torch.float64)  # layers saved by an exit at each of two checkpoints
ERROR_SCALE = torch.tensor([0.9, 0.1])  # wrong-exit probability per unit of (1 - score), per checkpoint


def synthetic(n: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Scores uniform in [0, 1]; a token's exit at checkpoint j is wrong with probability (1 - score) * c_j, so
    high scores are reliable and the deep checkpoint is more reliable than the shallow one."""
    scores = torch.rand(n, 2, generator=gen)
    wrong = torch.rand(n, 2, generator=gen) < (1.0 - scores) * ERROR_SCALE
    return scores, wrong


def true_agreement(thresholds: dict[int, float]) -> float:
    """Exact agreement of a threshold pair under `synthetic`: integrate over the score square."""
    t = torch.tensor([thresholds[4], thresholds[8]])
    grid = (torch.arange(400, dtype=torch.float64) + 0.5) / 400
    s1, s2 = grid[:, None], grid[None, :]
    first = (s1 >= t[0]) & (t[0] < 1.0)
    second = ~first & (s2 >= t[1]) & (t[1] < 1.0)
    error = first * (1 - s1) * ERROR_SCALE[0] + second * (1 - s2) * ERROR_SCALE[1]
    return 1.0 - float(error.mean())


def fitted(seed: int, n: int = 3000) -> dict:
    gen = torch.Generator().manual_seed(seed)
    scores_a, wrong_a = synthetic(n, gen)
    scores_b, wrong_b = synthetic(n, gen)
    path = build_path(scores_a, wrong_a.double(), SAVED, grid=20)
    return {"agreement": path_losses(path, scores_b, wrong_b, torch.zeros(n, 2))}


def test_binomial_pvalue_is_the_binomial_tail() -> None:
    for errors, n, alpha in ((0, 10, 0.1), (3, 40, 0.05), (17, 200, 0.1)):
        want = sum(math.comb(n, k) * alpha**k * (1 - alpha) ** (n - k) for k in range(errors + 1))
        assert binomial_pvalue(errors, n, alpha) == pytest.approx(want, rel=1e-9)
    assert binomial_pvalue(0, 100, 0.0) == 1.0  # zero errors never prove a zero error rate


def test_normal_pvalue_is_one_sided() -> None:
    assert normal_pvalue(total=0.0, total_sq=10.0, n=1000, bound=0.1) < 0.01  # mean 0 well under 0.1
    assert normal_pvalue(total=200.0, total_sq=1000.0, n=1000, bound=0.1) > 0.99  # mean 0.2 over it
    assert normal_pvalue(total=5.0, total_sq=5.0, n=1, bound=10.0) == 1.0  # one loss certifies nothing


def test_path_goes_from_closed_to_open_and_saves_more_at_each_step() -> None:
    gen = torch.Generator().manual_seed(0)
    scores, wrong = synthetic(2000, gen)
    path = build_path(scores, wrong.double(), SAVED, grid=10)
    assert path[0] == [1.0, 1.0] and all(max(p) < 1.0 for p in path[-1:])
    assert len(path) == 1 + 2 * 10  # one step per candidate threshold of each checkpoint
    totals = []
    for before, point in zip([path[0], *path], path):
        changed = [j for j, (a, b) in enumerate(zip(before, point)) if a != b]
        assert len(changed) == (0 if point is path[0] else 1) and all(point[j] < before[j] for j in changed)
        first = exit_index(scores, torch.tensor(point))
        totals.append(float(torch.cat([SAVED, torch.zeros(1, dtype=torch.float64)])[first].sum()))
    assert all(b >= a for a, b in zip(totals, totals[1:])), "every step lowers a threshold: exits only grow"


def test_path_takes_small_steps_first() -> None:
    """The first points exit about 1/grid^2 of the tokens each, not 1/grid: one coarse first step whose loss
    cannot be certified would stop fixed-sequence testing before any exit (the perplexity path on SmolLM2)."""
    gen = torch.Generator().manual_seed(0)
    scores, wrong = synthetic(4000, gen)
    grid = 10
    path = build_path(scores, wrong.double(), SAVED, grid=grid)
    exits = [int((exit_index(scores, torch.tensor(p)) < 2).sum()) for p in path[:3]]
    assert exits[0] == 0
    assert 0 < exits[1] <= 1.5 * 4000 / grid**2 and exits[2] - exits[1] <= 3.5 * 4000 / grid**2


def test_shallow_unreliable_checkpoint_opens_later_than_the_deep_one() -> None:
    """The point of per-checkpoint thresholds: at a strict target the error-prone shallow checkpoint stays
    closed (or much stricter) while the reliable deep one already exits."""
    paths = fitted(seed=1)
    chosen = select(paths, [4, 8], min_agreement=0.97, confidence=0.9)
    assert chosen[8] < 1.0 and chosen[4] > chosen[8]


@pytest.mark.parametrize("target", [0.97, 0.9])
def test_target_holds_with_the_stated_confidence(target: float) -> None:
    """Over independent calibration draws, the true agreement of the chosen thresholds is below the target in
    at most 1 - confidence of them (binomial slack for 20 draws), and the choice is not vacuous."""
    confidence, draws = 0.9, 20
    delivered = [true_agreement(select(fitted(seed), [4, 8], min_agreement=target, confidence=confidence))
                 for seed in range(draws)]
    misses = sum(a < target for a in delivered)
    assert misses <= 5, f"{misses} of {draws} draws missed {target}: {delivered}"  # P(>5 | 10 %) ~ 1 %
    assert sum(delivered) / draws < target + 0.03, "the thresholds are so strict that nothing exits"


def test_select_refuses_what_it_cannot_do() -> None:
    paths = fitted(seed=0)
    with pytest.raises(TideTargetError, match="min_agreement"):
        select(paths, [4, 8], min_agreement=1.5, confidence=0.9)
    with pytest.raises(TideTargetError, match="confidence"):
        select(paths, [4, 8], min_agreement=0.9, confidence=1.0)
    with pytest.raises(TideTargetError, match="perplexity path"):
        select(paths, [4, 8], max_perplexity_increase=0.05, confidence=0.9)
    assert select(paths, [4, 8], min_agreement=1.0, confidence=0.9) == {4: 1.0, 8: 1.0}


def test_calibrated_router_attaches_at_its_default_target(tmp_path: Path) -> None:
    """calibrate() with defaults: label top1, both paths stored; attach() without arguments keeps the
    router's default target; the table survives save_pretrained / from_pretrained."""
    model = make_tiny_llama()
    docs = tmp_path / "docs"
    docs.mkdir()
    gen = torch.Generator().manual_seed(0)
    for i in range(40):
        (docs / f"d{i}.txt").write_text(" ".join(str(int(x)) for x in torch.randint(0, 99, (60,), generator=gen)))
    router = tide_hf.calibrate(model, ByteTokenizer(), str(docs), num_samples=40, seq_len=64, num_epochs=3,
                               router_bottleneck_dim=16, progress=False)
    cfg = router.config
    assert cfg.label == "top1" and set(cfg.exit_paths) == {"agreement", "perplexity"}
    path = cfg.exit_paths["agreement"]
    assert path["thresholds"][0] == [1.0] * len(cfg.checkpoint_layers) and path["errors"][0] == 0
    assert path["n"] >= path["n_next"] > 0  # the last token of a sample has no next token for the NLL
    want = select(cfg.exit_paths, cfg.checkpoint_layers, min_agreement=cfg.min_agreement, confidence=cfg.confidence)
    with tide_hf.attach(model, router, mode="select") as handle:
        assert handle.options.thresholds == want and handle.options.target == {"min_agreement": 0.95,
                                                                                "confidence": 0.9}
    router.save_pretrained(tmp_path / "r")
    loaded = tide_hf.TideRouter.from_pretrained(tmp_path / "r")
    assert loaded.config.exit_paths == cfg.exit_paths
    with tide_hf.attach(model, loaded, min_agreement=0.9, mode="select") as handle:
        assert handle.options.thresholds == select(cfg.exit_paths, cfg.checkpoint_layers, min_agreement=0.9,
                                                   confidence=cfg.confidence)
    with pytest.raises(ValueError, match="not both"):
        tide_hf.attach(model, loaded, exit_threshold=0.5, min_agreement=0.9, mode="select")


def test_older_router_without_the_table_uses_its_global_threshold(tmp_path: Path) -> None:
    model = make_tiny_llama()
    router = new_router(model, exit_threshold=0.7)
    router.save_pretrained(tmp_path)
    config = inline_record(tmp_path)
    for key in ("exit_paths", "min_agreement", "confidence", "threshold_fraction", "path_grid"):
        config.pop(key)  # what a router saved before quality targets existed looks like
    (tmp_path / "config.json").write_text(json.dumps(config))
    old = tide_hf.TideRouter.from_pretrained(tmp_path)
    with tide_hf.attach(model, old, mode="select") as handle:
        assert handle.options.thresholds is None and handle.options.exit_threshold == 0.7
        assert all(handle.options.threshold(k) == 0.7 for k in old.checkpoint_layers)
    with pytest.raises(TideTargetError, match="no calibrated agreement path"):
        tide_hf.attach(model, old, min_agreement=0.9, mode="select")


def test_select_mode_exits_follow_the_per_checkpoint_thresholds() -> None:
    """A checkpoint closed by its threshold never exits even where its router would fire."""
    model = make_tiny_llama()
    router = new_router(model, seed=3)
    with torch.no_grad():
        for mlp in router.routers.values():  # every score saturates at 1: any open checkpoint fires
            mlp.fc2.weight.zero_()
            mlp.fc2.bias.fill_(30.0)
    k1, k2 = router.checkpoint_layers
    router.config.exit_paths = {"agreement": {"thresholds": [[1.0, 1.0], [1.0, 0.5]], "errors": [0, 0], "n": 10**6,
                                              "nll_sum": [0.0, 0.0], "nll_sumsq": [0.0, 0.0], "n_next": 10**6}}
    ids = torch.randint(3, 200, (2, 6), generator=torch.Generator().manual_seed(0))
    with tide_hf.attach(model, router, min_agreement=0.99, mode="select") as handle:
        assert handle.options.thresholds == {k1: 1.0, k2: 0.5}
        with torch.no_grad():
            model(input_ids=ids)
        assert dict(handle.last_stats.prefill.exits) == {k2: ids.numel()}


def test_perplexity_path_is_ordered_by_kl_not_by_noisy_nll() -> None:
    """On the ordering split the observed NLL change is pure noise that favours the shallow checkpoint, while
    the KL (its expectation) says the deep one is nearly free: the perplexity path must open the deep one first."""
    from tide_hf.calibration.labels import Collected
    from tide_hf.calibration.thresholds import fit_exit_paths

    gen = torch.Generator().manual_seed(0)
    n, layers = 4000, [4, 8]
    router = new_router(make_tiny_llama(), seed=0)
    features = {k: torch.randn(n, 32, generator=gen) for k in layers}
    noise = torch.randn(n, generator=gen) * 5
    data = Collected(features=features, cosine={k: torch.zeros(n) for k in layers},
                     final=torch.zeros(n, 32), next_ids=torch.zeros(n, dtype=torch.long),
                     final_top1=torch.zeros(n, dtype=torch.long),
                     top1={k: torch.ones(n, dtype=torch.bool) for k in layers},
                     kl={4: torch.full((n,), 2.0), 8: torch.full((n,), 0.01)},
                     nll={4: noise - 3.0, 8: noise + 3.0},  # observed: shallow looks better than deep
                     is_val=torch.ones(n, dtype=torch.bool), is_test=torch.arange(n) >= n // 2,
                     labelled={}, seconds={})
    path = fit_exit_paths(router, data)["perplexity"]["thresholds"]
    first_open = next(i for i, p in enumerate(path) if min(p) < 1.0)
    assert path[first_open][1] < 1.0 and path[first_open][0] == 1.0


def test_paths_keep_checkpoints_below_min_layers_closed() -> None:
    """The path is tested under the rule served: a checkpoint below the router's min_layers never exits, so it
    stays closed on every point (else its certified exits would move to later checkpoints when served)."""
    gen = torch.Generator().manual_seed(0)
    scores, wrong = synthetic(2000, gen)
    path = build_path(scores, wrong.double(), SAVED, grid=20, served=[False, True])
    assert len(path) > 2 and all(point[0] == 1.0 for point in path)
    assert path[-1][1] < 1.0
    open_path = build_path(scores, wrong.double(), SAVED, grid=20)
    assert any(point[0] < 1.0 for point in open_path)
    from tide_hf.calibration.labels import Collected
    from tide_hf.calibration.thresholds import fit_exit_paths

    n, layers = 2000, [4, 8]
    features = {k: torch.randn(n, 32, generator=gen) for k in layers}
    data = Collected(features=features, cosine={k: torch.zeros(n) for k in layers}, final=torch.zeros(n, 32),
                     next_ids=torch.zeros(n, dtype=torch.long), final_top1=torch.zeros(n, dtype=torch.long),
                     top1={k: torch.rand(n, generator=gen) > 0.3 for k in layers},
                     kl={k: torch.rand(n, generator=gen) for k in layers}, nll={k: torch.zeros(n) for k in layers},
                     is_val=torch.ones(n, dtype=torch.bool), is_test=torch.arange(n) >= n // 2, labelled={}, seconds={})
    for min_layers, shallow_opens in ((4, True), (8, False)):
        router = new_router(make_tiny_llama(), seed=0, min_layers=min_layers)
        for kind, fitted_path in fit_exit_paths(router, data).items():
            assert any(p[0] < 1.0 for p in fitted_path["thresholds"]) == shallow_opens, (kind, min_layers)


def test_a_perplexity_point_with_no_spread_is_not_certified() -> None:
    """A path point that let no threshold-split token exit has NLL-change sum and sum of squares 0: no evidence
    about the mean change where it does exit. It was certified at any confidence (p = 0), even for +0 %."""
    from tide_hf.modeling.targets import normal_pvalue, select

    assert normal_pvalue(0.0, 0.0, 2, 0.0) == 1.0
    paths = {"perplexity": {"thresholds": [[1.0, 1.0], [0.2, 1.0]], "errors": [0, 0], "n": 2,
                            "nll_sum": [0.0, 0.0], "nll_sumsq": [0.0, 0.0], "n_next": 2}}
    assert select(paths, [4, 8], max_perplexity_increase=0.0, confidence=0.999999) == {4: 1.0, 8: 1.0}


def test_a_perplexity_target_passes_the_closed_start_of_its_path() -> None:
    """Every path starts with all checkpoints closed: nothing exits there, so its NLL changes are all 0 (no spread).
    That point needs no test (its risk is 0 by construction); treated as untestable it stopped the fixed sequence at
    once, and no perplexity target opened any checkpoint on real routers. The first open points may let no
    threshold-split token exit either (no evidence): they are passed over, never chosen. Points with spread are
    tested in order; the first without spread after them ends the sequence."""
    from tide_hf.modeling.targets import select

    n = 1000
    changes = torch.cat([torch.full((10,), 0.02), torch.full((10,), -0.01), torch.zeros(n - 20)]).double()
    paths = {"perplexity": {"thresholds": [[1.0, 1.0], [0.9, 1.0], [0.5, 1.0]], "errors": [0, 0, 0], "n": n,
                            "nll_sum": [0.0, float(changes.sum()), 0.0],
                            "nll_sumsq": [0.0, float(changes.pow(2).sum()), 0.0], "n_next": n}}
    assert select(paths, [4, 8], max_perplexity_increase=0.05, confidence=0.9) == {4: 0.9, 8: 1.0}
    paths["perplexity"]["thresholds"][0] = [0.99, 1.0]  # no token exited there either: passed over, not chosen
    assert select(paths, [4, 8], max_perplexity_increase=0.05, confidence=0.9) == {4: 0.9, 8: 1.0}
    silent = {k: [v[0], v[0], *v[1:]] if isinstance(v, list) else v for k, v in paths["perplexity"].items()}
    silent["thresholds"] = [[1.0, 1.0], [1.0, 0.95], [0.9, 1.0], [0.5, 1.0]]  # a small step no split token took
    assert select({"perplexity": silent}, [4, 8], max_perplexity_increase=0.05, confidence=0.9) == {4: 0.9, 8: 1.0}
    assert select({"perplexity": silent}, [4, 8], max_perplexity_increase=0.0, confidence=0.9) == {4: 1.0, 8: 1.0}


def test_an_always_right_checkpoint_opens_under_an_agreement_target() -> None:
    """Layers after 4 add nothing: every exit at 4 is right, so its router is the constant 'always exit'. Its score
    was sigmoid(30) == 1.0 in fp32, the closed threshold: no candidate, and no target could open it."""
    import warnings


    model = make_tiny_llama()
    with torch.no_grad():
        for layer in model.model.layers[4:]:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    gen = torch.Generator().manual_seed(0)
    samples = [torch.randint(3, 256, (48,), generator=gen) for _ in range(200)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        router = tide_hf.calibration.calibrate_tokens(model, samples, num_epochs=3, router_bottleneck_dim=16,
                                                      progress=False,
                                          exit_head="lens")
    ids = torch.stack(samples[:20])
    with tide_hf.attach(model, router, min_agreement=0.5, mode="select") as handle, torch.no_grad():
        model(input_ids=ids)
        assert dict(handle.last_stats.prefill.exits) == {4: ids.numel()}


def test_a_perplexity_target_exits_end_to_end_and_holds() -> None:
    """A calibrated router on a model whose layers after 4 barely write (o_proj / down_proj x 0.01): a +5 %
    perplexity target must open checkpoint 4, and the held-out perplexity change must stay within it (the closed
    start of the path stopped every perplexity target before any exit, a regression no synthetic path showed)."""
    import warnings

    from tide_bench.easy import make_near_identity

    model = make_near_identity(make_tiny_llama(), 4, scale=0.01)
    gen = torch.Generator().manual_seed(0)
    samples = [torch.randint(3, 256, (48,), generator=gen) for _ in range(240)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        router = tide_hf.calibration.calibrate_tokens(model, samples[:200], num_epochs=3, router_bottleneck_dim=16,
                                          progress=False)
    held_out = torch.stack(samples[200:])
    with torch.no_grad():
        stock = model(input_ids=held_out, labels=held_out).loss
        with tide_hf.attach(model, router, max_perplexity_increase=0.05, mode="select") as handle:
            served = model(input_ids=held_out, labels=held_out).loss
            exits = handle.last_stats.prefill.exits
    assert handle.options.thresholds[4] < 1.0 and exits.get(4, 0) > held_out.numel() // 2
    assert math.exp(float(served - stock)) <= 1.05


def test_a_checkpoint_whose_label_never_fired_stays_closed() -> None:
    """No positive training token at a checkpoint gives it a never-firing constant router: its constant score as
    a threshold would exit every token there (a fixed depth, against calibration's own warning)."""
    from tide_hf.calibration.labels import Collected
    from tide_hf.calibration.thresholds import fit_exit_paths

    gen = torch.Generator().manual_seed(0)
    n, layers = 2000, [4, 8]
    is_val = torch.arange(n) >= n // 2
    top1 = {4: is_val & (torch.rand(n, generator=gen) > 0.3), 8: torch.rand(n, generator=gen) > 0.3}
    data = Collected(features={k: torch.randn(n, 32, generator=gen) for k in layers}, cosine={k: torch.zeros(n)
                     for k in layers}, final=torch.zeros(n, 32), next_ids=torch.zeros(n, dtype=torch.long),
                     final_top1=torch.zeros(n, dtype=torch.long), top1=top1,
                     kl={k: torch.rand(n, generator=gen) for k in layers}, nll={k: torch.zeros(n) for k in layers},
                     is_val=is_val, is_test=torch.arange(n) >= 3 * n // 4, labelled={}, seconds={})
    router = new_router(make_tiny_llama(), seed=0, label="top1")
    for kind, fitted in fit_exit_paths(router, data).items():
        assert all(point[0] == 1.0 for point in fitted["thresholds"]), kind  # layer 4: no positive in training
        assert any(point[1] < 1.0 for point in fitted["thresholds"]), kind


@pytest.mark.parametrize("edit,message", [
    (lambda p: p["perplexity"].update(n_next=10**9), "n_next=1000000000 tokens with a next token out of n"),
    (lambda p: p["agreement"].update(n=p["agreement"]["n"] + 1, errors=[0, 0]), "their \\(n, n_next\\) differ"),
    (lambda p: p["perplexity"]["nll_sum"].__setitem__(0, 0.5), "its losses must be 0"),
    (lambda p: p["perplexity"]["nll_sumsq"].__setitem__(1, 1e-6), "impossible"),
])
def test_a_table_no_test_could_produce_is_refused(edit, message) -> None:
    """A hand-edited table with impossible sizes or sums certified every target (even 0.999 agreement)."""
    from tide_hf.config import TideRouterConfig

    paths = {kind: {"thresholds": [[1.0, 1.0], [0.5, 1.0]], "errors": [0, 3], "n": 100, "nll_sum": [0.0, 4.0],
                    "nll_sumsq": [0.0, 9.0], "n_next": 90} for kind in ("agreement", "perplexity")}
    TideRouterConfig(checkpoint_layers=[4, 8], num_hidden_layers=9, exit_paths=json.loads(json.dumps(paths)),
                     exit_head="lens")
    edit(paths)
    with pytest.raises(tide_hf.errors.TideArgumentError, match=message):
        TideRouterConfig(checkpoint_layers=[4, 8], num_hidden_layers=9, exit_paths=paths, exit_head="lens")


# -- refusals and odd but valid input ---------------------------------------------------------------------------
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



def test_old_routers_whose_paths_open_checkpoints_below_their_min_layers_are_told_to_recalibrate() -> None:
    model = make_model()
    path = {**CLOSED_PATH, "thresholds": [[1.0, 1.0], [0.9, 0.8]]}
    router = new_router(model, exit_paths={"agreement": path}, min_layers=8)
    with pytest.raises(TideTargetError, match="a tide_hf older than the fix that keeps them closed calibrated"):
        tide_hf.attach(model, router, min_agreement=0.5, mode="select")
    with tide_hf.attach(model, router, exit_threshold=0.9, mode="select"):
        pass



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
