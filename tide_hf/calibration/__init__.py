"""Calibration: text (data), token samples, collected states and labels, router training, and `calibrate()`,
also under `accelerate launch` (distributed)."""

from __future__ import annotations

from .data import DEFAULT_DATASET, load_texts
from .pipeline import calibrate, calibrate_tokens
from .samples import held_out_texts, make_samples, pad_right, pad_token_id

__all__ = ["DEFAULT_DATASET", "calibrate", "calibrate_tokens", "held_out_texts", "load_texts", "make_samples",
           "pad_right", "pad_token_id"]
