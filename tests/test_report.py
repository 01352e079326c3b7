"""The docs' results page is exactly what the committed JSON generates."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from report import BEGIN, END, SECTIONS, render, section_markers, update  # benchmarks/report.py (conftest)
from tide_hf.errors import TideArgumentError, TideDataError

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PAGE = DOCS / "results.md"
SCRIPT = ROOT / "benchmarks" / "report.py"


@pytest.mark.parametrize("folder", sorted(SECTIONS))
def test_results_page_equals_the_committed_json(folder: str) -> None:
    begin, end = SECTIONS[folder]
    text = PAGE.read_text()
    section = text.split(begin, 1)[1].split(end, 1)[0]
    assert section == "\n" + render(DOCS / folder, PAGE), \
        f"docs/results.md is stale: run `python benchmarks/report.py docs/{folder} docs/results.md`"


def test_update_rewrites_only_the_marked_section(tmp_path: Path) -> None:
    results = tmp_path / "results"
    results.mkdir()
    (results / "calibrate-top1.json").write_text(json.dumps({
        "command": "tide-hf calibrate --label top1", "label": "top1", "num_samples": 7, "seq_len": 9,
        "checkpoint_layers": [4], "wall_s": 12.0, "peak_rss_gb": 1.5, "bare_forward_s": 10.0,
        "seconds": {"forward": 8.0, "label": 2.0, "train": 1.0}, "overhead_vs_bare": 0.3,
        "metrics": {"4": {"positive_rate": 0.25, "precision": 0.5, "recall": None, "auc": 0.875, "best_epoch": 3}}}))
    (results / "pareto.png").write_bytes(b"png")
    readme = tmp_path / "README.md"
    readme.write_text(f"intro\n{BEGIN}\nold numbers\n{END}\noutro\n")
    assert update(results, readme)
    text = readme.read_text()
    assert text.startswith(f"intro\n{BEGIN}\n") and text.endswith(f"{END}\noutro\n") and "old numbers" not in text
    assert "| 12 s | 1.50 GB | 10 s | 8 s | 2 s | 1 s | 30.0% |" in text
    assert "| 4 | 0.250 | 0.500 | n/a | 0.875 | 3 |" in text
    assert "`tide-hf calibrate --label top1`" in text
    assert not update(results, readme)  # idempotent
    readme.write_text("no markers")
    with pytest.raises(ValueError, match="markers"):
        update(results, readme)


def test_a_readme_outside_the_results_tree_links_its_plots_with_dotdot(tmp_path: Path) -> None:
    """`Path.relative_to` raised for a README that is not above the results folder."""
    docs = tmp_path / "docs"
    docs.mkdir()
    text = render(DOCS / "results" / "smollm2-cpu", docs / "README.md")
    link = text.split("![convergence.png](", 1)[1].split(")", 1)[0]
    assert link.startswith("../") and (docs / link).resolve() == DOCS / "results" / "smollm2-cpu" / "convergence.png"


def test_bad_results_are_named_and_the_readme_is_left_as_it_was(tmp_path: Path) -> None:
    """A mistyped or empty folder emptied the section (exit 0); a damaged JSON was a traceback naming no file; a
    folder given by another spelling (an absolute path) was written into the CPU section."""
    import subprocess
    import sys

    readme = tmp_path / "README.md"
    text = PAGE.read_text()
    readme.write_text(text)
    (tmp_path / "empty").mkdir()
    (tmp_path / "results" / "h100").mkdir(parents=True)
    (tmp_path / "results" / "h100" / "bench.json").write_text("{not json")
    (tmp_path / "results" / "smollm2-cpu").mkdir()
    (tmp_path / "results" / "smollm2-cpu" / "calibrate-x.json").write_text("{}")
    cases = [(["results/smollm2-cppu", "README.md"], "no section in"), (["empty", "README.md"], "no section in"),
             ([str(tmp_path / "results" / "h100"), "README.md"], "h100/bench.json is not valid JSON"),
             (["results/smollm2-cpu", "README.md"], "calibrate-x.json holds {}, not a result")]
    for argv, message in cases:
        out = subprocess.run([sys.executable, str(SCRIPT), *argv], cwd=tmp_path, capture_output=True, text=True)
        assert out.returncode == 1 and message in out.stderr and "Traceback" not in out.stderr, (argv, out.stderr)
        assert readme.read_text() == text
    (tmp_path / "results" / "smollm2-cpu" / "calibrate-x.json").write_text('{"label": "top1"}')
    with pytest.raises(TideDataError, match=r"lacks what its table shows \(KeyError: 'num_samples'\)"):
        render(tmp_path / "results" / "smollm2-cpu", readme)
    with pytest.raises(TideDataError, match="not a folder of result JSON files"):
        render(tmp_path / "empty", readme)
    assert section_markers(tmp_path / "results" / "h100" / ".." / "h100", readme) == SECTIONS["results/h100"]
    # a NaN figure rendered as "+nan%" (exit 0); an end marker before the begin marker was a raw ValueError
    (tmp_path / "results" / "smollm2-cpu" / "calibrate-x.json").write_text('{"label": "top1", "auc": NaN}')
    with pytest.raises(TideDataError, match=r"calibrate-x.json holds a non-finite number \(NaN\)"):
        render(tmp_path / "results" / "smollm2-cpu", readme)
    (tmp_path / "results" / "smollm2-cpu" / "calibrate-x.json").unlink()
    begin, end = SECTIONS["results/smollm2-cpu"]
    swapped = tmp_path / "SWAPPED.md"
    swapped.write_text(f"head\n{end}\nmiddle\n{begin}\ntail\n")
    with pytest.raises(TideArgumentError, match="end marker .* comes before its begin marker"):
        update(tmp_path / "results" / "smollm2-cpu", swapped)
    assert swapped.read_text() == f"head\n{end}\nmiddle\n{begin}\ntail\n"


def test_rendering_the_readme_loads_no_torch(tmp_path: Path) -> None:
    """The tables lived beside the measurements, so rendering the README from JSON imported torch, transformers
    and the model code (7 s a call here)."""
    import json
    import shutil
    import subprocess
    import sys

    readme = tmp_path / "docs" / "results.md"
    readme.parent.mkdir()
    readme.write_text(PAGE.read_text())
    shutil.copytree(DOCS / "results" / "smollm2-cpu", tmp_path / "docs" / "results" / "smollm2-cpu")
    code = ("import json, runpy, sys\nsys.argv = ['report', *sys.argv[1:]]\n"
            f"sys.path.insert(0, {str(SCRIPT.parent)!r})\ntry:\n"  # as `python benchmarks/report.py` has it
            f"    runpy.run_path({str(SCRIPT)!r}, run_name='__main__')\nexcept SystemExit as e:\n"
            "    assert not e.code, e.code\nprint(json.dumps(sorted(m for m in ('torch', 'transformers') if m in "
            "sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, check=True)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []
    assert readme.read_text() == PAGE.read_text()  # rendered, equal to the committed one


def test_the_quality_target_table_shows_the_efficiency_on_held_out_text_too() -> None:
    """The goal's efficiency is on held-out text; the table showed it on greedy text only. Each cell is the JSON's
    figure, "-" where the oracle saves nothing (no ratio exists)."""
    from tide_hf.eval.tables import format_analysis

    def row(target: float, agreement: float, saved: float, oracle: float) -> dict:
        return {"target": target, "agreement": agreement, "layers_saved": saved, "oracle_layers_saved": oracle,
                "efficiency": saved / oracle if oracle else None}

    result = {"efficiency": {"tokens": 10, "router": [], "confidence": 0.9, "heldout_tokens": 20,
                             "targets": [row(0.97, 0.975, 3.0, 12.0), row(0.9, 0.95, 2.0, 8.0)],
                             "heldout_targets": [row(0.97, 0.986, 1.5, 10.0), row(0.9, 1.0, 0.0, 0.0)]}}
    lines = format_analysis(result, convergence=False).splitlines()
    assert "| 0.97 | 97.5% | 3.00 | 12.00 | 0.25 | 98.6% | 1.50 | 10.00 | 0.15 |" in lines
    assert "| 0.9 | 95.0% | 2.00 | 8.00 | 0.25 | 100.0% | 0.00 | 0.00 | - |" in lines
    header = next(line for line in lines if line.startswith("| target |"))
    assert header.count("efficiency") == 2 and header.count("oracle saves") == 2
