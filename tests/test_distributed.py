"""Calibration under `accelerate launch`: two CPU processes (gloo) give the single-process result.

The launches use `accelerate launch --multi_gpu --num_processes 2`: accelerate's `--cpu` flag starts a
single process unless MPI is set up (its simple launcher), while `--multi_gpu` starts one process per rank
through torchrun; with no visible GPU (`CUDA_VISIBLE_DEVICES=""`) tide_hf sets up gloo on the CPU.

Tolerance: each process runs exactly the single-process batches (same padding) with one thread, so the
gathered features, labels and the trained routers are expected to be bitwise equal; the tests allow
`ATOL` (1e-5) and print the largest difference seen, with both wall times.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from helpers import make_documents
from safetensors.torch import load_file

from tide_hf.calibration import distributed

ATOL = 1e-5  # on features, cosines, KLs and router weights; boolean labels must be equal
METRIC_ATOL = 1e-4  # on every validation metric (precision, recall, AUC, losses, rates)
LAUNCH = ["accelerate", "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
          "--mixed_precision", "no", "--dynamo_backend", "no"]
TESTS = Path(__file__).parent
TIMEOUT_S = 900  # generous: on a busy machine a launch waits long for CPU time


def launch(cmd: list[str], cwd: Path) -> subprocess.CompletedProcess:
    """Run `cmd` on the CPU with one thread per process, in its own process group: on a timeout the
    launcher's workers are ended with it."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", "TOKENIZERS_PARALLELISM": "false"}
    with subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          start_new_session=True) as proc:
        try:
            out, err = proc.communicate(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            raise
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def run(cmd: list[str], cwd: Path) -> float:
    """`launch` that must succeed; its wall time in seconds."""
    started = time.perf_counter()
    proc = launch(cmd, cwd)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return time.perf_counter() - started


def max_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """Largest absolute difference over same-named float tensors; booleans must be equal (NaN == NaN)."""
    assert a.keys() == b.keys()
    worst = 0.0
    for name in a:
        assert a[name].shape == b[name].shape, name
        if a[name].dtype == torch.bool:
            assert torch.equal(a[name], b[name]), name
            continue
        x, y = a[name].double(), b[name].double()
        assert torch.equal(x.isnan(), y.isnan()), name
        worst = max(worst, float((x - y).nan_to_num().abs().max()) if x.numel() else 0.0)
    return worst


def metric_difference(a: dict, b: dict) -> float:
    """Largest absolute difference between two routers' nested validation metrics (same keys, same Nones)."""
    if isinstance(a, dict):
        assert a.keys() == b.keys()
        return max((metric_difference(a[k], b[k]) for k in a), default=0.0)
    assert (a is None) == (b is None)
    return 0.0 if a is None else abs(float(a) - float(b))


def report(capsys, what: str, single: float, multi: float, weights: float, metrics: float, inside: str = "") -> None:
    with capsys.disabled():
        print(f"\n{what}: wall time (process start to exit) 1 process {single:.1f} s, "
              f"2 processes {multi:.1f} s{inside}; "
              f"max |difference| router weights {weights:.2e}, metrics {metrics:.2e} "
              f"(tolerance {ATOL:g} / {METRIC_ATOL:g})")


def test_batches_split_into_contiguous_blocks_in_process_order(monkeypatch) -> None:
    keep = [torch.rand(n, generator=torch.Generator().manual_seed(n)) < 0.5 for n in range(3, 14)]  # 11 samples
    counts = [int(k.sum()) for k in keep]
    for processes in (1, 2, 3, 5):
        blocks = []
        for index in range(processes):
            state = SimpleNamespace(num_processes=processes, process_index=index)
            monkeypatch.setattr(distributed, "_state", lambda state=state: state)
            blocks.append(distributed.local_batches(keep, batch_size=2))
        assert [s for starts, _ in blocks for s in starts] == list(range(0, 11, 2))  # every batch once, in order
        sizes = [len(starts) for starts, _ in blocks]
        assert max(sizes) - min(sizes) <= 1
        for starts, rows in blocks:  # a block's rows are the kept tokens of its samples, where one process has them
            assert (rows.start, rows.stop) == (sum(counts[: starts.start]), sum(counts[: starts.stop]))
        assert blocks[0][1].start == 0 and blocks[-1][1].stop == sum(counts)


def test_single_process_is_untouched() -> None:
    assert os.environ.get("WORLD_SIZE") in (None, "1") and distributed._state() is None
    assert distributed.is_main_process()
    starts, rows = distributed.local_batches([torch.ones(3, dtype=torch.bool)] * 5, 2)
    assert list(starts) == [0, 2, 4] and rows == slice(None)


@pytest.fixture(scope="module")
def launched(tmp_path_factory) -> tuple[Path, Path, float, float]:
    """tests/dist_calibrate.py once in one process and once under `accelerate launch` with 2 processes."""
    root = tmp_path_factory.mktemp("dist")
    texts = root / "texts"
    texts.mkdir()
    for i, doc in enumerate(make_documents(64, 200, seed=1)):
        (texts / f"doc{i:02d}.txt").write_text(doc)
    script = [str(TESTS / "dist_calibrate.py"), str(texts)]
    sizes = ["--num-samples", "256", "--seq-len", "128", "--max-train-tokens", "4096"]
    single = run([sys.executable, *script, str(root / "single"), *sizes], root)
    multi = run([*LAUNCH, *script, str(root / "multi"), *sizes], root)
    return root / "single", root / "multi", single, multi


def test_two_processes_collect_the_single_process_tokens(launched) -> None:
    single, multi, _, _ = launched
    collected = load_file(single / "collected.safetensors")
    assert collected["is_val"].numel() > 3000  # a real amount of tokens, from both processes' batches
    assert max_difference(collected, load_file(multi / "collected.safetensors")) <= ATOL


def results(folder: Path) -> dict:
    """The results section of a saved router's calibration record (in its config.json)."""
    return json.loads((folder / "config.json").read_text())["calibration"]["results"]


def test_two_processes_train_the_single_process_router(launched, capsys) -> None:
    single, multi, single_s, multi_s = launched
    weights = max_difference(load_file(single / "router" / "model.safetensors"),
                             load_file(multi / "router" / "model.safetensors"))
    metrics = [results(folder / "router")["metrics"] for folder in (single, multi)]
    difference = metric_difference(*metrics)
    assert weights <= ATOL and difference <= METRIC_ATOL
    # every process returned the main process's router
    hashes = {json.loads((multi / f"rank{i}.json").read_text())["router_sha256"] for i in range(2)}
    assert len(hashes) == 1
    assert "draft_vocab" in load_file(multi / "router" / "model.safetensors")  # the ranking reached every process
    runs = [json.loads((folder / "run.json").read_text()) for folder in (single, multi)]
    inside = "; inside calibrate(): {:.2f} s vs {:.2f} s, of which model forward {:.2f} s vs {:.2f} s".format(
        runs[0]["calibrate_seconds"], runs[1]["calibrate_seconds"],
        runs[0]["calibration_seconds"]["forward"], runs[1]["calibration_seconds"]["forward"])
    report(capsys, "tests/dist_calibrate.py (tiny Llama, 256 x 128 tokens)", single_s, multi_s, weights, difference,
           inside)


def test_a_training_error_stops_every_process(tmp_path) -> None:
    """A failure in the main process's training reaches the other process instead of leaving it waiting."""
    texts = tmp_path / "texts"
    texts.mkdir()
    (texts / "doc.txt").write_text(make_documents(1, 200)[0])
    cmd = [*LAUNCH, str(TESTS / "dist_calibrate.py"), str(texts), str(tmp_path / "out"), "--num-samples", "8",
           "--max-train-tokens", "1"]  # about one kept token: no held-out tokens, train_routers raises
    proc = launch(cmd, tmp_path)
    assert proc.returncode != 0
    assert "calibration kept no" in proc.stderr
    assert not (tmp_path / "out" / "router").exists()


@pytest.mark.slow
def test_cli_under_accelerate_launch_matches_one_process(tmp_path, capsys) -> None:
    """The real `tide-hf calibrate` on the embedded SmolLM2, launched as a module in 2 processes, on the model's
    own greedy continuations (each process writes those of its own batches)."""
    args = ["-m", "tide_hf.cli", "calibrate", "--dataset", "sotu", "--num-samples", "16", "--seq-len", "64",
            "--num-epochs", "3",
            "--continuation", "greedy", "--continuation-prompt-len", "48"]
    (tmp_path / "one").mkdir()
    (tmp_path / "two").mkdir()
    single = run([sys.executable, *args, "--output", "router"], tmp_path / "one")
    multi = run([*LAUNCH, *args, "--output", "router"], tmp_path / "two")
    assert sorted(p.name for p in (tmp_path / "two").iterdir()) == ["router"]  # written once, by the main process
    assert sorted(p.name for p in (tmp_path / "two" / "router").iterdir()) == ["README.md", "config.json",
                                                                               "model.safetensors"]
    weights = max_difference(load_file(tmp_path / "one" / "router" / "model.safetensors"),
                             load_file(tmp_path / "two" / "router" / "model.safetensors"))
    metrics = [results(tmp_path / d / "router")["metrics"] for d in ("one", "two")]
    difference = metric_difference(*metrics)
    assert weights <= ATOL and difference <= METRIC_ATOL
    configs = [json.loads((tmp_path / d / "router" / "config.json").read_text()) for d in ("one", "two")]
    assert all(c["continuation"] == "greedy" for c in configs)
    assert all("generate" in results(tmp_path / d / "router")["calibration_seconds"] for d in ("one", "two"))
    report(capsys, "tide-hf calibrate (SmolLM2, 16 x 64 tokens, greedy continuations)", single, multi, weights,
           difference)
