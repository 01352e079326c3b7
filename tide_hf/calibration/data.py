"""Calibration text: a Hub dataset name, local text / jsonl files and folders (or a folder written by
`save_to_disk`), or documents already in memory (a list of strings, a `datasets` Dataset).

A dataset that cannot be loaded raises `TideDataError` naming it and the cause; nothing is ever
replaced by stand-in text.
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from ..assets import DEFAULT_TEXT, sotu_path
from ..errors import TideArgumentError, TideArgumentTypeError, TideDataError, TideMissingDataError
from ..modeling import quiet_hf

_BUILDERS = {".txt": "text", ".text": "text", ".md": "text", ".jsonl": "json", ".json": "json"}
# What `save_to_disk` leaves in a folder: a Dataset's state, or a DatasetDict's list of splits.
_SAVED_MARKERS = ("state.json", "dataset_dict.json")
ACCEPTED = ("a local .txt / .jsonl file or folder, a Hub dataset name, None (WikiText-103), a list (or other "
            "ordered iterable) of strings, a datasets Dataset / IterableDataset / DatasetDict, or a pandas DataFrame")


def _hidden(path: Path, root: Path) -> bool:
    """`path` is inside `root` under a hidden name (`.ipynb_checkpoints/`, `.git/`, `__pycache__/`, `.draft.txt`):
    not read from a folder (`datasets` too leaves hidden files and folders out of its data-file patterns)."""
    return any(part.startswith((".", "__")) for part in path.relative_to(root).parts)


def _local_files(path: Path) -> tuple[str, list[str]]:
    files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in _BUILDERS
                   and not _hidden(p, path)) if path.is_dir() else [path]
    if not files:
        raise TideDataError(f"no text files ({', '.join(_BUILDERS)}) under {path}")
    builders = {_BUILDERS.get(p.suffix.lower()) for p in files}
    if None in builders:  # a single file given by name, of a kind not read
        raise TideDataError(f"{path}: not a text file kind tide_hf reads ({', '.join(_BUILDERS)})")
    if len(builders) != 1:
        raise TideDataError(
            f"{path}: mix of file kinds {sorted({p.suffix.lower() for p in files})}; give one kind (text or jsonl)"
        )
    return builders.pop(), [str(p) for p in files]


def dataset_label(dataset: Any, split: str = "train") -> str:
    """What a router records as its calibration text (`config.dataset`): the name or path given, or the kind of
    in-memory data (with the builder's name when a `datasets` Dataset knows it)."""
    if isinstance(dataset, (str, os.PathLike)):
        return os.fspath(dataset)
    builder = getattr(getattr(dataset, "info", None), "dataset_name", None)
    split_part = f"[{split!r}]" if isinstance(dataset, Mapping) else ""
    return f"in-memory {type(dataset).__name__}{split_part}" + (f" of {builder}" if builder else "")


def _cause(exc: BaseException) -> BaseException:
    """The innermost error behind `exc` (datasets wraps a decoding error in "An error occurred while generating")."""
    while exc.__cause__ is not None or exc.__context__ is not None:
        exc = exc.__cause__ or exc.__context__  # type: ignore[assignment]
    return exc


def _undecodable(files: list[str]) -> str | None:
    """The first of `files` that is not UTF-8 text, with where its first bad byte is (None: all decode)."""
    for name in files:
        try:
            Path(name).read_bytes().decode("utf-8")
        except UnicodeDecodeError as exc:
            return f"{name} is not UTF-8 text (byte {exc.start}: {exc.reason}); re-save it as UTF-8"
    return None


def _blank(files: list[str]) -> str | None:
    """Which of `files` hold nothing but white space, when all of them do (None: some text is there)."""
    if files and all(not Path(name).read_text(encoding="utf-8", errors="replace").strip() for name in files):
        return f"{', '.join(files)} {'holds' if len(files) == 1 else 'hold'} nothing but blank lines: no records"
    return None


def _bad_json(files: list[str]) -> str | None:
    """The first record of these JSON / JSON Lines files that does not parse, by file and line (None: all do)."""
    for name in files:
        text = Path(name).read_text(encoding="utf-8", errors="replace")
        try:
            json.loads(text)  # one JSON document (a list of records)
            continue
        except ValueError:
            pass
        for number, line in enumerate(text.splitlines(), 1):
            try:
                if line.strip():
                    json.loads(line)
            except ValueError as exc:
                return f"{name} line {number} is not a JSON record ({exc})"
    return None


def _read_named(name: str, dataset_config: str | None, split: str) -> Any:
    """A local file / folder / save_to_disk folder, else a Hub dataset, as a `datasets` object; `TideDataError`
    naming the source, the cause and (for text that is not UTF-8) the file."""
    from datasets import load_dataset, load_from_disk

    local, builder, files = Path(name).expanduser(), None, []
    try:
        if local.is_dir() and any((local / marker).is_file() for marker in _SAVED_MARKERS):
            return _pick_split(load_from_disk(str(local)), split, name)
        if local.exists():
            builder, files = _local_files(local)
            bad = _undecodable(files) if builder == "json" else None
            if bad:  # pyarrow's JSON reader keeps undecodable bytes: they would fail later, naming no file
                raise TideDataError(f"could not load calibration dataset {name!r}: {bad}")
            extra = {"sample_by": "document", "encoding": "utf-8-sig"} if builder == "text" else {}  # BOM: not text
            with quiet_hf(datasets=True):  # local text: no "Downloading data" / "Generating train split" bars
                return load_dataset(builder, data_files=files, split="train", **extra)
        return load_dataset(name, dataset_config, split=split)
    except TideDataError:
        raise
    except Exception as exc:  # datasets raises many kinds; say which source failed, why, and which file
        cause = _cause(exc)
        why = ((_undecodable(files) if isinstance(cause, UnicodeDecodeError) else None)
               or (_bad_json(files) if builder == "json" else None)
               or _blank(files)
               or f"{exc}" + (f" ({type(cause).__name__}: {cause})" if cause is not exc else ""))
        raise TideDataError(f"could not load calibration dataset {name!r} (config={dataset_config!r}, "
                            f"split={split!r}): {why}") from exc


def _pick_split(data: Any, split: str, name: str) -> Any:
    """A DatasetDict's `split` (refused naming the splits it has); any other data as it is."""
    from datasets import DatasetDict, IterableDatasetDict

    if isinstance(data, (DatasetDict, IterableDatasetDict)):
        if split not in data:
            raise TideDataError(f"dataset {name!r} has no split {split!r}; its splits: {sorted(data)}")
        return data[split]
    return data


def _values(data: Any, name: str, text_field: str) -> tuple[list[Any], str]:
    """The `text_field` column of a `datasets` Dataset / IterableDataset or a pandas DataFrame, or the items of an
    iterable of texts; and what they are called in messages."""
    from datasets import Dataset, IterableDataset

    column = f"{text_field!r} values"
    if isinstance(data, Dataset):
        if text_field not in data.column_names:
            raise TideDataError(f"dataset {name!r} has no column {text_field!r}; columns: {data.column_names}")
        return list(data[text_field]), column
    if isinstance(data, IterableDataset):
        values = []
        for row in data:  # column_names may be unknown until a row is read
            if text_field not in row:
                raise TideDataError(f"dataset {name!r} has no column {text_field!r}; columns: {sorted(row)}")
            values.append(row[text_field])
        return values, column
    if callable(getattr(data, "itertuples", None)) and hasattr(data, "columns"):  # pandas: iterating gives names
        if text_field not in data.columns:
            raise TideDataError(f"dataset {name!r} has no column {text_field!r}; columns: {list(data.columns)}")
        return data[text_field].tolist(), column
    if isinstance(data, (set, frozenset)):
        raise TideArgumentTypeError(f"dataset is a {type(data).__name__}: its order changes from one process to the "
                                    "next, and the seeded samples with it; pass a list (e.g. sorted(texts))")
    if isinstance(data, (bytes, bytearray, Mapping)) or not isinstance(data, Iterable):
        raise TideArgumentTypeError(f"dataset must be {ACCEPTED}; got {type(data).__name__}")
    return list(data), "items"


def load_texts(
    dataset: str | os.PathLike | Iterable[str] | Any,
    *,
    dataset_config: str | None = None,
    split: str = "train",
    text_field: str = "text",
    unique: bool = True,
) -> list[str]:
    """Return the non-empty documents of `dataset`, in order, each once ("sotu": the embedded corpus).

    A local .txt file is one document, a folder of them one document per file; .jsonl / .json files one
    document per record's `text_field`; a folder written by `save_to_disk`, a Hub dataset name or an in-memory
    `datasets` Dataset / IterableDataset one document per row's `text_field` (a DatasetDict: its `split`), as does
    a pandas DataFrame; a list or other ordered iterable of strings one document per string. A folder's hidden
    files (a name or folder starting with "." or "__") are not read.
    In-memory data is read whole (`IterableDataset.take(n)` bounds a stream). Repeated documents are kept once
    (with a warning): a copy on both sides of the split between training and the threshold split would void the
    quality targets' certificate (`unique=False`: as routers calibrated before that read them, to find their
    held-out documents). Missing values (None) are dropped with a warning.
    """
    if dataset is None:  # there is no default text: calibration reads the text it is given
        raise TideArgumentError("dataset is required: a .txt / .jsonl file or folder, a Hub dataset name, 'sotu' "
                                "(the embedded corpus) or the documents themselves")
    if isinstance(dataset, (str, os.PathLike)):
        if not os.fspath(dataset).strip():  # e.g. an unset $DATA: never a stand-in corpus
            raise TideArgumentError(f"dataset is an empty name ({dataset!r}); give a file, folder or Hub dataset")
        name = os.fspath(dataset)
        if name == DEFAULT_TEXT:  # the embedded State of the Union corpus, as on the command line
            name = str(sotu_path())
        local = Path(name).expanduser()
        as_path = not isinstance(dataset, str) or local.is_absolute() or name.startswith((".", "~")) \
            or local.suffix.lower() in _BUILDERS  # a Path object, or a name written as one
        if as_path and not local.exists():
            raise TideMissingDataError(f"calibration dataset {name!r}: no such file or folder (a name written as a "
                                       "path is not looked up on the Hub)")
        data = _read_named(name, dataset_config, split)
    else:
        name = dataset_label(dataset, split)
        data = _pick_split(dataset, split, name)
    values, what = _values(data, name, text_field)
    odd = [t for t in values if t is not None and not isinstance(t, str)]
    if odd:  # not text: refused rather than dropped
        raise TideDataError(f"dataset {name!r}: {len(odd)} {what} are not strings (first: {odd[0]!r})")
    missing = sum(t is None for t in values)
    texts = [t for t in values if t is not None and t.strip()]
    if not texts:
        raise TideDataError(f"dataset {name!r} has no non-empty {what}")
    unique_texts = list(dict.fromkeys(texts)) if unique else texts
    notes = [f"{missing} {what} missing (None), dropped"] if missing else []
    if len(unique_texts) < len(texts):
        notes.append(f"{len(texts) - len(unique_texts)} repeated documents dropped (each is kept once: a copy on both "
                     "sides of the threshold split would make quality targets look safer than they are)")
    if notes:
        warnings.warn(f"dataset {name!r}: " + "; ".join(notes), stacklevel=2)
    return unique_texts
