"""Arguments several of `tide-hf`'s commands take (the model and its text, --router folders), checked without torch
so a bad argument answers at once."""

from __future__ import annotations

import argparse
import os

from ..assets import DEFAULT_MODEL
from .values import DTYPE_HELP, DTYPES, MODEL_HELP


def add_text_args(group: argparse._ArgumentGroup, what: str, required: bool = False) -> None:
    """--model, --dataset (`required`: no default text, as `calibrate()` has none) and --dtype (`what`: the text
    --dataset is read for)."""
    group.add_argument("--model", default=DEFAULT_MODEL, metavar="NAME",
                       help=MODEL_HELP)
    group.add_argument("--dataset", metavar="NAME", help=what,
                       **({"required": True} if required else {"default": "sotu"}))
    group.add_argument("--dtype", default=DTYPES[0], choices=DTYPES, metavar="DTYPE", help=DTYPE_HELP)


def check_router_paths(args: argparse.Namespace) -> None:
    """A --router named by a local path (absolute, starting with . or ~) or a bare name (no '/': no Hub repo id)
    must be a folder, said before torch loads (modeling.files.check_config_source's rule, without torch)."""
    routers = getattr(args, "router", None) or []
    command = " ".join(filter(None, (args.command, getattr(args, "section", None))))
    for name in [routers] if isinstance(routers, str) else routers:
        if (os.path.isabs(name) or name.startswith((".", "~"))) and not os.path.isdir(os.path.expanduser(name)):
            raise SystemExit(f"tide-hf {command}: error: no TIDE router folder at {name}")
        if "/" not in name and not os.path.isdir(name):
            raise SystemExit(f"tide-hf {command}: error: no TIDE router folder named {name!r} here ({os.getcwd()}), "
                             "and it is not a Hub repo id (those read 'owner/name')")
