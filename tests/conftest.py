"""Shared fixtures (the helpers they build on live in helpers.py, which test modules import): tiny models and
tokenizers, text files, one intra-op thread, and the real SmolLM2 with its one calibration, loaded once per session
(per xdist worker) and checked after every test to be left as loaded."""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

import pytest
import torch
from helpers import ByteTokenizer, left_behind, make_documents, make_tiny_llama, stock_state

import tide_hf

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))  # benchmarks/report.py: `import report`
tide_hf.enable_generate_keyword()  # the documented call behind generate(tide=...) (`import tide_hf` patches nothing)


@pytest.fixture
def byte_tokenizer() -> ByteTokenizer:
    return ByteTokenizer()


@pytest.fixture(scope="module")
def tiny_llama():
    return make_tiny_llama()


@pytest.fixture(scope="session")
def near_identity_calibration():
    """(model, router, held-out samples): a tiny Llama whose layers after 2 barely write, so exits certify at every
    one of its four checkpoints (2, 4, 6, 8); the router calibrated on 160 samples, 40 others held out. Shared:
    use the model through a copy (`copy.deepcopy`) where a test attaches to it."""
    from tide_bench.easy import make_near_identity

    model = make_near_identity(make_tiny_llama(), 2, scale=0.3)
    gen = torch.Generator().manual_seed(0)
    samples = [torch.randint(3, 256, (32,), generator=gen) for _ in range(200)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        router = tide_hf.calibration.calibrate_tokens(model, samples[:160], num_epochs=2, router_bottleneck_dim=16,
                                                      checkpoint_interval=2, progress=False)
    return model, router, torch.stack(samples[160:])


@pytest.fixture
def text_folder(tmp_path: Path) -> Path:
    """A folder of 12 .txt documents (~300 bytes each), one document per file."""
    folder = tmp_path / "texts"
    folder.mkdir()
    for i, doc in enumerate(make_documents(12, 60, seed=1)):
        (folder / f"doc{i:02d}.txt").write_text(doc)
    return folder


@pytest.fixture
def jsonl_file(tmp_path: Path) -> Path:
    """A .jsonl file of 12 records with a `text` field."""
    path = tmp_path / "texts.jsonl"
    path.write_text("".join(json.dumps({"text": doc, "id": i}) + "\n"
                            for i, doc in enumerate(make_documents(12, 60, seed=2))))
    return path


@pytest.fixture(scope="session", autouse=True)
def one_intra_op_thread():
    """Every test runs on one intra-op thread (the suite did since test_skip_checks.py pinned it at import; a
    module naming this fixture relies on it). The models are small: one thread is as fast, and on a small shared
    CPU box an OpenMP pool competing with other jobs (CI's two xdist workers) makes each op stall."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture
def early_exit_only(monkeypatch):
    """Speculative mode without lookup drafts (no n-gram of the context ever matches): the early-exit source alone."""
    from tide_hf.integrations.sources import ContextLookup

    monkeypatch.setattr(ContextLookup, "draft", lambda *_: (None, 0))


# -- the real SmolLM2, shared by every test that needs it ------------------------------------------------------------
SHARED: list[tuple[object, dict]] = []  # (model, its stock_state) per shared model loaded in this process


@pytest.fixture(scope="session")
def smollm2():
    """SmolLM2-135M-Instruct (fp32, eval mode) and its left-padding tokenizer, from `tide_hf.assets.load_model`:
    loaded once, shared by every test (each must leave it as loaded: `shared_models_left_as_loaded` checks)."""
    from tide_hf.assets import load_model

    try:
        model, tok = load_model("smollm2")
    except FileNotFoundError as exc:  # TideMissingError: the weights' package is not installed
        pytest.skip(str(exc))
    SHARED.append((model, stock_state(model)))
    return model, tok


@pytest.fixture(scope="session")
def smollm2_calibration(smollm2):
    """(router, warnings raised): the suite's one real calibration of SmolLM2 (State of the Union, 24 samples x 64
    tokens, 3 epochs, top-1 labels, the default exit heads)."""
    model, tok = smollm2
    from tide_hf.assets import sotu_path

    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        router = tide_hf.calibrate(model, tok, str(sotu_path()), num_samples=24, seq_len=64, num_epochs=3,
                                   label="top1", progress=False)
    return router, [str(w.message) for w in record]


@pytest.fixture(autouse=True)
def shared_models_left_as_loaded(request):
    """A test that leaves a router attached, a patch, a hook, train mode or changed weights on a shared model
    fails here (at its teardown) instead of changing the tests that run after it; the handle is detached. Only
    tests that use the shared model (through `smollm2`) are checked: no other can reach it."""
    yield
    if "smollm2" not in request.fixturenames:
        return
    for model, stock in SHARED:
        found = left_behind(model, stock)
        if tide_hf.get_handle(model) is not None:
            tide_hf.get_handle(model).detach()
        assert not found, f"the shared {type(model).__name__} was not left as loaded: {found}"
