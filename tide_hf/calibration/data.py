"""Calibration text through `datasets`: a Hub dataset name, or local text / jsonl files and folders.

A dataset that cannot be loaded raises `TideDataError` naming it and the cause; nothing is ever
replaced by stand-in text.
"""

from __future__ import annotations

import os
from pathlib import Path

from ..errors import TideArgumentError, TideDataError
from ..modeling import quiet_hf

DEFAULT_DATASET = "wikitext"
DEFAULT_DATASET_CONFIG = "wikitext-103-raw-v1"
_BUILDERS = {".txt": "text", ".text": "text", ".md": "text", ".jsonl": "json", ".json": "json"}


def _local_files(path: Path) -> tuple[str, list[str]]:
    files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in _BUILDERS) if path.is_dir() else [path]
    if not files:
        raise TideDataError(f"no text files ({', '.join(_BUILDERS)}) under {path}")
    builders = {_BUILDERS.get(p.suffix) for p in files}
    if None in builders:  # a single file given by name, of a kind not read
        raise TideDataError(f"{path}: not a text file kind tide_hf reads ({', '.join(_BUILDERS)})")
    if len(builders) != 1:
        raise TideDataError(
            f"{path}: mix of file kinds {sorted({p.suffix for p in files})}; give one kind (text or jsonl)"
        )
    return builders.pop(), [str(p) for p in files]


def load_texts(
    dataset: str | None = None,
    *,
    dataset_config: str | None = None,
    split: str = "train",
    text_field: str = "text",
) -> list[str]:
    """Return the non-empty documents of `dataset` (a local file / folder, or a Hub dataset name).

    Local .txt files are one document per file; .jsonl / .json files one document per record's
    `text_field`. A Hub name defaults to WikiText-103 when `dataset` is None.
    """
    from datasets import load_dataset

    if dataset is not None and not str(dataset).strip():  # e.g. an unset $DATA: never a stand-in corpus
        raise TideArgumentError(f"dataset is an empty name ({dataset!r}); give a file, folder or Hub dataset, "
                                "or None for the default")
    name = DEFAULT_DATASET if dataset is None else os.fspath(dataset)
    config = dataset_config if dataset is not None else (dataset_config or DEFAULT_DATASET_CONFIG)
    local = Path(name).expanduser()
    try:
        if local.exists():
            builder, files = _local_files(local)
            extra = {"sample_by": "document"} if builder == "text" else {}
            with quiet_hf(datasets=True):  # local text: no "Downloading data" / "Generating train split" bars
                ds = load_dataset(builder, data_files=files, split="train", **extra)
        else:
            ds = load_dataset(name, config, split=split)
    except TideDataError:
        raise
    except Exception as exc:  # datasets raises many kinds; say which source failed and why
        raise TideDataError(
            f"could not load calibration dataset {name!r} (config={config!r}, split={split!r}): {exc}") from exc
    if text_field not in ds.column_names:
        raise TideDataError(f"dataset {name!r} has no column {text_field!r}; columns: {ds.column_names}")
    values = ds[text_field]
    odd = [t for t in values if t is not None and not isinstance(t, str)]
    if odd:  # not text: refused rather than dropped
        raise TideDataError(f"dataset {name!r}: {len(odd)} {text_field!r} values are not strings (first: {odd[0]!r})")
    texts = [t for t in values if t is not None and t.strip()]
    if not texts:
        raise TideDataError(f"dataset {name!r} has no non-empty {text_field!r} values")
    return texts
