"""Quiet Hugging Face calls: no "Writing model shards", "Downloading data" or info logs around small files.

`quiet_hf()` turns off the progress bars and lowers the log level of transformers, huggingface_hub and (when
asked) datasets for the duration of a block, and puts every previous setting back afterwards.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator


@contextlib.contextmanager
def quiet_hf(datasets: bool = False) -> Iterator[None]:
    """Silence progress bars and info / warning logs of the HF libraries inside the block (errors still show)."""
    import huggingface_hub.utils as hub
    from transformers.utils import logging as tf_logging

    undo = []
    verbosity, bars = tf_logging.get_verbosity(), tf_logging.is_progress_bar_enabled()
    tf_logging.set_verbosity_error()
    tf_logging.disable_progress_bar()
    undo.append(lambda: (tf_logging.set_verbosity(verbosity),
                         tf_logging.enable_progress_bar() if bars else tf_logging.disable_progress_bar()))
    hub_off = hub.are_progress_bars_disabled()
    hub.disable_progress_bars()
    undo.append(lambda: None if hub_off else hub.enable_progress_bars())
    if datasets:
        import datasets as ds

        ds_verbosity, ds_off = ds.logging.get_verbosity(), ds.are_progress_bars_disabled()
        ds.logging.set_verbosity_error()
        ds.disable_progress_bars()
        undo.append(lambda: (ds.logging.set_verbosity(ds_verbosity), None if ds_off else ds.enable_progress_bars()))
    try:
        yield
    finally:
        for step in reversed(undo):
            step()
