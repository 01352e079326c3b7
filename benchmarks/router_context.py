"""Offline router experiment: does the previous token tell a router more than the current state does, and how
does router efficiency depend on how far into a greedy continuation a token sits?

On the model's own greedy continuations of held-out prompts (the text `tide-hf analyze` measures efficiency on),
for the router's top-1 label at every checkpoint:

1. Context inputs. Per checkpoint, a logistic regression on the router's logit alone, and on the logit plus
   the previous token's router logit, its true top-1 match (what select mode could know), or its match, the
   match two tokens back and its first agreeing checkpoint (the oracle's), or the token's position in the
   continuation (as a share of its length). Fitted on the first half of the
   prompts, scored on the second: AUC per checkpoint, and layers saved / efficiency at agreement 0.97 / 0.95 /
   0.90 under the global threshold that meets each on the first half. The state-only row is the baseline
   the others must beat.
2. Position. The router's stored quality targets (`attach(min_agreement=a)` thresholds), on the first and the
   second half of each continuation's positions.

    python benchmarks/router_context.py --router ROUTER --out context.json  # ~6 min on 2 CPU cores
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

from tide_hf.assets import default_dataset, load_model
from tide_hf.calibration import held_out_texts, load_texts, pad_token_id
from tide_hf.calibration.training import auc
from tide_hf.eval.analyze import exit_summary, greedy_text, scored_text
from tide_hf.modeling import TideRouter
from tide_hf.modeling.targets import select

TARGETS = (0.97, 0.95, 0.90)
STORED_TARGETS = (0.99, 0.97, 0.95, 0.90)
INPUTS = {"state": ("logit",), "+prev logit": ("logit", "prev_logit"), "+prev match": ("logit", "prev_match"),
          "+prev match, match 2 back, prev depth": ("logit", "prev_match", "prev2_match", "prev_depth"),
          "+position": ("logit", "position")}
SWEEP = torch.linspace(0.5, 1.0, 201)  # global thresholds on the regression's probability


def features(match: torch.Tensor, score: torch.Tensor) -> dict[str, torch.Tensor]:
    """Inputs per token x checkpoint of one continuation (tokens in order). The first tokens, with no
    previous one, get "no match" and the deepest exit; positions are shares of the continuation's length."""
    k = match.shape[1]
    m = match.float()
    first = torch.where(match.any(1), match.int().argmax(1), k).float()
    shift = lambda x, s: torch.cat([x.new_zeros(s, *x.shape[1:]), x[:-s]])  # noqa: E731
    logit = torch.logit(score.double().clamp(1e-6, 1 - 1e-6)).float()
    prev_depth = torch.cat([first.new_full((1,), k), first[:-1]]) / k
    return {"logit": logit, "prev_logit": shift(logit, 1), "prev_match": shift(m, 1), "prev2_match": shift(m, 2),
            "prev_depth": prev_depth[:, None].expand(-1, k),
            "position": (torch.arange(len(m), dtype=torch.float) / len(m))[:, None].expand(-1, k)}


def fit_logistic(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Weights (inputs + bias) of a logistic regression, fitted with L-BFGS."""
    w = torch.zeros(x.shape[1] + 1, requires_grad=True)
    opt = torch.optim.LBFGS([w], max_iter=200)

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = F.binary_cross_entropy_with_logits(x @ w[:-1] + w[-1], y)
        loss.backward()
        return loss

    opt.step(closure)
    return w.detach()


def context_inputs(fit: list[dict], test: list[dict], checkpoints: list[int], n: int) -> list[dict]:
    """Part 1: each input set's held-out AUC per checkpoint and efficiency at `TARGETS`."""
    cat = lambda seqs, key: torch.cat([s[key] for s in seqs])  # noqa: E731
    y_fit, y_test = cat(fit, "match"), cat(test, "match")
    rows = []
    for name, cols in INPUTS.items():
        x = {part: torch.stack([cat(seqs, c) for c in cols], -1)  # tokens x checkpoints x inputs
             for part, seqs in (("fit", fit), ("test", test))}
        probs = {part: torch.empty(x[part].shape[:2]) for part in x}
        for j in range(len(checkpoints)):
            w = fit_logistic(x["fit"][:, j], y_fit[:, j].float())
            for part in x:
                probs[part][:, j] = torch.sigmoid(x[part][:, j] @ w[:-1] + w[-1])
        aucs = [auc(probs["test"][:, j], y_test[:, j]) for j in range(len(checkpoints))]
        at = []
        for a in TARGETS:
            met = [t for t in SWEEP.tolist()
                   if exit_summary(y_fit, probs["fit"], torch.full((len(checkpoints),), t), checkpoints, n)
                   ["agreement"] >= a]
            t = min(met) if met else 1.0
            at.append({"target": a, "threshold": t,
                       **exit_summary(y_test, probs["test"], torch.full((len(checkpoints),), t), checkpoints, n)})
        rows.append({"inputs": name, "auc": aucs, "targets": at})
    return rows


def by_position(seqs: list[dict], router: TideRouter, checkpoints: list[int], n: int, half: int) -> list[dict]:
    """Part 2: the stored targets' thresholds on the first `half` positions and on the rest."""
    cfg = router.config
    rows = []
    for name, part in ((f"positions 1-{half}", slice(0, half)), (f"positions {half + 1}+", slice(half, None)),
                       ("all", slice(None))):
        match = torch.cat([s["match"][part] for s in seqs])
        score = torch.cat([s["score"][part] for s in seqs])
        at = []
        for a in STORED_TARGETS:
            chosen = select(cfg.exit_paths, list(cfg.checkpoint_layers), min_agreement=a, confidence=cfg.confidence)
            vector = torch.tensor([chosen[k] for k in checkpoints])
            at.append({"target": a, **exit_summary(match, score, vector, checkpoints, n)})
        rows.append({"positions": name, "tokens": len(match), "targets": at})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--router", required=True, help="a router folder with stored quality targets")
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--dataset", default="sotu")
    parser.add_argument("--num-prompts", type=int, default=48)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--out", required=True, help="JSON results file")
    args = parser.parse_args()

    model, tokenizer = load_model(args.model, "float32")
    router = TideRouter.from_pretrained(args.router)
    router.check_compatible(model)
    cfg = router.config
    texts = held_out_texts(tokenizer, load_texts(default_dataset(args.dataset)), cfg)
    ids = [torch.tensor(tokenizer(t, add_special_tokens=False)["input_ids"]) for t in texts]
    prompts = [d[: args.prompt_len] for d in ids if len(d) > args.prompt_len][: args.num_prompts]
    checkpoints = [k for k in cfg.checkpoint_layers if k >= cfg.min_layers]
    n = cfg.num_hidden_layers
    seqs = []
    for seq, prompt in zip(greedy_text(model, prompts, args.new_tokens, pad_token_id(tokenizer)), prompts):
        match, score = scored_text(model, router, [(seq, len(prompt) - 1)], checkpoints, False, "")
        seqs.append({"match": match, "score": score, **features(match, score)})
    half = len(seqs) // 2
    result = {"settings": vars(args), "checkpoints": checkpoints, "tokens": sum(len(s["match"]) for s in seqs),
              "context_inputs": context_inputs(seqs[:half], seqs[half:], checkpoints, n),
              "by_position": by_position(seqs, router, checkpoints, n, args.new_tokens // 2)}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    for r in result["context_inputs"]:
        print(f"{r['inputs']:40s} AUC " + " ".join(f"{x:.3f}" for x in r["auc"]) + " | " + "; ".join(
            f"{t['target']}: {t['layers_saved']:.2f} at {t['agreement']:.1%}, eff {t['efficiency']:.2f}"
            for t in r["targets"]))
    for r in result["by_position"]:
        print(f"{r['positions']:16s} ({r['tokens']} tokens) " + "; ".join(
            f"{t['target']}: {t['layers_saved']:.2f} at {t['agreement']:.1%}, eff {t['efficiency']:.2f}"
            for t in r["targets"]))


if __name__ == "__main__":
    main()
