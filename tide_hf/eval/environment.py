"""`tide-hf env`: what a bug report needs, read from this process: versions, devices, kernel backends, cache folders.

The GPU suite records the same versions beside its figures (`tide-hf bench gpu`, benchmarks/tide_bench/gpu.py).
"""

from __future__ import annotations

import os
import platform
from importlib.metadata import PackageNotFoundError, version
from typing import Any

import torch
from huggingface_hub.constants import HF_HUB_CACHE
from packaging.version import Version

from ..assets import cache_dir
from ..compat import NEWEST_TESTED_TRANSFORMERS
from ..kernels import active_backend, kernel_build_error


def versions() -> dict[str, str | None]:
    """Python, torch (and its CUDA), transformers, accelerate and tide_hf; tide_hf run from a checkout without
    installing reads as such."""
    import accelerate
    import transformers

    try:
        tide_hf = version("tide_hf")
    except PackageNotFoundError:
        tide_hf = "a source checkout (not installed)"
    return {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
            "transformers": transformers.__version__, "accelerate": accelerate.__version__, "tide_hf": tide_hf}


def environment() -> dict[str, Any]:
    """Versions, the devices torch sees, the kernel backend of each (building the kernels if they were not built),
    and the folders tide_hf and its dependencies cache into."""
    devices = ["cpu"] + [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    backends = {}
    for device in devices:
        backend = active_backend(device)
        error = kernel_build_error(device)
        backends[device] = backend if error is None else f"{backend} ({' '.join(error.split())[:200]})"
    return {**versions(), "platform": platform.platform(), "torch_threads": torch.get_num_threads(),
            "devices": {d: (torch.cuda.get_device_name(d) if d != "cpu" else platform.processor() or "cpu")
                        for d in devices},
            "kernels": backends, "tide_hf_cache": str(cache_dir()), "hf_hub_cache": HF_HUB_CACHE,
            "torch_extensions": os.environ.get("TORCH_EXTENSIONS_DIR", "(torch's default)")}


def untested_transformers(installed: str) -> str | None:
    """A warning when `installed` (a transformers version) is newer than the newest release the test suite passed
    on (`NEWEST_TESTED_TRANSFORMERS`); None otherwise."""
    if Version(installed) <= Version(NEWEST_TESTED_TRANSFORMERS):
        return None
    return (f"transformers {installed} is newer than {NEWEST_TESTED_TRANSFORMERS}, the newest release tide_hf's test "
            f"suite passed on: if something fails, try pip install 'transformers=={NEWEST_TESTED_TRANSFORMERS}'")


def run(_args: Any) -> dict[str, Any]:
    """Print `environment()` as `name: value` lines (paste them into a bug report), and a warning line when
    transformers is newer than the newest release tide_hf was tested on."""
    env = environment()
    warning = untested_transformers(env["transformers"])
    if warning is not None:
        print(f"warning: {warning}")
    for name, value in env.items():
        if isinstance(value, dict):
            for key, item in value.items():
                print(f"{name} {key}: {item}")
        else:
            print(f"{name}: {value}")
    return env
