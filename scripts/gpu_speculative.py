"""Speculative mode on an easy synthetic Llama-3-8B shape: stock vs TIDE speculative vs `assistant_early_exit`.

    python scripts/gpu_speculative.py --out DIR          # H100: ~3-4 min, writes DIR/gpu_speculative.json
    python scripts/gpu_speculative.py --out DIR --tiny   # a tiny shape on CPU, to check that it runs

Random bf16 weights are made directly on the GPU (no download, no internet). Decoder layers after
`KEEP` are made near-identity (`tide_hf.eval.easy.make_near_identity`), so an exit at `KEEP` usually
agrees with the final layer. Routers come from a quick top-1 calibration on random word text (the
random model has no tokenizer: words map to token ids by hash). Then, at batch size 1 with 128-token
prompts and 64 new tokens, interleaved prompt by prompt: stock greedy, speculative mode (draft layer
chosen from the routers' metrics) and transformers' `assistant_early_exit=KEEP`; speed ratios are
medians over repetitions, divergence is the share of continuations not token-identical to stock greedy.
Also: the model truncated to `KEEP` layers (speed ratio, the draft's ceiling) and the top-1 agreement
of layer `KEEP` with the final layer on stock's continuations.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
import zlib
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from tide_hf.eval.easy import NEAR_IDENTITY_SCALE, easy_router, make_near_identity
from tide_hf.eval.measure import generate, left_pad
from tide_hf.eval.modes import speculative, truncated

LLAMA3_8B = dict(num_hidden_layers=32, hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                 num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0)
TINY = dict(num_hidden_layers=9, hidden_size=64, intermediate_size=128, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=512, max_position_embeddings=512)
KEEP = {"8b": 16, "tiny": 4}  # layers kept as they are (the 8B experiment: layers 17-32 near-identity)
PROMPT_LEN, NEW_TOKENS = 128, 64
CALIBRATION_SAMPLES, CALIBRATION_LEN = 32, 128
WORDS = 5000  # distinct words of the random calibration text


class WordTokenizer:
    """What calibration needs from a tokenizer, for a model without one: each word -> a token id by hash."""

    pad_token_id = 0

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        return {"input_ids": [3 + zlib.crc32(w.encode()) % (self.vocab_size - 3) for w in text.split()]}


def build(shape: dict, device: str, dtype: torch.dtype) -> LlamaForCausalLM:
    """Random weights made on `device` in `dtype` (no fp32 copy on the host)."""
    config = LlamaConfig(**shape, pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(config).eval()
    finally:
        torch.set_default_dtype(previous)
    model.generation_config.eos_token_id = None  # random weights: always generate NEW_TOKENS tokens
    model.generation_config.pad_token_id = 0
    return model


def random_text(path: Path, documents: int, words: int, seed: int) -> None:
    rng = random.Random(seed)
    path.write_text("\n\n".join(" ".join(f"w{rng.randrange(WORDS)}" for _ in range(words))
                                for _ in range(documents)))


def truncated_ratio(model: LlamaForCausalLM, batch: dict, depth: int, reps: int) -> float:
    """Median over repetitions of stock time / time of the model truncated to `depth` layers."""
    ratios = []
    for _ in range(reps):
        stock = generate(model, batch, NEW_TOKENS)[1]
        with truncated(model, depth):
            ratios.append(stock / generate(model, batch, NEW_TOKENS)[1])
    return statistics.median(ratios)


@torch.no_grad()
def agreement(model: LlamaForCausalLM, batches: list[dict], layer: int) -> float:
    """Top-1 agreement of layer `layer`'s exit with the final layer on stock greedy continuations."""
    same, total = 0, 0
    for batch in batches:
        out = model.generate(**batch, max_new_tokens=NEW_TOKENS, do_sample=False)
        hidden = model(out, output_hidden_states=True)
        exit_top1 = model.lm_head(model.model.norm(hidden.hidden_states[layer])).argmax(-1)
        start = batch["input_ids"].shape[1]
        same += int((exit_top1 == hidden.logits.argmax(-1))[:, start:].sum())
        total += out.shape[1] - start
    return same / total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="folder for gpu_speculative.json")
    parser.add_argument("--tiny", action="store_true", help="a tiny shape (runs on CPU): checks the script only")
    parser.add_argument("--prompts", type=int, default=4, help="random prompts, each decoded alone (bs1)")
    parser.add_argument("--reps", type=int, default=3, help="interleaved repetitions")
    args = parser.parse_args()
    started = time.perf_counter()
    kind = "tiny" if args.tiny else "8b"
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if kind == "8b" and device != "cuda":
        raise SystemExit("the 8B shape needs a GPU (use --tiny to check the script on CPU)")
    torch.manual_seed(0)
    model = build(TINY if args.tiny else LLAMA3_8B, device, torch.bfloat16)
    keep = KEEP[kind]
    make_near_identity(model, keep, NEAR_IDENTITY_SCALE)
    vocab = model.config.vocab_size
    with tempfile.TemporaryDirectory() as tmp:
        text = Path(tmp) / "random.txt"
        random_text(text, documents=4 * CALIBRATION_SAMPLES, words=2 * CALIBRATION_LEN, seed=0)
        router = easy_router(model, WordTokenizer(vocab), str(text), num_samples=CALIBRATION_SAMPLES,
                             seq_len=CALIBRATION_LEN)
    built = time.perf_counter() - started
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, vocab, (PROMPT_LEN,), generator=gen) for _ in range(args.prompts)]
    batches = [{k: v.to(device) for k, v in left_pad([p], 0).items()} for p in prompts]
    batched = {k: v.to(device) for k, v in left_pad(prompts, 0).items()}
    result = {
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "torch": torch.__version__, "transformers": __import__("transformers").__version__,
        "shape": kind, "dtype": "bfloat16", "near_identity_after": keep, "near_identity_scale": NEAR_IDENTITY_SCALE,
        "prompt_len": PROMPT_LEN, "new_tokens": NEW_TOKENS, "batch_size": 1,
        "router_metrics": {k: {m: v.get(m) for m in ("label_rates", "precision", "predicted_rate")}
                           for k, v in router.config.metrics.items()},
        "layer_agreement": agreement(model, batches, keep),
        "truncated_speed_ratio": truncated_ratio(model, batches[0], keep, args.reps),
        "speculative": speculative(model, router, batches, batched, NEW_TOKENS, args.reps, assisted_layer=keep),
        "setup_s": built,
    }
    result["wall_s"] = time.perf_counter() - started
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_speculative.json").write_text(json.dumps(result, indent=2))
    spec = result["speculative"]
    print(json.dumps({k: result[k] for k in ("device", "layer_agreement", "truncated_speed_ratio", "wall_s")}))
    print({k: spec[k] for k in ("draft_layer", "draft_vocab", "speed_ratio", "assisted_speed_ratio", "divergence",
                                "assisted_divergence", "acceptance_per_token", "mean_draft_length",
                                "optimal_draft_length", "optimal_speedup", "realized_over_optimum")})


if __name__ == "__main__":
    main()
