"""`tide-hf bench gpu`: the dry run goes through every section of the GPU suite on the CPU (so a lent GPU can only
fail on the device), its goals read the figures they name, and a failing section keeps the others' figures."""

from __future__ import annotations

import json

import pytest
import torch

from tide_bench import gpu
from tide_bench.synthetic import build_model, configurations, row_configurations, with_ideal_ratios
from tide_bench.tables import format_gpu_suite
from tide_hf.errors import TideError


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory) -> tuple:
    from tide_hf.cli import main

    out = tmp_path_factory.mktemp("gpu") / "out"
    main(["bench", "gpu", "--dry-run", "--output", str(out)])
    return out, json.loads((out / "gpu.json").read_text())


def test_dry_run_exercises_every_section(dry_run) -> None:
    out, result = dry_run
    plan = gpu.DRY_RUN
    assert result["errors"] == {} and list(result["seconds"]) == list(gpu.SECTIONS)
    assert result["dry_run"] and result["versions"]["torch"] == torch.__version__
    model = build_model(plan.shape, "cpu", torch.float32)
    depth = result["eager"]["depth"]
    every = [name for name, _ in configurations(model, depth).values()]
    rows = [name for name, _ in row_configurations(model, depth, 2).values()]
    eager = [(r["config"], r["batch_size"]) for r in result["eager"]["rows"]]
    assert eager == [(c, 1) for c in every] + [(c, 2) for c in every + rows]
    compiled = [r["config"] for r in result["compiled"]["rows"]]
    assert compiled == [configurations(model, depth)[key][0] for key in plan.compiled_configs]
    assert all(r["compiled"] for r in result["compiled"]["rows"])
    assert [r["rows"] for r in result["kernels"]["rows"]] == list(plan.kernel_rows)
    assert result["calibration"]["samples"] == plan.calibration_samples and result["calibration"]["total_s"] > 0
    spec = result["speculative"]["speculative"]
    assert spec["lookup_tokens"] == plan.lookup_tokens and spec["lookup_speed_ratio"] > 0
    assert spec["assisted_layer"] == depth == result["speculative"]["near_identity_after"]
    # every goal found its figure, except the kernels' share of copy bandwidth (a GPU figure) and timing goals whose
    # section has a row below the timer's noise (a tiny model's few tokens; no ratio is computed from those)
    noisy = {name for name in ("eager", "compiled") if any(r["ms_per_token"] <= 0 for r in result[name]["rows"])}
    unread = [g for g in result["goals"] if g["figure"] is None]
    assert "fused kernel: share of copy bandwidth at >= 4096 rows" in [g["goal"] for g in unread]
    assert all(g["section"] in noisy for g in unread if g["section"] != "kernels")
    assert (out / "gpu.md").read_text() == format_gpu_suite(result) + "\n"


def test_the_report_renders_the_suite(dry_run, tmp_path) -> None:
    from report import render  # benchmarks/report.py (conftest puts benchmarks/ on the path)

    out, result = dry_run
    text = render(out, tmp_path / "README.md")
    assert "### Every GPU goal, one call of `tide-hf bench gpu`" in text
    assert "| calibration time / bare forward | <= 1.5 | " in text


def test_half_the_rows_leave_at_the_depth() -> None:
    """The per-row configurations force what they are named after: the even rows exit at `depth` at every step."""
    model = build_model("tiny", "cpu", torch.float32)
    ids = torch.randint(3, 256, (4, 6), generator=torch.Generator().manual_seed(0))
    for key, (_, context) in row_configurations(model, 4, 4).items():
        with context() as handle:
            model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=3, min_new_tokens=3,
                           do_sample=False, pad_token_id=0)
            assert dict(handle.last_stats.decode.exits) == {4: 2 * 2, 8: 2 * 2}, key  # 2 of 4 rows x 2 steps each
            assert handle.last_stats.decode.mean_executed == pytest.approx((4 + 8) / 2), key


def test_ideal_of_half_the_rows_is_the_mean_of_stock_and_truncated() -> None:
    rows = [{"config": c, "batch_size": 8, "compiled": False, "ms_per_token": ms}
            for c, ms in (("stock", 10.0), ("truncated to 16 (ideal)", 6.0),
                          ("skip, all exit at 16, kv=propagate", 7.5),
                          ("skip, half the rows leave at 16, kv=propagate", 9.0), ("exits off", 11.0))]
    by_name = {r["config"]: r for r in with_ideal_ratios(rows, 16)}
    assert by_name["skip, all exit at 16, kv=propagate"]["vs_ideal"] == 6.0 / 7.5
    assert by_name["skip, half the rows leave at 16, kv=propagate"]["vs_ideal"] == 8.0 / 9.0
    assert "vs_ideal" not in by_name["exits off"]


def test_goals_read_the_worst_figure_of_what_they_name() -> None:
    def row(config: str, bs: int, compiled: bool, **figures: float) -> dict:
        return {"config": config, "batch_size": bs, "compiled": compiled, **figures}

    result = {
        "eager": {"depth": 16, "rows": [row("skip, all exit at 16, kv=propagate", 1, False, vs_ideal=0.95),
                                        row("skip, all exit at 16, kv=propagate", 8, False, vs_ideal=0.85),
                                        row("skip, all exit at 16, kv=propagate", 64, False, vs_ideal=0.5),
                                        row("skip, all exit at 16, kv=recompute", 8, False, vs_ideal=0.93)]},
        "compiled": {"rows": [row("select, scored, no exits", 1, True, vs_stock=0.98),
                              row("select, scored, no exits", 1, False, vs_stock=0.5)]},
        "kernels": {"rows": [{"rows": 256, "kernel_us": 9.0}, {"rows": 4096, "kernel_us": 30.0, "copy_share": 0.6},
                             {"rows": 32768, "kernel_us": 90.0, "copy_share": 0.4}]},
        "calibration": {"total_over_bare": 1.4},
        "speculative": {"speculative": {"speed_ratio": 1.5, "assisted_speed_ratio": 1.2, "lookup_speed_ratio": 1.6}},
    }
    got = {g["goal"]: (g["figure"], g["met"]) for g in gpu.goals(result)}
    assert got["eager skip at half depth, kv=propagate, of ideal (batch 1 and 8)"] == (0.85, False)  # not batch 64
    assert got["eager skip at half depth, kv=recompute, of ideal (batch 1 and 8)"] == (0.93, True)
    assert got["compiled static select (scored, no exits) vs stock"] == (0.98, True)  # the eager row is not read
    assert got["compiled skip at half depth vs the compiled truncated model"] == (None, None)
    assert got["fused kernel: share of copy bandwidth at >= 4096 rows"] == (0.4, False)
    assert got["fused kernel: device us per call at <= 256 rows"] == (9.0, True)
    assert got["calibration time / bare forward"] == (1.4, True)
    assert got["speculative over the faster peer (assistant_early_exit, prompt lookup)"] == (1.5 / 1.6, False)


def test_a_failing_section_keeps_the_others_and_fails_the_command(tmp_path, monkeypatch) -> None:
    def broken(plan, model, save):
        raise RuntimeError("out of device memory")

    monkeypatch.setattr(gpu, "SECTIONS", {"eager": broken, "kernels": gpu.kernels_section})
    with pytest.raises(TideError, match="section\\(s\\) eager failed"):
        gpu.run_suite(tmp_path, dry_run=True, command="test")
    result = json.loads((tmp_path / "gpu.json").read_text())
    assert "RuntimeError: out of device memory" in result["errors"]["eager"]
    assert len(result["kernels"]["rows"]) == len(gpu.DRY_RUN.kernel_rows)
    assert "Section `eager` failed" in (tmp_path / "gpu.md").read_text()


@pytest.mark.parametrize("argv, message", [
    (["bench", "gpu", "--router", "r"], "unrecognized arguments: --router r"),
    (["bench", "gpu", "--reps", "5"], "unrecognized arguments: --reps 5"),
    (["bench", "kernels", "--dry-run"], "unrecognized arguments: --dry-run"),
])
def test_the_suite_takes_only_its_flags(argv, message, tmp_path, capsys) -> None:
    """The suite's plan is fixed: `bench gpu` knows --dry-run and --output only, and no other section --dry-run."""
    from tide_hf.cli import main

    with pytest.raises(SystemExit) as info:
        main([*argv, "--output", str(tmp_path / "out")])
    assert info.value.code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_without_a_gpu_the_suite_names_the_dry_run(tmp_path, capsys) -> None:
    from tide_hf.cli import main

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is here: the suite would run")
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "gpu", "--output", str(tmp_path / "out")])
    assert exit_info.value.code == 1
    assert "no CUDA device here; `--dry-run` runs the suite's code on the CPU" in capsys.readouterr().err
