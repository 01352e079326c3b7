"""Offline router experiment, step 1: collect checkpoint features, labels and cheap extra inputs ONCE.

Documents the shipped 800-sample router never read (SOTU, `held_out_texts`) are split by document into
train / val (early stopping, path ordering) / test (Learn-then-Test losses) / held-out A / held-out B, a few
chunks per document so every split spans many speeches. `tide_hf.calibration.labels.collect` computes the
normed features and the top-1 / KL / NLL labels of every kept token; extra forward hooks record, per token and
checkpoint k, quantities the runtime hook has at hand: the pre-norm state's log RMS, its cosine with the
layer's input (one layer of movement) and with the previous checkpoint's state (the embedding output for the
first checkpoint). Labels come from the shipped router's exit heads (the logits exits really use); with a draft
vocabulary in it, three more inputs read the exit logits over its first `--conf-vocab` tokens: the top
probability there ("conf"), the top-1 minus top-2 logit ("margin"), and whether the top token equals the
previous checkpoint's ("stable"; 0 at the first).

    PYTHONPATH=. python benchmarks/router_features.py --shipped my-router --out /tmp/r12x/data.safetensors
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from tide_hf.assets import load_model, smollm2_path, sotu_path
from tide_hf.calibration import load_texts, pad_right
from tide_hf.calibration.labels import collect, label
from tide_hf.calibration.samples import document_chunks, held_out_texts
from tide_hf.config import TideRouterConfig
from tide_hf.modeling import TideRouter, get_adapter, layer_output

SPLITS = ("train", "val", "test", "a", "b")
PER_LAYER = ("features", "top1", "kl", "nll")
META = ("splits", "layers", "num_layers", "seconds", "kl_threshold")


def save_features(out: dict[str, Any], path: str) -> None:
    """The collected features as safetensors (per-layer tensors under "name/layer", extras under
    "extra/name/layer"), the scalars and lists as JSON metadata: no pickle on either side."""
    tensors = {f"{name}/{k}": t.contiguous() for name in PER_LAYER for k, t in out[name].items()}
    tensors |= {f"extra/{n}/{k}": t.contiguous() for n, d in out["extra"].items() for k, t in d.items()}
    tensors |= {"split": out["split"], "sample": out["sample"]}
    save_file(tensors, path, metadata={"meta": json.dumps({m: out[m] for m in META})})


def load_features(path: str) -> dict[str, Any]:
    """What `save_features` wrote, in the shape `main` built it (layers as int keys)."""
    with safe_open(path, "pt") as f:
        meta = json.loads(f.metadata()["meta"])
    tensors = load_file(path)
    out: dict[str, Any] = {**meta, "splits": tuple(meta["splits"]), "split": tensors.pop("split"),
                           "sample": tensors.pop("sample"), "extra": {}}
    for name in PER_LAYER:
        out[name] = {}
    for key, t in tensors.items():
        parts = key.split("/")
        if parts[0] == "extra":
            out["extra"].setdefault(parts[1], {})[int(parts[2])] = t
        else:
            out[parts[0]][int(parts[1])] = t
    return out


def split_samples(tokenizer: Any, texts: list[str], docs: dict[str, int], chunks_per_doc: int, seq_len: int,
                  seed: int) -> tuple[list[torch.Tensor], list[str]]:
    """Samples of whole documents (their first chunks) assigned to the splits in order, and each one's split."""
    want = [name for name in SPLITS for _ in range(docs[name])]
    samples, names = [], []
    for (_, doc), name in zip(document_chunks(tokenizer, texts, seq_len, seed), want):
        chunks = [c for c in doc if len(c) > 1][:chunks_per_doc]
        samples += chunks
        names += [name] * len(chunks)
    return samples, names


@torch.no_grad()
def exit_confidence(features: dict[int, torch.Tensor], router: TideRouter, adapter: Any, size: int
                    ) -> dict[str, dict[int, torch.Tensor]]:
    """Per checkpoint: top probability, top-1 minus top-2 logit, and top-token stability of the exit logits over
    the router's first `size` draft-vocabulary tokens."""
    weight = adapter.lm_head.weight[router.draft_vocab[:size]].float()
    out: dict[str, dict[int, torch.Tensor]] = {"conf": {}, "margin": {}, "stable": {}}
    previous = None
    for k, f in features.items():
        logits = torch.cat([adapter.normed(router.mapped(k, part)) @ weight.T for part in f.split(4096)])
        top = logits.topk(2, dim=-1)
        out["conf"][k] = top.values[:, 0].sub(logits.logsumexp(-1)).exp()
        out["margin"][k] = top.values[:, 0] - top.values[:, 1]
        out["stable"][k] = torch.zeros(len(f)) if previous is None else (top.indices[:, 0] == previous).float()
        previous = top.indices[:, 0]
    return out


@torch.no_grad()
def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--docs", type=int, nargs=5, default=[64, 16, 16, 16, 16], help="documents per split")
    parser.add_argument("--chunks-per-doc", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--keep", type=float, default=0.7, help="share of tokens kept")
    parser.add_argument("--shipped", required=True, help="a router folder: its calibration documents are skipped")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--conf-vocab", type=int, default=1024, help="draft-vocabulary tokens the extra inputs read")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, tokenizer = load_model(str(smollm2_path()))
    texts = load_texts(str(sotu_path()))
    shipped = TideRouterConfig.from_pretrained(args.shipped)
    unseen = held_out_texts(tokenizer, texts, shipped)
    samples, names = split_samples(tokenizer, unseen, dict(zip(SPLITS, args.docs)), args.chunks_per_doc,
                                   args.seq_len, seed=1)
    adapter = get_adapter(model)
    total = sum(len(s) for s in samples)
    cfg = TideRouterConfig(hidden_size=model.config.hidden_size, num_hidden_layers=adapter.num_layers,
                           label="top1_kl", max_train_tokens=int(args.keep * total), seed=0, exit_head="lens")
    layers = list(cfg.checkpoint_layers)
    # the same kept-token draw as collect()'s
    gen = torch.Generator().manual_seed(cfg.seed)
    keep_p = min(1.0, cfg.max_train_tokens / max(total, 1))
    keep = [torch.rand(len(s), generator=gen) < keep_p for s in samples]
    states: dict[int, torch.Tensor] = {}
    extra: dict[str, dict[int, list[torch.Tensor]]] = {n: {k: [] for k in layers} for n in ("log_rms", "move1", "move")}
    batch_sel: list[torch.Tensor] = []
    prev = {k: (layers[i - 1] if i else 0) for i, k in enumerate(layers)}

    def store(layer: int, hidden: torch.Tensor) -> None:
        states[layer] = hidden.float()
        if layer in layers:
            sel = batch_sel[0]
            h = states[layer]
            extra["log_rms"][layer].append(h.pow(2).mean(-1).add(1e-12).log().mul(0.5)[sel])
            extra["move1"][layer].append(1 - F.cosine_similarity(h, states[layer - 1], dim=-1)[sel])
            extra["move"][layer].append(1 - F.cosine_similarity(h, states[prev[layer]], dim=-1)[sel])

    wanted = sorted({0, *layers, *(k - 1 for k in layers)})
    handles = [adapter.embeddings.register_forward_hook(lambda _m, _a, out: store(0, out))]
    for layer in wanted:
        if layer:
            handles.append(adapter.layers[layer - 1].register_forward_hook(
                lambda _m, _a, out, layer=layer: store(layer, layer_output(out))))
    batch_size = 8

    starts = iter(range(0, len(samples), batch_size))

    def pre(_m: Any, _a: Any) -> None:
        start = next(starts)
        sel, _ = pad_right(keep[start : start + batch_size], 0)
        batch_sel[:] = [sel.bool()]
    handles.append(adapter.embeddings.register_forward_pre_hook(pre))
    t0 = time.perf_counter()
    try:
        data = collect(model, adapter, samples, cfg, batch_size=batch_size, pad_id=0, progress=True)
    finally:
        for h in handles:
            h.remove()
    router = TideRouter.from_pretrained(args.shipped)  # labels through the exits' own logits (its exit heads)
    router.config.label = cfg.label
    label(data, adapter, router, device=torch.device("cpu"))
    if hasattr(router, "draft_vocab"):
        extra.update({n: {k: [t] for k, t in d.items()} for n, d in
                      exit_confidence(data.features, router, adapter, args.conf_vocab).items()})
    which = torch.cat([torch.full((int(k.sum()),), SPLITS.index(n)) for k, n in zip(keep, names)])
    doc_of = torch.cat([torch.full((int(k.sum()),), i) for i, k in enumerate(keep)])
    out = {"features": data.features, "top1": data.top1, "kl": data.kl, "nll": data.nll,
           "extra": {n: {k: torch.cat(v) for k, v in d.items()} for n, d in extra.items()},
           "split": which, "sample": doc_of, "splits": SPLITS, "layers": layers,
           "num_layers": adapter.num_layers, "seconds": time.perf_counter() - t0, "kl_threshold": cfg.kl_threshold}
    if not len(which) == len(data.top1[layers[0]]) == len(out["extra"]["move"][layers[0]]):
        raise RuntimeError("the extra hooks saw other tokens than collect() kept: the kept-token draws differ")
    save_features(out, args.out)
    print({n: int((which == i).sum()) for i, n in enumerate(SPLITS)}, f"{out['seconds']:.0f} s")


if __name__ == "__main__":
    main()
