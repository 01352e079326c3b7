"""A measured figure in the README or docs/ names the JSON it comes from: `1.22× (`smollm2-cpu/modes.json:speculative.
speed_ratio`)` is checked against that key of `docs/results/smollm2-cpu/modes.json`, rounded as written (× and
plain numbers and s, ms, min, nats, GB: the value; %: the value x 100). A figure may be cited across a line break.
A table of the README's first screen holds no number without one. And no page holds a measured-looking figure (a
number with ×, x, %, s, ms, min, µs, nats or GB) that names no key, outside code, the sections `benchmarks/report.py`
generates and the tables `tide-hf bench` writes beside its JSON; settings and arithmetic are listed in
`NOT_MEASURED`. Unit-less figures (an efficiency, an AUC) are not found by that scan."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "results"
FIGURE = re.compile(r"(\d+(?:\.\d+)?)\s?(×|%|s|ms|min|nats|GB)?\s+\(`([\w\-]+/[\w\-]+\.json):([\w.\[\]\-]+)`\)")
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


# A measured-looking figure: a number with a unit of speed, share, time, size or divergence (`1.2×`, `0.98x`,
# `56 %`, `0.1 s`, `54 ms`, `13 min`, `2.7 GB`, `0.32 nats`); `128 x 256` and `8 × 256` are sizes, not figures.
MEASURED = re.compile(
    r"(?<![\w.\-/])[+\-~]?\d+(?:\.\d+)?\s?(?:[×x](?!\s?\d)|%|s|ms|min|µs|nats|GB)(?![\w])"
)
FENCED = re.compile(r"^\s*(```|~~~).*?^\s*\1", re.S | re.M)
CODE_SPAN = re.compile(r"(`+)(.+?)\1", re.S)
# Sections written by `benchmarks/report.py` from the JSON (tests/test_report.py checks them).
GENERATED = re.compile(r"<!-- (?:gpu )?results: generated.*?<!-- end of generated[^>]*-->", re.S)
# Tables `tide-hf bench` writes beside its JSON (`batches.md`, `linears.md`), from that JSON.
BENCH_TABLES = RESULTS
# Figures that are not measurements: settings, defaults, sizes by parameter count, product names. Each entry is
# (page, a snippet of the line that holds the figure); the snippet holds the figure.
NOT_MEASURED = [
    ("docs/concepts/choosing-a-mode.md", "The default target is 95 %"),
    ("docs/concepts/how-it-works.md", "the MACs of 9 % of a layer on SmolLM2 and 8 % on"),
    ("docs/concepts/quality-targets.md", "so 97 % per-token agreement"),
    ("docs/getting-started.md", "Quality target >= 95 % top-1 agreement with stock, held with 90 % confidence"),
    ("docs/guides/calibrate.md", "a 95 % agreement target"),
    ("docs/concepts/modes.md", "about 0.5 GB in bf16, by parameter count"),
    ("docs/concepts/modes.md", "6.5 % of a Llama-3-8B step (by parameters)"),
    ("docs/concepts/modes.md", "Probes cost at most ~2 %"),
    ("docs/results.md", "+5 / +10 / +25 %"),
    ("docs/results.md", "for 100 % agreement"),
    ("docs/results.md", "layers at 100 % agreement"),
    ("docs/results.md", "At most +5 % perplexity"),
    ("docs/results.md", "At +10 % TIDE"),
    ("docs/results.md", "At +25 % TIDE"),
    ("docs/results.md", "the goal is 0.7 at 97 %"),
    ("docs/results.md", "Efficiency at 97 %"),
    ("docs/results.md", "NVIDIA H100 80GB"),
]


def uncited(text: str, page: str = "") -> list[str]:
    """The measured-looking figures of `text` that name no JSON key, outside fenced code, code spans and the
    generated sections, each with its line; those `NOT_MEASURED` lists for `page` are left out."""
    def blank(match: re.Match) -> str:
        return "\n" * match.group(0).count("\n")

    text = GENERATED.sub(blank, text)
    text = FENCED.sub(blank, text)
    text = FIGURE.sub(lambda m: "cited" + "\n" * m.group(0).count("\n"), text)
    text = CODE_SPAN.sub(lambda m: "code" + "\n" * m.group(0).count("\n"), text)
    allowed = [snippet for where, snippet in NOT_MEASURED if where == page]
    found = []
    for number, line in enumerate(text.splitlines(), 1):
        for match in MEASURED.finditer(line):
            if not any(match.group(0).strip() in snippet and snippet in line for snippet in allowed):
                found.append(f"line {number}: {match.group(0).strip()!r} names no JSON key: {line.strip()}")
    return found


CHECKED = [page for page in PAGES if BENCH_TABLES not in page.parents]


@pytest.mark.parametrize("page", CHECKED, ids=[p.relative_to(ROOT).as_posix() for p in CHECKED])
def test_every_measured_figure_names_its_json_key(page: Path) -> None:
    found = uncited(page.read_text(), page.relative_to(ROOT).as_posix())
    assert not found, "\n".join(found)


def test_the_uncited_check_flags_and_passes_what_it_should() -> None:
    for bare in ("It ran 1.22× stock.", "It ran 0.98x stock.", "It kept 56 % of them.", "A step took 0.1 s.",
                 "It took 54 ms.", "It took 13 min.", "Peak 2.7 GB.", "A KL of 0.32 nats.", "Cost +7.3 %."):
        assert uncited(bare), bare
    for fine in ("It ran 1.22× (`smollm2-cpu/modes.json:speculative.speed_ratio`) stock.",
                 "It kept 56 %\n  (`smollm2-cpu/modes.json:speculative.acceptance_per_token`) of them.",
                 "Prompts of 16 x 64 tokens and 8 × 256 tokens.", "Run `bench --reps 3` for `2 s`.",
                 "```text\nIt ran 1.22× stock.\n```", "Layer 16 of 30 layers, 2048 tokens.",
                 "<!-- results: generated by x -->\n| 1.22× |\n<!-- end of generated results -->"):
        assert not uncited(fine), fine
    assert not uncited("The default target is 95 % agreement.", "docs/concepts/choosing-a-mode.md")
    assert uncited("The default target is 95 % agreement.", "docs/concepts/modes.md")


@pytest.mark.parametrize(("page", "snippet"), NOT_MEASURED)
def test_every_listed_setting_is_still_on_its_page(page: str, snippet: str) -> None:
    """An exception whose line was rewritten would excuse nothing and hide nothing: it goes with the line."""
    assert snippet in " ".join((ROOT / page).read_text().split()), f"{page} no longer holds {snippet!r}"
