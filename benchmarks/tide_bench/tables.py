"""Markdown tables of the result JSON that `tide-hf bench` writes: kept apart from the measurements (no torch,
no model code), so `python benchmarks/report.py` renders the results page in a moment."""

from __future__ import annotations

from tide_hf.eval.tables import percent


def format_table(result: dict) -> str:
    """Markdown tables of a bench result (the results page shows these)."""
    lines = ["| batch | stock tok/s | TIDE (exits off) tok/s | ratio |", "|---|---|---|---|"]
    for r in result["overhead"]:
        lines.append(f"| {r['batch_size']} | {r['stock_tok_s']:.1f} | {r['tide_tok_s']:.1f} | {r['ratio']:.3f} |")
    rows = result["quality"]["rows"]
    named = len({r.get("router") for r in rows}) > 1  # a router column only where it tells rows apart
    lines += ["", f"stock perplexity {result['quality']['stock_perplexity']:.3f}", "",
              "| " + "router | " * named + "label | threshold | decode exit rate | mean layers | greedy exact | "
              "greedy prefix | ppl change | speed vs stock |",
              "|---" * (8 + named) + "|"]
    for r in rows:
        lines.append("| " + (f"{r['router']} | " if named else "") + f"{r['label']} | {r['threshold']} | "
                     f"{r['decode_exit_rate']:.1%} | "
                     f"{r['decode_mean_layers']:.2f} | "
                     f"{r['greedy_exact_match']:.1%} | {r['greedy_prefix_match']:.1%} | "
                     f"{r['perplexity_change']:+.2%} | "
                     f"{r['speed_ratio']:.3f} |")
    return "\n".join(lines)


def format_modes(result: dict) -> str:
    """Markdown tables of the modes section."""
    lines = ["| exit depth | kv | stock ms/step | ideal ms/step | skip ms/step | speedup vs stock | realized / ideal |",
             "|---|---|---|---|---|---|---|"]
    for r in result["forced"]["rows"]:
        lines.append(f"| {r['depth']} | {r['kv']} | {r['stock_step_ms']:.1f} | {r['ideal_step_ms']:.1f} | "
                     f"{r['skip_step_ms']:.1f} | {r['speedup_vs_stock']:.2f} | {r['realized_over_ideal']:.2f} |")
    lines += ["", "| kv | threshold | mean executed layers | speedup vs stock | realized / ideal | greedy exact | "
              "greedy prefix | ppl change |", "|---|---|---|---|---|---|---|---|"]
    for r in result["mixed"]["rows"]:
        lines.append(f"| {r['kv']} | {r['threshold']} | {r['mean_executed_layers']:.2f} | "
                     f"{r['speedup_vs_stock']:.2f} | "
                     f"{r['realized_over_ideal']:.2f} | {r['greedy_exact_match']:.1%} | "
                     f"{r['greedy_prefix_match']:.1%} | "
                     f"{r['perplexity_change']:+.2%} |")
    if result.get("speculative"):
        lines += ["", format_speculative(result["speculative"])]
    return "\n".join(lines)


def format_batches(result: dict) -> str:
    """Markdown tables of the batches section: a decode step's cost by rows, forced per-row exits, real router
    decode, prefill. Results written before a column existed (the step cost, the row-cost ideal) show "-" or leave
    it out; those written while `park_rows` was an option name it beside their kv."""
    def policy(row: dict) -> str:
        return f"{row['kv']}, park_rows" if row.get("park_rows") else row["kv"]

    lines = []
    if result.get("step_cost"):
        lines += ["| rows | seconds per stock decode step | vs the fewest rows |", "|---|---|---|"]
        lines += [f"| {c['rows']} | {c['step_s']:.4f} | {c['over_first']:.2f} |" for c in result["step_cost"]]
        lines.append("")
    lines += ["| batch | kv | exiting rows | exit depth | layers executed / token | speed vs stock | realized / ideal "
              "| row-cost ideal speed |", "|---|---|---|---|---|---|---|---|"]
    for r in result["forced"]:
        row_ideal = "-" if r.get("row_cost_ideal_speedup") is None else f"{r['row_cost_ideal_speedup']:.2f}"
        lines.append(f"| {r['batch_size']} | {policy(r)} | {r['exiting_rows']} | {r['depth']} | "
                     f"{r['mean_executed_layers']:.2f} | {r['speedup_vs_stock']:.2f} | "
                     f"{r['realized_over_ideal']:.2f} | {row_ideal} |")
    lines += ["", "| target | kv | batch | layers executed / decode token (rows alone) | speed vs stock | "
              "realized / ideal | top-1 agreement |", "|---|---|---|---|---|---|---|"]
    for r in result["router"]["decode"]:
        lines.append(f"| {r['target']} | {policy(r)} | {r['batch_size']} | {r['mean_executed_layers']:.2f} "
                     f"({r['alone_mean_executed_layers']:.2f}) | {r['speedup_vs_stock']:.2f} | "
                     f"{r['realized_over_ideal']:.2f} | {percent(r['top1_agreement'])} |")
    lines += ["", "| prefill | target | kv | layers executed / position | exit rate | speed vs stock | "
              "top-1 agreement |", "|---|---|---|---|---|---|---|"]
    for r in result["router"]["prefill"]:
        lines.append(f"| {r['rows']} x {r['positions']} | {r['target']} | {r['kv']} | "
                     f"{r['mean_executed_layers']:.2f} | {percent(r['exit_rate'])} | {r['speedup_vs_stock']:.2f} | "
                     f"{percent(r['top1_agreement'])} |")
    return "\n".join(lines)


def format_continuous(result: dict) -> str:
    """Markdown table of the continuous section: skip mode in continuous batching at each target vs stock."""
    lines = ["| target | kv | requests x new tokens | layers executed / decode token | layers executed / prompt "
             "position | decode exit rate | speed vs stock | top-1 agreement |", "|---|---|---|---|---|---|---|---|"]
    for r in result["continuous"]:
        lines.append(f"| {r['target']} | {r['kv']} | {r['requests']} x {r['new_tokens']} | "
                     f"{r['decode_mean_executed_layers']:.2f} | {r['prefill_mean_executed_layers']:.2f} | "
                     f"{percent(r['decode_exit_rate'])} | {r['speedup_vs_stock']:.2f} | "
                     f"{percent(r['top1_agreement'])} |")
    return "\n".join(lines)


def format_speculative(spec: dict) -> str:
    """Markdown table of the speculative section, a row per workload (open prose; `grounded`: prompts asking to
    repeat a passage, where measured), each lossless peer's speed beside ours and our acceptance per draft
    source; then lookup's rounds per class of match length. Results written before a column existed (the
    drafting policy, prompt lookup, draft sources) show "-" there."""
    def cell(row: dict, key: str, fmt: str) -> str:
        return "-" if row.get(key) is None else format(row[key], fmt)

    def source(row: dict, name: str, key: str, fmt: str) -> str:
        counts = (row.get("sources") or {}).get(name)
        return "-" if counts is None else format(counts[key], fmt)

    def line(name: str, row: dict) -> str:
        divergence = (cell(row, "divergence", ".1%") if "divergence" in row
                      else ("0" if row["identical_all_prompts"] else "> 0"))
        batched = "-" if row.get("identical_batched") is None else \
            f"{row['identical_batched']} ({row['batched_rows']} rows)"
        return (f"| {name}: {row['prompts']} prompts x {row['reps']} reps | "
                f"{row['draft_layer']} ({row.get('draft_vocab') or 'all'}) | {row['speed_ratio']:.3f} | "
                f"{cell(row, 'lookup_speed_ratio', '.3f')} | "
                f"{cell(row, 'assisted_speed_ratio', '.3f')} (layer {row.get('assisted_layer', '-')}) | "
                f"{source(row, 'early_exit', 'acceptance_per_token', '.1%')} / "
                f"{source(row, 'lookup', 'acceptance_per_token', '.1%')} | "
                f"{source(row, 'early_exit', 'rounds', 'd')} / {source(row, 'lookup', 'rounds', 'd')} | "
                f"{cell(row, 'acceptance_per_token', '.1%')} | {row['mean_draft_length']:.2f} "
                f"({cell(row, 'mean_planned_length', '.2f')}) | {cell(row, 'optimal_draft_length', 'd')} | "
                f"{cell(row, 'optimal_speedup', '.3f')} | {cell(row, 'realized_over_optimum', '.2f')} | "
                f"{divergence} / {cell(row, 'assisted_divergence', '.1%')} / {cell(row, 'lookup_divergence', '.1%')}"
                f" | {batched} |")

    rows = [("open prose", spec)] + ([("grounded", spec["grounded"])] if spec.get("grounded") else [])
    lookup = next((r["lookup_tokens"] for _, r in rows if r.get("lookup_tokens") is not None), "-")
    table = "\n".join([
        f"| speculative | draft layer (vocabulary) | speed vs stock | prompt lookup ({lookup} tokens) speed | "
        "`assistant_early_exit` speed | acceptance per token (early exit / lookup) | rounds (early exit / lookup) "
        "| acceptance per token (all) | mean draft length (planned) | optimal early-exit length | optimum E | "
        "realized / optimum | divergence (ours / assisted / lookup) | identical (batched) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|", *(line(name, row) for name, row in rows)])
    classes = [f"| {name} | {match} | {c['rounds']} | {c['drafted']} | {c['accepted']} | "
               f"{c['acceptance_per_token']:.1%} |"
               for name, row in rows for match, c in (row.get("lookup_matches") or {}).items()]
    if not classes:  # (results written before lookup kept classes)
        return table
    return "\n".join([table, "", "| lookup drafts | match length (tokens) | rounds | drafted | accepted | "
                       "acceptance per token |", "|---|---|---|---|---|---|", *classes])


def format_baselines(result: dict) -> str:
    """Markdown table of every point, then the verdict per TIDE threshold."""
    lines = [f"stock perplexity {result['stock']['perplexity']:.3f}; static skipping drops, in order: "
             + ", ".join(f"{o['layer']} ({o['agreement']:.1%})" for o in result["static_skip_order"]), "",
             "| method | setting | decode layers | text layers | greedy exact | greedy prefix | ppl change "
             "| speed vs stock |",
             "|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        lines.append(f"| {r['method']} | {r['param']} | {r['decode_mean_layers']:.2f} | "
                     f"{r['text_mean_layers']:.2f} | "
                     f"{r['greedy_exact_match']:.1%} | {r['greedy_prefix_match']:.1%} | "
                     f"{r['perplexity_change']:+.1%} | "
                     f"{r['speed_ratio']:.2f} |")
    lines += ["", "| TIDE threshold | quality measure | TIDE | TIDE layers | "
              "best baseline at equal or better quality | "
              "its quality | its layers | TIDE saves more |", "|---|---|---|---|---|---|---|---|"]
    for v in result["verdict"]:
        fmt = "{:.1%}" if v["quality"] == "greedy_prefix_match" else "{:+.1%}"
        theirs = "-" if v["baseline_quality"] is None else fmt.format(v["baseline_quality"])
        layers = "-" if v["baseline_layers"] is None else f"{v['baseline_layers']:.2f}"
        lines.append(f"| {v['threshold']} | {v['quality']} | {fmt.format(v['tide_quality'])} | "
                     f"{v['tide_layers']:.2f} | "
                     f"{v['best_baseline'] or 'none'} | {theirs} | {layers} | "
                     f"{'yes' if v['tide_saves_more'] else 'no'} |")
    if result.get("at_perplexity"):
        lines += ["", "| perplexity change at most | TIDE layers saved | TIDE setting | best baseline | "
                  "its layers saved | TIDE / baseline |", "|---|---|---|---|---|---|"]
        for a in result["at_perplexity"]:
            def cell(value: float | None, fmt: str = "{:.2f}") -> str:
                return "-" if value is None else fmt.format(value)
            lines.append(f"| +{a['level']:.0%} | {cell(a['tide'])} | {a['tide_setting'] or '-'} | "
                         f"{a['best_baseline'] or 'none'} | {cell(a['baseline_saved'])} | {cell(a['ratio'])} |")
    return "\n".join(lines)



def format_kernels(result: dict) -> str:
    """Markdown table of `bench kernels`; GPU results add host time and the roofline columns."""
    rows = result["rows"]
    keys = ["rows", "hidden", "bottleneck", "dtype", "backend", "kernel_us", "torch_us", "speedup"]
    gpu = bool(rows) and "copy_gbps" in rows[0]
    lines = []
    if gpu:
        first = rows[0]
        lines += [f"{first['device_name']}: copy {first['copy_gbps']:.0f} GB/s, bf16 matmul "
                  f"{first['matmul_tflops']:.0f} TFLOP/s (measured in the same run); µs are device time "
                  f"({first['timing']}), host µs what the caller spends per call.", ""]
        keys = ["rows", "hidden", "dtype", "kernel_us", "kernel_host_us", "torch_us", "speedup", "kernel_gbps",
                "copy_share", "kernel_tflops", "matmul_share", "bound", "roofline_share"]
    lines += ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    formats = {"copy_share": ".1%", "matmul_share": ".1%", "roofline_share": ".1%", "kernel_tflops": ".2f"}
    for r in rows:
        cells = [format(r[k], formats.get(k, ".1f")) if isinstance(r[k], float) else str(r[k]) for k in keys]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def format_synthetic(result: dict) -> str:
    """Markdown table of a `bench synthetic` run (rows below the timer's noise are named so, not given a ratio)."""
    lines = [f"{result['shape']} ({result['dtype']}, random weights) on {result['device']}, prompt "
             f"{result['prompt_len']}, {result['new_tokens']} tokens, median of {result['reps']}", "",
             "| configuration | batch | path | ms / token | vs stock | vs ideal |", "|---|---|---|---|---|---|"]
    for r in result["rows"]:
        ideal = f"{r['vs_ideal']:.2f}" if "vs_ideal" in r else ""
        path = "compiled static" if r["compiled"] else "eager"
        ms, vs_stock = ((f"{r['ms_per_token']:.2f}", "" if r["vs_stock"] is None else f"{r['vs_stock']:.3f}")
                        if r["ms_per_token"] > 0 else ("below noise", ""))
        lines.append(f"| {r['config']} | {r['batch_size']} | {path} | {ms} | {vs_stock} | {ideal} |")
    return "\n".join(lines)


def _goal_figure(goal: dict) -> str:
    return "not measured" if goal["figure"] is None else format(goal["figure"], goal["format"])


def format_gpu_suite(result: dict) -> str:
    """Markdown of `tide-hf bench gpu`: the goals met or not with their figures, then each section's table."""
    versions = result["versions"]
    plan = result["plan"]
    lines = [f"{'Dry run (tiny shape, CPU)' if result['dry_run'] else 'GPU suite'} on {result['device']}: torch "
             f"{versions['torch']} (CUDA {versions['cuda']}), transformers {versions['transformers']}, kernels "
             f"{result['kernels_backend']}; {plan['shape']} in {plan['dtype']}, random weights; "
             f"{result['wall_s']:.0f} s in all (" + ", ".join(f"{k} {v:.0f} s" for k, v in result["seconds"].items())
             + ").", "", "| goal | target | figure | met |", "|---|---|---|---|"]
    for goal in result["goals"]:
        target = f">= {goal['at_least']}" if goal["at_least"] is not None else f"<= {goal['at_most']}"
        met = {True: "yes", False: "**no**", None: "-"}[goal["met"]]
        lines.append(f"| {goal['goal']} | {target} | {_goal_figure(goal)} | {met} |")
    for name in result["errors"]:
        lines += ["", f"Section `{name}` failed (traceback in the JSON): "
                  + result["errors"][name].strip().splitlines()[-1]]
    timing = {"shape": plan["shape"], "dtype": plan["dtype"], "device": result["device"],
              "prompt_len": plan["prompt_len"], "new_tokens": plan["new_tokens"], "reps": plan["reps"]}
    for name, title in (("eager", "Eager decoding"), ("compiled", "Compiled static cache")):
        if result.get(name):
            lines += ["", f"#### {title}", "", format_synthetic({**timing, "rows": result[name]["rows"]})]
    if result.get("kernels"):
        lines += ["", "#### Fused kernels", "", format_kernels(result["kernels"])]
    cal = result.get("calibration")
    if cal:
        bare = sum(cal["bare_forward_s"]) / len(cal["bare_forward_s"])
        secs = cal["seconds"]
        lines += ["", "#### Calibration", "", "| samples x tokens | label (exit head) | total | model forward | "
                  "labelling | training | bare forward | total / bare |", "|---|---|---|---|---|---|---|---|",
                  f"| {cal['samples']} x {cal['seq_len']} | {cal['label']} ({cal['exit_head']}) | "
                  f"{cal['total_s']:.1f} s | {secs['forward']:.1f} s | {secs['label']:.1f} s | {secs['train']:.1f} s "
                  f"| {bare:.1f} s | {cal['total_over_bare']:.2f} |"]
    spec = result.get("speculative")
    if spec:
        lines += ["", "#### Speculative mode, near-identity after layer " f"{spec['near_identity_after']} "
                  f"(x {spec['near_identity_scale']})", "", format_speculative(spec["speculative"])]
    return "\n".join(lines)


def format_linears(result: dict) -> str:
    """The `linears` bench as two Markdown tables: forward costs by k, then generation ratios."""
    tokens = result["forward_costs"][0]["tokens"]
    lines = ["| dtype | linear path | " + " | ".join(f"k = {k}" for k in tokens) + " |",
             "|---|---|" + "---|" * len(tokens)]
    for row in result["forward_costs"]:
        cells = " | ".join(f"{ms:.1f} ms ({steps:.2f}x)" for ms, steps in zip(row["ms"], row["steps"]))
        served = row.get("rows_from")
        label = row["path"] if served is None else f"{row['path']} (oneDNN from {served} rows)"
        lines.append(f"| {row['dtype']} | {label} | {cells} |")
    gen = result["generation"]
    lines += ["", "| linear path | method | vs stock, same path | vs stock eager | identical to stock, same path |",
              "|---|---|---|---|---|"]
    for row in gen["rows"]:
        lines.append(f"| {row['path']} | {row['method']} | {row['ratio_vs_stock_same_path']:.3f}x | "
                     f"{row['ratio_vs_stock_eager']:.3f}x | {row['identical_to_stock_same_path']:.0%} |")
    lines += ["", f"Stock on the fast path gave stock eager's tokens on {gen['stock_fast_identical_to_eager']:.0%} of "
              "the prompts."]
    return "\n".join(lines)
