"""Exit heads: the closed-form fit against a least-squares solver, the out-of-fold labelling, the sidecar files."""

from __future__ import annotations

import pytest
import torch
import transformers as tf
from helpers import make_tiny_llama, new_router

import tide_hf
from tide_hf import TideRouter
from tide_hf.calibration.heads import fit_exit_heads
from tide_hf.calibration.labels import Collected, collect, label
from tide_hf.errors import TideRouterFileError

LAYERS = [4, 8]
HIDDEN = 32


def synthetic(n: int = 600, seed: int = 0, held_out: int = 100) -> Collected:
    """Features and last-layer states with a noisy linear relation of different scales per token."""
    gen = torch.Generator().manual_seed(seed)
    features = {k: torch.randn(n, HIDDEN, generator=gen) for k in LAYERS}
    mix = torch.randn(HIDDEN, HIDDEN, generator=gen)
    final = (features[8] @ mix + 0.3 * torch.randn(n, HIDDEN, generator=gen)) * torch.rand(n, 1, generator=gen) * 5
    is_val = torch.arange(n) >= n - held_out
    return Collected(features=features, cosine={k: torch.zeros(n) for k in LAYERS}, final=final,
                     next_ids=torch.randint(3, 256, (n,), generator=gen), final_top1=torch.full((n,), -1),
                     top1={k: torch.zeros(n, dtype=torch.bool) for k in LAYERS},
                     kl={k: torch.full((n,), float("nan")) for k in LAYERS},
                     nll={k: torch.full((n,), float("nan")) for k in LAYERS}, is_val=is_val,
                     is_test=torch.arange(n) >= n - held_out // 2,
                     labelled={kind: torch.zeros(n, dtype=torch.bool) for kind in ("top1", "kl", "top1_kl")},
                     seconds={"forward": 0.0, "label": 0.0})


def lstsq_solution(data: Collected, layer: int, rows: torch.Tensor, ridge: float, unit_rms: bool = True
                   ) -> torch.Tensor:
    """The ridge solution by an independent route: an ordinary least-squares solve of the system augmented
    with sqrt(lambda) * I rows (lambda = ridge x the mean diagonal of X^T X); targets at unit RMS or as they are."""
    x = torch.cat([data.features[layer][rows], torch.ones(len(rows), 1)], 1).double()
    y = data.final[rows].double()
    if unit_rms:
        y = y / y.pow(2).mean(-1, keepdim=True).sqrt()
    lam = ridge * float((x * x).sum(0).mean())
    a = torch.cat([x, lam ** 0.5 * torch.eye(x.shape[1], dtype=torch.float64)])
    b = torch.cat([y, torch.zeros(x.shape[1], y.shape[1], dtype=torch.float64)])
    return torch.linalg.lstsq(a, b).solution


@torch.no_grad()
@pytest.mark.parametrize("ridge", [0.0, 0.05])
def test_fit_is_the_ridge_solution_and_each_fold_is_fitted_without_its_tokens(ridge: float) -> None:
    data = synthetic()
    router = new_router(make_tiny_llama(), exit_head="linear", exit_head_ridge=ridge, checkpoint_layers=LAYERS)
    crossfit = fit_exit_heads(router, data, device=torch.device("cpu"), scale_free=True)
    train = torch.nonzero(~data.is_val).squeeze(1)
    for k in LAYERS:
        head = router.exit_heads[str(k)].down
        fitted = torch.cat([head.weight.T, head.bias[None]]).double()
        torch.testing.assert_close(fitted, lstsq_solution(data, k, train, ridge), atol=1e-5, rtol=1e-4)
    # two contiguous blocks of training tokens; held-out tokens belong to none
    assert crossfit.fold[data.is_val].eq(-1).all() and set(crossfit.fold[~data.is_val].tolist()) == {0, 1}
    for f in (0, 1):
        others = torch.nonzero((crossfit.fold >= 0) & (crossfit.fold != f)).squeeze(1)
        torch.testing.assert_close(crossfit.weights[8][f].double(), lstsq_solution(data, 8, others, ridge),
                                   atol=1e-5, rtol=1e-4)
    # the fit recovers the planted map up to each token's scale: the head predicts held-out directions well
    rows = data.is_val
    predicted = router.mapped(8, data.features[8][rows])
    cos = torch.nn.functional.cosine_similarity(predicted, data.final[rows], dim=-1)
    assert float(cos.mean()) > 0.95


@torch.no_grad()
def test_low_rank_head_is_the_best_rank_r_map_of_the_fitted_values() -> None:
    """Reduced-rank regression checked another way: the ridge solution's fitted values X W, truncated to their
    top-r right singular vectors (an SVD of the values, not an eigendecomposition of their Gram matrix)."""
    data, rank = synthetic(), 5
    router = new_router(make_tiny_llama(), exit_head="linear", exit_head_rank=rank, checkpoint_layers=LAYERS)
    crossfit = fit_exit_heads(router, data, device=torch.device("cpu"), scale_free=True)
    train = torch.nonzero(~data.is_val).squeeze(1)
    full = lstsq_solution(data, 8, train, router.config.exit_head_ridge)
    x = torch.cat([data.features[8][train], torch.ones(len(train), 1)], 1).double()
    top = torch.linalg.svd(x @ full, full_matrices=False).Vh[:rank].T  # hidden x r
    expected = x[:50] @ full @ top @ top.T
    got = router.mapped(8, data.features[8][train[:50]]).double()
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-3)
    head = router.exit_heads["8"]
    assert head.down.weight.shape == (rank, HIDDEN) and head.up.weight.shape == (HIDDEN, rank)
    # a rank-r map: the matrix of the whole head has rank r; the fold heads too
    assert int(torch.linalg.matrix_rank(head.up.weight @ head.down.weight)) == rank
    assert int(torch.linalg.matrix_rank(crossfit.weights[8][0][:-1])) == rank


def test_lens_router_has_no_heads_and_fits_nothing() -> None:
    router = new_router(make_tiny_llama(), checkpoint_layers=LAYERS)
    assert router.config.exit_head == "lens" and len(router.exit_heads) == 0
    assert fit_exit_heads(router, synthetic(), device=torch.device("cpu"), scale_free=True) is None
    hidden = torch.randn(3, HIDDEN)
    assert router.exit_state(tide_hf.modeling.get_adapter(make_tiny_llama()), 4, hidden) is hidden


@torch.no_grad()
def test_training_tokens_are_labelled_by_the_head_that_did_not_see_them() -> None:
    """Labels of a training token come from the other block's head, held-out ones from the router's own head."""
    model = make_tiny_llama()
    adapter = tide_hf.modeling.get_adapter(model)
    data = synthetic()
    router = new_router(model, exit_head="linear", checkpoint_layers=LAYERS)
    crossfit = fit_exit_heads(router, data, device=torch.device("cpu"), scale_free=True)
    label(data, adapter, router, device=torch.device("cpu"), progress=False,
          exit_logits=lambda k, rows, normed, dtype: crossfit.exit_logits(router, adapter, k, rows, normed, dtype))
    final_top1 = model.lm_head(model.model.norm(data.final)).argmax(-1)
    for k in LAYERS:
        expected = torch.empty(len(data.final), dtype=torch.bool)
        folds = [(crossfit.fold == f, crossfit.weights[k][f]) for f in (0, 1)]
        for rows, weights in (*folds, (data.is_val, None)):
            head = router.exit_heads[str(k)].down
            w, b = (head.weight.T, head.bias) if weights is None else (weights[:-1], weights[-1])
            state = data.features[k][rows] @ w + b
            expected[rows] = model.lm_head(model.model.norm(state)).argmax(-1) == final_top1[rows]
        assert torch.equal(data.top1[k], expected)
        assert 0 < int(expected.sum()) < len(expected)  # both outcomes: the comparison is not vacuous


def test_exit_heads_round_trip_and_a_missing_head_is_refused(tmp_path) -> None:
    model = make_tiny_llama()
    router = new_router(model, exit_head="linear")
    router.save_pretrained(tmp_path / "r")
    loaded = TideRouter.from_pretrained(tmp_path / "r")
    assert loaded.config.exit_head == "linear"
    a, b = router.state_dict(), loaded.state_dict()
    assert any(n.startswith("exit_heads.") for n in a) and a.keys() == b.keys()
    assert all(torch.equal(a[n], b[n]) for n in a)
    # a config that says "linear" with weights lacking the heads (or the reverse) is a broken router
    lens = new_router(model)
    lens.save_pretrained(tmp_path / "lens")
    config = (tmp_path / "lens" / "config.json").read_text().replace('"exit_head": "lens"', '"exit_head": "linear"')
    (tmp_path / "lens" / "config.json").write_text(config)
    with pytest.raises(TideRouterFileError, match="missing tensors"):
        TideRouter.from_pretrained(tmp_path / "lens")


def test_bad_exit_head_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="exit_head must be one of"):
        new_router(make_tiny_llama(), exit_head="tuned")
    with pytest.raises(ValueError, match="exit_head_ridge"):
        new_router(make_tiny_llama(), exit_head_ridge=-1.0)
    with pytest.raises(ValueError, match="exit_head_rank=4 needs exit_head='linear'"):
        new_router(make_tiny_llama(), exit_head="lens", exit_head_rank=4)
    with pytest.raises(ValueError, match="exit_head_rank must be below hidden_size=32"):
        new_router(make_tiny_llama(), exit_head="linear", exit_head_rank=32)


@torch.no_grad()
def test_without_a_final_norm_the_head_predicts_the_state_itself() -> None:
    """`scale_free=False` (no final norm: the head reads the state's scale) fits the raw last-layer states."""
    data = synthetic()
    router = new_router(make_tiny_llama(), exit_head="linear", checkpoint_layers=LAYERS)
    fit_exit_heads(router, data, device=torch.device("cpu"), scale_free=False)
    train = torch.nonzero(~data.is_val).squeeze(1)
    head = router.exit_heads["8"].down
    fitted = torch.cat([head.weight.T, head.bias[None]]).double()
    want = lstsq_solution(data, 8, train, router.config.exit_head_ridge, unit_rms=False)
    torch.testing.assert_close(fitted, want, atol=1e-5, rtol=1e-4)


def test_exits_of_a_model_without_final_norm_are_served_at_the_models_scale() -> None:
    """OPT-350m's layout (post-layer norms, no final norm, project_out): its exit state goes to the head as is.
    Reference: the ridge least-squares map from the layer-4 state to the raw last-layer state, fitted here on
    the calibration's own training tokens, through the model's project_out and head; served exit logits (every
    token exits at 4) of a threshold-split sample must equal it, and keep the stock logits' spread."""
    torch.manual_seed(0)
    model = tf.OPTForCausalLM(tf.OPTConfig(vocab_size=256, hidden_size=32, ffn_dim=64, num_hidden_layers=9,
                                           num_attention_heads=4, max_position_embeddings=64, word_embed_proj_dim=16,
                                           do_layer_norm_before=False, pad_token_id=0)).eval()
    last_norm = model.model.decoder.layers[-1].final_layer_norm
    with torch.no_grad():  # the model's output scale: far from the unit RMS of a direction
        last_norm.weight.mul_(4.0)
        last_norm.bias.mul_(4.0)
    gen = torch.Generator().manual_seed(0)
    samples = [torch.randint(3, 256, (24,), generator=gen) for _ in range(30)]
    router = tide_hf.calibration.calibrate_tokens(model, samples, num_epochs=1, max_train_tokens=10**6, progress=False)
    adapter = tide_hf.modeling.get_adapter(model)
    data = collect(model, adapter, samples, router.config, batch_size=8, pad_id=0, progress=False)
    weights = lstsq_solution(data, 4, torch.nonzero(~data.is_val).squeeze(1), router.config.exit_head_ridge,
                             unit_rms=False).float()
    ids = samples[-1]
    rows = slice(len(data.final) - len(ids), None)  # every token kept: the last sample's tokens come last
    with torch.no_grad():
        state = data.features[4][rows] @ weights[:-1] + weights[-1]
        want = model.lm_head(model.model.decoder.project_out(state))
        with tide_hf.attach(model, router, exit_threshold=0.0, min_layers=4, mode="select"):
            served = model(input_ids=ids[None]).logits[0]
        stock = model(input_ids=ids[None]).logits[0]
    torch.testing.assert_close(served, want, atol=1e-3 * float(want.abs().max()), rtol=1e-3)
    assert 0.7 < float(served.std() / stock.std()) < 1.4
    assert not adapter.scale_free
