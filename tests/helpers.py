"""Shared test helpers: a byte-level tokenizer, tiny random Llamas, routers with known decisions, the
stock reference TIDE must reproduce, small local text datasets, and one tiny random model per family (all offline)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import transformers
from transformers import AutoModelForCausalLM, CohereConfig, GraniteConfig, LlamaConfig, LlamaForCausalLM

import tide_hf
from tide_hf import TideRouter, TideRouterConfig
from tide_hf.record import flatten_record

WORDS = ("the", "state", "of", "union", "is", "strong", "we", "will", "build", "a", "nation", "people",
         "work", "together", "for", "our", "children", "future", "and", "peace", "congress", "law")


class ByteTokenizer:
    """The tokenizer interface calibration uses: `tok(text, add_special_tokens=False)["input_ids"]`, `pad_token_id`."""

    pad_token_id = 0
    vocab_size = 256

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        return {"input_ids": list(text.encode("utf-8"))}


def make_tiny_llama(num_layers: int = 9, hidden: int = 32, seed: int = 0, vocab: int = 256):
    """A seeded random Llama in eval mode (fp32), its RMSNorm weights randomized (at init they are all 1,
    which would make a norm indistinguishable from a per-token rescaling) and its head scaled up."""
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 1:
                param.copy_(torch.randn_like(param) * 0.5 + 1.0)
        model.lm_head.weight.mul_(10.0)  # peaked next-token distributions: KL / top-1 labels are not trivial
    return model


def make_documents(count: int, words: int, seed: int = 0) -> list[str]:
    """Deterministic pseudo-English documents of `words` words each."""
    gen = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, len(WORDS), (count, words), generator=gen).tolist()
    return [" ".join(WORDS[i] for i in row) + "." for row in idx]


# -- tiny Llamas and routers for the attach / generate tests --------------------------------------
NUM_LAYERS = 9  # checkpoints every 4 layers: [4, 8]


def make_model(seed: int = 0, hidden: int = 64, layers: int = NUM_LAYERS) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=256, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         pad_token_id=0, bos_token_id=1, eos_token_id=2)
    return LlamaForCausalLM(config).eval()


# an exit path (calibration's certified table for one quality target) that opens checkpoint 4 at threshold 0.9
CLOSED_PATH = {"thresholds": [[1.0, 1.0], [0.9, 1.0]], "errors": [0, 2], "n": 100, "nll_sum": [0.0, 0.5],
               "nll_sumsq": [0.0, 0.5], "n_next": 90}


def router_config(**fields) -> TideRouterConfig:
    """A router config for a 9-layer, 64-wide model (lens exit heads unless `fields` says otherwise)."""
    return TideRouterConfig(hidden_size=64, num_hidden_layers=9, router_bottleneck_dim=8,
                            **{"exit_head": "lens", **fields})


def inline_record(folder: Path) -> dict:
    """Turn a saved router's config.json into the layout before its "calibration" section (release 0.1.0:
    provenance and results at the top level) and return its dict, for a test to edit and write back."""
    config = flatten_record(json.loads((folder / "config.json").read_text()))
    (folder / "config.json").write_text(json.dumps(config))
    return config


def new_router(model, seed: int = 0, **config) -> TideRouter:
    torch.manual_seed(seed)
    return TideRouter(TideRouterConfig(
        hidden_size=model.config.hidden_size, num_hidden_layers=model.config.num_hidden_layers,
        router_bottleneck_dim=16, base_architecture=type(model).__name__,
        base_fingerprint=tide_hf.modeling.model_fingerprint(model), **{"exit_head": "lens", **config}))


def positions(mask: torch.Tensor) -> torch.Tensor:
    return (mask.cumsum(-1) - 1).clamp(min=0)


HOOK_DICTS = (
    "_forward_hooks",
    "_forward_pre_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_pre_hooks_with_kwargs",
    "_forward_hooks_always_called",
    "_backward_hooks",
    "_backward_pre_hooks",
)


def hooks(model) -> dict:
    """Every hook dict of every module (copies). Compared to a snapshot, never to "empty": transformers
    itself leaves output-capturing hooks on the layers after the first `output_hidden_states=True` call."""
    return {name: {attr: dict(getattr(mod, attr)) for attr in HOOK_DICTS} for name, mod in model.named_modules()}


@torch.no_grad()
def reference(model, router, ids, mask=None, *, threshold: float = 0.5, min_layers: int = 4):
    """(exit layer per position, TIDE logits) from a stock output_hidden_states run, router applied by hand."""
    assert tide_hf.get_handle(model) is None, "the reference needs the stock model"
    kwargs = {} if mask is None else {"attention_mask": mask, "position_ids": positions(mask)}
    out = model(ids, output_hidden_states=True, **kwargs)
    exit_layer = torch.full(ids.shape, NUM_LAYERS, dtype=torch.long)
    logits = out.logits.clone()
    for k in router.checkpoint_layers:
        if k < min_layers:
            continue
        hidden = out.hidden_states[k]
        score = torch.sigmoid(router.logit(k, model.model.norm(hidden).float()))
        exits = (exit_layer == NUM_LAYERS) & (score >= threshold)
        exit_layer[exits] = k
        logits[exits] = model.lm_head(model.model.norm(exit_state_by_hand(model, router, k, hidden)))[exits]
    return exit_layer, logits


def exit_state_by_hand(model, router, layer: int, hidden: torch.Tensor) -> torch.Tensor:
    """What the final norm reads for a token exiting at `layer`: `hidden`, or its exit head's map of
    norm(hidden), written out as a matmul."""
    if router.config.exit_head == "lens":
        return hidden
    head = router.exit_heads[str(layer)]
    low = model.model.norm(hidden) @ head.down.weight.T + head.down.bias
    return low if router.config.exit_head_rank is None else low @ head.up.weight.T


@torch.no_grad()
def mixed_router(model, ids, mask=None, seed: int = 1, quantiles=(0.6, 0.5), **config) -> TideRouter:
    """A router whose scores are far from 0.5 nearly everywhere and whose decisions mix 4 / 8 / no exit.

    Random weights scaled up so scores saturate; each checkpoint's bias puts the 0.5 threshold in the
    middle of a gap between two sorted logits of the calibration batch (robust to float noise).
    """
    router = new_router(model, seed=seed, **config)
    kwargs = {} if mask is None else {"attention_mask": mask, "position_ids": positions(mask)}
    out = model(ids, output_hidden_states=True, **kwargs)
    valid = torch.ones(ids.shape, dtype=torch.bool) if mask is None else mask.bool()
    for k, q in zip(router.checkpoint_layers, quantiles):
        mlp = router.routers[str(k)]
        mlp.fc2.weight.mul_(40.0)
        mlp.fc2.bias.zero_()
        logits = router.logit(k, model.model.norm(out.hidden_states[k]).float())[valid].sort().values
        i = max(1, int(q * len(logits)))
        mlp.fc2.bias.fill_(-float(logits[i - 1] + logits[i]) / 2)
    return router


@torch.no_grad()
def constant_router(model, logit: float, **config) -> TideRouter:
    """Score sigmoid(logit) everywhere: +30 -> 1.0 (always exit at the first eligible checkpoint), -30 -> never."""
    router = new_router(model, **config)
    for mlp in router.routers.values():
        mlp.fc2.weight.zero_()
        mlp.fc2.bias.fill_(logit)
    return router


def left_padded(seed: int = 0, lengths=(7, 5, 3)) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded input_ids (pad 0, tokens from 3 up so no prompt holds BOS/EOS) and attention_mask."""
    gen = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.zeros(len(lengths), width, dtype=torch.long)
    mask = torch.zeros(len(lengths), width, dtype=torch.long)
    for row, n in enumerate(lengths):
        ids[row, width - n:] = torch.randint(3, 256, (n,), generator=gen)
        mask[row, width - n:] = 1
    return ids, mask


def scaled_logit_model(family: str, scale: float, *, vocab: int, layers: int) -> torch.nn.Module:
    """A tiny random Granite (logits / `scale`) or Cohere (logits x `scale`): a head that scales the logits."""
    base = dict(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    config = GraniteConfig(**base, logits_scaling=scale) if family == "granite" else CohereConfig(**base,
                                                                                                 logit_scale=scale)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).eval()


# -- one tiny random model per family (the rows of docs/reference/architectures.md) ---------------------
FAMILY_VOCAB, FAMILY_EOS = 128, 2
_HIDDEN, _LAYERS = 32, 5
# untied heads: with tied ones, a tiny random GPT-2 or Gemma picks the same tokens at every depth (the residual
# stream still carries the token's own embedding), and an exit would not show in the tokens
_SPECIAL = dict(vocab_size=FAMILY_VOCAB, pad_token_id=0, bos_token_id=1, eos_token_id=FAMILY_EOS,
                tie_word_embeddings=False)
_LLAMA_LIKE = dict(_SPECIAL, hidden_size=_HIDDEN, intermediate_size=2 * _HIDDEN, num_hidden_layers=_LAYERS,
                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)

# family (the table's row) -> its tiny config
FAMILIES: dict[str, Callable[[], Any]] = {
    "llama": lambda: transformers.LlamaConfig(**_LLAMA_LIKE),
    "mistral": lambda: transformers.MistralConfig(**_LLAMA_LIKE, sliding_window=None),
    "mistral-window": lambda: transformers.MistralConfig(**_LLAMA_LIKE, sliding_window=4),  # as Mistral-7B-v0.1
    "mixtral": lambda: transformers.MixtralConfig(**_LLAMA_LIKE, num_local_experts=2, num_experts_per_tok=1),
    "qwen2": lambda: transformers.Qwen2Config(**_LLAMA_LIKE),
    "qwen3": lambda: transformers.Qwen3Config(**_LLAMA_LIKE, head_dim=8),
    "gemma": lambda: transformers.GemmaConfig(**_LLAMA_LIKE, head_dim=8),
    "gemma2": lambda: transformers.Gemma2Config(**_LLAMA_LIKE, head_dim=8, sliding_window=4),
    "gemma3": lambda: transformers.Gemma3TextConfig(**_LLAMA_LIKE, head_dim=8, sliding_window=4),
    "phi": lambda: transformers.PhiConfig(**_LLAMA_LIKE),
    "phi3": lambda: transformers.Phi3Config(**_LLAMA_LIKE),
    "gpt2": lambda: transformers.GPT2Config(**_SPECIAL, n_embd=_HIDDEN, n_layer=_LAYERS, n_head=4, n_positions=64),
    "gpt_neox": lambda: transformers.GPTNeoXConfig(**_SPECIAL, hidden_size=_HIDDEN, intermediate_size=2 * _HIDDEN,
                                                   num_hidden_layers=_LAYERS, num_attention_heads=4,
                                                   max_position_embeddings=64),
    "opt": lambda: transformers.OPTConfig(**_SPECIAL, hidden_size=_HIDDEN, ffn_dim=2 * _HIDDEN,
                                          num_hidden_layers=_LAYERS, num_attention_heads=4,
                                          max_position_embeddings=64, word_embed_proj_dim=_HIDDEN),
    "falcon": lambda: transformers.FalconConfig(**_SPECIAL, hidden_size=_HIDDEN, num_hidden_layers=_LAYERS,
                                                num_attention_heads=4, max_position_embeddings=64),
}


def make_family(family: str) -> torch.nn.Module:
    """The family's tiny random model (seeded), in eval mode."""
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(FAMILIES[family]()).eval()


# -- skip mode: a vocabulary-128 Llama (or another family) and constant routers (test_skip, test_compaction, bench) ----
def skip_model(config_cls=LlamaConfig, seed: int = 0, **extra):
    """A seeded random model of `config_cls` with NUM_LAYERS layers and a 128-token vocabulary, in eval mode."""
    torch.manual_seed(seed)
    config = config_cls(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=NUM_LAYERS,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                        pad_token_id=0, eos_token_id=2, **extra)
    return AutoModelForCausalLM.from_config(config).eval()


def router_for(model, logit: float) -> TideRouter:
    """A router whose score is sigmoid(logit) everywhere: +30 always exits, -30 never (the global RNG untouched)."""
    cfg = model.config
    router = TideRouter(TideRouterConfig(
        hidden_size=cfg.hidden_size, num_hidden_layers=cfg.num_hidden_layers, router_bottleneck_dim=8,
        base_architecture=type(model).__name__, base_fingerprint=tide_hf.modeling.model_fingerprint(model),
        exit_head="lens"))
    with torch.no_grad():
        for mlp in router.routers.values():
            mlp.fc2.weight.zero_()
            mlp.fc2.bias.fill_(logit)
    return router


def skip_prompts() -> tuple[torch.Tensor, torch.Tensor]:
    """Three 6-token prompts of a 128-token vocabulary, rows 1 and 2 left-padded by 2 and 4."""
    ids = torch.randint(3, 128, (3, 6), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :2] = 0  # left padding
    mask[2, :4] = 0
    return ids, mask


# -- compiled decoding (test_compile, test_compile_skip) ------------------------------------------------------------
def compiled(backend: str = "aot_eager"):
    """transformers' CompileConfig, allowed on the CPU; aot_eager traces like inductor without its codegen."""
    from transformers import CompileConfig

    config = CompileConfig(fullgraph=True, backend=backend, mode=None)
    config._compile_all_devices = True
    return config


def greedy(model, ids, mask, new_tokens: int, **kwargs) -> torch.Tensor:
    """Greedy generate of exactly `new_tokens` new tokens (pad 0)."""
    return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                          do_sample=False, pad_token_id=0, **kwargs)


# -- speculative mode (test_speculative*) ---------------------------------------------------------------------------
NEW = 16  # new tokens per speculative call
SPECULATIVE_HOOK_DICTS = ("_forward_hooks", "_forward_pre_hooks", "_forward_hooks_with_kwargs",
                          "_forward_pre_hooks_with_kwargs")


def speculative_model(kind: str = "random", seed: int = 0):
    """'random': drafts at layer 4 rarely agree with the full model. 'shallow': layers 5-9 barely write to
    the residual stream (o_proj / down_proj scaled by 1e-3), so layer-4 drafts are almost always right."""
    from tide_bench.easy import make_near_identity

    model = make_tiny_llama(num_layers=NUM_LAYERS, hidden=64, seed=seed)
    return make_near_identity(model, 4, scale=1e-3) if kind == "shallow" else model


@torch.no_grad()
def speculative_router(model, gate: str, seed: int = 0, prior: bool = True, exit_head: str = "lens") -> TideRouter:
    """'always' (+30: converged everywhere), 'never' (-30), 'mixed' (saturated random scores around 0.5).

    `prior`: calibration metrics with the top-1 agreement the gate's rate implies (the policy's prior
    acceptance; without them it starts from `DEFAULT_ACCEPTANCE`).
    """
    torch.manual_seed(seed)
    rate = {"always": 1.0, "never": 0.0, "mixed": 0.5}[gate]
    router = TideRouter(TideRouterConfig(
        hidden_size=model.config.hidden_size, num_hidden_layers=model.config.num_hidden_layers,
        router_bottleneck_dim=16, base_architecture=type(model).__name__, label="top1", exit_head=exit_head,
        base_fingerprint=tide_hf.modeling.model_fingerprint(model),
        metrics={"4": {"predicted_rate": rate, "precision": 1.0, "label_rates": {"top1": rate}}} if prior else None))
    for mlp in router.routers.values():
        if gate == "mixed":
            mlp.fc2.weight.mul_(40.0)
            mlp.fc2.bias.zero_()
        else:
            mlp.fc2.weight.zero_()
            mlp.fc2.bias.fill_(30.0 if gate == "always" else -30.0)
    return router


def snapshot(model) -> tuple:
    """The model's attributes, forward hooks and configs: what a call must leave as it found them."""
    hook_dicts = {name: {attr: dict(getattr(mod, attr)) for attr in SPECULATIVE_HOOK_DICTS}
                  for name, mod in model.named_modules()}
    return set(model.__dict__), hook_dicts, model.config.to_dict(), model.generation_config.to_dict()


def counter(module) -> list[int]:
    """A one-item list counting the module's forward calls from now on."""
    calls = [0]
    module.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    return calls


@torch.no_grad()
def speculative(model, router, *args, draft_layer: int = 4, threshold: float = 0.5, **kwargs):
    """(generate's output, the call's stats) with the router attached in speculative mode, detached after."""
    handle = tide_hf.attach(model, router, mode="speculative", exit_threshold=threshold, draft_layer=draft_layer)
    try:
        out = model.generate(*args, **kwargs)
        return out, handle.last_stats
    finally:
        handle.detach()


# -- a model shared across tests (conftest's session-scoped SmolLM2): what a test may not leave on it -----------------
def stock_state(model) -> dict:
    """What `left_behind` compares to: each module's instance attributes (patched methods show there), hooks and
    train / eval mode, each parameter's in-place write counter, and a checksum of each parameter's values."""
    modules = {name: (dict(vars(mod)), {attr: set(getattr(mod, attr)) for attr in HOOK_DICTS}, mod.training)
               for name, mod in model.named_modules()}
    params = {name: (p._version, p.dtype, p.device, _checksum(p)) for name, p in model.named_parameters()}
    return {"modules": modules, "params": params}


def _checksum(param: torch.Tensor) -> float:
    with torch.no_grad():
        return float(param.detach().sum(dtype=torch.float64))


def _origin(hook) -> str:
    """The module a hook's function was defined in (a bound method's or a partial's function included)."""
    fn = getattr(hook, "func", hook)
    return getattr(getattr(fn, "__func__", fn), "__module__", "") or ""


TRANSFORMERS_MARKS = {"_output_capturing_hooks_installed"}  # what transformers adds at its first hidden-states call


def left_behind(model, stock: dict) -> list[str]:
    """What differs from `stock` (a `stock_state` of the same model): an attached TIDE handle, module attributes
    added or replaced, hooks added (but transformers' own output-capturing hooks), a module left in train mode,
    weights of another dtype / device or written in place and not restored. Empty: the model is as loaded."""
    found = ["a TIDE handle is still attached"] if tide_hf.get_handle(model) is not None else []
    modules = dict(model.named_modules())
    if set(modules) != set(stock["modules"]):
        found.append(f"modules added or removed: {sorted(set(modules) ^ set(stock['modules']))[:5]}")
    for name, (attrs, hook_keys, training) in stock["modules"].items():
        mod = modules.get(name)
        if mod is None:
            continue
        now = vars(mod)
        added = sorted(set(now) - set(attrs) - TRANSFORMERS_MARKS)
        replaced = sorted(k for k in attrs if k in now and now[k] is not attrs[k] and callable(attrs[k]))
        if added or replaced:
            found.append(f"{name or 'model'}: attributes added {added}, replaced {replaced}")
        for attr, keys in hook_keys.items():
            new = [h for k, h in getattr(mod, attr).items() if k not in keys]
            if any(not _origin(h).startswith("transformers") for h in new):
                found.append(f"{name or 'model'}.{attr}: hooks left {[_origin(h) for h in new]}")
        if mod.training != training:
            found.append(f"{name or 'model'} left in {'train' if mod.training else 'eval'} mode")
    for name, param in model.named_parameters():
        version, dtype, device, checksum = stock["params"].get(name, (None, None, None, None))
        if (param.dtype, param.device) != (dtype, device):
            found.append(f"parameter {name}: {param.dtype} on {param.device}, loaded as {dtype} on {device}")
        elif param._version != version and _checksum(param) != checksum:
            found.append(f"parameter {name} written in place and not restored")
    return found
