"""Out-of-fold top-1 agreement of exit heads of several ranks, on the demo's calibration data (or larger).

Calibration labels each training token with the exit head fitted on the other fold (`heads.CrossFit`), so the
share of training tokens labelled "agrees" is an out-of-fold agreement; held-out tokens go through the head
fitted on all training tokens. This script collects the tokens once and refits the heads per rank, to see
whether a rank chosen by agreement would match what makes routers exit (the demo's rank 64: 11 % of tokens
exit, full rank: none).

    PYTHONPATH=. python benchmarks/exit_head_rank.py                      # the demo's 128 x 128, 8192 kept tokens
    PYTHONPATH=. python benchmarks/exit_head_rank.py --samples 800 --seq-len 256 --max-train-tokens 65536
"""

from __future__ import annotations

import argparse
import copy
import time
from functools import partial

import torch

from tide_hf.assets import default_dataset, load_model
from tide_hf.calibration import load_texts
from tide_hf.calibration.heads import fit_exit_heads
from tide_hf.calibration.labels import collect, label
from tide_hf.calibration.pipeline import model_config
from tide_hf.calibration.samples import make_samples, pad_token_id
from tide_hf.modeling import TideRouter, get_adapter


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=128)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--max-train-tokens", type=int, default=8192)
    parser.add_argument("--ranks", nargs="*", default=["16", "32", "64", "128", "256", "full"])
    args = parser.parse_args()
    torch.set_num_threads(2)
    model, tokenizer = load_model("smollm2")
    adapter = get_adapter(model)
    cfg = model_config(model, args.seq_len, {"max_train_tokens": args.max_train_tokens})
    samples = make_samples(tokenizer, load_texts(default_dataset(None)), args.samples, args.seq_len, cfg.seed)
    data = collect(model, adapter, samples, cfg, batch_size=8, pad_id=pad_token_id(tokenizer), progress=True)
    train, cpu = ~data.is_val, torch.device("cpu")
    print("| rank | out-of-fold agreement per checkpoint (mean) | held-out agreement (mean) | seconds |")
    print("|---|---|---|---|")
    for name in args.ranks:
        rank_cfg = copy.deepcopy(cfg)
        rank_cfg.exit_head_rank = None if name == "full" else int(name)
        router = TideRouter(rank_cfg)
        started = time.perf_counter()
        crossfit = fit_exit_heads(router, data, device=cpu, scale_free=adapter.scale_free)
        label(data, adapter, router, device=cpu, exit_logits=partial(crossfit.exit_logits, router, adapter),
              progress=False)
        cells = []
        for rows in (train, data.is_val):
            rates = [float(data.top1[k][rows].float().mean()) for k in cfg.checkpoint_layers]
            cells.append(" ".join(f"{r:.3f}" for r in rates) + f" ({sum(rates) / len(rates):.3f})")
        print(f"| {name} | {cells[0]} | {cells[1]} | {time.perf_counter() - started:.0f} |", flush=True)


if __name__ == "__main__":
    main()
