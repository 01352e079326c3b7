"""Building the compiled kernels: sources in the repository's `cuda/` folder, compiled on first use with
`torch.utils.cpp_extension.load` into torch's extension cache (a second process reuses the build).

CPU tensors use the C++ extension, CUDA tensors the CUDA one. Without a compiler or device, after a failed
build, or with `TIDE_HF_NO_KERNELS=1`, `extension()` returns None and the PyTorch reference runs instead.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import sys
import threading
import warnings
from pathlib import Path
from types import ModuleType

import torch

from ..errors import TideArgumentError

logger = logging.getLogger(__name__)


def _find_kernel_dir() -> Path:
    """Kernel sources: shipped in a wheel as tide_hf/_kernel_src, in a checkout (editable install) as cuda/."""
    package = Path(__file__).resolve().parent.parent
    shipped = package / "_kernel_src"
    return shipped if shipped.is_dir() else package.parent / "cuda"


ENV_NO_KERNELS = "TIDE_HF_NO_KERNELS"  # "1" forces the PyTorch path
ENV_TRUE, ENV_FALSE = ("1", "true", "yes", "on"), ("", "0", "false", "no", "off")  # its values (any case)
KERNEL_DIR = _find_kernel_dir()
EXTENSIONS = {  # flavour -> (torch extension name, sources in KERNEL_DIR)
    "cpu": ("tide_hf_cpu", ("tide_cpu.cpp",)),
    "cuda": ("tide_hf_cuda", ("tide_cuda.cpp", "tide_cuda_kernels.cu")),
}
BUILD_SECONDS = {"cpu": 45, "cuda": 120}  # a first build's rough time on a 2-core machine
STALE_LOCK_FACTOR = 10  # a build idle for this many first builds' time is dead (a killed build left its lock)
LOCK_POLL_SECONDS = 0.5  # how often a process waiting for another's build looks at the lock
OPT_FLAGS = ["/O2"] if os.name == "nt" else ["-O3"]

_build_lock = threading.Lock()
_extensions: dict[str, ModuleType | None] = {}
_build_errors: dict[str, str] = {}


def flavour_of(device: torch.device | str) -> str | None:
    kind = torch.device(device).type
    return kind if kind in EXTENSIONS else None


def _toolchain_missing(flavour: str) -> str | None:
    """Why the extension for `flavour` cannot be built here, or None when it can."""
    from torch.utils import cpp_extension

    if not cpp_extension.is_ninja_available():
        return "ninja is not installed (pip install ninja)"
    compiler = os.environ.get("CXX", "cl" if os.name == "nt" else "c++")
    if shutil.which(compiler) is None:
        return f"no C++ compiler ({compiler!r} is not on PATH)"
    if flavour == "cuda":
        if not torch.cuda.is_available():
            return "no CUDA device"
        if cpp_extension.CUDA_HOME is None or not (Path(cpp_extension.CUDA_HOME) / "bin" / "nvcc").exists():
            return "nvcc not found (set CUDA_HOME)"
    if not all((KERNEL_DIR / src).is_file() for src in EXTENSIONS[flavour][1]):
        return f"kernel sources missing from {KERNEL_DIR}"
    return None


def sources_digest(sources: tuple[str, ...]) -> str:
    """A short hash of the kernel sources and their folder: part of the extension's name, so two checkouts
    (another version, a CI clone) build side by side in torch's cache instead of rebuilding over each other in
    turn (ninja rebuilds when a source's path changes, even with the same contents)."""
    digest = hashlib.sha256(str(KERNEL_DIR).encode())
    for src in sources:
        digest.update((KERNEL_DIR / src).read_bytes())
    return digest.hexdigest()[:12]


def _already_built(name: str, sources: tuple[str, ...]) -> bool:
    """Whether torch's extension cache holds `name` built from these very sources (then loading takes a second)."""
    from torch.utils.cpp_extension import _get_build_directory

    try:
        folder = Path(_get_build_directory(name, verbose=False))
        built = [p.stat().st_mtime for p in (*folder.glob(f"{name}*.so"), *folder.glob(f"{name}*.pyd"))]
        same_sources = all(str(KERNEL_DIR / src) in (folder / "build.ninja").read_text() for src in sources)
        return bool(built) and same_sources and max(built) >= max((KERNEL_DIR / src).stat().st_mtime
                                                                   for src in sources)
    except Exception:  # a private torch helper: if it changes, just say that a build may happen
        return False


def _wait_for_other_build(name: str, flavour: str) -> None:
    """Wait while another process builds (torch's build lock exists), but not for a lock a killed build left:
    torch would wait for that one forever. A build is taken for dead when this process has seen nothing in its
    folder change for STALE_LOCK_FACTOR first builds, or for one first build when the files' own times say
    they are that old already (a lock left long ago goes quickly; a folder whose clock runs behind, not)."""
    import time

    from torch.utils.cpp_extension import _get_build_directory

    folder = Path(_get_build_directory(name, verbose=False))
    lock, limit = folder / "lock", STALE_LOCK_FACTOR * BUILD_SECONDS[flavour]
    seen, since = None, time.monotonic()
    while lock.exists():
        try:
            newest = max(p.stat().st_mtime for p in folder.rglob("*"))
        except (OSError, ValueError):  # a file went away while looking: the build is alive
            newest = time.time()
        if newest != seen:
            seen, since = newest, time.monotonic()
        watched, idle = time.monotonic() - since, time.time() - newest
        if watched > limit or (idle > limit and watched > BUILD_SECONDS[flavour]):
            logger.warning("tide_hf: removing %s: the %s kernel build that left it has done nothing for %.0f s",
                           lock, flavour, max(idle, watched))
            lock.unlink(missing_ok=True)
            return
        time.sleep(LOCK_POLL_SECONDS)


def _build(flavour: str) -> ModuleType:
    from torch.utils.cpp_extension import load

    name, sources = EXTENSIONS[flavour]
    name = f"{name}_{sources_digest(sources)}"
    _wait_for_other_build(name, flavour)
    if not _already_built(name, sources):  # one line, so a first build (~45 s on 2 cores) does not look like a hang
        print(f"tide_hf: compiling the {flavour.upper()} kernels (first use, ~{BUILD_SECONDS[flavour]} s)...",
              file=sys.stderr, flush=True)
    with warnings.catch_warnings(record=True) as caught:  # keep the build quiet; details at DEBUG level
        warnings.simplefilter("always")
        module = load(
            name=name,
            sources=[str(KERNEL_DIR / src) for src in sources],
            extra_cflags=OPT_FLAGS,
            extra_cuda_cflags=OPT_FLAGS if flavour == "cuda" else None,
            verbose=False,
        )
    for warning in caught:
        logger.debug("building %s: %s", name, warning.message)
    return module


def kernels_disabled() -> bool:
    """Whether `TIDE_HF_NO_KERNELS` asks for the PyTorch path; a value that is neither yes nor no is refused
    (`TIDE_HF_NO_KERNELS=false` turned the kernels off)."""
    value = os.environ.get(ENV_NO_KERNELS, "").strip().lower()
    if value not in ENV_TRUE + ENV_FALSE:
        raise TideArgumentError(f"{ENV_NO_KERNELS}={os.environ[ENV_NO_KERNELS]!r}: use 1 (PyTorch path) or 0 "
                                f"(kernels); it takes {', '.join(v for v in ENV_TRUE + ENV_FALSE if v)}")
    return value in ENV_TRUE


def extension(flavour: str | None) -> ModuleType | None:
    """The compiled extension for `flavour`, building it once per process (thread-safe); None -> PyTorch."""
    if flavour is None or kernels_disabled():
        return None
    if flavour in _extensions:
        return _extensions[flavour]
    with _build_lock:
        if flavour not in _extensions:
            reason = _toolchain_missing(flavour)
            module = None
            if reason is None:
                try:
                    module = _build(flavour)
                except Exception as err:  # any build failure means: use PyTorch
                    logger.debug("building the %s kernels failed", flavour, exc_info=True)
                    lines = [line.strip() for line in str(err).splitlines() if line.strip()] or [type(err).__name__]
                    reason = "build failed: " + next((line for line in lines if "error:" in line), lines[0])
            if reason is not None:
                _build_errors[flavour] = reason
                logger.warning("tide_hf: %s kernels unavailable (%s); using PyTorch", flavour, reason)
            _extensions[flavour] = module
    return _extensions[flavour]


def active_backend(device: torch.device | str) -> str:
    """Which implementation runs for `device`: "cpp", "cuda" or "pytorch" (see kernel_build_error); builds the
    compiled kernels on first call."""
    flavour = flavour_of(device)
    return ("cpp" if flavour == "cpu" else "cuda") if extension(flavour) is not None else "pytorch"


def build_in_background(device: torch.device | str) -> threading.Thread:
    """Start building `device`'s kernels in a daemon thread and return it. The compiler runs while the caller
    works (the demo calibrates meanwhile); the first use of a kernel waits for the build, or finds it done."""
    thread = threading.Thread(target=extension, args=(flavour_of(device),), name="tide_hf kernel build", daemon=True)
    thread.start()
    return thread


def kernel_build_error(device: torch.device | str) -> str | None:
    """Why `device` has no compiled kernels (no compiler, no device, build error), if it was tried."""
    return _build_errors.get(flavour_of(device) or "")

