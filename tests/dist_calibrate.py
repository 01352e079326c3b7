"""Calibrate a tiny random Llama on a text folder: run by tests/test_distributed.py with `python` and under
`accelerate launch`. The main process writes the router, the collected tokens (`collected.safetensors`) and
`run.json` (wall times); every process writes `rank<i>.json` with a hash of the router it returned."""

from __future__ import annotations

import argparse
import hashlib
import json
import time
from pathlib import Path

import torch
from helpers import ByteTokenizer, make_tiny_llama
from safetensors.torch import save_file

import tide_hf
from tide_hf.calibration import distributed, load_texts, make_samples
from tide_hf.calibration.labels import collect
from tide_hf.modeling import get_adapter


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("texts")
    parser.add_argument("output")
    parser.add_argument("--num-samples", type=int, default=48)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--num-epochs", type=int, default=8)
    parser.add_argument("--max-train-tokens", type=int, default=2048)
    args = parser.parse_args()
    torch.set_num_threads(1)  # the same arithmetic in every process and in the single-process run
    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    model, tokenizer = make_tiny_llama(hidden=64, vocab=1024), ByteTokenizer()  # 1024: a draft vocabulary
    settings = dict(num_samples=args.num_samples, seq_len=args.seq_len, batch_size=args.batch_size, label="top1",
                    num_epochs=args.num_epochs, max_train_tokens=args.max_train_tokens, progress=False)
    started = time.perf_counter()
    router = tide_hf.calibrate(model, tokenizer, args.texts, **settings)
    wall = time.perf_counter() - started
    digest = hashlib.sha256(b"".join(t.numpy().tobytes() for t in router.state_dict().values())).hexdigest()
    rank = int(torch.distributed.get_rank()) if torch.distributed.is_initialized() else 0
    # the collected tokens themselves, gathered across processes like calibrate() gathers them
    samples = make_samples(tokenizer, load_texts(args.texts), args.num_samples, args.seq_len, router.config.seed)
    data = collect(model, get_adapter(model), samples, router.config, batch_size=args.batch_size, pad_id=0,
                   progress=False)
    if distributed.is_main_process():
        router.save_pretrained(out / "router")
        tensors = {"is_val": data.is_val, "final": data.final, "next_ids": data.next_ids}
        for name in ("features", "cosine"):
            tensors.update({f"{name}.{k}": v.contiguous() for k, v in getattr(data, name).items()})
        save_file(tensors, out / "collected.safetensors")
        (out / "run.json").write_text(json.dumps({"calibrate_seconds": wall,
                                                  "calibration_seconds": router.config.calibration_seconds}))
    (out / f"rank{rank}.json").write_text(json.dumps({"router_sha256": digest}))
    distributed.finish()


if __name__ == "__main__":
    main()
