"""`tide-hf analyze`: does early exit pay on this model? Per-layer convergence, the oracle, router efficiency.

- Convergence on real text, for every layer l: mean cos(h_l, h_final) of the pre-norm states (fp32), the
  share above the cosine label's threshold, top-1 agreement of the exit logits (the model's own final norm
  and LM head on h_l) with the final logits, and KL(final || exit).
- The oracle: each token exits at the first checkpoint whose argmax equals the final one. It may also spend
  an error budget: at agreement a, the (1 - a) share of tokens whose wrong early exit saves the most layers
  leave at the first checkpoint. That is the fewest layers any checkpoint-exit policy can use at agreement a.
- Router efficiency, on the model's own greedy text: layers the routers save at a threshold divided by
  layers the oracle saves at the same top-1 agreement. Both exit through the router's exit heads (when it has
  them), so the oracle there is the best any policy could do with those heads; the convergence section uses
  the model's own head, which is the model's property, not the router's.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from ..assets import default_dataset, load_model
from ..calibration import held_out_texts, load_texts, make_samples, pad_right, pad_token_id
from ..calibration.labels import LABEL_CHUNK_ROWS, FinalDistribution
from ..calibration.pipeline import check_context
from ..config import default_checkpoints
from ..errors import TideArgumentError, TideDataError
from ..modeling import ModelAdapter, TideRouter, check_head, get_adapter, layer_output
from ..modeling.files import check_results_folder
from ..modeling.targets import exit_index, select
from ..values import check_real
from .plots import convergence as plot_convergence
from .plots import efficiency as plot_efficiency
from .plots import heatmap as plot_heatmap
from .tables import format_analysis

ORACLE_CURVE = [1.0 - i / 20 for i in range(11)]  # agreements 1.0 down to 0.5 in steps of 0.05, beside the rows'
AGREEMENT_DECIMALS = 4  # agreements closer than this are one point of the oracle's curve
COUNT_SLACK = 1e-6  # an agreement given as a float may sit a rounding error below the count it came from


@torch.no_grad()
def _layer_states(model: Any, adapter: ModelAdapter, ids: torch.Tensor, mask: torch.Tensor,
                  layers: list[int]) -> dict[int, torch.Tensor]:
    """Pre-norm outputs of the 1-based `layers` at the real (mask = 1) positions, as (tokens, hidden)."""
    captured: dict[int, torch.Tensor] = {}
    keep = mask.bool().to(model.device)

    def hook_for(k: int) -> Callable[[Any, Any, Any], None]:
        def hook(_m: Any, _a: Any, output: Any) -> None:
            captured[k] = layer_output(output)[keep]
        return hook

    handles = [adapter.layers[k - 1].register_forward_hook(hook_for(k)) for k in layers]
    try:
        model.base_model(input_ids=ids.to(model.device), attention_mask=mask.to(model.device), use_cache=False)
    finally:
        for h in handles:
            h.remove()
    return captured


@torch.no_grad()
def _compare(adapter: ModelAdapter, states: dict[int, torch.Tensor], final: int, kl: bool,
             router: TideRouter | None = None) -> dict[str, torch.Tensor]:
    """Per token (rows) and layer (columns, in `states` order): cosine, top-1 match, and KL if asked. Exit
    logits: the model's own head on each state, or `router`'s exit logits (its exit heads) when given."""
    layers = [k for k in states]
    h_final = states[final]
    out = {"cosine": torch.stack([F.cosine_similarity(states[k].float(), h_final.float(), dim=-1) for k in layers], 1),
           "match": torch.empty(len(h_final), len(layers), dtype=torch.bool)}
    if kl:
        out["kl"] = torch.empty(len(h_final), len(layers))
    for rows in torch.arange(len(h_final)).split(LABEL_CHUNK_ROWS):
        final_logits = adapter.logits(h_final[rows])
        final_argmax = final_logits.argmax(-1)
        target = FinalDistribution(final_logits) if kl else None
        for j, k in enumerate(layers):
            if k == final:
                exit_logits = final_logits
            elif router is None:
                exit_logits = adapter.logits(states[k][rows])
            else:
                exit_logits = router.exit_logits(adapter, k, adapter.normed(states[k][rows]), states[k].dtype)
            out["match"][rows, j] = (exit_logits.argmax(-1) == final_argmax).cpu()
            if target is not None:
                out["kl"][rows, j] = target.kl(exit_logits).cpu()
    return {name: t.cpu() for name, t in out.items()}


def oracle(match: torch.Tensor, checkpoints: list[int], num_layers: int, agreements: list[float]) -> list[dict]:
    """Fewest mean layers at each top-1 agreement, over exits at `checkpoints` (`match`: tokens x checkpoints)."""
    first = torch.where(match.any(1), match.int().argmax(1), len(checkpoints))
    depth = torch.tensor([*checkpoints, num_layers], dtype=torch.float64)[first]
    gain = (depth - checkpoints[0]).sort(descending=True).values  # what a wrong exit at the first checkpoint saves
    rows = []
    for a in agreements:
        wrong = min(int(math.floor((1.0 - a) * len(depth) + COUNT_SLACK)), int((gain > 0).sum()))
        mean = float((depth.sum() - gain[:wrong].sum()) / len(depth))
        rows.append({"agreement": 1.0 - wrong / len(depth), "mean_layers": mean, "layers_saved": num_layers - mean})
    return rows


def convergence(model: Any, tokenizer: Any, texts: list[str], *, num_samples: int, seq_len: int, batch_size: int,
                checkpoint_interval: int, convergence_threshold: float, agreements: list[float], bins: int,
                seed: int, progress: bool = True) -> dict:
    """Per-layer convergence on `texts` and the oracle at `agreements` (the `convergence` section). Checked
    first: the threshold is a cosine, samples fit the model's context, the interval leaves a checkpoint, and the
    model's head is the adapter's (`check_head`: every exit's logits come from it)."""
    check_real("convergence_threshold", convergence_threshold, low=-1.0, high=1.0)
    check_context(model, seq_len)
    adapter = get_adapter(model)
    check_head(model, adapter)
    n = adapter.num_layers
    layers = list(range(1, n + 1))
    checkpoints = default_checkpoints(n, checkpoint_interval)
    if not checkpoints:
        raise TideArgumentError(f"checkpoint_interval={checkpoint_interval} leaves no checkpoint before the last of "
                                f"the model's {n} layers: give at most {n - 1}")
    samples = make_samples(tokenizer, texts, num_samples, seq_len, seed, spread=True)  # many documents, not a few
    if not samples:
        raise TideDataError("no text to analyze: the documents hold no tokens")
    parts = []
    for start in tqdm(range(0, len(samples), batch_size), desc="analyze: per-layer convergence", disable=not progress):
        ids, mask = pad_right(samples[start : start + batch_size], 0)
        parts.append(_compare(adapter, _layer_states(model, adapter, ids, mask, layers), n, kl=True))
    cos, match, kl = (torch.cat([p[name] for p in parts]) for name in ("cosine", "match", "kl"))
    edges = torch.linspace(float(cos.min().clamp(max=0.0)), 1.0, bins + 1)
    clamped = cos.clamp(max=1.0)  # fp32 rounding puts identical states at 1 + 1e-7, past the last edge
    hist = torch.stack([torch.histogram(clamped[:, j], bins=edges).hist for j in range(n)], 1) / len(cos)
    return {
        "title": f"{Path(getattr(model.config, 'name_or_path', '') or model.config.model_type).name}: "
                 f"{len(cos)} tokens",
        "tokens": len(cos), "num_layers": n, "checkpoints": checkpoints, "convergence_threshold": convergence_threshold,
        "layers": [{"layer": k, "mean_cosine": float(cos[:, k - 1].mean()),
                    "cosine_label_rate": float((cos[:, k - 1] > convergence_threshold).float().mean()),
                    "top1_agreement": float(match[:, k - 1].float().mean()), "mean_kl": float(kl[:, k - 1].mean())}
                   for k in layers],
        "cosine_histogram": {"edges": edges.tolist(), "share": hist.tolist()},
        "oracle": oracle(match[:, [k - 1 for k in checkpoints]], checkpoints, n, agreements),
    }


@torch.no_grad()
def greedy_text(model: Any, prompts: list[torch.Tensor], new_tokens: int, pad_id: int) -> list[torch.Tensor]:
    """Each prompt followed by the model's own greedy continuation (stock generate, one prompt at a time)."""
    out = []
    for p in prompts:
        ids = p[None].to(model.device)
        seq = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                             do_sample=False, pad_token_id=pad_id)
        out.append(seq[0].cpu())
    return out


@torch.no_grad()
def scored_text(model: Any, router: TideRouter, texts: list[tuple[torch.Tensor, int]], checkpoints: list[int],
                 progress: bool, desc: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(top-1 match, router score) per token x checkpoint of each sequence from its position `start` on."""
    adapter = get_adapter(model)
    n = adapter.num_layers
    matches, scores = [], []
    for seq, start in tqdm(texts, desc=desc, disable=not progress):
        ids = seq[None]
        states = _layer_states(model, adapter, ids, torch.ones_like(ids), [*checkpoints, n])
        positions = slice(start, len(seq) - 1)  # positions whose next token is part of the text
        states = {k: h[positions] for k, h in states.items()}
        matches.append(_compare(adapter, states, n, kl=False, router=router)["match"][:, :-1])
        scores.append(torch.stack([torch.sigmoid(router.logit(k, adapter.normed(states[k]).float())).cpu()
                                   for k in checkpoints], 1))
    return torch.cat(matches), torch.cat(scores)


def exit_summary(match: torch.Tensor, score: torch.Tensor, thresholds: torch.Tensor, checkpoints: list[int], n: int
           ) -> dict[str, Any]:
    """Agreement and layers saved (the routers', the oracle's at that agreement) under per-checkpoint thresholds."""
    first = exit_index(score, thresholds)
    correct = torch.cat([match, torch.ones(len(match), 1, dtype=torch.bool)], 1).gather(1, first[:, None])
    agreement = int(correct.sum()) / len(correct)  # exact count: the oracle gets the same budget
    saved = n - float(torch.tensor([*checkpoints, n], dtype=torch.float64)[first].mean())
    best = oracle(match, checkpoints, n, [agreement])[0]["layers_saved"]
    return {"agreement": agreement, "layers_saved": saved, "oracle_layers_saved": best,
            "efficiency": saved / best if best > 0 else None}


@torch.no_grad()
def router_efficiency(model: Any, router: TideRouter, prompts: list[torch.Tensor], *, new_tokens: int,
                      thresholds: list[float], pad_id: int, targets: tuple[float, ...] = (), progress: bool = True,
                      heldout: tuple[torch.Tensor, ...] | list[torch.Tensor] = ()) -> dict:
    """Layers saved by the routers / by the oracle at the same agreement, on the model's own greedy text, at
    global `thresholds` and at quality `targets` (min_agreement, the router's per-checkpoint thresholds; also
    on the teacher-forced `heldout` samples when given: the agreement delivered on text like the calibration's).
    The model's head is checked first (`check_head`)."""
    adapter = get_adapter(model)
    check_head(model, adapter)
    n = adapter.num_layers
    cfg = router.config
    checkpoints = [k for k in cfg.checkpoint_layers if k >= cfg.min_layers]
    texts = [(seq, len(p) - 1) for seq, p in zip(greedy_text(model, prompts, new_tokens, pad_id), prompts)]
    match, score = scored_text(model, router, texts, checkpoints, progress, "analyze: router efficiency")
    rows = [{"threshold": t, **exit_summary(match, score, torch.full((len(checkpoints),), float(t)), checkpoints, n)}
            for t in thresholds]
    out = {"tokens": len(match), "num_layers": n, "checkpoints": checkpoints, "router": rows}
    if targets:
        chosen = {a: select(cfg.exit_paths, list(cfg.checkpoint_layers), min_agreement=a, confidence=cfg.confidence)
                  for a in targets}
        vectors = {a: torch.tensor([chosen[a][k] for k in checkpoints]) for a in targets}
        out["confidence"] = cfg.confidence
        out["targets"] = [{"target": a, "thresholds": chosen[a],
                           **exit_summary(match, score, vectors[a], checkpoints, n)} for a in targets]
        if heldout:
            h_match, h_score = scored_text(model, router, [(s, 0) for s in heldout], checkpoints, progress,
                                            "analyze: targets on held-out text")
            out["heldout_tokens"] = len(h_match)
            out["heldout_targets"] = [{"target": a, **exit_summary(h_match, h_score, vectors[a], checkpoints, n)}
                                      for a in targets]
    agreements = [r["agreement"] for r in rows + out.get("targets", [])]
    curve = sorted({round(x, AGREEMENT_DECIMALS) for x in [*ORACLE_CURVE, *agreements]})
    out["oracle"] = oracle(match, checkpoints, n, curve[::-1])
    return out


def is_analyze_result(path: Path) -> bool:
    """`path` holds what `tide-hf analyze` writes (a JSON object with its convergence section), not a file of the
    same name that something else wrote."""
    import json

    try:
        result = json.loads(path.read_text())
    except (OSError, ValueError):
        return False
    return isinstance(result, dict) and isinstance(result.get("convergence"), dict) and "settings" in result


def run(args: Any) -> dict:
    """The `tide-hf analyze` command: analyze.json, analyze.md and PNG plots in `args.output` (replacing its own
    files of an earlier analyze run there, the efficiency plot included when this run has no router)."""
    import json

    out = Path(args.output)
    check_results_folder(out, "--output", args.dataset)
    model, tokenizer = load_model(args.model, args.dtype)
    pad_id = pad_token_id(tokenizer)
    router = TideRouter.from_pretrained(args.router) if args.router else None
    texts = load_texts(default_dataset(args.dataset), unique=router is None or router.config.unique_documents)
    if router is not None:  # text the routers never saw, so their efficiency is not measured on training data
        router.check_compatible(model)
        read = len(texts)
        texts = held_out_texts(tokenizer, texts, router.config)
        if not texts:
            raise TideDataError(f"the router's calibration read every document ({read}) of {args.dataset}: measure it "
                                "on text it did not read (another --dataset, or more documents)")
        check_context(model, args.prompt_len + args.new_tokens,
                      f"--prompt-len {args.prompt_len} + --new-tokens {args.new_tokens}")
    result: dict[str, Any] = {"model": args.model, "dataset": args.dataset, "settings": {
        k: v for k, v in vars(args).items() if k != "func"}}
    if router is not None:  # refused before the forward passes and the plots, not after
        ids = [torch.tensor(tokenizer(t, add_special_tokens=False)["input_ids"]) for t in texts]
        prompts = [d[: args.prompt_len] for d in ids if len(d) > args.prompt_len][: args.num_prompts]
        if not prompts:
            raise TideDataError(f"no held-out document is longer than --prompt-len {args.prompt_len} tokens")
    result["convergence"] = convergence(
        model, tokenizer, texts, num_samples=args.num_samples, seq_len=args.seq_len, batch_size=args.batch_size,
        checkpoint_interval=args.checkpoint_interval, convergence_threshold=args.convergence_threshold,
        agreements=args.agreements, bins=args.bins, seed=args.seed)
    if router is not None:
        heldout = make_samples(tokenizer, texts, args.num_samples, args.seq_len, args.seed, spread=True)
        targets = args.targets if router.config.exit_paths else []  # (the CLI refuses --targets for such a router)
        result["efficiency"] = router_efficiency(model, router, prompts, new_tokens=args.new_tokens,
                                                 thresholds=args.thresholds, pad_id=pad_id, targets=targets,
                                                 heldout=heldout)
    # every file is written once every figure is measured: an interrupted run leaves an earlier run's files whole
    out.mkdir(parents=True, exist_ok=True)
    files = [plot_convergence(result["convergence"], out / "convergence.png"),
             plot_heatmap(result["convergence"], out / "heatmap.png")]
    if router is not None:
        files.append(plot_efficiency(result["efficiency"], out / "efficiency.png"))
    elif is_analyze_result(out / "analyze.json"):  # an earlier run's plot describes a router this run does not name
        (out / "efficiency.png").unlink(missing_ok=True)  # (a folder no analyze wrote keeps a file of that name)
    (out / "analyze.json").write_text(json.dumps(result, indent=2))
    table = format_analysis(result)
    (out / "analyze.md").write_text(table + "\n")
    print(table)
    print("plots:", ", ".join(str(f) for f in files))
    return result
