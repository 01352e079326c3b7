"""How much a forward of w new tokens costs next to a one-token decode step, on this machine, and what that
allows speculative decoding at a given acceptance and draft cost (the ceiling behind the README's CPU
speculative figures).

Speculative decoding pays when verifying k + 1 tokens costs little more than one step (a memory-bound GPU).
Where it costs much more (a CPU whose BLAS handles 2-8 rows far slower than 1), no draft policy can win:
with per-width verify cost V(w) and draft cost c (both in plain steps), a round drafting k tokens gives at most

    E(k) = (1 - a^(k+1)) / ((1 - a) * (k * c + V(k + 1)))

(V(k + 1) is the full model's forward of k + 1 tokens; verification reuse runs the first layers for one of
them only, so the true verify cost lies between this and the deep layers' share of it).

    python benchmarks/verify_width_cost.py --acceptance 0.876 --draft-cost 0.667
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from transformers import DynamicCache

from tide_hf.assets import load_model
from tide_hf.integrations.draft import MAX_DRAFT_TOKENS, interpolated_verify, speedup


@torch.no_grad()
def forward_ms(model: torch.nn.Module, prompt: torch.Tensor, width: int, reps: int, vocab: int) -> float:
    """Median ms of one forward of `width` new tokens after a cached prompt (logits for every position, as
    verification computes them)."""
    times = []
    gen = torch.Generator().manual_seed(width)
    for _ in range(reps):
        cache = DynamicCache(config=model.config)
        model(prompt, past_key_values=cache, use_cache=True)
        new = torch.randint(0, vocab, (1, width), generator=gen)
        start = time.perf_counter()
        model(new, past_key_values=cache, use_cache=True)
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--model", default="smollm2", help="Hub id or folder ('smollm2' = embedded)")
    parser.add_argument("--prompt-len", type=int, default=128, help="cached tokens before the timed forward")
    parser.add_argument("--max-width", type=int, default=MAX_DRAFT_TOKENS + 1,
                        help="widest forward timed (k + 1 for the longest draft speculative mode plans)")
    parser.add_argument("--reps", type=int, default=20, help="repetitions per width (median)")
    parser.add_argument("--acceptance", type=float, default=None, help="per-token acceptance a, for E(k)")
    parser.add_argument("--draft-cost", type=float, default=None, help="draft forward cost c in plain steps")
    args = parser.parse_args()
    model, _ = load_model(args.model)
    model.eval()
    vocab = model.config.vocab_size
    prompt = torch.randint(0, vocab, (1, args.prompt_len), generator=torch.Generator().manual_seed(0))
    forward_ms(model, prompt, 1, 2, vocab)  # warm-up
    ms = {w: forward_ms(model, prompt, w, args.reps, vocab) for w in range(1, args.max_width + 1)}
    costs = {w: t / ms[1] for w, t in ms.items()}
    result: dict = {"torch_threads": torch.get_num_threads(), "ms": ms, "cost_vs_one_token": costs}
    if args.acceptance is not None and args.draft_cost is not None:
        verify = interpolated_verify(costs)  # the policy's own E(k), with these costs as V(w)
        result["E"] = {k: speedup(args.acceptance, k, args.draft_cost, verify) for k in range(1, args.max_width)}
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
