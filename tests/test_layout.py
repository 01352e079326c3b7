"""The package's layout: rooms whose imports flow one way, no cycles, small modules, no private names across
modules, and a serving import that pulls in neither the tooling nor its heavy dependencies."""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "tide_hf"
BENCHMARKS = PACKAGE.parent / "benchmarks" / "tide_bench"  # `tide-hf bench`'s sections, not in the wheel
# a bound against a module growing unnoticed, well above every module: a module is split when it holds two concepts,
# never to pass a line count
MAX_LINES = 600
# room -> rooms it may import. The base (errors, values: checks of numbers, record: a router's calibration record
# file, settings: every setting's default and help, without torch, config, plotting, assets, compat: transformers'
# private names, callers: the frame a warning names) imports no room but errors (settings, config, assets and
# plotting raise its errors; config also reads values, record and settings);
# the model side
# comes next, then kernels, the runtime and the transformers integration; calibration needs only the model
# side (and the base: the corpus, transformers' private names); eval may use everything but the CLI; the CLI
# everything; the package root everything but eval / cli.
BASE = {"errors", "values", "record", "settings", "config", "plotting", "assets", "compat", "callers"}
ALLOWED = {
    **{room: set() for room in BASE},
    "values": {"errors"},
    "record": {"errors", "values"},
    "settings": {"errors"},
    "config": {"errors", "values", "record", "settings"},
    "plotting": {"errors"},
    "assets": {"errors"},
    "modeling": {"errors", "values", "record", "config"},
    "kernels": {"errors", "config"},
    "runtime": {"errors", "record", "config", "compat", "callers", "plotting", "modeling", "kernels"},
    "integrations": {"errors", "record", "config", "compat", "callers", "modeling", "kernels", "runtime"},
    # runtime: stock text of an attached model (continuations write it with the router turned off)
    "calibration": {"errors", "values", "record", "settings", "config", "assets", "compat", "modeling", "runtime"},
    "eval": BASE | {"modeling", "kernels", "runtime", "integrations", "calibration"},
    "cli": BASE | {"modeling", "kernels", "runtime", "integrations", "calibration", "eval"},
    "__init__": BASE | {"modeling", "kernels", "runtime", "integrations", "calibration"},
}


def modules() -> dict[str, Path]:
    """Dotted module name -> file, for every module of the package."""
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def imports(name: str, path: Path, known: dict[str, Path]) -> list[tuple[str, list[str]]]:
    """(imported tide_hf module, names taken from it) for every import in `path`, inside functions too."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(alias.name, []) for alias in node.names if alias.name.startswith("tide_hf")]
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            stem = ".".join(base + ([node.module] if node.module else []))
            if not stem.startswith("tide_hf"):
                continue
            for alias in node.names:  # `from pkg import submodule` imports the submodule
                sub = f"{stem}.{alias.name}"
                found.append((sub, []) if sub in known else (stem, [alias.name]))
    return found


def room(module: str) -> str:
    parts = module.split(".")
    return "__init__" if len(parts) == 1 else parts[1]


def test_no_import_cycles() -> None:
    known = modules()
    graph = {m: {t for t, _ in imports(m, p, known) if t in known and t != m} for m, p in known.items()}
    state: dict[str, int] = {}

    def visit(node: str, trail: list[str]) -> None:
        state[node] = 1
        for nxt in graph[node]:
            if state.get(nxt) == 1:
                raise AssertionError("import cycle: " + " -> ".join(trail[trail.index(nxt):] + [node, nxt]))
            if nxt not in state:
                visit(nxt, trail + [node])
        state[node] = 2

    for m in graph:
        if m not in state:
            visit(m, [])


def test_imports_flow_one_way() -> None:
    known = modules()
    wrong = []
    for name, path in known.items():
        mine = room(name)
        for target, _ in imports(name, path, known):
            theirs = room(target)
            if theirs != mine and theirs not in ALLOWED[mine]:
                wrong.append(f"{name} imports {target} ({mine} may use {sorted(ALLOWED[mine]) or 'no room'})")
    assert not wrong, "\n".join(wrong)


def test_no_private_names_across_modules() -> None:
    known = modules()
    wrong = [f"{name} imports {target}.{n}" for name, path in known.items()
             for target, names in imports(name, path, known) for n in names
             if n.startswith("_") and target != name]
    assert not wrong, "\n".join(wrong)


def test_modules_are_small() -> None:
    big = {name: n for name, path in modules().items() if (n := len(path.read_text().splitlines())) >= MAX_LINES}
    assert not big, f"modules of {MAX_LINES}+ lines: {big}"


def test_the_benchmarks_import_tide_hf_never_the_reverse() -> None:
    """benchmarks/tide_bench uses tide_hf's public names (no private one); no tide_hf module imports it (`tide-hf
    bench` looks it up by name, tide_hf.cli.bench, and says how to get it where it is missing)."""
    known = modules()
    reverse = [name for name, path in known.items() for node in ast.walk(ast.parse(path.read_text()))
               if isinstance(node, (ast.Import, ast.ImportFrom))
               and any(n.startswith("tide_bench") for n in ([a.name for a in node.names] if isinstance(node, ast.Import)
                                                             else [node.module or ""]))]
    assert not reverse, f"tide_hf modules importing the benchmarks: {reverse}"
    private = [f"{path.relative_to(BENCHMARKS)} imports {target}.{n}" for path in sorted(BENCHMARKS.rglob("*.py"))
               for target, names in imports("tide_bench", path, known) for n in names if n.startswith("_")]
    assert BENCHMARKS.is_dir() and not private, "\n".join(private)


def test_serving_import_is_light() -> None:
    """`import tide_hf` (serving) loads neither the tooling (eval, cli, the benchmarks) nor datasets or matplotlib."""
    code = ("import json, sys, tide_hf; print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in "
            "('datasets', 'matplotlib', 'tide_bench') or m.startswith(('tide_hf.eval', 'tide_hf.cli')))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []


def test_version_matches_pyproject() -> None:
    import tide_hf

    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((PACKAGE.parent / "pyproject.toml").read_text())["project"]
    assert tide_hf.__version__ == project["version"]


def test_optional_test_dependencies_skip_instead_of_breaking_collection() -> None:
    """A test module imports the `test` extra's packages (those not installed by `pip install .`) only through
    `pytest.importorskip`, so `pytest -k ...` without the extra collects (it skips those modules)."""
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((PACKAGE.parent / "pyproject.toml").read_text())["project"]
    required = {re.split(r"[<>=!~ \[;]", d)[0].lower().replace("-", "_") for d in project["dependencies"]}
    optional = {d.lower().replace("-", "_") for d in project["optional-dependencies"]["test"]} - required - {"pytest"}
    offenders = []
    for path in sorted((PACKAGE.parent / "tests").glob("*.py")):
        for node in ast.parse(path.read_text()).body:  # module level only: imports inside tests are fine
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            offenders += [f"{path.name}: {n}" for n in names if n.split(".")[0].lower() in optional]
    assert optional and not offenders, offenders


def test_no_file_holds_a_merge_conflict_marker() -> None:
    """A conflict left in a page or a module: the docs build and most tests read around it."""
    tracked = subprocess.run(["git", "ls-files"], cwd=PACKAGE.parent, capture_output=True, text=True, check=True)
    markers = ("<" * 7 + " ", ">" * 7 + " ")
    found = [name for name in tracked.stdout.splitlines() if name.endswith((".py", ".md", ".toml", ".yml"))
             and (PACKAGE.parent / name).is_file()
             and any(line.startswith(markers) for line in (PACKAGE.parent / name).read_text().splitlines())]
    assert not found, found


def test_no_test_module_imports_another() -> None:
    """Shared test code lives in tests/helpers.py and the fixtures in tests/conftest.py: a test module imported by
    another ties the two files' edits together and brings its module-level fixtures and settings along."""
    tests = PACKAGE.parent / "tests"
    test_modules = {path.stem for path in tests.glob("test_*.py")}
    offenders = []
    for path in sorted(tests.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):  # imports inside functions too
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            offenders += [f"{path.name}: {n}" for n in names
                          if n.split(".")[0] in test_modules or n.split(".")[0] == "tests"]
    assert test_modules and not offenders, offenders
