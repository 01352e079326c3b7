"""What a push leaves on the Hub: exactly the router `save_pretrained` writes (no stale weight files of an earlier
push), nothing over a model's repo, and `save_pretrained(push_to_hub=True)` pushing the saved folder, TIDE model
card included. Offline, through the real `huggingface_hub` client against the loopback Hub of `hub_server.py`;
the client runs in one fresh interpreter (this file run as a script), as in `test_hub.py`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load

try:
    from .hub_server import HubServer
except ImportError:  # tests/ is not a package (pytest rootdir-relative import), or run as a script
    from hub_server import HubServer

ROUTER_KWARGS: dict[str, Any] = {"hidden_size": 64, "num_hidden_layers": 8, "router_bottleneck_dim": 16,
                                 "checkpoint_layers": [2, 5, 6], "exit_head": "linear"}
SHARD = "20KB"  # the linear exit heads (64 x 64 floats, 16 KB each) make several shards
STALE_REPO, MODEL_REPO, WEIGHTS_REPO = "org/router", "org/model", "org/weights"
WITH_ID, NO_ID_FOLDER, USER = "org/with-id", "router-noid", "user"
SUBPROCESS_TIMEOUT_S = 180
LLAMA_CONFIG = json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"]}).encode()


def _router(seed: int, **config: Any) -> Any:
    import tide_hf

    torch.manual_seed(seed)
    return tide_hf.TideRouter(tide_hf.TideRouterConfig(**ROUTER_KWARGS, **config))


def _attempt(fn: Any) -> dict[str, Any]:
    try:
        fn()
    except Exception as err:  # noqa: BLE001 - the test inspects what was raised
        return {"raised": type(err).__name__, "msg": str(err)}
    return {"raised": None}


def _worker(out_dir: str) -> None:
    """Every push scenario in one client process; what the tests check is written to `out/result.json`."""
    from huggingface_hub import HfApi
    from safetensors.torch import save_file

    import tide_hf

    out, result = Path(out_dir), {}
    v1, v2 = _router(0), _router(1, exit_threshold=0.6)
    result["v1"] = v1.push_to_hub(STALE_REPO).oid
    HfApi().upload_file(path_or_fileobj=b"mine", path_in_repo="notes.txt", repo_id=STALE_REPO)
    result["v2"] = v2.push_to_hub(STALE_REPO, max_shard_size=SHARD).oid
    got = tide_hf.TideRouter.from_pretrained(STALE_REPO, force_download=True)
    save_file(got.state_dict(), str(out / "loaded_v2.safetensors"))
    save_file(v2.state_dict(), str(out / "v2.safetensors"))
    result["loaded_threshold"] = got.config.exit_threshold
    result["v1_again"] = v1.push_to_hub(STALE_REPO).oid

    result["over_model"] = _attempt(lambda: v1.push_to_hub(MODEL_REPO))
    result["over_weights"] = _attempt(lambda: v1.push_to_hub(WEIGHTS_REPO))
    result["bad_id"] = _attempt(lambda: v1.push_to_hub("not a valid/repo id!!"))

    v1.save_pretrained(out / "my-router", push_to_hub=True, repo_id=WITH_ID)
    v1.save_pretrained(out / NO_ID_FOLDER, push_to_hub=True)
    result["save_bad_id"] = _attempt(lambda: v1.save_pretrained(out / "bad name!", push_to_hub=True))
    result["bad_folder_saved"] = (out / "bad name!").exists()
    (out / "result.json").write_text(json.dumps(result))


def _client_env(hub: HubServer, root: Path) -> dict[str, str]:
    drop = ("HF_", "HUGGINGFACE_", "TRANSFORMERS_")
    env = {k: v for k, v in os.environ.items() if not k.startswith(drop) and "proxy" not in k.lower()}
    env.update(HF_ENDPOINT=hub.url, HF_TOKEN="hf_dummy", HF_HOME=str(root / "home"), HF_HUB_CACHE=str(root / "cache"),
               HF_HUB_DISABLE_TELEMETRY="1", HF_HUB_DISABLE_PROGRESS_BARS="1", HF_HUB_DISABLE_UPDATE_CHECK="1",
               NO_PROXY="127.0.0.1,localhost")
    return env


@pytest.fixture(scope="module")
def hub() -> Iterator[HubServer]:
    server = HubServer(token="hf_dummy", max_lifetime_s=300, user=USER).start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def pushed(hub: HubServer) -> Iterator[tuple[Path, dict[str, Any]]]:
    hub.seed(MODEL_REPO, {"config.json": LLAMA_CONFIG, "model.safetensors": b"model weights"})
    hub.seed(WEIGHTS_REPO, {"model.safetensors": b"someone's weights"})
    with tempfile.TemporaryDirectory(prefix="tide-hub-push-") as tmp:
        out = Path(tmp) / "out"
        out.mkdir()
        proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), str(out)],
                              env=_client_env(hub, Path(tmp)),
                              capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT_S)
        assert proc.returncode == 0, f"client process failed:\n{proc.stdout}\n{proc.stderr[-6000:]}"
        yield out, json.loads((out / "result.json").read_text())


def _files(hub: HubServer, repo: str, commit: str) -> dict[str, bytes]:
    return hub.repos[repo].commits[commit]


def test_a_push_leaves_exactly_the_saved_router_files_and_keeps_the_users_own(hub: HubServer, pushed) -> None:
    """v1 unsharded, then v2 sharded: v1's model.safetensors used to stay and be loaded under v2's config."""
    out, result = pushed
    v2_files = _files(hub, STALE_REPO, result["v2"])
    shards = sorted(f for f in v2_files if f.startswith("model-"))
    assert len(shards) > 1 and "model.safetensors.index.json" in v2_files
    assert sorted(v2_files) == sorted([".gitattributes", "README.md", "config.json", "notes.txt",
                                       "model.safetensors.index.json", *shards])
    assert result["loaded_threshold"] == 0.6
    loaded, want = load((out / "loaded_v2.safetensors").read_bytes()), load((out / "v2.safetensors").read_bytes())
    assert sorted(loaded) == sorted(want) and all(torch.equal(loaded[k], want[k]) for k in want)
    again = _files(hub, STALE_REPO, result["v1_again"])  # and back: the shards and their index go
    assert sorted(again) == [".gitattributes", "README.md", "config.json", "model.safetensors", "notes.txt"]
    assert again["notes.txt"] == b"mine"
    # one commit per push: created, v1, the user's upload, v2, v1 again
    assert len(hub.repos[STALE_REPO].commits) == 5


def test_a_push_over_a_model_or_foreign_weights_is_refused_before_uploading(hub: HubServer, pushed) -> None:
    _, result = pushed
    assert result["over_model"]["raised"] == "TideRouterFileError"
    assert "model_type 'llama'" in result["over_model"]["msg"] and MODEL_REPO in result["over_model"]["msg"]
    assert result["over_weights"]["raised"] == "TideRouterFileError"
    assert "model.safetensors" in result["over_weights"]["msg"]
    for repo in (MODEL_REPO, WEIGHTS_REPO):
        assert len(hub.repos[repo].commits) == 1, f"{repo} got a commit"
    assert hub.files(MODEL_REPO)["config.json"] == LLAMA_CONFIG
    assert result["bad_id"]["raised"] == "TideArgumentError" and "not a Hub repo id" in result["bad_id"]["msg"]


def test_save_pretrained_push_to_hub_pushes_the_saved_folder_with_its_card(hub: HubServer, pushed) -> None:
    """It pushed from the hidden staging folder before the TIDE card was written (a generic card on the Hub), and
    without repo_id named the repo after that staging folder, failing with nothing saved."""
    out, result = pushed
    for folder, repo in (("my-router", WITH_ID), (NO_ID_FOLDER, f"{USER}/{NO_ID_FOLDER}")):
        remote = hub.files(repo)
        local = {p.name: p.read_bytes() for p in (out / folder).iterdir()}
        assert {k: v for k, v in remote.items() if k != ".gitattributes"} == local
        assert "library_name: tide_hf" in local["README.md"].decode()
    assert result["save_bad_id"]["raised"] == "TideArgumentError"
    assert "folder's name" in result["save_bad_id"]["msg"] and not result["bad_folder_saved"]


if __name__ == "__main__":
    _worker(sys.argv[1])
