"""Calibration: text (data), token samples, collected states and labels, router training, and `calibrate()`,
also under `accelerate launch` (distributed)."""

from __future__ import annotations

from ..settings import CalibrationConfig
from .data import load_texts
from .pipeline import calibrate, calibrate_tokens
from .samples import held_out_texts, make_samples, pad_right, pad_token_id

__all__ = ["CalibrationConfig", "calibrate", "calibrate_tokens", "held_out_texts", "load_texts", "make_samples",
           "pad_right", "pad_token_id"]
