"""Router folders on disk: what a save may replace (never a model), the atomic write, and the checks a load
makes so that a router never comes back partly random or without its config."""

from __future__ import annotations

import ctypes
import errno
import glob
import json
import os
import re
import shutil
import sys
import tempfile
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ..config import check_field_names
from ..errors import TideArgumentError, TideMissingRouterError, TideRouterFileError

ROUTER_MODEL_TYPE = "tide_router"
# The weights `TideRouter.save_pretrained` writes: one file, or shards and their index.
WEIGHT_FILES = re.compile(r"model\.safetensors(\.index\.json)?|model-\d+-of-\d+\.safetensors")
# What `TideRouter.save_pretrained` writes, plus the Hub's .gitattributes.
ROUTER_FILES = re.compile(rf"config\.json|README\.md|\.gitattributes|{WEIGHT_FILES.pattern}")
CONFIG_FILE = "config.json"  # a model's and a router's folder hold one
SHOWN_FILES = 8  # a refused folder's files an error message lists
# Pickle files: never loaded (unpickling can run code); a folder holding these but no safetensors is named as such.
PICKLE_FILES = re.compile(r".*\.(bin|pt|pth|ckpt|pkl)")
# renameat2(2) on Linux: swap two paths in one step (linux/fs.h's RENAME_EXCHANGE; AT_FDCWD: relative to the cwd).
RENAME_EXCHANGE, AT_FDCWD = 2, -100
# renameat2's errors that mean "this system or filesystem cannot swap": the save falls back to two renames.
NO_EXCHANGE = (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP)
# What a move meets when another process moves the same folders meanwhile: a target made, or taken away.
MADE_MEANWHILE = (errno.ENOTEMPTY, errno.EEXIST)
RACED = (*MADE_MEANWHILE, errno.ENOENT)
HUB_KWARGS = ("cache_dir", "force_download", "local_files_only", "token", "revision", "subfolder", "proxies")


def is_router_folder(path: Path) -> bool:
    """`path` holds a saved TIDE router and nothing else."""
    try:
        config = json.loads((path / CONFIG_FILE).read_text())
    except (OSError, ValueError):
        return False
    names = [p.name for p in path.iterdir()]
    return config.get("model_type") == ROUTER_MODEL_TYPE and all(ROUTER_FILES.fullmatch(n) for n in names)


def check_save_target(path: Path, overwrite: bool) -> None:
    """Refuse (`TideRouterFileError`) to save into anything but a missing / empty folder, or, with
    `overwrite=True`, a folder that holds a TIDE router only: a model's folder is never touched."""
    cwd, resolved = Path.cwd().resolve(), Path(os.path.realpath(path))
    if resolved == cwd or resolved in cwd.parents:
        raise TideRouterFileError(f"cannot save a TIDE router to {path}: it is the working directory or holds it "
                                  "(a save replaces the folder); choose a folder inside it")
    if not path.exists():
        return
    if not path.is_dir():
        raise TideRouterFileError(f"cannot save a TIDE router to {path}: it exists and is not a folder")
    try:
        names = sorted(p.name for p in path.iterdir())
        router = bool(names) and is_router_folder(path)
    except FileNotFoundError:
        return
    if not names or not path.exists():  # moved away meanwhile (another save's two-move replace): as if missing
        return
    if not router:
        shown = ", ".join(names[:SHOWN_FILES]) + (", ..." if len(names) > SHOWN_FILES else "")
        raise TideRouterFileError(
            f"refusing to save a TIDE router into {path}: the folder holds files that are not a TIDE router "
            f"({shown}); choose an empty or new folder")
    if not overwrite:
        raise TideRouterFileError(f"{path} already holds a TIDE router; pass overwrite=True (CLI: --overwrite) "
                                  "to replace it")


def atomic_save(path: str | os.PathLike, write: Callable[[str], None], *, overwrite: bool) -> None:
    """Run `write(folder)` into a fresh folder next to `path`, then move it into place (`place`).

    A crash or an error while writing leaves `path` as it was (an old router stays whole); the checks of
    `check_save_target` come first, and are made again on what the move replaces (it may have changed during the
    write). A symbolic link is followed: the folder it points to is replaced. An empty mount point (a container's
    volume), which cannot be moved, is written into directly.
    """
    target = Path(os.path.realpath(os.path.expanduser(path)))  # a link: replace the folder, not the link
    check_save_target(target, overwrite)
    if target.is_dir() and os.path.ismount(target):
        write_into_mount_point(target, write)
        return
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = target.parent / f".{target.name}.tmp-{uuid.uuid4().hex}"
    staging.mkdir()  # not mkdtemp: the folder gets the umask's permissions, as a plain save would
    try:
        write(str(staging))
        place(staging, target, overwrite)
    finally:
        shutil.rmtree(staging, ignore_errors=True)  # what was written, or the old router swapped into it


def place(staging: Path, target: Path, overwrite: bool) -> None:
    """Move the written folder `staging` to `target`. An old router is swapped with it in one step where the
    system can (`exchange`), so even a kill leaves `target` holding one of the two; elsewhere it is moved aside
    first, and a kill between the two moves leaves it next to `target` (`leftover_routers` names it). What is
    replaced must still be what `check_save_target` allowed (another process may have saved there meanwhile):
    otherwise it is put back and the save refused."""
    if not target.exists():
        try:
            os.replace(staging, target)
            return
        except OSError as err:
            if err.errno not in MADE_MEANWHILE:
                raise  # else another save made `target` meanwhile: replace it as below, if allowed
    if exchange(staging, target):
        if not replaceable(staging, overwrite):
            exchange(staging, target)  # put it back
            refuse_changed(target, overwrite)
        return
    backup = Path(tempfile.mkdtemp(prefix=f".{target.name}.old-", dir=target.parent))
    old = backup / "router"
    try:
        os.replace(target, old)
        if not replaceable(old, overwrite):
            os.replace(old, target)
            refuse_changed(target, overwrite)
        os.replace(staging, target)
    except BaseException as err:
        if old.exists() and not target.exists():
            os.replace(old, target)  # put the old router back
        if isinstance(err, OSError) and err.errno in RACED:
            raise TideRouterFileError(f"another process was saving at {target} at the same time: this save was not "
                                      "made") from err
        raise
    finally:
        if target.exists() or not old.exists():  # else the old router is the only one left: it stays, named
            shutil.rmtree(backup, ignore_errors=True)


def refuse_changed(target: Path, overwrite: bool) -> None:
    """Refuse a save whose target changed during the write into something it may not replace (said as
    `check_save_target` says it, where it can)."""
    check_save_target(target, overwrite)
    raise TideRouterFileError(f"{target} changed during the save (another process wrote there); it is left as it is")


def replaceable(folder: Path, overwrite: bool) -> bool:
    """What a save may replace: an empty folder, or with `overwrite` a folder holding a TIDE router only."""
    return not any(folder.iterdir()) or (overwrite and is_router_folder(folder))


def write_into_mount_point(target: Path, write: Callable[[str], None]) -> None:
    """Write straight into an empty mount point (it cannot be swapped or moved); what a failed write left there is
    removed, so the folder stays empty."""
    if any(target.iterdir()):
        raise TideRouterFileError(f"{target} is a mount point holding files: a router there cannot be replaced "
                                  "safely; save into a new folder inside it")
    try:
        write(str(target))
    except BaseException:
        for child in target.iterdir():
            if child.is_dir() and not child.is_symlink():
                shutil.rmtree(child)
            else:
                child.unlink()
        raise


def exchange(a: Path, b: Path) -> bool:
    """Swap two existing folders in one atomic step (Linux `renameat2`); False where the system or the filesystem
    cannot, so the caller moves them one after the other."""
    if not sys.platform.startswith("linux"):
        return False
    renameat2 = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)  # glibc >= 2.28
    if renameat2 is None:
        return False
    if renameat2(AT_FDCWD, os.fsencode(a), AT_FDCWD, os.fsencode(b), RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in NO_EXCHANGE:
        return False
    raise OSError(err, os.strerror(err), str(b))


def leftover_routers(path: str | os.PathLike) -> list[Path]:
    """Old routers an interrupted two-move save left next to `path` (`place`'s fallback), the newest last."""
    target = Path(os.path.realpath(os.path.expanduser(path)))
    left = target.parent.glob(f".{glob.escape(target.name)}.old-*/router")
    return sorted(left, key=lambda folder: folder.stat().st_mtime)


def check_writable(path: Path, what: str, *, folder: bool) -> None:
    """`path` can be created (or replaced) as a folder (`folder=True`) or a file: refused before the work
    whose results go there, not after it."""
    if path.exists() and path.is_dir() != folder:
        found, wanted = ("a folder", "file") if path.is_dir() else ("a file", "folder")
        raise TideArgumentError(f"{what} {path} is {found}; give a {wanted} name")
    parent = Path(os.path.realpath(path)).parent  # a link: the save goes next to the folder it points to
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
        raise TideArgumentError(f"{what} {path} cannot be written: {parent} is not a writable folder")
    try:  # permissions say yes for root, but a file system may still refuse (read-only, /proc, a full disk)
        tempfile.TemporaryDirectory(prefix=".tide-write-check-", dir=parent).cleanup()
    except OSError as err:
        raise TideArgumentError(f"{what} {path} cannot be written: {parent} refuses new folders ({err.strerror})"
                                ) from None


def check_results_folder(path: Path, what: str, dataset: str | None = None) -> None:
    """`path` can take a command's results (`check_writable`) and is not a model's or a router's folder (one
    holding a config.json): the results would mix with their files, and a router folder holding them is no longer
    one a save with `overwrite=True` may replace (`is_router_folder`). Nor is it in the local text folder
    `dataset`, which is read recursively: its tables would be read back as text."""
    check_writable(path, what, folder=True)
    if (path / CONFIG_FILE).is_file():
        raise TideArgumentError(f"{what} {path} holds a model or a TIDE router ({CONFIG_FILE}); give the results "
                                "a folder of their own")
    if dataset is not None and os.path.isdir(os.path.expanduser(dataset)):
        text = Path(dataset).expanduser().resolve()
        if path.expanduser().resolve() == text or text in path.expanduser().resolve().parents:
            raise TideArgumentError(f"{what} {path} is inside the text folder {dataset}, which is read with every "
                                    "file under it: give the results a folder outside it")


def check_config_source(name: str | os.PathLike, config_cls: Any, kwargs: dict[str, Any]) -> None:
    """The router at `name` has a config.json of a TIDE router (a missing one would load defaults)."""
    text = os.fspath(name)
    written_as_path = not isinstance(name, str) or os.path.isabs(text) or text.startswith((".", "~"))  # a Path too
    missing = not os.path.isdir(os.path.expanduser(text))
    left = leftover_routers(text) if missing else []
    if left:  # whatever the spelling: `owner/name` too, where a local folder `owner` holds the leftover
        raise TideMissingRouterError(f"no TIDE router folder at {text}; an interrupted save left the router it "
                                     f"replaced at {left[-1]}: move it back to use it")
    if written_as_path and missing:
        raise TideMissingRouterError(f"no TIDE router folder at {text}")  # not the Hub's "repo id must be ..."
    if "/" not in text and missing:  # a mistyped folder: not a Hub id, whose retries take ~25 s
        raise TideMissingRouterError(f"no TIDE router folder named {text!r} here ({os.getcwd()}), and it is not "
                                     "a Hub repo id (those read 'owner/name')")
    hub = {k: kwargs[k] for k in HUB_KWARGS if k in kwargs}
    if hub.get("subfolder") and os.path.isdir(text) and not os.path.isdir(os.path.join(text, hub["subfolder"])):
        raise TideRouterFileError(f"no TIDE router folder at {text}: it has no subfolder {hub['subfolder']!r}")
    where = f"{name} (subfolder {hub['subfolder']!r})" if hub.get("subfolder") else name
    local = os.path.join(os.path.expanduser(text), hub.get("subfolder") or "", CONFIG_FILE)
    if os.path.isfile(local):  # transformers' own errors for these were an OSError or an AttributeError
        try:
            written = json.loads(Path(local).read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise TideRouterFileError(f"TIDE router {where}: config.json is not valid JSON ({err})") from None
        if not isinstance(written, dict):
            raise TideRouterFileError(f"TIDE router {where}: config.json holds a {type(written).__name__}, not an "
                                      "object of router fields")
    folder = os.path.join(os.path.expanduser(text), hub.get("subfolder") or "")
    check_local_weights(folder, where)
    config, _ = config_cls.get_config_dict(name, **hub)  # a missing repo / no network: transformers' OSError
    if not config:
        raise TideRouterFileError(f"{where} has no config.json: not a TIDE router (its weights alone do not say "
                                  "which model, checkpoints and threshold they belong to)")
    if config.get("model_type") != ROUTER_MODEL_TYPE:
        raise TideRouterFileError(f"{where} is not a TIDE router: its config.json has model_type "
                                  f"{config.get('model_type')!r}, not {ROUTER_MODEL_TYPE!r}")
    check_field_names(config, config_cls.field_names(), f"TIDE router {where}: config.json")
    for key in ("dtype", "torch_dtype"):
        if isinstance(config.get(key), str) and not isinstance(getattr(torch, config[key], None), torch.dtype):
            raise TideRouterFileError(f"TIDE router {where}: config.json's {key} {config[key]!r} is not a torch "
                                      "dtype (e.g. 'float32')")
    check_field_names(kwargs, config_cls.field_names(), "TideRouter.from_pretrained")


def refuse_variant(kwargs: dict[str, Any]) -> None:
    """A router folder holds one model.safetensors: `variant=` would save a file no load reads, or read none."""
    if kwargs.get("variant") is not None:
        raise TideRouterFileError("TideRouter folders hold one model.safetensors; variant= is not supported")


def check_local_weights(folder: str, where: object) -> None:
    """A local router folder holds safetensors weights: one holding only pickles is named as such (transformers
    would say "no file named model.safetensors", or a missing config would hide the cause). A Hub repo id is
    left to the download."""
    if not os.path.isdir(folder):
        return
    names = sorted(os.listdir(folder))
    if any(WEIGHT_FILES.fullmatch(n) for n in names):
        return
    pickles = [n for n in names if PICKLE_FILES.fullmatch(n)]
    if pickles:  # a missing file to transformers (OSError): TideMissingRouterError keeps that base
        raise TideMissingRouterError(
            f"TIDE router {where} has no model.safetensors, only pickle files ({', '.join(pickles[:SHOWN_FILES])}), "
            "which tide_hf never loads (unpickling can run code); save the router again with "
            "TideRouter.save_pretrained, which writes model.safetensors")
    if CONFIG_FILE in names:
        raise TideMissingRouterError(f"TIDE router {where} has a config.json but no weights (model.safetensors)")


def check_loading_info(name: str | os.PathLike, info: dict[str, Any]) -> None:
    """Every configured tensor was in the weights file, with its shape, and nothing else was."""
    problems = []
    if info.get("missing_keys"):
        problems.append(f"missing tensors {sorted(info['missing_keys'])} (their routers would be random)")
    if info.get("unexpected_keys"):
        problems.append(f"extra tensors {sorted(info['unexpected_keys'])}")
    if info.get("mismatched_keys"):
        problems.append(f"tensors of the wrong shape {sorted(str(m) for m in info['mismatched_keys'])}")
    if problems:
        raise TideRouterFileError(f"TIDE router {name}: config.json and the weights do not agree: "
                                  + "; ".join(problems))


def check_finite(name: str | os.PathLike, state: dict[str, Any]) -> None:
    """Every floating tensor of a loaded router is finite: a NaN exit head makes NaN logits for every exited
    token, a NaN router never fires, and neither says so at serving time."""
    bad = [f"{key} ({int((~torch.isfinite(t)).sum())} of {t.numel()} values)"
           for key, t in state.items() if t.is_floating_point() and not bool(torch.isfinite(t).all())]
    if bad:
        raise TideRouterFileError(f"TIDE router {name}: tensors hold NaN or inf values: {'; '.join(bad)}; the "
                                  "weights file is damaged or was trained into NaN (recalibrate)")
