"""PNG plots of `tide-hf analyze` results (matplotlib, imported only when a plot is drawn)."""

from __future__ import annotations

from pathlib import Path

from ..plotting import pyplot, save_png


def convergence(result: dict, path: str | Path) -> Path:
    """Mean cosine to the final state, top-1 agreement and KL per layer, checkpoints marked."""
    plt = pyplot()
    rows = result["layers"]
    layers = [r["layer"] for r in rows]
    fig, ax = plt.subplots(figsize=(8, 4))
    ax.plot(layers, [r["mean_cosine"] for r in rows], label="mean cos(h_l, h_final)")
    ax.plot(layers, [r["top1_agreement"] for r in rows], label="top-1 agreement with final")
    ax.plot(layers, [r["cosine_label_rate"] for r in rows], label=f"cos > {result['convergence_threshold']}")
    ax.set(xlabel="layer", ylabel="share / cosine", ylim=(0, 1.02), title=result["title"])
    kl = ax.twinx()
    kl.plot(layers, [r["mean_kl"] for r in rows], color="grey", linestyle="--", label="KL(final || exit)")
    kl.set(ylabel="KL (nats)", yscale="log")
    for k in result["checkpoints"]:
        ax.axvline(k, color="#dddddd", linewidth=0.8, zorder=0)
    ax.legend(loc="upper left", fontsize=8)
    kl.legend(loc="center left", fontsize=8)
    return save_png(fig, path)


def heatmap(result: dict, path: str | Path) -> Path:
    """Share of tokens per cosine bin (rows) and layer (columns): how spread convergence is."""
    plt = pyplot()
    hist = result["cosine_histogram"]
    fig, ax = plt.subplots(figsize=(8, 4))
    image = ax.imshow(hist["share"], origin="lower", aspect="auto", cmap="viridis",
                      extent=(0.5, len(result["layers"]) + 0.5, hist["edges"][0], hist["edges"][-1]))
    ax.set(xlabel="layer", ylabel="cos(h_l, h_final)", title="per-token convergence (share of tokens)")
    fig.colorbar(image, ax=ax)
    return save_png(fig, path)


def efficiency(result: dict, path: str | Path) -> Path:
    """Layers saved against top-1 agreement: the router at its thresholds and the oracle frontier."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4))
    oracle = result["oracle"]
    ax.plot([100 * o["agreement"] for o in oracle], [o["layers_saved"] for o in oracle], "k--", marker=".",
            label="oracle (best exits at that agreement)")
    rows = result["router"]
    ax.plot([100 * r["agreement"] for r in rows], [r["layers_saved"] for r in rows], marker="o", label="TIDE router")
    for r in rows:
        ax.annotate(str(r["threshold"]), (100 * r["agreement"], r["layers_saved"]), textcoords="offset points",
                    xytext=(4, 4), fontsize=8)
    ax.set(xlabel="top-1 agreement with the full model (%)", ylabel="mean layers saved per token",
           title="router efficiency on the model's own greedy text")
    ax.legend(fontsize=8)
    return save_png(fig, path)
