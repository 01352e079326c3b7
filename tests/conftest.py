"""Shared fixtures (the helpers they build on live in helpers.py, which test modules import)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from helpers import ByteTokenizer, make_documents, make_tiny_llama

import tide_hf

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))  # benchmarks/report.py: `import report`
tide_hf.enable_generate_keyword()  # the documented call behind generate(tide=...) (`import tide_hf` patches nothing)


@pytest.fixture
def byte_tokenizer() -> ByteTokenizer:
    return ByteTokenizer()


@pytest.fixture(scope="module")
def tiny_llama():
    return make_tiny_llama()


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


@pytest.fixture(scope="module")
def one_intra_op_thread():
    """These models are tiny: one intra-op thread is as fast, and on a small shared CPU box an OpenMP
    pool competing with other jobs makes each op stall (minutes instead of seconds for this file)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture
def early_exit_only(monkeypatch):
    """Speculative mode without lookup drafts (no n-gram of the context ever matches): the early-exit source alone."""
    from tide_hf.integrations.sources import ContextLookup

    monkeypatch.setattr(ContextLookup, "draft", lambda *_: (None, 0))
