"""Exit heads: per checkpoint, a linear map from the checkpoint's final-normed state to the last layer's state.

A token that exits at checkpoint k gets its logits from the model's final norm and head applied to
`E_k(final_norm(h_k))` instead of to `h_k` itself. `E_k` is fitted in closed form by ridge least squares on
the training split of the kept calibration tokens (a "linear shortcut", Din et al. 2023, "Jump to
Conclusions"), at full rank or, with `exit_head_rank`, projected on the leading directions of its fitted
values (reduced-rank regression): it predicts the direction of the last layer's pre-norm state, which is all
the final norm keeps (RMSNorm and LayerNorm are scale-invariant), so every token weighs the same in the fit.
A model without a final norm (OPT-350m normalizes inside each layer) feeds the state as is to its head, so there
the target is the state itself: a direction alone would give exit logits at the wrong temperature.
The validation and threshold samples are left out, so the thresholds fitted on them see exit heads that
never saw them.

Cross-fitting: a head fitted on a token agrees with the final layer on it more often than on unseen text, so
labels made with it would teach the routers an agreement they will not meet. The training tokens are split
into `CROSS_FOLDS` contiguous blocks (whole samples, but for the block edges) and each block is labelled with
a head fitted on the other blocks; the router keeps the head fitted on all of them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import TideArgumentError
from ..modeling import ModelAdapter, TideRouter
from .labels import Collected

CROSS_FOLDS = 2  # blocks of training tokens; each is labelled by a head fitted on the others
FIT_CHUNK_ROWS = 8192  # tokens per accumulation of the normal equations (bounds the fit's device memory)
RMS_FLOOR = 1e-12  # an all-zero state has no direction: it stays a zero target instead of dividing by 0


@dataclass
class CrossFit:
    """Out-of-fold exit heads: the head each training token is labelled with was fitted without it."""

    fold: torch.Tensor  # (n,) long: the training block of each kept token; -1 for held-out tokens
    weights: dict[int, list[torch.Tensor]]  # layer -> per block, (hidden + 1, hidden) weights fitted without it

    def exit_logits(self, router: TideRouter, adapter: ModelAdapter, layer: int, rows: torch.Tensor,
                    normed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Exit logits of kept tokens `rows` (features `normed`) at `layer`: each training token through the head
        that did not see it, each held-out one through the router's own (fitted on every training token)."""
        fold = self.fold[rows].to(normed.device)
        features = normed.float()
        mapped = torch.empty_like(features)
        held = fold < 0
        mapped[held] = router.mapped(layer, features[held]).to(normed.device)
        for f, weights in enumerate(self.weights[layer]):
            mine = fold == f
            w = weights.to(normed.device)
            mapped[mine] = features[mine] @ w[:-1] + w[-1]
        return adapter.logits(mapped.to(dtype))


@torch.no_grad()
def fit_exit_heads(router: TideRouter, data: Collected, *, device: torch.device,
                   scale_free: bool) -> CrossFit | None:
    """Fit every checkpoint's exit head of `router` (when `config.exit_head == "linear"`) on `data`'s training
    tokens: minimise |[x, 1] W - y|^2 + ridge |W|^2 in float64, x the final-normed features, y the last layer's
    state, scaled to unit RMS when the final norm discards scale (`scale_free`, `ModelAdapter.scale_free`), ridge
    = `config.exit_head_ridge` times the mean diagonal of the Gram matrix. Returns the out-of-fold heads to
    label the training tokens with (None without exit heads)."""
    if not router.exit_heads:
        return None
    train = torch.nonzero(~data.is_val).squeeze(1)
    blocks = list(train.tensor_split(CROSS_FOLDS))
    fold = torch.full_like(data.is_val, -1, dtype=torch.long)
    for f, rows in enumerate(blocks):
        fold[rows] = f
    dtype = torch.float64 if device.type != "mps" else torch.float32  # MPS has no float64
    weights: dict[int, list[torch.Tensor]] = {}
    ridge, rank = router.config.exit_head_ridge, router.config.exit_head_rank
    for k in router.checkpoint_layers:
        sums = [_normal_equations(data, k, rows, device, dtype, scale_free) for rows in blocks]
        gram, cross = sum(g for g, _ in sums), sum(c for _, c in sums)
        w = _solve(gram, cross, ridge)  # (hidden + 1, hidden): the last row is the bias
        basis = _output_basis(w, gram, rank)
        head = router.exit_heads[str(k)]
        down = w if basis is None else w @ basis
        head.down.weight.copy_(down[:-1].T)
        head.down.bias.copy_(down[-1])
        if basis is not None:
            head.up.weight.copy_(basis)
        weights[k] = []
        for g, c in sums:
            w_fold = _solve(gram - g, cross - c, ridge)
            basis = _output_basis(w_fold, gram - g, rank)
            weights[k].append((w_fold if basis is None else w_fold @ basis @ basis.T).float())
    return CrossFit(fold, weights)


def _output_basis(weights: torch.Tensor, gram: torch.Tensor, rank: int | None) -> torch.Tensor | None:
    """Reduced-rank regression: the `rank` leading eigenvectors (hidden x rank) of the fitted values' Gram
    matrix W^T X^T X W; projecting the ridge solution on them gives the best rank-r map. None: full rank."""
    if rank is None:
        return None
    _, vectors = torch.linalg.eigh(weights.T @ gram @ weights)  # ascending eigenvalues
    return vectors[:, -rank:]


def _normal_equations(data: Collected, layer: int, rows: torch.Tensor, device: torch.device,
                      dtype: torch.dtype, scale_free: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """X^T X and X^T Y over `rows` (X: features with a column of ones, Y: last-layer states, at unit RMS when
    `scale_free`)."""
    hidden = data.features[layer].shape[1]
    gram = torch.zeros(hidden + 1, hidden + 1, dtype=dtype, device=device)
    cross = torch.zeros(hidden + 1, hidden, dtype=dtype, device=device)
    for part in rows.split(FIT_CHUNK_ROWS):
        x = data.features[layer][part].to(device, dtype)
        x = torch.cat([x, x.new_ones(len(x), 1)], 1)
        y = data.final[part].to(device, dtype)
        if scale_free:
            y = y / y.pow(2).mean(-1, keepdim=True).sqrt().clamp_min(RMS_FLOOR)
        gram += x.T @ x
        cross += x.T @ y
    return gram, cross


def _solve(gram: torch.Tensor, cross: torch.Tensor, ridge: float) -> torch.Tensor:
    regularised = gram.clone()
    regularised.diagonal().add_(ridge * gram.diagonal().mean())
    try:
        return torch.linalg.solve(regularised, cross)
    except torch.linalg.LinAlgError:  # no token in a fold (a relative ridge of a zero matrix is zero), or ridge 0
        raise TideArgumentError(f"the exit heads' least-squares fit is singular (exit_head_ridge={ridge}, "
                                f"{int(gram[-1, -1])} training tokens in the fit): give calibration more text, or a "
                                "larger exit_head_ridge") from None
