"""Markdown tables of the result JSON that `tide-hf analyze` writes, and the percentages the demo prints: kept
apart from the measurements (no torch, no model code), so `python benchmarks/report.py` renders the results page
in a moment."""

from __future__ import annotations


def percent(share: float) -> str:
    """`share` as a percentage without rounding it (a target of 0.955 is "95.5%", not a stronger-sounding "96%")."""
    return f"{100 * share:g}%"


def format_analysis(result: dict, convergence: bool = True) -> str:
    """Markdown: per-layer table and oracle table (unless `convergence` is False: they describe the model and
    text, not the router), and router efficiency when present."""
    lines: list[str] = []
    if convergence:
        conv = result["convergence"]
        lines += [f"{conv['title']}", "", "| layer | mean cosine | cos > threshold | top-1 agreement | mean KL |",
                  "|---|---|---|---|---|"]
        for r in conv["layers"]:
            mark = " (checkpoint)" if r["layer"] in conv["checkpoints"] else ""
            lines.append(f"| {r['layer']}{mark} | {r['mean_cosine']:.3f} | {r['cosine_label_rate']:.1%} | "
                         f"{r['top1_agreement']:.1%} | {r['mean_kl']:.3f} |")
        lines += ["", f"oracle over checkpoints {conv['checkpoints']} ({conv['num_layers']} layers):", "",
                  "| top-1 agreement | mean layers | layers saved |", "|---|---|---|"]
        lines += [f"| {o['agreement']:.1%} | {o['mean_layers']:.2f} | {o['layers_saved']:.2f} |"
                  for o in conv["oracle"]]
    eff = result.get("efficiency")
    if eff:
        lines += [""] * bool(lines) + [f"router efficiency on the model's own greedy text ({eff['tokens']} tokens):",
                                        "", "| threshold | agreement | layers saved | oracle saves | efficiency |",
                                        "|---|---|---|---|---|"]
        for r in eff["router"]:
            lines.append(f"| {r['threshold']} | {r['agreement']:.1%} | {r['layers_saved']:.2f} | "
                         f"{r['oracle_layers_saved']:.2f} | {efficiency(r)} |")
        if eff.get("targets"):
            lines += ["", f"quality targets (per-checkpoint thresholds, confidence {eff['confidence']}): agreement "
                      "delivered on the model's own greedy text and on held-out text "
                      f"({eff.get('heldout_tokens', 0)} teacher-forced tokens):", "",
                      "| target | greedy text: agreement | layers saved | oracle saves | efficiency | "
                      "held-out text: agreement | layers saved | oracle saves | efficiency |",
                      "|---|---|---|---|---|---|---|---|---|"]
            held = {r["target"]: r for r in eff.get("heldout_targets", [])}
            for r in eff["targets"]:
                h = held.get(r["target"])
                tail = (f"{h['agreement']:.1%} | {h['layers_saved']:.2f} | {h['oracle_layers_saved']:.2f} | "
                        f"{efficiency(h)}") if h else "- | - | - | -"
                lines.append(f"| {r['target']} | {r['agreement']:.1%} | {r['layers_saved']:.2f} | "
                             f"{r['oracle_layers_saved']:.2f} | {efficiency(r)} | {tail} |")
    return "\n".join(lines)


def efficiency(row: dict) -> str:
    """A row's router efficiency, or "-" where the oracle saves nothing at its agreement (no ratio exists)."""
    return "-" if row["efficiency"] is None else f"{row['efficiency']:.2f}"
