"""Can a top-1 label be certified without the full-vocabulary exit logits? Measured per checkpoint on real text.

Calibration labels a kept token "agrees" at checkpoint k when the exit logits' argmax equals the final logits'
argmax. Both are vocabulary-wide matmuls, so labelling costs (checkpoints + 1) head matmuls per kept token. An
exact shortcut would compute the exit logits of a few candidate tokens only and prove that no other token can
beat them. With u the exit state after the final norm, v the final one and w_j the head's rows:
|u.w_j - v.w_j| <= |w_j| |u - v| (Cauchy-Schwarz). A token j can be the exit argmax only if
v.w_j + |w_j| |u - v| reaches a lower bound of the exit maximum (here: the largest exact exit logit among the
final logits' top `--top-k` tokens). This script counts those candidates for every held-out token and checkpoint,
with the router's own exit heads: where a handful remain, the label is certified cheaply; where thousands
remain, the full matmul is needed.

    python benchmarks/label_bounds.py --router ROUTER --out docs/results/smollm2-cpu/label-bounds.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from tide_hf.assets import default_dataset, load_model
from tide_hf.modeling import TideRouter, get_adapter


@torch.no_grad()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--router", required=True, help="a router folder with exit heads (calibrated for --model)")
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--text", default=None, help="a text file (default: the last SOTU speech by file name)")
    parser.add_argument("--tokens", type=int, default=512, help="tokens of the text measured")
    parser.add_argument("--top-k", type=int, default=64, help="final top-k tokens whose exit logits are computed")
    parser.add_argument("--certify-at", type=int, default=256, help="candidates up to which a label counts as cheap")
    parser.add_argument("--out", required=True, help="JSON file to write")
    args = parser.parse_args()
    model, tokenizer = load_model(args.model)
    router = TideRouter.from_pretrained(args.router)
    adapter = get_adapter(model)
    text = Path(args.text) if args.text else sorted(Path(default_dataset("sotu")).glob("*.txt"))[-1]
    ids = tokenizer(text.read_text(), return_tensors="pt").input_ids[:, : args.tokens]
    out = model(ids, output_hidden_states=True)
    head = adapter.lm_head.weight.float()
    row_norms = head.norm(dim=1)
    final_state = out.hidden_states[-1][0].float()  # transformers' last hidden state is already final-normed
    final = final_state @ head.T
    final_top1 = final.argmax(-1)
    top_k = final.topk(args.top_k, dim=-1).indices
    rows = []
    for k in router.checkpoint_layers:
        hidden = out.hidden_states[k][0]
        mapped = router.mapped(k, adapter.normed(hidden).float())
        exit_state = adapter.normed(mapped.to(hidden.dtype)).float()
        exit_logits = exit_state @ head.T
        distance = (exit_state - final_state).norm(dim=-1, keepdim=True)
        lower = exit_logits.gather(1, top_k).max(-1, keepdim=True).values
        candidates = (final + row_norms * distance >= lower).sum(-1).float()
        agrees = exit_logits.argmax(-1) == final_top1
        rows.append({"layer": k, "label_rate": float(agrees.float().mean()),
                     "cosine": float(torch.cosine_similarity(exit_state, final_state).mean()),
                     "median_candidates": float(candidates.median()), "vocab": int(head.shape[0]),
                     "certified_share": float((candidates <= args.certify_at).float().mean()),
                     "certified_share_of_positives": float((candidates[agrees] <= args.certify_at).float().mean())})
        print(rows[-1])
    result = {"command": "python benchmarks/label_bounds.py " + " ".join(
        f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if v is not None),
              "model": args.model, "text": text.name, "tokens": int(ids.shape[1]), "top_k": args.top_k,
              "certify_at": args.certify_at, "rows": rows}
    Path(args.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
