"""The measurement helpers behind `tide-hf bench`: each checked against a computation done another way."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import (
    NUM_LAYERS,
    ByteTokenizer,
    constant_router,
    make_documents,
    make_model,
    make_tiny_llama,
    new_router,
    router_for,
    skip_model,
)
from transformers import AutoModelForCausalLM

import tide_hf
from tide_bench.measure import match_rate, perplexity
from tide_bench.modes import fit_line, truncated
from tide_hf.calibration import held_out_texts, make_samples
from tide_hf.config import TideRouterConfig


def test_truncated_context_runs_exactly_a_shallower_model_and_restores_depth():
    model = make_tiny_llama()
    config = copy.deepcopy(model.config)
    config.num_hidden_layers = 4
    small = AutoModelForCausalLM.from_config(config).eval()
    small.load_state_dict(model.state_dict(), strict=False)
    ids = torch.randint(3, 256, (2, 6), generator=torch.Generator().manual_seed(0))
    with truncated(model, 4):
        ours = model.generate(input_ids=ids, max_new_tokens=5, do_sample=False)
    assert torch.equal(ours, small.generate(input_ids=ids, max_new_tokens=5, do_sample=False))
    assert model.config.num_hidden_layers == 9
    assert not torch.equal(model.generate(input_ids=ids, max_new_tokens=5, do_sample=False), ours)


def test_fit_recovers_a_linear_cost_model():
    a, b = fit_line([8, 16, 24, 30], [0.002 + 0.001 * d for d in (8, 16, 24, 30)])
    assert abs(a - 0.002) < 1e-12 and abs(b - 0.001) < 1e-12


def test_match_rate_counts_exact_rows_and_prefixes():
    stock = torch.tensor([[1, 2, 3, 4], [1, 2, 3, 4]])
    ours = torch.tensor([[1, 2, 3, 4], [1, 9, 3, 4]])  # row 2 diverges after one token, later tokens don't count
    assert match_rate(ours, stock) == (0.5, (1.0 + 0.25) / 2)


def test_perplexity_equals_exp_of_mean_token_nll():
    model = make_tiny_llama()
    chunks = [torch.randint(3, 256, (n,), generator=torch.Generator().manual_seed(n)) for n in (5, 8)]
    ppl, exits = perplexity(model, chunks, batch_size=2)
    nll, count = 0.0, 0
    with torch.no_grad():
        for c in chunks:  # one at a time, no padding
            logp = torch.log_softmax(model(input_ids=c[None]).logits[0, :-1].float(), -1)
            nll -= float(logp.gather(1, c[1:, None]).sum())
            count += len(c) - 1
    assert abs(ppl - torch.exp(torch.tensor(nll / count)).item()) < 1e-3 * ppl
    assert exits is None  # no router attached: no exit statistics
    with tide_hf.attach(model, constant_router(model, -30.0), exit_threshold=0.5, mode="select"):
        attached, exits = perplexity(model, chunks, batch_size=2)
    assert attached == pytest.approx(ppl) and exits.tokens == count  # the scored positions, each chunk's last not


def test_held_out_texts_are_exactly_the_documents_calibration_never_read():
    tok = ByteTokenizer()
    texts = make_documents(20, 30, seed=4)
    cfg = TideRouterConfig(hidden_size=8, num_hidden_layers=9, num_samples=7, seq_len=64, seed=3, exit_head="lens")
    samples = make_samples(tok, texts, cfg.num_samples, cfg.seq_len, cfg.seed)
    held = held_out_texts(tok, texts, cfg)
    used = {bytes(s.tolist()) for s in samples}
    assert held and len(held) < len(texts)
    for text in held:  # no chunk of a held-out document was a calibration sample
        ids = tok(text)["input_ids"]
        assert all(bytes(ids[i : i + cfg.seq_len]) not in used for i in range(0, len(ids), cfg.seq_len))
    read = [t for t in texts if t not in held]  # and every other document contributed a sample
    assert all(any(bytes(tok(t)["input_ids"][:cfg.seq_len]) == u for u in used) for t in read)


def test_speculative_section_reports_identical_output_and_consistent_counters():
    from helpers import constant_router, make_model

    from tide_bench.measure import left_pad
    from tide_bench.modes import speculative
    from tide_bench.tables import format_speculative

    model = make_model()
    model.generation_config.eos_token_id = None
    router = constant_router(model, 30.0)  # always says "converged": drafting is attempted
    # phrases said 3 times: the context has matches of several lengths to draft after
    prompts = [torch.randint(3, 256, (n,), generator=torch.Generator().manual_seed(n)).repeat(3) for n in (5, 7)]
    batches = [left_pad([p], 0) for p in prompts]
    res = speculative(model, router, batches, left_pad(prompts, 0), new_tokens=6, reps=1)
    assert res["identical_all_prompts"] and res["identical_batched"] and res["batched_rows"] == 2
    assert res["prompts"] == 2 and res["speed_ratio"] > 0
    assert res["acceptance_rate"] == (res["accepted"] / res["drafted"] if res["drafted"] else 0.0)
    assert res["mean_draft_length"] == (res["drafted"] / res["rounds"] if res["rounds"] else 0.0)
    classes = res["lookup_matches"]  # lookup's rounds split by class of match length, summing to its own
    assert classes and all(sum(c[k] for c in classes.values()) == res["sources"]["lookup"][k]
                           for k in ("rounds", "drafted", "accepted", "trials"))
    table = format_speculative(res)
    for match, counts in classes.items():
        assert f"| open prose | {match} | {counts['rounds']} | {counts['drafted']} | {counts['accepted']} |" in table


def test_synthetic_forced_exits_and_table() -> None:
    """The synthetic bench's constant routers force exactly the decisions its rows are named after."""
    from types import SimpleNamespace

    import tide_hf
    from tide_bench.synthetic import build_model, configurations, run_synthetic

    model = build_model("tiny", "cpu", torch.float32)
    ids = torch.randint(3, 256, (2, 6))
    configs = configurations(model, 4)
    for key, depth in (("select-exit", 4), ("select-scored", 8), ("skip-recompute", 4)):
        with configs[key][1]() as handle:
            model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=3, min_new_tokens=3,
                           do_sample=False, pad_token_id=0)
            assert dict(handle.last_stats.decode.exits) == {depth: 2 * 2}, key  # 2 rows x 2 decode steps
    assert tide_hf.get_handle(model) is None
    args = SimpleNamespace(device="cpu", dtype="float32", synthetic="tiny", synthetic_depth=4, configs=["select-exit"],
                           compile=["eager"], batch_sizes=[1], prompt_len=6, new_tokens=3, reps=1)
    rows = run_synthetic(args)["rows"]
    assert [r["config"] for r in rows] == ["stock", "select, all exit at 4"]
    assert "vs_ideal" not in rows[1]  # no truncated model was timed
    args.configs = ["select-exit", "truncated"]
    rows = run_synthetic(args)["rows"]
    if min(rows[1]["ms_per_token"], rows[2]["ms_per_token"]) > 0:  # else below timing noise: no ratio (below)
        assert rows[1]["vs_ideal"] == rows[2]["ms_per_token"] / rows[1]["ms_per_token"]


def test_synthetic_refuses_bad_settings_before_building_anything(tmp_path, capsys) -> None:
    """A device torch cannot use, a depth between checkpoints (it would be measured at the next checkpoint
    under this depth's name) or one decode token are one-line errors, and a refused run leaves no folder."""
    from tide_hf.cli import main

    out = tmp_path / "out"
    for extra, message in ((["--device", "nonsense"], "--device 'nonsense' cannot be used here"),
                           (["--synthetic-depth", "6"], "--synthetic-depth 6: tokens exit only at a checkpoint, "
                                                        "here after 4 layers"),
                           (["--synthetic-depth", "4", "--new-tokens", "1"], "needs at least 2")):
        with pytest.raises(SystemExit) as info:
            main(["bench", "synthetic", "tiny", *extra, "--output", str(out)])
        said = capsys.readouterr().err or str(info.value.code)  # an error's line, or the argument check's exit text
        assert info.value.code != 0 and message in said and len(said.strip().splitlines()) == 1, said
        assert not out.exists()
    (tmp_path / "afile").write_text("x")
    with pytest.raises(SystemExit):
        main(["bench", "synthetic", "tiny", "--synthetic-depth", "4", "--output", str(tmp_path / "afile")])
    assert "is a file; give a folder name" in capsys.readouterr().err


def test_modes_refuses_depths_between_checkpoints_before_loading_the_model(tmp_path, capsys) -> None:
    from tide_hf.cli import main

    router = new_router(make_model())  # checkpoints after 4 and 8 of 9 layers
    router.save_pretrained(tmp_path / "router")
    with pytest.raises(SystemExit) as info:
        main(["bench", "modes", "--router", str(tmp_path / "router"), "--depths", "4", "6", "9",
              "--model", str(tmp_path / "no-model"), "--output", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert info.value.code == 1 and "--depths 6 9: tokens exit only at a checkpoint, here after 4, 8 layers" in err
    assert not (tmp_path / "out").exists()


def test_synthetic_table_reports_decode_times_below_noise_without_ratios() -> None:
    """(T(n) - T(1)) / (n - 1) can come out <= 0 when the decode time drowns in timing noise: no ratio is
    computed from such a time, and the table says so instead of printing a negative time."""
    from tide_bench.synthetic import with_ideal_ratios
    from tide_bench.tables import format_synthetic

    rows = [{"config": "stock", "batch_size": 1, "compiled": False, "ms_per_token": 2.0, "vs_stock": 1.0},
            {"config": "select, all exit at 4", "batch_size": 1, "compiled": False, "ms_per_token": -0.5,
             "vs_stock": None},
            {"config": "truncated to 4 (ideal)", "batch_size": 1, "compiled": False, "ms_per_token": 1.0,
             "vs_stock": 2.0}]
    rows = with_ideal_ratios(rows, 4)
    assert "vs_ideal" not in rows[1]
    table = format_synthetic({"shape": "tiny", "dtype": "float32", "device": "cpu", "prompt_len": 6,
                              "new_tokens": 3, "reps": 1, "rows": rows})
    assert "| select, all exit at 4 | 1 | eager | below noise |  |  |" in table
    assert "| truncated to 4 (ideal) | 1 | eager | 1.00 | 2.000 |  |" in table


def test_bench_table_names_the_router_of_each_row_when_there_are_several() -> None:
    """Two routers of the same label gave rows nothing told apart."""
    from tide_bench.tables import format_table

    row = {"label": "top1", "threshold": 0.9, "decode_exit_rate": 0.5, "decode_mean_layers": 6.0,
           "greedy_exact_match": 1.0, "greedy_prefix_match": 1.0, "perplexity_change": 0.01, "speed_ratio": 1.1}
    result = {"overhead": [], "quality": {"stock_perplexity": 2.0, "rows": [{**row, "router": "a"},
                                                                            {**row, "router": "org/b"}]}}
    lines = format_table(result).splitlines()
    assert lines[-4].startswith("| router | label | threshold |") and lines[-3] == "|---" * 9 + "|"
    assert lines[-2].startswith("| a | top1 | 0.9 |") and lines[-1].startswith("| org/b | top1 | 0.9 |")
    result["quality"]["rows"] = [{**row, "router": "a"}]  # one router: no column (nor in older results)
    assert format_table(result).splitlines()[-2:] == ["|---" * 8 + "|", "| top1 | 0.9 | 50.0% | 6.00 | 100.0% | "
                                                      "100.0% | +1.00% | 1.100 |"]


def test_batches_forced_rows_report_each_rows_depth_and_a_table() -> None:
    """Forced per-row exits: at batch 2 one row leaves at the depth and one runs every layer, so the mean executed
    depth is their mean (kv="propagate"); kv="recompute" runs the batch
    whole until every row has exited; at batch 1 the one row leaves. The row-cost ideal prices the deep layers at
    the running rows' step cost."""
    from tide_bench.batches import forced, step_cost
    from tide_bench.tables import format_batches

    model = skip_model()
    prompts = [torch.randint(3, 128, (5,), generator=torch.Generator().manual_seed(i)) for i in range(2)]
    costs = step_cost(model, prompts, 0, [1, 2], steps=2, reps=1)
    assert [c["rows"] for c in costs] == [1, 2] and costs[0]["over_first"] == 1.0 and costs[1]["step_s"] > 0
    rows = forced(model, router_for(model, 0.0), prompts, 0, [1, 2], depth=4, new_tokens=3, reps=1,
                  costs={1: 1.0, 2: 4.0})
    executed = {(r["batch_size"], r["kv"]): r["mean_executed_layers"] for r in rows}
    assert executed[(1, "propagate")] == executed[(1, "recompute")] == 4
    assert executed[(2, "propagate")] == (4 + NUM_LAYERS) / 2
    assert executed[(2, "recompute")] == NUM_LAYERS
    for r in rows:  # batch 2: the deep layers at a quarter of their full-batch time; batch 1: none of it
        deep = r["stock_s"] - r["truncated_s"]
        ideal = r["truncated_s"] + (deep / 4 if r["batch_size"] == 2 else 0.0)
        assert r["row_cost_ideal_speedup"] == pytest.approx(r["stock_s"] / ideal)
    table = format_batches({"step_cost": costs, "forced": rows, "router": {"decode": [], "prefill": []}})
    assert table.count("| 2 | propagate | 1 | 4 | 6.50 |") == 1
    assert table.count(f"| 2 | recompute | 1 | 4 | {NUM_LAYERS:.2f} |") == 1
    assert table.splitlines()[3].startswith("| 2 | ")  # the step cost table: 1 row, then 2


def test_continuous_generate_batch_returns_each_prompts_stock_greedy_tokens_in_order() -> None:
    """`bench continuous`'s call: one `generate_batch` over prompts of different lengths gives, in prompt order,
    each prompt's tokens from stock greedy `generate` alone; its table row shows the figures."""
    from tide_bench.continuous import generate_batch
    from tide_bench.tables import format_continuous

    model = make_tiny_llama()
    prompts = [torch.randint(3, 256, (n,), generator=torch.Generator().manual_seed(n)) for n in (7, 3, 5)]
    out, seconds = generate_batch(model, prompts, 4)
    alone = [model.generate(input_ids=p[None], max_new_tokens=4, min_new_tokens=4, do_sample=False)[0, len(p):]
             for p in prompts]
    assert torch.equal(out, torch.stack(alone)) and seconds > 0
    row = {"target": 0.95, "kv": "propagate", "requests": 3, "new_tokens": 4, "decode_mean_executed_layers": 7.5,
           "prefill_mean_executed_layers": 8.25, "decode_exit_rate": 0.25, "speedup_vs_stock": 1.05,
           "top1_agreement": 0.9}
    assert format_continuous({"continuous": [row]}).splitlines()[-1] == \
        "| 0.95 | propagate | 3 x 4 | 7.50 | 8.25 | 25% | 1.05 | 90% |"


def test_each_synthetic_configuration_runs_the_mode_it_is_named_after() -> None:
    """The GPU suite's and `bench synthetic`'s rows: a row named select attaches in select mode, one named skip in
    skip mode with the kv it names (attach's default mode would otherwise run skip mode under select's name)."""
    import torch

    from tide_bench.synthetic import build_model, configurations
    from tide_hf.runtime import get_handle

    model = build_model("tiny", "cpu", torch.float32)
    expected = {"exits-off": ("select", None), "select-scored": ("select", None), "select-exit": ("select", None),
                "skip-recompute": ("skip", "recompute"), "skip-propagate": ("skip", "propagate")}
    for key, (_, enter) in configurations(model, 4).items():
        with enter():
            handle = get_handle(model)
            if key in ("stock", "truncated"):
                assert handle is None, key
                continue
            mode, kv = expected[key]
            assert handle.options.mode == mode and (kv is None or handle.options.kv == kv), key


def test_linears_bench_times_both_paths_and_checks_tokens_against_the_same_path():
    """`bench linears`: a cost per k and path (each also in one-token steps of its path), then generation rows for
    stock on both paths and each method on the fast path; lossless methods give stock's tokens on the same path,
    skip mode with a router that never exits too; the fast path's stock gives eager stock's tokens here (fp32)."""
    from tide_bench.linears import FORWARD_TOKENS, METHODS, forward_costs, generation
    from tide_bench.measure import left_pad
    from tide_bench.tables import format_linears

    model = make_tiny_llama()
    costs = forward_costs(model, cache_len=8, repeats=1, vocab=256)
    rows_from = costs.pop("rows_from")
    assert rows_from is None or rows_from >= 1
    assert set(costs) == {"eager", "fast"} and all(len(ms) == len(FORWARD_TOKENS) for ms in costs.values())
    assert all(m > 0 for ms in costs.values() for m in ms)
    prompts = [torch.randint(3, 256, (n,), generator=torch.Generator().manual_seed(n)) for n in (5, 7)]
    result = generation(model, constant_router(model, -30.0), [left_pad([p], 0) for p in prompts], new_tokens=4,
                        reps=2)
    rows = {(row["path"], row["method"]): row for row in result["rows"]}
    assert set(rows) == {("eager", "stock"), *(("fast", name) for name in METHODS)}
    assert all(row["identical_to_stock_same_path"] == 1.0 for row in rows.values())
    assert rows["eager", "stock"]["ratio_vs_stock_eager"] == 1.0
    assert rows["fast", "stock"]["ratio_vs_stock_same_path"] == 1.0
    assert result["stock_fast_identical_to_eager"] == 1.0
    assert result["skip_layers_per_decode_token"] == model.config.num_hidden_layers  # the router never exits
    ablation = result["speculative_sources"]
    assert ablation["speculative, early-exit drafts only"].get("lookup", {}).get("rounds", 0) == 0
    assert ablation["speculative, lookup drafts only"].get("early_exit", {}).get("rounds", 0) == 0
    table = format_linears({"forward_costs": [{"dtype": "float32", "path": p, "ms": ms, "tokens": FORWARD_TOKENS,
                                               "steps": [m / ms[0] for m in ms]} for p, ms in costs.items()],
                            "generation": result})
    assert table.count("| float32 |") == 2 and "| fast | speculative | " in table
