"""The newest releases of transformers, accelerate, huggingface-hub and safetensors that pyproject.toml allows.

A fresh `pip install` resolves these to their newest allowed releases, so CI tests those: `.ci/install` upgrades
them (`--requirements` prints their requirement lines for pip), then this script prints installed and newest, and
exits non-zero when the installed transformers is not the newest allowed one. It also says when that transformers
is newer than `tide_hf.compat.NEWEST_TESTED_TRANSFORMERS` (raise it in the commit that makes CI pass on it).

    python .ci/newest.py --requirements    # the requirement lines, e.g. transformers>=5.17,<6
    python .ci/newest.py                   # installed vs newest allowed; exit 1 if transformers is behind
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import tomllib
from packaging.requirements import Requirement
from packaging.version import Version

UPGRADED = ("transformers", "accelerate", "huggingface-hub", "safetensors")
MUST_BE_NEWEST = "transformers"


def requirements() -> dict[str, Requirement]:
    """pyproject's requirement of each upgraded package, by name."""
    project = tomllib.loads((Path(__file__).resolve().parent.parent / "pyproject.toml").read_text())["project"]
    found = {Requirement(line).name: Requirement(line) for line in project["dependencies"]}
    return {name: found[name] for name in UPGRADED}


def newest_allowed(requirement: Requirement) -> Version:
    """The newest release on the package index that `requirement` allows (pre-releases aside)."""
    listing = subprocess.run([sys.executable, "-m", "pip", "index", "versions", requirement.name],
                             capture_output=True, text=True, check=True).stdout
    available = re.search(r"Available versions: (.*)", listing)
    if available is None:
        raise SystemExit(f"pip index versions {requirement.name} listed no versions:\n{listing}")
    versions = [Version(v.strip()) for v in available.group(1).split(",")]
    allowed = [v for v in versions if requirement.specifier.contains(v)]
    if not allowed:
        raise SystemExit(f"no release of {requirement.name} satisfies {requirement.specifier}")
    return max(allowed)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requirements", action="store_true", help="print the requirement lines and exit")
    args = parser.parse_args()
    if args.requirements:
        print(" ".join(str(r) for r in requirements().values()))
        return
    behind = []
    for name, requirement in requirements().items():
        installed, newest = Version(version(name)), newest_allowed(requirement)
        print(f"{name}: installed {installed}, newest allowed {newest} ({requirement.specifier})")
        if name == MUST_BE_NEWEST and installed != newest:
            behind.append(f"{name} {installed} is not the newest release pyproject allows ({newest})")
    from tide_hf.compat import NEWEST_TESTED_TRANSFORMERS

    if Version(version(MUST_BE_NEWEST)) > Version(NEWEST_TESTED_TRANSFORMERS):
        print(f"transformers {version(MUST_BE_NEWEST)} is newer than tide_hf.compat.NEWEST_TESTED_TRANSFORMERS "
              f"({NEWEST_TESTED_TRANSFORMERS}): raise it in the commit whose CI passes on this release")
    if behind:
        raise SystemExit("; ".join(behind))


if __name__ == "__main__":
    main()
