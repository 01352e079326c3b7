"""Two commits side by side: skip and speculative mode against stock, at batch 1 and 8, interleaved.

A refactoring must not change speed. This script runs the same measurement in two checkouts (e.g. a `git worktree`
of the old commit and this one), alternating between them `--reps` times, each run in its own process. Each run
times stock `generate` and TIDE `generate` on the same prompts (the first words of the last speeches of the State
of the Union corpus) and records TIDE's speed as a ratio of stock's. The JSON holds every ratio, their medians and
ranges per commit, and whether the two commits' ranges overlap.

    git worktree add /tmp/old OLD_COMMIT
    python benchmarks/commit_parity.py --router ROUTER --checkouts /tmp/old . --out parity.json  # ~4 min, 2 cores
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

# (mode, batch): what each run measures; speculative mode decodes a batch row by row
CASES = (("skip", 1), ("skip", 8), ("speculative", 1), ("speculative", 8))
PROMPT_WORDS = 48  # the first words of each speech make its prompt
NUM_PROMPTS = 8  # the last speeches of the corpus, one per row of a batch of 8


def prompts(count: int) -> list[str]:
    """The first `PROMPT_WORDS` words of the last `count` speeches of the corpus."""
    from tide_hf.assets import sotu_path

    files = sorted(sotu_path().glob("*.txt"))[-count:]
    return [" ".join(f.read_text().split()[:PROMPT_WORDS]) for f in files]


def timed(model, inputs: dict, new_tokens: int) -> float:
    """Generated tokens per second of one greedy call."""
    import torch

    started = time.perf_counter()
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    return (out.shape[0] * (out.shape[1] - inputs["input_ids"].shape[1])) / (time.perf_counter() - started)


def worker(router_path: str, new_tokens: int) -> dict:
    """One run in this process's checkout: TIDE's speed over stock's, per case, after one warm-up each; and the
    folder `tide_hf` was imported from (the checkout's own, not an installed copy)."""
    import torch

    import tide_hf
    from tide_hf.assets import load_model

    torch.set_num_threads(int(os.environ.get("PARITY_THREADS", "2")))
    model, tok = load_model("smollm2")
    tok.padding_side = "left"
    router = tide_hf.TideRouter.from_pretrained(router_path)
    texts = prompts(NUM_PROMPTS)
    ratios = {}
    for mode, batch in CASES:
        inputs = tok(texts[:batch], return_tensors="pt", padding=True)
        with tide_hf.attach(model, router, mode=mode):
            timed(model, inputs, 2)
        timed(model, inputs, 2)
        stock = timed(model, inputs, new_tokens)
        with tide_hf.attach(model, router, mode=mode):
            tide = timed(model, inputs, new_tokens)
        ratios[f"{mode}-b{batch}"] = tide / stock
    return {"module": str(Path(tide_hf.__file__).parent), "ratios": ratios}


def commit(path: str) -> str:
    """The commit a checkout is at (with "+changes" where its tracked files differ from it)."""
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=path, capture_output=True, text=True, check=True)
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=path, capture_output=True,
                           text=True, check=True)
    return head.stdout.strip() + ("+changes" if dirty.stdout.strip() else "")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--router", required=True, help="a router folder both commits can load")
    parser.add_argument("--checkouts", nargs=2, metavar=("OLD", "NEW"), help="the two checkouts' folders")
    parser.add_argument("--reps", type=int, default=3, help="runs per checkout, alternating")
    parser.add_argument("--new-tokens", type=int, default=32, help="tokens generated per call")
    parser.add_argument("--out", help="the JSON to write")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)  # one run, its JSON on stdout
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args.router, args.new_tokens)))
        return
    runs: dict[str, list[dict[str, float]]] = {path: [] for path in args.checkouts}
    for rep in range(args.reps):
        for path in args.checkouts:
            env = {**os.environ, "PYTHONPATH": str(Path(path).resolve())}
            done = subprocess.run([sys.executable, __file__, "--worker", "--router", args.router, "--new-tokens",
                                   str(args.new_tokens)], env=env, capture_output=True, text=True, check=True)
            run = json.loads(done.stdout.strip().splitlines()[-1])
            if not Path(run["module"]).is_relative_to(Path(path).resolve()):
                raise SystemExit(f"{path}: tide_hf was imported from {run['module']}, not from the checkout")
            runs[path].append(run["ratios"])
            print(f"rep {rep + 1}/{args.reps} {path}: {runs[path][-1]}", file=sys.stderr)
    old, new = args.checkouts
    cases = {}
    for case in runs[old][0]:
        ranges = {path: [min(r[case] for r in runs[path]), max(r[case] for r in runs[path])] for path in runs}
        cases[case] = {"old": [r[case] for r in runs[old]], "new": [r[case] for r in runs[new]],
                       "old_median": statistics.median(r[case] for r in runs[old]),
                       "new_median": statistics.median(r[case] for r in runs[new]),
                       "ranges_overlap": ranges[old][0] <= ranges[new][1] and ranges[new][0] <= ranges[old][1]}
    record = {"command": " ".join(sys.argv), "checkouts": {"old": old, "new": new},
              "commits": {"old": commit(old), "new": commit(new)}, "reps": args.reps,
              "new_tokens": args.new_tokens, "cases": cases}
    text = json.dumps(record, indent=2)
    if args.out:
        Path(args.out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
