"""Calibration text: documents in memory (lists, generators, `datasets` objects) read like a file's records,
load errors that name the file and the cause, samples that fit the model's context, and a huge document that is
tokenized only as far as the samples reach."""

from __future__ import annotations

import json
from pathlib import Path

import datasets
import pytest
import torch
from helpers import ByteTokenizer, make_documents, make_tiny_llama, new_router
from transformers import GPT2Config, GPT2LMHeadModel

import tide_hf
from tide_hf.calibration import held_out_texts, load_texts, make_samples
from tide_hf.errors import TideArgumentError, TideArgumentTypeError, TideDataError

FAST = dict(seq_len=32, batch_size=8, num_epochs=2, progress=False)
DOCS = make_documents(12, 60, seed=2)


@pytest.fixture
def records(tmp_path: Path) -> Path:
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": doc, "id": i}) + "\n" for i, doc in enumerate(DOCS)))
    return path


def in_memory() -> dict[str, object]:
    table = datasets.Dataset.from_dict({"text": DOCS, "id": list(range(len(DOCS)))})
    return {"list": list(DOCS), "tuple": tuple(DOCS), "generator": (d for d in DOCS), "Dataset": table,
            "DatasetDict": datasets.DatasetDict({"train": table}), "IterableDataset": table.to_iterable_dataset()}


@pytest.mark.parametrize("kind", list(in_memory()))
def test_documents_in_memory_read_like_a_files_records(kind: str, records: Path) -> None:
    """They raised a bare TypeError from os.fspath."""
    assert load_texts(in_memory()[kind]) == load_texts(str(records)) == DOCS


@pytest.mark.filterwarnings("ignore:TIDE calibration")  # so few samples certify no exit
def test_a_router_calibrated_on_a_list_is_the_one_calibrated_on_the_same_file(records: Path) -> None:
    """Same documents, same seeded split into calibration samples and held-out documents."""
    model, tok = make_tiny_llama(), ByteTokenizer()
    from_file = tide_hf.calibrate(model, tok, str(records), num_samples=12, **FAST)
    from_list = tide_hf.calibrate(model, tok, list(DOCS), num_samples=12, **FAST)
    assert from_list.config.dataset == "in-memory list" and from_file.config.dataset == str(records)
    assert all(torch.equal(a, b) for a, b in zip(from_file.state_dict().values(), from_list.state_dict().values()))
    assert held_out_texts(tok, list(DOCS), from_list.config) == held_out_texts(tok, load_texts(str(records)),
                                                                              from_file.config)


@pytest.mark.parametrize("data,error,message", [
    ({"text": DOCS}, TideArgumentTypeError, "dataset must be a local .* got dict"),
    (b"docs.txt", TideArgumentTypeError, "dataset must be .* got bytes"),
    (7, TideArgumentTypeError, "dataset must be .* got int"),
    (["one", 2], TideDataError, "1 items are not strings"),
    (datasets.Dataset.from_dict({"body": DOCS}), TideDataError, r"no column 'text'; columns: \['body'\]"),
    (datasets.DatasetDict({"validation": datasets.Dataset.from_dict({"text": DOCS})}), TideDataError,
     r"no split 'train'; its splits: \['validation'\]"),
])
def test_in_memory_data_that_cannot_be_read_is_refused_naming_it(data, error, message) -> None:
    with pytest.raises(error, match=message):
        load_texts(data)


def test_a_save_to_disk_folder_loads(tmp_path: Path) -> None:
    """Its dataset_info.json / state.json were read as JSON records and failed without a cause."""
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": DOCS})}).save_to_disk(tmp_path / "saved")
    assert load_texts(str(tmp_path / "saved")) == DOCS


def test_load_errors_name_the_file_and_the_cause(tmp_path: Path) -> None:
    """It said only "An error occurred while generating the dataset"."""
    (tmp_path / "texts").mkdir()
    for i, doc in enumerate(DOCS[:4]):
        (tmp_path / "texts" / f"d{i}.txt").write_text(doc)
    (tmp_path / "texts" / "d2.txt").write_bytes("Caf\u00e9 cr\u00e8me".encode("latin-1"))
    with pytest.raises(TideDataError, match=r"d2.txt is not UTF-8 text \(byte 3: invalid continuation byte\)"):
        load_texts(str(tmp_path / "texts"))
    (tmp_path / "records.jsonl").write_text('{"text": "fine"}\n{"text": broken}\n')
    with pytest.raises(TideDataError, match=r"records.jsonl line 2 is not a JSON record"):
        load_texts(str(tmp_path / "records.jsonl"))
    (tmp_path / "blank.jsonl").write_text("\n  \n")  # was datasets' 'Instruction "train" corresponds to no data!'
    with pytest.raises(TideDataError, match=r"blank.jsonl holds nothing but blank lines: no records"):
        load_texts(str(tmp_path / "blank.jsonl"))


def test_samples_longer_than_the_context_are_refused_before_any_work(tmp_path: Path) -> None:
    """GPT-2 crashed mid-forward with an IndexError; Llama calibrated on positions it never had."""
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=256, n_positions=64, n_embd=32, n_layer=9, n_head=4)).eval()
    missing = str(tmp_path / "no-such-data")  # never read: the context is checked first
    with pytest.raises(TideArgumentError, match=r"seq_len=100 is longer than the model's context "
                                                r"\(max_position_embeddings=64 positions\)"):
        tide_hf.calibrate(gpt2, ByteTokenizer(), missing, num_samples=4, seq_len=100)
    llama = make_tiny_llama()  # max_position_embeddings=256
    with pytest.raises(TideArgumentError, match="a sample of 300 tokens is longer than the model's context"):
        tide_hf.calibration.calibrate_tokens(llama, [torch.randint(3, 256, (300,)), torch.randint(3, 256, (20,))])
    with pytest.raises(TideArgumentError, match="seq_len=257"):
        tide_hf.calibrate(llama, ByteTokenizer(), missing, num_samples=4, seq_len=257)


class CountingTokenizer(ByteTokenizer):
    """Records how many characters each call tokenized."""

    def __init__(self) -> None:
        self.lengths: list[int] = []

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        self.lengths.append(len(text))
        return super().__call__(text, add_special_tokens)


def test_a_huge_document_is_tokenized_only_as_far_as_the_samples_reach() -> None:
    """One big .txt file was tokenized whole (~130 bytes of memory per byte of text) for a few samples."""
    huge = " ".join(make_documents(400, 200, seed=3))  # ~400 KB, one document
    order = torch.randperm(len(DOCS) + 1, generator=torch.Generator().manual_seed(0)).tolist()
    for place in (order[0], order[2]):  # the huge document read first, or after two whole ones
        texts = [*DOCS[:place], huge, *DOCS[place:]]
        tok = CountingTokenizer()
        samples = make_samples(tok, texts, 40, 32, seed=0)
        cfg = tide_hf.TideRouterConfig(hidden_size=8, num_hidden_layers=9, num_samples=40, seq_len=32, exit_head="lens")
        held_out = held_out_texts(tok, texts, cfg)
        assert max(tok.lengths) < len(huge) // 20
        expected, used = [], []  # the old way: every document tokenized whole, in the seeded order
        for i in order:
            if len(expected) >= 40:
                break
            ids = ByteTokenizer()(texts[i])["input_ids"]
            expected += [torch.tensor(ids[s : s + 32]) for s in range(0, len(ids), 32)]
            used.append(i)
        assert place in used
        assert all(torch.equal(a, b) for a, b in zip(samples, expected[:40], strict=True))
        assert held_out == [t for i, t in enumerate(texts) if i not in used]


def test_evaluation_samples_spread_over_the_documents_evenly() -> None:
    """analyze measured its held-out text on consecutive chunks of the first held-out documents: 32 x 256 tokens
    were one or two speeches. Spread samples take ceil(n / documents) chunks of each document (more where short
    documents leave the samples short), at the middles of equal shares of it, from a bounded prefix of a huge one."""
    tok = ByteTokenizer()
    docs = ["".join(f"{chr(65 + d)}{k:02d}".ljust(32, ".") for k in range(16)) for d in range(6)]  # 16 chunks each

    def names(samples: list[torch.Tensor]) -> list[str]:
        return [bytes(s[:3].tolist()).decode() for s in samples]

    order = torch.randperm(6, generator=torch.Generator().manual_seed(0)).tolist()
    assert names(make_samples(tok, docs, 6, 32, seed=0, spread=True)) == [f"{chr(65 + d)}08" for d in order]
    assert names(make_samples(tok, docs, 6, 32, seed=0)) == [f"{chr(65 + order[0])}{k:02d}" for k in range(6)]
    assert names(make_samples(tok, docs, 12, 32, seed=0, spread=True)) == [  # 2 each: the middles of the halves
        f"{chr(65 + d)}{k:02d}" for d in order for k in (4, 12)]
    short = ["x" * 32, docs[0]]  # one chunk and 16: 2 each leaves 3 samples, so the long one gives the rest
    filled = make_samples(tok, short, 6, 32, seed=0, spread=True)
    assert len(filled) == 6 and sum(bytes(s.tolist()) == b"x" * 32 for s in filled) == 1
    huge = " ".join(make_documents(400, 200, seed=3))
    counting = CountingTokenizer()
    assert len(make_samples(counting, [huge], 4, 32, seed=0, spread=True)) == 4
    from tide_hf.calibration.samples import CHARS_PER_TOKEN, SPREAD_SPAN

    assert max(counting.lengths) <= SPREAD_SPAN * 4 * 32 * CHARS_PER_TOKEN < len(huge)  # a prefix, not all of it


def test_too_little_text_is_named_as_the_cause() -> None:
    """Two short documents give two samples: the error must say the text ran out (it said "raise num_samples=2",
    already below the 64 asked for)."""
    with pytest.warns(UserWarning), pytest.raises(tide_hf.errors.TideArgumentError, match="give it more text"):
        tide_hf.calibrate(make_tiny_llama(), ByteTokenizer(), ["First document.", "Second document."],
                          num_samples=64, seq_len=16, progress=False)


def test_repeated_documents_are_kept_once_with_a_warning() -> None:
    """A copy in the training split and another in the threshold split made the quality targets' certificate
    over-optimistic (missed in 7 of 8 seeds on 4 documents x 20 copies); missing values are named too."""
    with pytest.warns(UserWarning, match="2 repeated documents dropped") as caught:
        texts = load_texts(["one document", "another", "one document", None, "another"])
    assert texts == ["one document", "another"]
    assert any("1 items missing (None)" in str(w.message) for w in caught)


def test_a_jsonl_file_that_is_not_utf8_is_named(tmp_path: Path) -> None:
    """pyarrow's JSON reader keeps undecodable bytes: a bare UnicodeDecodeError came later, naming no file."""
    path = tmp_path / "data.jsonl"
    path.write_bytes(b'{"text": "fine"}\n{"text": "caf\xe9 au lait"}\n')
    with pytest.raises(TideDataError, match=r"data\.jsonl is not UTF-8 text \(byte \d+"):
        load_texts(str(path))


def test_the_corpus_alias_works_from_python_too() -> None:
    """`--dataset sotu` named the embedded corpus on the command line only; from Python it went to the Hub."""
    from tide_hf.assets import sotu_path

    texts = load_texts("sotu")
    assert texts == load_texts(str(sotu_path())) and len(texts) > 100


def test_routers_calibrated_before_repeats_were_dropped_are_evaluated_on_their_own_split(tmp_path: Path) -> None:
    """bench / analyze find the documents calibration never read by position in the loaded list: a router made
    before `load_texts` dropped repeats must be evaluated on the list as it read it (else dropping the repeats
    shifts every position and part of its training text counts as held out); a new calibration records that it
    dropped them."""
    from tide_bench.measure import evaluation_text

    docs = make_documents(24, 60)
    texts = docs + docs[:8]  # 8 documents twice
    for i, text in enumerate(texts):
        (tmp_path / f"doc{i:02d}.txt").write_text(text)
    tok, model = ByteTokenizer(), make_tiny_llama()
    with pytest.warns(UserWarning, match="8 repeated documents dropped"):
        router = tide_hf.calibrate(model, tok, str(tmp_path), num_samples=8, seq_len=64, num_epochs=1, progress=False)
    assert router.config.unique_documents
    router.config.unique_documents = False  # as a router saved by an earlier version reads
    files = load_texts(str(tmp_path), unique=False)
    held_out = held_out_texts(tok, files, router.config)
    prompts, _ = evaluation_text(tok, str(tmp_path), router, num_prompts=len(held_out), prompt_len=16, num_chunks=1,
                                 chunk_len=8)
    expected = [torch.tensor(tok(t, add_special_tokens=False)["input_ids"])[:16] for t in held_out]
    assert all(torch.equal(a, b) for a, b in zip(prompts, expected, strict=True))


def test_bench_evaluates_several_routers_on_documents_none_of_them_read(tmp_path: Path) -> None:
    """`tide-hf bench --router A B` took its held-out text from A's calibration alone: B, calibrated with another
    seed, was scored on documents it was trained on."""
    from tide_bench.measure import evaluation_text

    docs = make_documents(24, 60)
    for i, text in enumerate(docs):
        (tmp_path / f"doc{i:02d}.txt").write_text(text)
    tok, model = ByteTokenizer(), make_tiny_llama()
    routers = [new_router(model, num_samples=6, seq_len=64) for _ in range(2)]
    routers[1].config.seed = 1  # calibrated with another seed: another document order
    held = [set(held_out_texts(tok, load_texts(str(tmp_path)), r.config)) for r in routers]
    assert held[0] != held[1]  # the two calibrations read different documents
    both = [t for t in load_texts(str(tmp_path)) if t in held[0] & held[1]]
    prompts, _ = evaluation_text(tok, str(tmp_path), routers, num_prompts=len(both), prompt_len=16, num_chunks=1,
                                 chunk_len=8)
    expected = [torch.tensor(tok(t, add_special_tokens=False)["input_ids"])[:16] for t in both]
    assert all(torch.equal(a, b) for a, b in zip(prompts, expected, strict=True))
    with pytest.raises(TideDataError, match="held-out text too short"):  # no more than the documents both left
        evaluation_text(tok, str(tmp_path), routers, num_prompts=len(both) + 1, prompt_len=16, num_chunks=1,
                        chunk_len=8)


def test_a_dataframe_is_read_by_its_column_and_a_set_is_refused(records: Path) -> None:
    """A DataFrame was read as its column names (['text', 'id'], two 'documents'); a set was read in an order that
    changes with PYTHONHASHSEED, so the seeded samples did too."""
    pandas = pytest.importorskip("pandas")
    frame = pandas.DataFrame({"text": DOCS, "id": range(len(DOCS))})
    assert load_texts(frame) == load_texts(str(records)) == DOCS
    with pytest.raises(TideDataError, match=r"no column 'body'; columns: \['text', 'id'\]"):
        load_texts(frame, text_field="body")
    with pytest.raises(TideArgumentTypeError, match="dataset is a set: its order changes"):
        load_texts(set(DOCS))


def test_a_folder_is_read_whatever_the_extensions_case_without_hidden_files_or_byte_order_marks(tmp_path: Path
                                                                                                ) -> None:
    """`B.TXT` was skipped without a word (named alone, it was refused), `.ipynb_checkpoints/a-checkpoint.txt` was
    read as a document, and a UTF-8 byte-order mark became the first character of the text."""
    folder = tmp_path / "docs"
    (folder / ".ipynb_checkpoints").mkdir(parents=True)
    (folder / "a.txt").write_text(DOCS[0])
    (folder / "B.TXT").write_bytes(b"\xef\xbb\xbf" + DOCS[1].encode())
    (folder / ".ipynb_checkpoints" / "a-checkpoint.txt").write_text("a stale copy")
    (folder / "__pycache__").mkdir()
    (folder / "__pycache__" / "notes.txt").write_text("not a document")
    assert load_texts(str(folder)) == [DOCS[1], DOCS[0]]  # files in sorted order: "B.TXT" < "a.txt"
    assert load_texts(str(folder / "B.TXT")) == [DOCS[1]]


def test_a_tokenizer_that_is_no_tokenizer_or_ids_outside_the_embeddings_are_named(records: Path) -> None:
    """A model id or None as the tokenizer was a TypeError ('str' object is not callable); a pad token added
    without resizing the embeddings (or another model's tokenizer) an IndexError deep in the forward."""
    model = make_tiny_llama()  # 256 embeddings
    for bad in (None, "HuggingFaceTB/SmolLM2-135M"):
        with pytest.raises(TideArgumentTypeError, match=f"tokenizer must be a tokenizer .*got {type(bad).__name__}"):
            tide_hf.calibrate(model, bad, str(records), num_samples=4, **FAST)

    class AddedPad(ByteTokenizer):
        pad_token_id = 256  # tokenizer.add_special_tokens({"pad_token": ...}) without model.resize_token_embeddings

    class Wider(ByteTokenizer):
        def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
            return {"input_ids": [300 + b for b in text.encode("utf-8")]}

    with pytest.raises(TideArgumentError, match=r"must be in \[0, 256\) .* 3\d\.\.1\d\d, its pad id is 256 .*resize"):
        tide_hf.calibrate(model, AddedPad(), str(records), num_samples=4, **FAST)
    with pytest.raises(TideArgumentError, match=r"must be in \[0, 256\) .* 3\d\d\.\.4\d\d, its pad id is 0"):
        tide_hf.calibrate(model, Wider(), str(records), num_samples=4, **FAST)

    class NoPad:  # a tokenizer-like callable without the attribute: pads with 0, as one whose pad_token_id is None
        def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
            return ByteTokenizer()(text, add_special_tokens)

    with pytest.warns(UserWarning, match="TIDE calibration"):
        router = tide_hf.calibrate(model, NoPad(), str(records), num_samples=12, **FAST)
    assert router.config.num_samples == 12


# -- refusals and odd but valid input ---------------------------------------------------------------------------
def test_records_that_are_not_text_are_refused_not_dropped(tmp_path: Path) -> None:
    from tide_hf.calibration import load_texts
    from tide_hf.errors import TideDataError

    data = tmp_path / "data.jsonl"
    data.write_text("\n".join(json.dumps({"text": value}) for value in (1, 2, 3)) + "\n")
    with pytest.raises(TideDataError, match="3 'text' values are not strings"):
        load_texts(str(data))
