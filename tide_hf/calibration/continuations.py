"""Calibration on the model's own text: each sample keeps its first `continuation_prompt_len` corpus tokens
and the model writes the rest with stock `generate()` (greedy, or sampled from its full distribution).

Why: inside `generate()` routers read states of text the model wrote itself, which it finds far more
predictable than human text, so early checkpoints agree with the final layer more often there. Routers, exit
heads and thresholds fitted on the corpus as written learn the harder distribution and keep their targets
on it; fitted on continuations, they learn and certify the target on continuations of the calibration prompts
(served text unlike those prompts' continuations, e.g. chat answers, is not covered).

A continuation is as long as the corpus text it replaces (its sample keeps its length), ends early at the
model's end-of-sequence token (kept), and samples no longer than the prompt stay as they are. Batches are
the calibration's own, each seeded with `seed` + its first sample index, so under `accelerate launch` every
process writes exactly the continuations a single process would for its batches.
"""

from __future__ import annotations

import time
from contextlib import nullcontext
from typing import Any

import torch
from torch import nn
from tqdm.auto import tqdm

from ..compat import default_generation_settings
from ..config import TideRouterConfig
from ..errors import TideArgumentError
from ..modeling.devices import execution_device
from ..runtime import get_handle
from .distributed import local_starts

# generation-config fields a continuation keeps from the model (they choose no token; max_new_tokens is set here)
KEPT_SETTINGS = frozenset({"bos_token_id", "eos_token_id", "pad_token_id", "decoder_start_token_id", "max_length",
                           "use_cache", "cache_implementation", "cache_config", "transformers_version"})


def end_ids(model: nn.Module) -> torch.Tensor:
    """The model's end-of-sequence token ids (none when its generation config names none)."""
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    return torch.as_tensor([] if eos is None else eos, dtype=torch.long).reshape(-1)  # an int, a list or a tensor


def plain_decoding(model: nn.Module) -> dict[str, Any]:
    """What the model's generation config sets away from transformers' defaults (a repetition penalty, beams,
    n-gram bans, return_dict_in_generate, ...), reset to the defaults: the continuations are the model's own argmax
    or full distribution. Token ids, lengths and cache settings, which choose no token, stay the model's."""
    own = getattr(model, "generation_config", None)
    if own is None:
        return {}
    default = default_generation_settings()
    return {k: default[k] for k in own.to_diff_dict()
            if k not in KEPT_SETTINGS and k in default and not k.startswith("_")}  # "_": transformers' bookkeeping


def cut_at_end(tokens: torch.Tensor, eos: torch.Tensor) -> torch.Tensor:
    """`tokens` up to and including the first end-of-sequence token (all of them without one)."""
    ends = torch.isin(tokens, eos).nonzero()
    return tokens if len(ends) == 0 else tokens[: int(ends[0]) + 1]


def cuda_ids(device: torch.device) -> list[int]:
    """The CUDA device `device` is, as the index list `torch.random.fork_rng` takes (empty off CUDA)."""
    if device.type != "cuda":
        return []
    return [device.index if device.index is not None else torch.cuda.current_device()]


@torch.no_grad()
def continue_samples(model: nn.Module, samples: list[torch.Tensor], cfg: TideRouterConfig, *, batch_size: int,
                     pad_id: int, progress: bool = True) -> tuple[list[torch.Tensor], float]:
    """`samples` with everything after their first `cfg.continuation_prompt_len` tokens written by `model`
    (`cfg.continuation`: "greedy" or "sample"), and the seconds it took; this process's batches only (the
    others are not read here). `model` must be in eval mode."""
    prompt_len = cfg.continuation_prompt_len
    if not any(len(s) > prompt_len for s in samples):
        raise TideArgumentError(f"continuation={cfg.continuation!r} needs samples longer than continuation_prompt_len="
                                f"{prompt_len} tokens (the longest has {max(len(s) for s in samples)}): raise seq_len "
                                "or lower continuation_prompt_len")
    sample = cfg.continuation == "sample"
    settings: dict[str, Any] = {**plain_decoding(model), "do_sample": sample, "pad_token_id": pad_id}
    if sample:  # the model's own distribution, whatever its generation config says
        settings.update(temperature=1.0, top_k=0, top_p=1.0)
    eos, device = end_ids(model), execution_device(model.get_input_embeddings())
    out = list(samples)
    starts = local_starts(len(samples), batch_size)
    started = time.perf_counter()
    for start in tqdm(starts, desc=f"tide_hf: writing {cfg.continuation} continuations", unit="batch",
                      disable=not progress):
        rows = [i for i in range(start, min(start + batch_size, len(samples))) if len(samples[i]) > prompt_len]
        if not rows:
            continue
        prompts = torch.stack([samples[i][:prompt_len] for i in rows]).to(device)
        new_tokens = max(len(samples[i]) for i in rows) - prompt_len
        handle = get_handle(model)  # a router attached to the model: its text is written by the stock model
        with torch.random.fork_rng(devices=cuda_ids(device)), handle.disabled() if handle else nullcontext():
            torch.manual_seed(cfg.seed + start)  # (fork_rng: the caller's random state is left as it was)
            written = model.generate(input_ids=prompts, attention_mask=torch.ones_like(prompts),
                                     max_new_tokens=new_tokens, **settings).cpu()
        for row, i in enumerate(rows):
            tail = cut_at_end(written[row, prompt_len : len(samples[i])], eos)
            out[i] = torch.cat([samples[i][:prompt_len], tail])
    return out, time.perf_counter() - started
