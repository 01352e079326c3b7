"""Router folders that must not load as they are: non-finite weights, a subfolder that is not there, a config
whose key misspells a field (through transformers' own config loaders too), pickled or missing weights."""

from __future__ import annotations

import json
import math
import os
import pickle
import signal
import stat
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import CLOSED_PATH, make_model, new_router, router_config
from safetensors.torch import load_file, save_file
from transformers import AutoConfig

import tide_hf
import tide_hf.modeling.files as files
from tide_hf import TideRouter, TideRouterConfig
from tide_hf.errors import (
    TideArgumentError,
    TideArgumentTypeError,
    TideCompatibilityError,
    TideError,
    TideMissingRouterError,
    TideRouterFileError,
)


@pytest.mark.parametrize("key,value", [("exit_heads.4.down.weight", float("nan")),
                                       ("routers.8.fc1.bias", float("inf"))])
def test_non_finite_weights_are_refused_naming_the_tensor(tmp_path: Path, key: str, value: float) -> None:
    """They loaded: a NaN exit head made NaN logits for every exited token (token 0 generated), a NaN router
    never fired."""
    new_router(make_model(), exit_head="linear").save_pretrained(tmp_path / "r")
    weights = load_file(tmp_path / "r" / "model.safetensors")
    weights[key].view(-1)[:3] = value
    save_file(weights, tmp_path / "r" / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(TideRouterFileError, match=rf"NaN or inf values: {key} \(3 of \d+ values\)"):
        TideRouter.from_pretrained(tmp_path / "r")


def test_a_bf16_router_with_a_draft_vocabulary_still_loads(tmp_path: Path) -> None:
    """The finiteness check reads floating tensors of any dtype and leaves integer ones (draft ids) alone."""
    router = new_router(make_model(), exit_head="linear").to(torch.bfloat16)
    router.set_draft_vocab(torch.arange(8), {"8": 0.5})
    router.save_pretrained(tmp_path / "r")
    loaded = TideRouter.from_pretrained(tmp_path / "r")
    assert loaded.dtype == torch.bfloat16 and torch.equal(loaded.draft_vocab, torch.arange(8))


def test_a_missing_subfolder_is_named(tmp_path: Path) -> None:
    """The error said "<folder> has no config.json" of a folder that has one, and never named the subfolder."""
    new_router(make_model()).save_pretrained(tmp_path / "r")
    with pytest.raises(TideRouterFileError, match=r"no TIDE router folder at .*r: it has no subfolder 'v2'"):
        TideRouter.from_pretrained(tmp_path / "r", subfolder="v2")
    (tmp_path / "r" / "empty").mkdir()
    with pytest.raises(TideRouterFileError, match=r"r \(subfolder 'empty'\) has no config.json"):
        TideRouter.from_pretrained(tmp_path / "r", subfolder="empty")


def test_config_loaders_refuse_a_misspelled_field(tmp_path: Path) -> None:
    """TideRouter.from_pretrained refused `exit_treshold`; AutoConfig and TideRouterConfig.from_pretrained loaded
    it with exit_threshold left at its default."""
    new_router(make_model()).save_pretrained(tmp_path / "r")
    path = tmp_path / "r" / "config.json"
    config = json.loads(path.read_text())
    config.pop("exit_threshold")
    path.write_text(json.dumps({**config, "exit_treshold": 0.3}))
    for load in (AutoConfig.from_pretrained, TideRouterConfig.from_pretrained):
        with pytest.raises(TideRouterFileError, match="'exit_treshold' is not a TIDE router field; did you mean "
                                                      "'exit_threshold'"):
            load(tmp_path / "r")
    path.write_text(json.dumps({**config, "my_notes": "kept"}))  # a key unlike every field stays, as in transformers
    assert AutoConfig.from_pretrained(tmp_path / "r").my_notes == "kept"


def test_model_card_loads_the_base_model_at_the_calibrated_revision(tmp_path: Path) -> None:
    """The card's snippet pins the Hub commit of the weights the routers were calibrated on (a newer commit of the
    base model fails the fingerprint check at attach), and names the model type."""
    model = make_model()
    pinned = new_router(model, base_model_name_or_path="org/base", base_model_revision="0123abc",
                        base_model_type="llama").model_card().text
    assert "from_pretrained('org/base', revision='0123abc')" in pinned and "model type `llama`" in pinned
    local = new_router(model, base_model_name_or_path="org/base").model_card().text
    assert "from_pretrained('org/base')" in local and "revision" not in local


@pytest.mark.parametrize("write,message", [
    (lambda c: c.write_text("{oops"), "config.json is not valid JSON"),
    (lambda c: c.write_text("[1, 2]"), "config.json holds a list, not an object of router fields"),
    (lambda c: c.write_text(json.dumps({**json.loads(c.read_text()), "dtype": "float99"})),
     "config.json's dtype 'float99' is not a torch dtype"),
])
def test_a_damaged_config_is_a_router_file_error(tmp_path: Path, write, message: str) -> None:
    """transformers' OSError (invalid JSON) or an AttributeError (a list, an unknown dtype) said nothing of which
    router file was bad."""
    new_router(make_model()).save_pretrained(tmp_path / "r")
    write(tmp_path / "r" / "config.json")
    with pytest.raises(TideRouterFileError, match=message):
        TideRouter.from_pretrained(tmp_path / "r")


class Trap:
    """Unpickling this writes a file: its absence shows the pickle was never loaded."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple:
        return (Path.touch, (Path(self.path),))


@pytest.mark.parametrize("keep_config", [True, False])
def test_a_folder_of_pickled_weights_is_named_and_never_unpickled(tmp_path: Path, keep_config: bool) -> None:
    """transformers said "no file named model.safetensors" (an OSError), or, without a config, the error named
    only the missing config.json: neither said the weights are a pickle tide_hf will not load."""
    new_router(make_model()).save_pretrained(tmp_path / "r")
    (tmp_path / "r" / "model.safetensors").unlink()
    if not keep_config:
        (tmp_path / "r" / "config.json").unlink()
    (tmp_path / "r" / "pytorch_model.bin").write_bytes(pickle.dumps(Trap(str(tmp_path / "unpickled"))))
    with pytest.raises(TideMissingRouterError, match=r"has no model.safetensors, only pickle files "
                                                     r"\(pytorch_model.bin\), which tide_hf never loads"):
        TideRouter.from_pretrained(tmp_path / "r")
    if keep_config:  # a config given as an argument: the folder's weights are checked all the same
        with pytest.raises(TideMissingRouterError, match="only pickle files"):
            TideRouter.from_pretrained(tmp_path / "r", config=TideRouterConfig.from_pretrained(tmp_path / "r"))
    assert not (tmp_path / "unpickled").exists()


def test_a_config_without_weights_is_named(tmp_path: Path) -> None:
    new_router(make_model()).save_pretrained(tmp_path / "r")
    (tmp_path / "r" / "model.safetensors").unlink()
    with pytest.raises(TideMissingRouterError, match=r"has a config.json but no weights \(model.safetensors\)"):
        TideRouter.from_pretrained(tmp_path / "r")
    with pytest.raises(FileNotFoundError):  # the builtin base of transformers' own error is kept
        TideRouter.from_pretrained(tmp_path / "r")


KILLED_SAVE = """
import os, shutil, signal, sys
sys.path.insert(0, {tests!r})
from helpers import make_model, new_router
import tide_hf.modeling.files as files
router = new_router(make_model(), seed=1)
def kill(*args, **kwargs):
    os.kill(os.getpid(), signal.SIGKILL)
files.os.replace = kill  # the first move of the two-move save
files.shutil.rmtree = kill  # the clean-up after a one-step swap
router.save_pretrained({path!r}, overwrite=True)
"""


def test_a_save_killed_while_replacing_a_router_leaves_one_whole_router(tmp_path: Path) -> None:
    """The old router was moved aside before the new one moved in: a kill between the two left no router at the
    path (both were kept, the old one under a hidden name, which nothing named)."""
    old = new_router(make_model())
    old.save_pretrained(tmp_path / "r")
    code = KILLED_SAVE.format(tests=str(Path(__file__).parent), path=str(tmp_path / "r"))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == -signal.SIGKILL, done.stderr
    try:
        loaded = TideRouter.from_pretrained(tmp_path / "r")
    except TideMissingRouterError as err:  # a system without the one-step swap: the old router is named
        assert "an interrupted save left the router it replaced at" in str(err)
    else:  # the swap: the new router is in place, whole
        assert not torch.equal(loaded.routers["4"].fc1.weight, old.routers["4"].fc1.weight)


def test_the_router_an_interrupted_two_move_save_left_aside_is_named(tmp_path: Path, monkeypatch) -> None:
    """Where the one-step swap is missing, a kill between the two moves leaves the old router under a hidden
    name next to the path; looking for the router there names it, for a path and for a bare folder name."""
    new_router(make_model()).save_pretrained(tmp_path / "r")
    (tmp_path / ".r.old-1a2b").mkdir()
    (tmp_path / "r").rename(tmp_path / ".r.old-1a2b" / "router")  # what the kill left
    monkeypatch.chdir(tmp_path)
    for name in (tmp_path / "r", "r"):
        with pytest.raises(TideMissingRouterError, match=r"an interrupted save left the router it replaced at "
                                                         r".*\.r\.old-1a2b/router: move it back"):
            TideRouter.from_pretrained(name)


@pytest.mark.parametrize("swap", [True, False])
def test_overwriting_a_router_leaves_the_new_one_and_no_hidden_folders(tmp_path: Path, monkeypatch, swap: bool
                                                                         ) -> None:
    """Both ways of replacing an old router (one-step swap; two moves where the system has no swap) end with the
    new router in place and nothing left beside it."""
    if not swap:
        monkeypatch.setattr(files, "exchange", lambda a, b: False)
    new_router(make_model()).save_pretrained(tmp_path / "r")
    newer = new_router(make_model(), seed=1)
    newer.save_pretrained(tmp_path / "r", overwrite=True)
    loaded = TideRouter.from_pretrained(tmp_path / "r")
    torch.testing.assert_close(loaded.routers["4"].fc1.weight, newer.routers["4"].fc1.weight)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r"]


def test_the_newest_leftover_is_named_whatever_the_spelling_of_the_path(tmp_path: Path, monkeypatch) -> None:
    """`sub/r` (read as a Hub id) went to the Hub for ~25 s instead of naming the leftover; with two leftovers the
    one named was picked by the random folder suffix, not the newest."""
    (tmp_path / "sub").mkdir()
    for seed, suffix in ((0, "zz"), (1, "aa")):  # the newer one sorts first by name
        new_router(make_model(), seed=seed).save_pretrained(tmp_path / "sub" / f".r.old-{suffix}" / "router")
        os.utime(tmp_path / "sub" / f".r.old-{suffix}" / "router", (seed + 1, seed + 1))
    monkeypatch.chdir(tmp_path)
    for name in ("sub/r", "./sub/r", tmp_path / "sub" / "r"):
        with pytest.raises(TideMissingRouterError, match=r"replaced at .*\.r\.old-aa/router"):
            TideRouter.from_pretrained(name)


@pytest.mark.parametrize("swap", [True, False])
@pytest.mark.parametrize("intruder", ["model", "router"])
@pytest.mark.parametrize("overwrite", [True, False])
def test_a_target_another_process_fills_during_the_write(tmp_path: Path, monkeypatch, swap: bool, intruder: str,
                                                          overwrite: bool) -> None:
    """What the save replaces is checked again at the move: a model folder put there during the write was swapped
    out and deleted; a router another save put at a missing target made a raw ENOTEMPTY."""
    if not swap:
        monkeypatch.setattr(files, "exchange", lambda a, b: False)
    model = make_model()
    other, newer = new_router(model, seed=2), new_router(model, seed=1)
    target = tmp_path / "r"

    def write(folder: str) -> None:  # another process saves at the target while this save writes
        (model if intruder == "model" else other).save_pretrained(target)
        newer.save_pretrained(folder)

    if intruder == "router" and overwrite:  # replaced, as if it had been there at the start
        files.atomic_save(target, write, overwrite=True)
        loaded = TideRouter.from_pretrained(target)
        torch.testing.assert_close(loaded.routers["4"].fc1.weight, newer.routers["4"].fc1.weight)
    else:  # refused, the other process's folder left as it wrote it
        with pytest.raises(TideRouterFileError, match="not a TIDE router|already holds a TIDE router"):
            files.atomic_save(target, write, overwrite=overwrite)
        if intruder == "model":
            assert (target / "generation_config.json").exists()
        else:
            kept = TideRouter.from_pretrained(target)
            torch.testing.assert_close(kept.routers["4"].fc1.weight, other.routers["4"].fc1.weight)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r"]


def test_a_home_folder_path_is_saved_where_it_is_loaded_from(tmp_path: Path, monkeypatch) -> None:
    """`save_pretrained("~/r")` made a folder literally named `~` in the working directory, while loading read
    `~/r` in the home folder."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    new_router(make_model()).save_pretrained("~/r")
    assert (tmp_path / "home" / "r" / "config.json").exists() and not (tmp_path / "~").exists()
    assert TideRouter.from_pretrained("~/r")


def test_an_empty_mount_point_is_written_into_and_left_empty_by_a_failed_write(tmp_path: Path, monkeypatch) -> None:
    """A mount point (a container's volume) cannot be moved or swapped: renameat2 said EBUSY."""
    volume = tmp_path / "volume"
    volume.mkdir()
    monkeypatch.setattr(files.os.path, "ismount", lambda p: Path(p) == volume)
    router = new_router(make_model())

    def failing(folder: str) -> None:
        (Path(folder) / "config.json").write_text("{}")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        files.atomic_save(volume, failing, overwrite=False)
    assert not any(volume.iterdir())
    router.save_pretrained(volume)
    assert TideRouter.from_pretrained(volume)
    with pytest.raises(TideRouterFileError, match="is a mount point holding files"):
        router.save_pretrained(volume, overwrite=True)


@pytest.mark.parametrize("vanishes_at", ["listing", "config"])
def test_a_target_moved_away_during_the_check_counts_as_missing(tmp_path: Path, monkeypatch, vanishes_at: str
                                                                ) -> None:
    """Where the system has no one-step swap, another save moves the old router aside for a moment: a check that
    met it half-way was a raw FileNotFoundError (or called the vanished folder 'not a TIDE router')."""
    target = tmp_path / "r"
    new_router(make_model()).save_pretrained(target)
    original = Path.iterdir if vanishes_at == "listing" else Path.read_text

    def vanish_then(self: Path, *args, **kwargs):
        if target.exists() and (self == target or self.parent == target):
            os.replace(target, tmp_path / "aside")  # the other save's first move
        return original(self, *args, **kwargs)

    monkeypatch.setattr(Path, "iterdir" if vanishes_at == "listing" else "read_text", vanish_then)
    files.check_save_target(target, overwrite=False)  # allowed, as for a missing folder
    assert not target.exists() and (tmp_path / "aside" / "config.json").exists()


def test_a_path_to_a_file_is_refused_and_never_loaded(tmp_path: Path) -> None:
    """A file's path went to transformers, which torch.load-ed it (an unpickle: a torch.save-d state dict loaded;
    config.json was a raw UnpicklingError)."""
    router = new_router(make_model())
    router.save_pretrained(tmp_path / "r")
    torch.save(router.state_dict(), tmp_path / "weights.bin")
    for path, config in ((tmp_path / "r" / "config.json", None), (tmp_path / "weights.bin", router.config),
                         (str(tmp_path / "r" / "model.safetensors"), router.config)):
        with pytest.raises(TideRouterFileError, match="is a file, not a TIDE router folder"):
            TideRouter.from_pretrained(path, config=config)


def test_a_save_refuses_what_it_could_not_load_back(tmp_path: Path) -> None:
    """A config edited after loading (or a partial state_dict=) was saved, then refused by from_pretrained;
    variant= wrote model.fp16.safetensors, which no load read; overwrite="no" (truthy) replaced a router."""
    router = new_router(make_model())
    router.save_pretrained(tmp_path / "r")
    before = sorted(p.name for p in tmp_path.iterdir())
    edited = TideRouter.from_pretrained(tmp_path / "r")
    edited.config.hidden_size = 7
    partial = {k: v for k, v in router.state_dict().items() if not k.startswith("routers.8")}
    cases = [(lambda: edited.save_pretrained(tmp_path / "a"), TideRouterFileError,
              r"do not agree .*another shape \['routers.4.fc1.weight'"),
             (lambda: router.save_pretrained(tmp_path / "b", state_dict=partial), TideRouterFileError,
              r"missing tensors \['routers.8.fc1.bias'"),
             (lambda: router.save_pretrained(tmp_path / "c", variant="fp16"), TideRouterFileError, "variant="),
             (lambda: router.save_pretrained(tmp_path / "r", overwrite="no"), TypeError, "overwrite must be True"),
             (lambda: router.save_pretrained(tmp_path / "d", push_to_hub="no"), TypeError, "push_to_hub must be")]
    for save, error, message in cases:
        with pytest.raises(error, match=message):
            save()
    assert sorted(p.name for p in tmp_path.iterdir()) == before
    with pytest.raises(TideRouterFileError, match="variant="):
        TideRouter.from_pretrained(tmp_path / "r", variant="fp16")


def test_attach_names_a_config_edited_after_loading(tmp_path: Path) -> None:
    """checkpoint_layers edited after loading was a raw KeyError mid-attach, exit_paths set to nonsense a raw
    TypeError; a module without a config (no transformers model) an AttributeError in check_compatible."""
    from tide_hf.errors import TideArgumentError, TideArgumentTypeError, TideCompatibilityError

    model = make_model()
    for field, value, error, message in (
            ("checkpoint_layers", [4, 8, 20], TideArgumentError, r"checkpoint_layers \[20\] out of range"),
            ("checkpoint_layers", [4], TideRouterFileError, r"extra tensors \['routers.8.fc1.bias'"),
            ("exit_paths", {"agreement": 3}, TideArgumentTypeError, r"exit_paths\['agreement'\] must be a dict")):
        router = new_router(model)
        setattr(router.config, field, value)
        with pytest.raises(error, match=message):
            tide_hf.attach(model, router, mode="select")
        assert tide_hf.get_handle(model) is None
    with pytest.raises(TideCompatibilityError, match="Linear has no config"):
        new_router(model).check_compatible(torch.nn.Linear(2, 2))


@pytest.mark.parametrize("loader", ["AutoConfig", "TideRouterConfig"])
def test_config_loaders_check_their_keywords_like_the_files_keys(tmp_path: Path, loader: str) -> None:
    """Keywords were set after the config's checks (exit_threshold=5 kept) or dropped when no attribute
    (exit_treshold=0.3 left the field at its default), unlike TideRouter.from_pretrained's."""
    from tide_hf.errors import TideArgumentError

    new_router(make_model()).save_pretrained(tmp_path / "r")
    load = AutoConfig.from_pretrained if loader == "AutoConfig" else TideRouterConfig.from_pretrained
    for kwargs, error, message in ((dict(exit_threshold=5), TideArgumentError, "exit_threshold must be"),
                                   (dict(min_agreement=-3), TideArgumentError, "min_agreement must be"),
                                   (dict(exit_treshold=0.3), TideRouterFileError, "did you mean 'exit_threshold'")):
        with pytest.raises(error, match=message):
            load(tmp_path / "r", **kwargs)
    assert load(tmp_path / "r", exit_threshold=0.3).exit_threshold == 0.3


def test_provenance_and_results_are_a_section_of_config_json(tmp_path: Path) -> None:
    """Hyper-parameters stay at config.json's top level; provenance and results (they mixed with them) move to
    its "calibration" section. Every loader gives every field back: TideRouter, TideRouterConfig and AutoConfig
    (which reads config.json without TideRouterConfig's own loader)."""
    router = new_router(make_model(), metrics={"4": {"auc": 0.7}}, calibration_seconds={"forward": 1.5},
                        dataset="sotu", num_samples=8, seq_len=64, draft_vocab_coverage={"256": 0.8})
    router.save_pretrained(tmp_path / "r")
    written = json.loads((tmp_path / "r" / "config.json").read_text())
    record = written["calibration"]
    assert record["results"]["metrics"] == {"4": {"auc": 0.7}}
    assert record["results"]["calibration_seconds"] == {"forward": 1.5}
    assert record["provenance"]["base_fingerprint"] == router.config.base_fingerprint
    assert (record["provenance"]["dataset"], record["provenance"]["num_samples"]) == ("sotu", 8)
    moved = {"metrics", "exit_paths", "draft_vocab_coverage", "calibration_seconds", "base_fingerprint",
             "base_architecture", "dataset", "num_samples", "seq_len"}
    assert not moved & set(written)
    assert written["label"] == "top1" and written["checkpoint_layers"] == router.config.checkpoint_layers
    loaded = [TideRouter.from_pretrained(tmp_path / "r").config, TideRouterConfig.from_pretrained(tmp_path / "r"),
              AutoConfig.from_pretrained(tmp_path / "r")]
    loaded.append(TideRouterConfig.from_dict(router.config.to_dict()))
    for config in loaded:
        assert isinstance(config, TideRouterConfig) and not hasattr(config, "calibration")
        for name in TideRouterConfig.field_names():
            assert getattr(config, name) == getattr(router.config, name), name
    with pytest.raises(TideArgumentError, match="build it with TideRouterConfig.from_dict"):
        TideRouterConfig(**router.config.to_dict())  # the section's fields would have kept their defaults


@pytest.mark.parametrize("edit,message", [
    (lambda c: c.update(calibration=[1]), "must be an object with the sections"),
    (lambda c: c["calibration"].update(extra={}), "must be an object with the sections"),
    (lambda c: c["calibration"]["results"].update(metrix={}), r"\['metrix'\], not among its fields"),
    (lambda c: c.update(metrics={}), r"both hold \['metrics'\]"),
    (lambda c: c["calibration"].update(results=[]), r"\['results'\] must be an object"),
])
def test_a_damaged_calibration_section_is_named(tmp_path: Path, edit, message: str) -> None:
    """A misspelled result in the section would load as an empty one (a router without its exit paths serves
    its global threshold); a field in two places would load one of them silently."""
    new_router(make_model(), metrics={"4": {"auc": 0.7}}).save_pretrained(tmp_path / "r")
    path = tmp_path / "r" / "config.json"
    config = json.loads(path.read_text())
    edit(config)
    path.write_text(json.dumps(config))
    for load in (TideRouter.from_pretrained, TideRouterConfig.from_pretrained, AutoConfig.from_pretrained):
        with pytest.raises(TideRouterFileError, match=message):
            load(tmp_path / "r")


def test_auto_classes_load_a_router_folder_after_import_tide_hf(tmp_path: Path) -> None:
    """`from transformers import AutoModel; import tide_hf; AutoModel.from_pretrained(folder)` gives the router, its
    weights as saved (a fresh process: this one imported `TideRouter` long ago, which registers it too)."""
    router = new_router(make_model())
    router.save_pretrained(tmp_path / "r")
    script = (f"from transformers import AutoConfig, AutoModel\nimport tide_hf\n"
              f"from safetensors.torch import save_file\n"
              f"config = AutoConfig.from_pretrained({str(tmp_path / 'r')!r})\n"
              f"model = AutoModel.from_pretrained({str(tmp_path / 'r')!r})\n"
              f"save_file({{k: v.contiguous() for k, v in model.state_dict().items()}}, {str(tmp_path / 'w.st')!r})\n"
              f"print(type(config).__name__, type(model).__name__)")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["TideRouterConfig", "TideRouter"]
    loaded = load_file(tmp_path / "w.st")
    assert loaded.keys() == router.state_dict().keys()
    assert all(torch.equal(loaded[k], v) for k, v in router.state_dict().items())


# -- refusals and odd but valid input ---------------------------------------------------------------------------
@pytest.mark.parametrize("paths,message", [
    ("abc", "exit_paths must be a dict"),
    ({"speed": CLOSED_PATH}, "kinds must be among"),
    ({"agreement": {**CLOSED_PATH, "thresholds": [[1.0], [0.5]]}}, "one value per checkpoint"),
    ({"agreement": {**CLOSED_PATH, "thresholds": [[0.9, 1.0], [0.5, 1.0]]}}, "first threshold vector must close"),
    ({"agreement": {**CLOSED_PATH, "errors": [0]}}, r"\['errors'\] must be a list with one entry"),
    ({"agreement": {**CLOSED_PATH, "errors": [0, 200]}}, "200 errors out of n=100"),
    ({"agreement": {**CLOSED_PATH, "n": -5}}, r"\['n'\] must be >= 0"),
    ({"agreement": {k: v for k, v in CLOSED_PATH.items() if k != "nll_sum"}}, r"lacks \['nll_sum'\]"),
    ({"agreement": {**CLOSED_PATH, "thresholds": [[1.0, 1.0], [1.5, 1.0]]}}, "threshold must be a finite number"),
])
def test_a_hand_edited_exit_path_is_refused_at_load(tmp_path: Path, paths, message) -> None:
    model = make_model()
    router = new_router(model, exit_paths={"agreement": CLOSED_PATH})
    router.save_pretrained(tmp_path / "r")
    saved = json.loads((tmp_path / "r" / "config.json").read_text())
    saved["calibration"]["results"]["exit_paths"] = paths  # where config.json keeps the results
    (tmp_path / "r" / "config.json").write_text(json.dumps(saved))
    with pytest.raises(TideError, match=message):
        TideRouter.from_pretrained(tmp_path / "r")



def test_numpy_numbers_and_paths_are_stored_as_plain_values(tmp_path: Path) -> None:
    """What a script computes (numpy ints and floats, a pathlib dataset) saves as JSON and reloads equal."""
    cfg = router_config(seq_len=np.int64(32), learning_rate=np.float32(0.5), seed=np.int64(3),
                 dataset=tmp_path / "texts", checkpoint_layers=[np.int64(4), np.int64(8)])
    assert type(cfg.seq_len) is int and type(cfg.learning_rate) is float and type(cfg.seed) is int
    assert cfg.dataset == str(tmp_path / "texts") and all(type(k) is int for k in cfg.checkpoint_layers)
    TideRouter(cfg).save_pretrained(tmp_path / "r")
    loaded = TideRouter.from_pretrained(tmp_path / "r").config
    assert (loaded.seq_len, loaded.learning_rate, loaded.seed) == (32, 0.5, 3)
    with pytest.raises(TideArgumentError, match="seed must be in"):
        router_config(seed=2**70)
    with pytest.raises(TideArgumentTypeError, match="dataset must be a string"):
        router_config(dataset=3)



def test_load_time_keywords_are_checked_like_the_file(tmp_path: Path) -> None:
    new_router(make_model()).save_pretrained(tmp_path / "r")
    for bad, message in ((dict(exit_threshold=math.nan), "exit_threshold"), (dict(min_layers=100), "min_layers"),
                         (dict(label="bogus"), "label")):
        with pytest.raises(TideArgumentError, match=message):
            TideRouter.from_pretrained(tmp_path / "r", **bad)
    loaded = TideRouter.from_pretrained(tmp_path / "r", exit_threshold=np.float32(0.5), seed=np.int64(3),
                                        dataset=tmp_path / "texts")  # crashed inside transformers' config repr
    cfg = loaded.config
    assert (cfg.exit_threshold, cfg.seed, cfg.dataset) == (0.5, 3, str(tmp_path / "texts"))
    assert type(loaded.config.exit_threshold) is float and type(loaded.config.seed) is int



def test_unreadable_weights_and_negative_draft_ids_are_router_file_errors(tmp_path: Path) -> None:
    model = make_model()
    router = new_router(model)
    router.set_draft_vocab(torch.arange(256), {"256": 1.0})
    router.save_pretrained(tmp_path / "r")
    weights = tmp_path / "r" / "model.safetensors"
    data = weights.read_bytes()
    from safetensors.torch import load_file, save_file

    tensors = load_file(weights)
    tensors["draft_vocab"][3] = -7
    save_file(tensors, weights, metadata={"format": "pt"})
    with pytest.raises(TideRouterFileError, match="negative token ids"):
        TideRouter.from_pretrained(tmp_path / "r")
    weights.write_bytes(data[: len(data) // 2])
    with pytest.raises(TideRouterFileError, match="weights file cannot be read"):
        TideRouter.from_pretrained(tmp_path / "r")



def test_saving_through_a_link_replaces_the_linked_router_with_the_umask_permissions(tmp_path: Path) -> None:
    model = make_model()
    new_router(model, seed=0).save_pretrained(tmp_path / "real")
    (tmp_path / "link").symlink_to(tmp_path / "real")
    newer = new_router(model, seed=1)
    old_umask = os.umask(0o022)
    try:
        newer.save_pretrained(tmp_path / "link", overwrite=True)
    finally:
        os.umask(old_umask)
    assert (tmp_path / "link").is_symlink()
    loaded = TideRouter.from_pretrained(tmp_path / "real")
    torch.testing.assert_close(loaded.routers["4"].fc1.weight, newer.routers["4"].fc1.weight)
    assert stat.S_IMODE((tmp_path / "real").stat().st_mode) == 0o755



def test_model_card_shows_the_default_target_and_keeps_local_paths_out_of_metadata(tmp_path: Path) -> None:
    model = make_model()
    router = new_router(model, exit_paths={"agreement": CLOSED_PATH}, base_model_name_or_path=str(tmp_path),
                        dataset=str(tmp_path / "texts"))
    card = router.model_card()
    assert card.data.base_model is None and not card.data.datasets
    assert "tide_hf.attach(model, router)  # top-1 agreement >= 0.95" in card.text
    assert "exit_threshold" not in card.text.split("```")[1]
    hub = new_router(model, base_model_name_or_path="org/base", dataset="org/texts").model_card()
    assert hub.data.base_model == "org/base" and hub.data.datasets == ["org/texts"]
    assert "attach(model, router, exit_threshold=0.85)" in hub.text  # no exit paths: the global threshold



def test_held_out_fractions_that_leave_no_training_samples_are_refused_naming_both() -> None:
    with pytest.raises(TideArgumentError, match=r"validation_fraction \(0.95\) \+ threshold_fraction \(0.1\)"):
        router_config(validation_fraction=0.95)



def test_missing_or_wrong_folders_are_named(tmp_path: Path) -> None:
    from tide_hf.assets import load_model

    with pytest.raises(FileNotFoundError, match="model folder not found"):
        load_model(str(tmp_path / "nowhere"))
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "a.txt").write_text("x")
    with pytest.raises(TideCompatibilityError, match="cannot be loaded as a causal LM"):
        load_model(str(tmp_path / "notes"))
    with pytest.raises(TideRouterFileError, match="no TIDE router folder at"):
        TideRouter.from_pretrained(tmp_path / "no-router")



def test_the_working_directory_is_never_replaced(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    router = new_router(make_model())
    for target in (".", "..", str(work)):
        with pytest.raises(TideRouterFileError, match="working directory"):
            router.save_pretrained(target)
    router.save_pretrained("inside")  # a folder in it is fine
    assert (work / "inside" / "config.json").is_file() and Path.cwd() == work



def test_numbers_nested_in_tables_are_stored_as_plain_values(tmp_path: Path) -> None:
    path = {**CLOSED_PATH, "thresholds": [[1.0, 1.0], [np.float32(0.5), 1.0]], "errors": [0, np.int64(2)],
            "n": np.int64(100)}
    cfg = router_config(exit_paths={"agreement": path}, metrics={"4": {"auc": np.float64(0.8)}},
                 seed=2**64 - 1)
    json.loads(cfg.to_json_string())  # would raise on a numpy number
    assert type(cfg.exit_paths["agreement"]["n"]) is int and type(cfg.metrics["4"]["auc"]) is float



def test_misspelled_fields_are_refused_not_left_at_their_defaults(tmp_path: Path) -> None:
    """transformers keeps unknown config keys: a hand-edited `exit_treshold` loaded with the default threshold
    and no word. A key close to a field is now refused, naming the field; other unknown keys stay allowed."""
    new_router(make_model()).save_pretrained(tmp_path / "r")
    path = tmp_path / "r" / "config.json"
    good = json.loads(path.read_text())
    path.write_text(json.dumps({**good, "exit_treshold": 0.5}))
    with pytest.raises(TideRouterFileError, match="'exit_treshold' is not a TIDE router field; did you mean "
                                                  "'exit_threshold'"):
        TideRouter.from_pretrained(tmp_path / "r")
    path.write_text(json.dumps({**good, "my_notes": "calibrated on Tuesday"}))
    assert TideRouter.from_pretrained(tmp_path / "r").config.my_notes == "calibrated on Tuesday"
    with pytest.raises(TideRouterFileError, match="from_pretrained: 'min_layer' is not a TIDE router field"):
        TideRouter.from_pretrained(tmp_path / "r", min_layer=8)
    with pytest.raises(TideRouterFileError, match="TideRouterConfig: 'exit_treshold' is not a TIDE router field"):
        TideRouter(router_config(exit_treshold=0.5))  # was built and saved, then refused at load
