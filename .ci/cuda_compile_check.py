"""Compile, link and load the CUDA kernels of `cuda/` on a machine without a GPU (a build check, not a test).

`tide_hf` builds `cuda/` at first use on a GPU. Without one, `torch.cuda.is_available()` is False and the
build never starts, so a CUDA syntax or link error would only show on a lent GPU. This script runs the same
`torch.utils.cpp_extension.load` (same sources, same flags) for the given architectures with a CUDA build of
torch and an `nvcc` on PATH, then imports the module and lists its ops. Headers and libraries that a bare
toolkit lacks (cuSPARSE / cuBLAS headers, an unversioned libcudart.so) are taken from the `nvidia-*` wheels
that the CUDA build of torch installs.

    .venv-floors/bin/python .ci/cuda_compile_check.py          # torch 2.11+cu130 from .ci/floors, ~2.5 min
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import torch
from torch.utils import cpp_extension

from tide_hf.kernels.build import EXTENSIONS, KERNEL_DIR, OPT_FLAGS


def nvidia_wheel_dirs() -> tuple[list[str], list[str]]:
    """Include and library folders of the `nvidia` wheels next to torch (empty where there are none)."""
    root = Path(torch.__file__).parent.parent / "nvidia"
    includes = sorted(str(p) for p in root.glob("*/include") if p.is_dir())
    libs = sorted(str(p) for p in root.glob("*/lib") if p.is_dir())
    return includes, libs


def unversioned_cudart(libs: list[str], folder: Path) -> list[str]:
    """-L flags for libcudart.so: the linker wants the unversioned name, the wheels ship libcudart.so.N."""
    for lib in libs:
        for found in sorted(Path(lib).glob("libcudart.so.*")):
            (folder / "libcudart.so").symlink_to(found)
            return [f"-L{folder}"]
    return []


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", default="8.0;9.0", help="TORCH_CUDA_ARCH_LIST (Ampere and Hopper)")
    parser.add_argument("--build-dir", default=None, help="build folder (default: a temporary one)")
    args = parser.parse_args()
    if torch.version.cuda is None:
        raise SystemExit(f"torch {torch.__version__} is a CPU build: run this with a CUDA build of torch "
                         "(e.g. the .ci/floors venv)")
    os.environ["TORCH_CUDA_ARCH_LIST"] = args.arch
    includes, libs = nvidia_wheel_dirs()
    name, sources = EXTENSIONS["cuda"]
    with tempfile.TemporaryDirectory() as tmp:
        build = Path(args.build_dir or tmp)
        build.mkdir(parents=True, exist_ok=True)
        links = Path(tmp) / "links"
        links.mkdir()
        started = time.perf_counter()
        module = cpp_extension.load(
            name=f"{name}_check", sources=[str(KERNEL_DIR / s) for s in sources], extra_cflags=OPT_FLAGS,
            extra_cuda_cflags=OPT_FLAGS, extra_include_paths=includes,
            extra_ldflags=unversioned_cudart(libs, links) + [f"-L{lib}" for lib in libs],
            build_directory=str(build), verbose=False)
        ops = sorted(n for n in dir(module) if not n.startswith("_"))
        print(f"built for {args.arch} with torch {torch.__version__} (CUDA {torch.version.cuda}) in "
              f"{time.perf_counter() - started:.0f} s; loaded {module.__file__}: {ops}")


if __name__ == "__main__":
    main()
