"""Hub round trips of `TideRouter` through the real `huggingface_hub` client, fully offline.

A loopback fake Hub (`hub_server.py`) stands in for huggingface.co. The client side runs in fresh
interpreters (this file run as a script), because `huggingface_hub` reads HF_ENDPOINT, HF_HUB_OFFLINE and
HF_HUB_CACHE once at import: a subprocess with those set exercises exactly what a user's process would.
The user's own HF cache and token are never touched (HF_HOME/HF_HUB_CACHE are temp dirs, token is dummy).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load, load_file, save_file

try:
    from .hub_server import HubServer
except ImportError:  # tests/ is not a package (pytest rootdir-relative import), or run as a script
    from hub_server import HubServer

REPO_ID = "org/tiny-router"
OFFLINE_REPO_ID = "org/name"
ROUTER_KWARGS: dict[str, Any] = {
    "hidden_size": 64,
    "num_hidden_layers": 8,
    "router_bottleneck_dim": 16,
    "exit_head": "lens",
    "base_model_name_or_path": "org/base",
    "base_architecture": "LlamaForCausalLM",
    "checkpoint_layers": [2, 5, 6],  # not derivable from checkpoint_interval: must be stored, not recomputed
    "base_fingerprint": "0123456789abcdef",
    "dataset": "org/calib-data",
    "metrics": {"2": {"auc": 0.75, "precision": 0.5}, "5": {"auc": 0.875, "recall": 0.25}},
    # the quality-target table: attach(min_agreement=...) must work from a pulled router as from the original
    "exit_paths": {"agreement": {"thresholds": [[1.0, 1.0, 1.0], [1.0, 0.625, 1.0], [0.75, 0.625, 0.5]],
                                 "errors": [0, 3, 40], "n": 1000, "nll_sum": [0.0, 1.5, 30.25],
                                 "nll_sumsq": [0.0, 2.0, 60.5], "n_next": 990}},
    # the held-out scores the weights keep (validation, threshold tokens): they must come back with the tensors
    "held_out_tokens": [6, 5],
}
# Keys that legitimately differ between an in-memory config and one read back from a repo.
VOLATILE_CONFIG_KEYS = {"_name_or_path", "_commit_hash", "architectures", "transformers_version", "dtype"}
SUBPROCESS_TIMEOUT_S = 120
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt")


# --- client side: runs in a subprocess ------------------------------------------------------------
def _dump(model: torch.nn.Module, out: Path, name: str) -> None:
    """Write what a test needs from a model the worker holds: its tensors, class and config."""
    save_file({k: v.detach().contiguous() for k, v in model.state_dict().items()}, str(out / f"{name}.safetensors"))
    meta = {"class": f"{type(model).__module__}.{type(model).__qualname__}", "config": model.config.to_dict()}
    (out / f"{name}.json").write_text(json.dumps(meta))


def _set_held_out(router: torch.nn.Module) -> None:
    """Random held-out scores and losses of ROUTER_KWARGS' sizes (one token without a next token)."""
    from tide_hf.modeling.targets import HeldOut

    gen = torch.Generator().manual_seed(0)
    (n_order, n_test), k = ROUTER_KWARGS["held_out_tokens"], len(ROUTER_KWARGS["checkpoint_layers"])
    nll = torch.randn(n_test, k, generator=gen)
    nll[-1] = float("nan")
    router.set_held_out(HeldOut(order_scores=torch.rand(n_order, k, generator=gen),
                                test_scores=torch.rand(n_test, k, generator=gen),
                                test_mismatch=torch.rand(n_test, k, generator=gen) > 0.5, test_nll=nll))


def _worker(mode: str, out_dir: str) -> None:
    """`push_pull`: push a fresh router, then load it back twice (fresh caches). `offline`: load from cache only."""
    import transformers

    import tide_hf

    out = Path(out_dir)
    if mode == "push_pull":
        torch.manual_seed(0)
        router = tide_hf.TideRouter(tide_hf.TideRouterConfig(**ROUTER_KWARGS))
        _set_held_out(router)
        _dump(router, out, "original")
        (out / "commit.txt").write_text(router.push_to_hub(REPO_ID).oid)
        _dump(tide_hf.TideRouter.from_pretrained(REPO_ID), out, "tide")  # into $HF_HUB_CACHE
        _dump(transformers.AutoModel.from_pretrained(REPO_ID, cache_dir=out / "fresh_cache"), out, "auto")
    elif mode == "offline":
        _dump(tide_hf.TideRouter.from_pretrained(OFFLINE_REPO_ID), out, "tide")
        _dump(transformers.AutoModel.from_pretrained(OFFLINE_REPO_ID), out, "auto")
        try:
            tide_hf.TideRouter.from_pretrained("org/missing", cache_dir=out / "empty_cache")
            error: dict[str, Any] = {"raised": False}
        except Exception as err:  # noqa: BLE001 - the test inspects what was raised
            error = {"raised": True, "type": type(err).__name__, "oserror": isinstance(err, OSError), "msg": str(err)}
        (out / "missing.json").write_text(json.dumps(error))
    else:
        raise SystemExit(f"unknown mode {mode!r}")


# --- test side ------------------------------------------------------------------------------------
def _client_env(hub: HubServer, home: Path, cache: Path, **extra: str) -> dict[str, str]:
    """The environment of a client process: our endpoint, dummy token, temp caches, nothing inherited from HF."""
    drop = ("HF_", "HUGGINGFACE_", "TRANSFORMERS_")
    env = {k: v for k, v in os.environ.items() if not k.startswith(drop) and "proxy" not in k.lower()}
    env.update(
        HF_ENDPOINT=hub.url,
        HF_TOKEN="hf_dummy",
        HF_HOME=str(home),
        HF_HUB_CACHE=str(cache),
        HF_HUB_DISABLE_TELEMETRY="1",
        HF_HUB_DISABLE_PROGRESS_BARS="1",
        HF_HUB_DISABLE_UPDATE_CHECK="1",
        NO_PROXY="127.0.0.1,localhost",
        **extra,
    )
    return env


def _run(args: list[str], env: dict[str, str]) -> str:
    proc = subprocess.run(args, env=env, capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT_S)
    assert proc.returncode == 0, f"client process failed:\n{proc.stdout}\n{proc.stderr[-6000:]}"
    return proc.stdout


def _run_worker(mode: str, out: Path, env: dict[str, str]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    _run([sys.executable, str(Path(__file__).resolve()), mode, str(out)], env)


def _loaded(out: Path, name: str) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    return load_file(str(out / f"{name}.safetensors")), json.loads((out / f"{name}.json").read_text())


def _assert_same_tensors(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for key, tensor in want.items():
        assert got[key].dtype == tensor.dtype and torch.equal(got[key], tensor), f"tensor {key} differs"


def _assert_router(out: Path, name: str, want: dict[str, torch.Tensor], want_config: dict[str, Any]) -> None:
    """`name` (as dumped by the worker) is a TideRouter with exactly `want`'s tensors and config."""
    from tide_hf.record import flatten_record

    tensors, meta = _loaded(out, name)
    assert meta["class"] == "tide_hf.modeling.router.TideRouter"
    _assert_same_tensors(tensors, want)
    config = flatten_record(meta["config"])  # provenance and results: the "calibration" section of config.json
    assert config["model_type"] == "tide_router"
    for key, value in ROUTER_KWARGS.items():
        assert config[key] == value, f"config.{key} did not round-trip"
    assert _stable(config) == _stable(flatten_record(want_config))


def _stable(config: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in config.items() if k not in VOLATILE_CONFIG_KEYS}


@pytest.fixture(scope="module")
def workdir() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="tide-hub-test-") as tmp:
        yield Path(tmp)


@pytest.fixture(scope="module")
def hub() -> Iterator[HubServer]:
    server = HubServer(token="hf_dummy", max_lifetime_s=300).start()
    try:
        yield server
    finally:
        server.stop()
    assert not server.running


@pytest.fixture(scope="module")
def pushed(hub: HubServer, workdir: Path) -> Path:
    """Push a router to REPO_ID and pull it back with both loaders; the worker's dumps are in the returned dir."""
    out = workdir / "push_pull"
    _run_worker("push_pull", out, _client_env(hub, workdir / "home1", workdir / "cache1"))
    return out


def test_push_then_pull_round_trips(hub: HubServer, pushed: Path) -> None:
    original, meta = _loaded(pushed, "original")
    from tide_hf.modeling.router import HELD_OUT_BUFFERS

    assert len(original) == 4 * len(ROUTER_KWARGS["checkpoint_layers"]) + len(HELD_OUT_BUFFERS)
    assert set(HELD_OUT_BUFFERS) <= set(original) and bool(original["held_out_order_scores"].any())
    _assert_router(pushed, "tide", original, meta["config"])
    _assert_router(pushed, "auto", original, meta["config"])

    # The real client spoke the Hub protocol: repo created, files committed inline, then downloaded.
    assert hub.unhandled == []
    for request in ("POST /api/repos/create", f"POST /api/models/{REPO_ID}/preupload/main",
                    f"POST /api/models/{REPO_ID}/commit/main", f"GET /{REPO_ID}/resolve/"):
        assert any(line.startswith(request) for line in hub.log), f"client never sent {request}"
    assert (pushed / "commit.txt").read_text() == hub.repos[REPO_ID].refs["main"]

    files = hub.files(REPO_ID)
    assert {"README.md", "config.json", "model.safetensors"} <= set(files)
    assert not [p for p in files if p.endswith(PICKLE_SUFFIXES)], "a pickle checkpoint was uploaded"
    assert not [p for p, d in files.items() if d[:2] in (b"\x80\x02", b"\x80\x04", b"\x80\x05", b"PK")], "pickle/zip"
    _assert_same_tensors(load(files["model.safetensors"]), original)
    assert json.loads(files["config.json"])["checkpoint_layers"] == ROUTER_KWARGS["checkpoint_layers"]
    assert json.loads(files["config.json"])["calibration"]["results"]["exit_paths"] == ROUTER_KWARGS["exit_paths"]
    readme = files["README.md"].decode()
    assert readme.startswith("---\n") and "library_name: tide_hf" in readme, "the TIDE model card was not pushed"
    assert "base_model: org/base" in readme and "| 5 |" in readme


@pytest.fixture(scope="module")
def offline(hub: HubServer, pushed: Path, workdir: Path) -> Path:
    """Download OFFLINE_REPO_ID into a cache with the real client, then load it with HF_HUB_OFFLINE=1."""
    hub.seed(OFFLINE_REPO_ID, hub.files(REPO_ID), message="duplicate of " + REPO_ID)
    cache = workdir / "offline_cache"
    online = _client_env(hub, workdir / "home2", cache)
    code = "import sys; from huggingface_hub import snapshot_download; print(snapshot_download(sys.argv[1]))"
    snapshot = Path(_run([sys.executable, "-c", code, OFFLINE_REPO_ID], online).strip().splitlines()[-1])

    sha = hub.repos[OFFLINE_REPO_ID].refs["main"]
    storage = cache / "models--org--name"
    assert (storage / "refs" / "main").read_text() == sha
    assert snapshot == storage / "snapshots" / sha
    assert {"README.md", "config.json", "model.safetensors"} <= {p.name for p in snapshot.iterdir()}

    before = len(hub.log)
    out = workdir / "offline"
    _run_worker("offline", out, _client_env(hub, workdir / "home3", cache, HF_HUB_OFFLINE="1"))
    assert hub.log[before:] == [], "an offline load sent requests to the Hub"
    return out


def test_offline_load_from_prepopulated_cache(hub: HubServer, pushed: Path, offline: Path) -> None:
    reference = load(hub.files(OFFLINE_REPO_ID)["model.safetensors"])
    _assert_same_tensors(reference, load_file(str(pushed / "original.safetensors")))
    config = json.loads((pushed / "original.json").read_text())["config"]
    _assert_router(offline, "tide", reference, config)
    _assert_router(offline, "auto", reference, config)


def test_offline_missing_repo_raises(offline: Path) -> None:
    error = json.loads((offline / "missing.json").read_text())
    assert error["raised"], "loading an uncached repo with HF_HUB_OFFLINE=1 did not fail"
    assert error["oserror"], f"expected an OSError, got {error['type']}: {error['msg']}"
    assert "cached files" in error["msg"], error["msg"]


def test_hub_server_stops_by_itself() -> None:
    """The fake Hub is bounded: a server nobody stops still shuts down after `max_lifetime_s`."""
    server = HubServer(max_lifetime_s=0.2).start()
    url = server.url
    deadline = time.monotonic() + 5
    while server.running and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not server.running
    with pytest.raises(OSError):  # connection refused: the port is closed
        urllib.request.urlopen(f"{url}/api/models/org/name", timeout=2)


if __name__ == "__main__":
    _worker(sys.argv[1], sys.argv[2])


@pytest.mark.parametrize("order", ["from tide_hf import TideRouter\nfrom transformers import AutoConfig, AutoModel",
                                   "from transformers import AutoConfig, AutoModel\nfrom tide_hf import TideRouter"])
def test_auto_classes_read_a_router_once_the_router_class_is_imported(tmp_path: Path, order: str) -> None:
    """Importing `TideRouter` registers it with the Auto classes, whichever is imported first; a fresh process,
    since this one has registered them long ago."""
    from helpers import make_model, new_router

    new_router(make_model()).save_pretrained(tmp_path / "router")
    script = (f"{order}\nconfig = AutoConfig.from_pretrained({str(tmp_path / 'router')!r})\n"
              f"model = AutoModel.from_pretrained({str(tmp_path / 'router')!r})\n"
              "print(type(config).__name__, type(model).__name__)")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["TideRouterConfig", "TideRouter"]
