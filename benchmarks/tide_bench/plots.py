"""The Pareto plot of `tide-hf bench baselines` (matplotlib, imported only when it is drawn)."""

from __future__ import annotations

from pathlib import Path

from tide_hf.plotting import pyplot, save_png

MARKERS = {"tide": "o", "confidence": "s", "fixed_depth": "^", "static_skip": "D"}


def pareto(result: dict, path: str | Path) -> Path:
    """Quality against mean layers executed, one series per method, TIDE's thresholds annotated."""
    plt = pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    n = result["num_layers"]
    for method, marker in MARKERS.items():
        rows = sorted((r for r in result["rows"] if r["method"] == method), key=lambda r: r["decode_mean_layers"])
        if not rows:
            continue
        left.plot([r["decode_mean_layers"] for r in rows], [100 * r["greedy_prefix_match"] for r in rows],
                  marker=marker, label=method)
        right.plot([r["text_mean_layers"] for r in rows], [100 * r["perplexity_change"] for r in rows],
                   marker=marker, label=method)
        if method == "tide":
            for r in rows:
                left.annotate(str(r["param"]), (r["decode_mean_layers"], 100 * r["greedy_prefix_match"]),
                              textcoords="offset points", xytext=(4, 4), fontsize=8)
    left.plot([n], [100], "k*", markersize=10, label="stock")
    right.plot([n], [0], "k*", markersize=10, label="stock")
    left.set(xlabel="mean layers per generated token", ylabel="greedy continuation match vs stock (% of tokens)",
             title="generation quality vs depth")
    right.set(xlabel="mean layers per token (held-out text)", ylabel="perplexity change (%)", yscale="symlog",
              title="perplexity vs depth")
    left.legend(fontsize=8)
    return save_png(fig, path)
