"""A measured figure in the README or docs/ names the JSON it comes from: `1.22× (`smollm2-cpu/modes.json:speculative.
speed_ratio`)` is checked against that key of `docs/results/smollm2-cpu/modes.json`, rounded as written (× and
plain numbers: the value; %: the value x 100). A table of the README's first screen holds no number without one."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "results"
FIGURE = re.compile(r"(\d+(?:\.\d+)?)\s?(×|%|s|ms|min|nats|GB)? \(`([\w\-]+/[\w\-]+\.json):([\w.\[\]\-]+)`\)")
KEY_PART = re.compile(r"([\w\-]+)|\[([^\]]+)\]")
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def value_at(result: object, key: str) -> object:
    """`result`'s value at a dotted key with list indices (`router.decode[3].speedup_vs_stock`); a name in
    brackets is a key that holds a dot (`base.a[0.97].eff`)."""
    for name, bracket in KEY_PART.findall(key):
        if bracket:
            result = result[int(bracket)] if isinstance(result, list) else result[bracket]
        else:
            result = result[name]
    return result


def figures(text: str) -> list[tuple[str, str, str, str]]:
    return FIGURE.findall(text)


def check(figure: str, unit: str, file: str, key: str) -> str | None:
    """Why `figure` (with its `unit`) disagrees with `key` of `file` (None: it agrees as rounded)."""
    path = RESULTS / file
    if not path.is_file():
        return f"no {path.relative_to(ROOT)}"
    try:
        value = value_at(json.loads(path.read_text()), key)
    except (KeyError, IndexError, TypeError):
        return f"{file} has no key {key}"
    decimals = len(figure.partition(".")[2])
    shown = round(float(value) * (100 if unit == "%" else 1), decimals)
    return None if shown == float(figure) else f"{figure}{unit} but {file}:{key} is {value} (rounds to {shown})"


CASES = [(page, f) for page in PAGES for f in figures(page.read_text())]
IDS = [f"{p.relative_to(ROOT)}:{f[2]}:{f[3]}" for p, f in CASES]


def test_the_readme_cites_its_figures() -> None:
    assert len([case for case in CASES if case[0].name == "README.md"]) >= 6


def test_the_mode_choice_page_cites_its_figures() -> None:
    assert len([case for case in CASES if case[0].name == "choosing-a-mode.md"]) >= 20


@pytest.mark.parametrize(("page", "figure"), CASES, ids=IDS)
def test_every_cited_figure_equals_its_json(page: Path, figure: tuple[str, str, str, str]) -> None:
    assert check(*figure) is None, f"{page.name}: {check(*figure)}"


def test_the_mode_table_has_no_uncited_number() -> None:
    """Every number in the cells of the README's mode table (outside code spans) is a cited figure."""
    text = (ROOT / "README.md").read_text()
    table = text[text.index("| mode |"):text.index("\n\n", text.index("| mode |"))]
    for row in table.splitlines()[2:]:
        plain = FIGURE.sub("", row)
        plain = re.sub(r"`[^`]*`", "", plain)
        assert not re.search(r"(?<![\w-])\d", plain), f"an uncited number in: {row}"  # (not top-1's)


def test_the_check_refuses_a_wrong_figure() -> None:
    file, key = "smollm2-cpu/modes.json", "speculative.speed_ratio"
    value = value_at(json.loads((RESULTS / file).read_text()), key)
    assert check(f"{value:.2f}", "×", file, key) is None
    assert check(f"{value + 0.1:.2f}", "×", file, key) is not None
    assert "has no key" in check("1.00", "×", file, "speculative.no_such_key")
