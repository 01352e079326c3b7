"""Exit heads against the model's own head ("logit lens"), per checkpoint, on held-out documents.

Fits the linear exit heads exactly as calibration does (`collect` + `fit_exit_heads`) on the first documents of
the text, then measures on the last ones, which the fit never saw, for every checkpoint: top-1 agreement of the
exit logits with the final logits, the mean KL(final || exit), and the perplexity change if *every* token
exited there. Writes a JSON and prints a table.

    python benchmarks/exit_heads.py --out docs/results/smollm2-cpu/exit-heads.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from report import format_exit_heads  # benchmarks/report.py, beside this script
from tide_hf.assets import default_dataset, load_model
from tide_hf.calibration import load_texts, make_samples, pad_token_id
from tide_hf.calibration.heads import fit_exit_heads
from tide_hf.calibration.labels import LABEL_CHUNK_ROWS, FinalDistribution, collect
from tide_hf.calibration.pipeline import model_config
from tide_hf.modeling import TideRouter, get_adapter


@torch.no_grad()
def measure(router: TideRouter, adapter, data, dtype: torch.dtype) -> dict[int, dict[str, float]]:
    """Per checkpoint: agreement, mean KL and the NLL change of the next token (all rows of `data` that have one)."""
    rows = torch.nonzero(data.next_ids >= 0).squeeze(1)
    sums = {k: {"agree": 0.0, "kl": 0.0, "nll": 0.0} for k in router.checkpoint_layers}
    for part in rows.split(LABEL_CHUNK_ROWS):
        final_logits = adapter.logits(data.final[part].to(dtype))
        final = FinalDistribution(final_logits)
        targets = data.next_ids[part]
        for k in router.checkpoint_layers:
            exit_logits = router.exit_logits(adapter, k, data.features[k][part], dtype)
            logq = F.log_softmax(exit_logits.float(), dim=-1)
            s = sums[k]
            s["agree"] += float((exit_logits.argmax(-1) == final_logits.argmax(-1)).sum())
            s["kl"] += float(final.kl_logq(logq).sum())
            s["nll"] += float(final.nll_change(logq, targets).sum())
    n = len(rows)
    return {k: {"agreement": s["agree"] / n, "mean_kl": s["kl"] / n,
                "ppl_change_all_exit": math.exp(s["nll"] / n) - 1.0} for k, s in sums.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--dataset", default="sotu")
    parser.add_argument("--num-samples", type=int, default=400, help="calibration samples (fit)")
    parser.add_argument("--test-samples", type=int, default=64, help="held-out samples (measure)")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--max-train-tokens", type=int, default=65536)
    parser.add_argument("--rank", type=int, default=None, help="exit_head_rank (default: full rank)")
    parser.add_argument("--held-out-share", type=float, default=0.2, help="last share of documents held out")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    model, tokenizer = load_model(args.model)
    adapter = get_adapter(model)
    texts = load_texts(default_dataset(args.dataset))
    cut = int(len(texts) * (1 - args.held_out_share))
    started = time.perf_counter()
    fit_cfg = model_config(model, args.seq_len, {"exit_head": "linear", "exit_head_rank": args.rank,
                                                    "max_train_tokens": args.max_train_tokens})
    fit_samples = make_samples(tokenizer, texts[:cut], args.num_samples, args.seq_len, fit_cfg.seed)
    data = collect(model, adapter, fit_samples, fit_cfg, batch_size=8, pad_id=pad_token_id(tokenizer))
    linear = TideRouter(fit_cfg)
    fit_exit_heads(linear, data, device=torch.device("cpu"), scale_free=adapter.scale_free)
    lens = TideRouter(model_config(model, args.seq_len, {"exit_head": "lens"}))
    test_cfg = model_config(model, args.seq_len, {"max_train_tokens": 10**9})
    test_samples = make_samples(tokenizer, texts[cut:], args.test_samples, args.seq_len, test_cfg.seed)
    test = collect(model, adapter, test_samples, test_cfg, batch_size=8, pad_id=pad_token_id(tokenizer))
    dtype = next(model.parameters()).dtype
    command = "python benchmarks/exit_heads.py " + " ".join(sys.argv[1:])
    result = {"command": command, "model": args.model, "dataset": args.dataset, "settings": vars(args),
              "fit_tokens": int((~data.is_val).sum()), "test_tokens": int((test.next_ids >= 0).sum()),
              "lens": measure(lens, adapter, test, dtype), "linear": measure(linear, adapter, test, dtype),
              "seconds": time.perf_counter() - started}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(format_exit_heads(result))  # the table as the README shows it


if __name__ == "__main__":
    main()
