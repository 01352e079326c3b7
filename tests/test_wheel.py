"""The package users install: the wheel built from a clean copy of the sources holds every module of `tide_hf/` and
every kernel source of `cuda/`, and nothing else (no benchmark: those live in benchmarks/tide_bench/); installed (not
editable) into a fresh virtual environment, its `tide-hf` answers `--help` without torch, reports the environment,
says how to get the benchmarks, and a tiny model generates in every mode.

The virtual environment sees the installed dependencies (`--system-site-packages`), so it tests the transformers CI
installed (`.ci/install`: the newest release allowed), but imports tide_hf from the wheel only (checked).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SOURCES = ("pyproject.toml", "README.md", "LICENSE", "tide_hf", "cuda")  # what a clean clone builds from
KERNEL_SUFFIXES = {".cpp", ".cu", ".h", ".cuh"}  # pyproject's package data of tide_hf._kernel_src
WHEEL_MODULE = "tide_hf"
KERNEL_PACKAGE = f"{WHEEL_MODULE}/_kernel_src"
# the benchmarks' modules, once in tide_hf/eval/: run from a checkout (benchmarks/tide_bench/), never shipped
BENCH_ONLY = ("bench", "baselines", "batches", "continuous", "easy", "gpu", "kernels", "measure", "modes", "synthetic",
              "linears")

# A tiny Llama and a router for it, built in the process: stock greedy tokens, then each mode's. Select and skip mode
# with a router that never exits give stock's tokens; speculative mode gives them always (lossless).
SMOKE = """
import json, torch, transformers, tide_hf
torch.manual_seed(0)
config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                  pad_token_id=0, bos_token_id=1, eos_token_id=2)
model = transformers.LlamaForCausalLM(config).eval()
router = tide_hf.TideRouter(tide_hf.TideRouterConfig(
    hidden_size=32, num_hidden_layers=4, checkpoint_interval=2, router_bottleneck_dim=16, exit_head="lens",
    base_architecture="LlamaForCausalLM", base_fingerprint=tide_hf.modeling.model_fingerprint(model)))
for mlp in router.routers.values():  # never converged: no token exits
    mlp.fc2.weight.data.zero_()
    mlp.fc2.bias.data.fill_(-30.0)
ids = torch.randint(3, 64, (1, 6))
stock = model.generate(ids, max_new_tokens=8, do_sample=False, min_new_tokens=8)
same = {}
for mode in ("select", "skip", "speculative"):
    with tide_hf.attach(model, router, mode=mode, exit_threshold=0.5):
        same[mode] = bool(torch.equal(model.generate(ids, max_new_tokens=8, do_sample=False, min_new_tokens=8), stock))
print(json.dumps({"same": same, "file": tide_hf.__file__}))
"""


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel built from a copy of the sources a clean clone has (no build/, no egg-info, no caches)."""
    tree = tmp_path_factory.mktemp("clone")
    for name in SOURCES:
        source = ROOT / name
        if source.is_dir():
            shutil.copytree(source, tree / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy2(source, tree / name)
    dist = tmp_path_factory.mktemp("dist")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(dist),
                    str(tree)], check=True, capture_output=True, cwd=tree)
    (found,) = dist.glob("tide_hf-*.whl")
    return found


def test_the_wheel_holds_every_module_and_kernel_source_and_nothing_else(wheel: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    files = {n for n in names if ".dist-info/" not in n}
    modules = {p.relative_to(ROOT).as_posix() for p in (ROOT / WHEEL_MODULE).rglob("*.py")
               if "__pycache__" not in p.parts}
    kernels = {f"{KERNEL_PACKAGE}/{p.name}" for p in (ROOT / "cuda").iterdir() if p.suffix in KERNEL_SUFFIXES}
    assert kernels, "no kernel sources in cuda/"
    assert files == modules | kernels, (f"missing from the wheel: {sorted(modules | kernels - files)}; "
                                        f"not from the sources: {sorted(files - modules - kernels)}")
    shipped = sorted(f for f in files if f.startswith(("tide_bench/", "benchmarks/"))
                     or f in {f"{WHEEL_MODULE}/eval/{m}.py" for m in BENCH_ONLY})
    assert not shipped, f"bench-only modules in the wheel: {shipped}"
    entry_points = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    assert "tide-hf = tide_hf.cli:main" in zipfile.ZipFile(wheel).read(entry_points).decode()


@pytest.fixture(scope="module")
def installed(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh virtual environment with the wheel installed (its dependencies seen from this environment)."""
    env = tmp_path_factory.mktemp("venv")
    venv.create(env, system_site_packages=True, with_pip=True)
    subprocess.run([str(env / "bin" / "python"), "-m", "pip", "install", "-q", "--no-deps", str(wheel)], check=True,
                   capture_output=True)
    return env


def run(env: Path, *argv: str, cwd: Path) -> subprocess.CompletedProcess:
    """`argv` with the environment's bin/ first, from `cwd` (away from the checkout, whose tide_hf must not be seen)."""
    return subprocess.run([str(env / "bin" / argv[0]), *argv[1:]], capture_output=True, text=True, cwd=cwd,
                          timeout=600)


def test_the_installed_cli_answers_help_without_torch_and_reports_the_environment(installed: Path,
                                                                                  tmp_path: Path) -> None:
    help_ = run(installed, "tide-hf", "--help", cwd=tmp_path)
    assert help_.returncode == 0, help_.stderr
    assert "calibrate" in help_.stdout
    probe = ("import json, sys\nsys.argv = ['tide-hf', '--help']\nimport tide_hf\nfrom tide_hf.cli import main\n"
             "try:\n    main()\nexcept SystemExit:\n    pass\n"
             "print(json.dumps([tide_hf.__file__, 'torch' in sys.modules]))")
    out = run(installed, "python", "-c", probe, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    where, torch_loaded = json.loads(out.stdout.strip().splitlines()[-1])
    assert where.startswith(str(installed)), f"tide_hf imported from {where}, not the wheel"
    assert not torch_loaded
    env = run(installed, "tide-hf", "env", cwd=tmp_path)
    assert env.returncode == 0, env.stderr
    assert "transformers:" in env.stdout and "tide_hf: 0." in env.stdout
    bench = run(installed, "tide-hf", "bench", "overhead", "--router", "r", cwd=tmp_path)  # away from a checkout
    assert bench.returncode == 1 and "not in the tide_hf wheel" in bench.stderr and "clone" in bench.stderr, bench


def test_the_installed_package_generates_in_every_mode(installed: Path, tmp_path: Path) -> None:
    out = run(installed, "python", "-c", SMOKE, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["file"].startswith(str(installed))
    assert result["same"] == {"select": True, "skip": True, "speculative": True}
