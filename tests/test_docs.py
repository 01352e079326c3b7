"""Every ```python block of README.md and docs/ runs, and the docs site builds with `mkdocs build --strict`.

Each file's blocks run in order, in one namespace, in a fresh folder. Blocks that need a model, a tokenizer or a
router from an earlier page find the embedded SmolLM2 (`model`, `tok`), a small router (`router`) and a prompt
(`inputs`) there: the names the guides use."""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import tide_hf

ROOT = Path(__file__).resolve().parents[1]
FILES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def python_blocks(path: Path) -> list[str]:
    return BLOCK.findall(path.read_text())


PAGES = [path for path in FILES if python_blocks(path)]


def test_the_readme_and_the_guides_hold_python_blocks() -> None:
    """The collector finds the blocks (a changed fence would silently run nothing)."""
    names = {path.relative_to(ROOT).as_posix() for path in PAGES}
    assert {"README.md", "docs/getting-started.md", "docs/guides/calibrate.md"} <= names
    assert all("import tide_hf" in python_blocks(path)[0] or "tide_hf" in "".join(python_blocks(path))
               for path in PAGES)


@pytest.fixture(scope="module")
def context() -> tuple:
    from tide_hf.assets import load_model

    model, tok = load_model("smollm2")
    router = tide_hf.calibrate(model, tok, "sotu", num_samples=16, seq_len=64, progress=False)
    return model, tok, router


@pytest.mark.slow
@pytest.mark.parametrize("page", PAGES, ids=[path.relative_to(ROOT).as_posix() for path in PAGES])
def test_every_python_block_runs(page: Path, context: tuple, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    model, tok, router = context
    namespace = {"tide_hf": tide_hf, "model": model, "tok": tok, "router": router,
                 "inputs": tok(["The state of the union is"], return_tensors="pt")}
    try:
        for index, code in enumerate(python_blocks(page)):
            exec(compile(code, f"{page.relative_to(ROOT)} (python block {index + 1})", "exec"), namespace)
    finally:  # a block that failed half-way leaves the shared model as the next page expects it
        for used in (model, namespace["model"]):
            if tide_hf.get_handle(used) is not None:
                tide_hf.get_handle(used).detach()


def test_the_site_builds_strict(tmp_path: Path) -> None:
    """`mkdocs build --strict`: a broken link, a missing page in the nav or a docstring the API page cannot read
    fails the build (the API reference is generated from the docstrings, the config classes' `Args:` from their
    fields' help by docs/griffe_settings.py)."""
    if shutil.which("mkdocs") is None:
        pytest.skip("mkdocs is not installed: pip install '.[docs]'")
    out = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                         cwd=ROOT, capture_output=True, text=True, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    page = (tmp_path / "site" / "reference" / "api" / "index.html").read_text()
    from tide_hf.settings import CalibrationConfig

    helps = {f.name: f.metadata["help"] for f in dataclasses.fields(CalibrationConfig)}  # Args made at import
    assert "min_agreement" in page and helps["num_samples"] in page and "calibration_seconds" in page
