"""The family x mode table of docs/reference/architectures.md, cell by cell, on tiny random models of each family.

A supported cell generates stock's greedy tokens at exit_threshold 1.0 and with a router that never exits (its
hooks and replaced forwards in place), and, with a router that always exits at the first checkpoint, runs with
every decoded token exiting there: select and skip mode then give the tokens the model's head picks from that
checkpoint's state (a plain forward, read by hand), speculative mode stock's tokens with every step's draft gate
open. A refused cell raises its `TideError` at attach, naming the model, the mode and the way out, and leaves the
model as found. The table's first column, what a plain `attach(model, router)` serves, is checked too: speculative
mode, else skip mode with kv="recompute", else select mode, with a `ModeFallbackWarning`.
"""

from __future__ import annotations

import functools
import re
import warnings

import pytest
import torch
import transformers
from helpers import FAMILIES, FAMILY_EOS, FAMILY_VOCAB, constant_router, hooks, new_router

import tide_hf
from tide_hf.errors import TideError
from tide_hf.modeling import get_adapter, layer_output
from tide_hf.runtime import ModeFallbackWarning

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")
CHECKPOINT = 2  # routers with checkpoint_interval=2: checkpoints [2, 4]; tokens that exit leave at 2
NEW_TOKENS = 4
MODES: dict[str, dict[str, str]] = {
    "select": dict(mode="select"),
    "skip-propagate": dict(mode="skip", kv="propagate"),
    "skip-recompute": dict(mode="skip", kv="recompute"),
    "speculative": dict(mode="speculative"),
}
_PARTS = "lacks .*: skip mode supports Llama-style attention"  # blocks without Llama's attention parts
_DEPTH = "ignores config.num_hidden_layers"  # forwards that run every layer whatever the config says
_WINDOW = "sliding-window attention; kv='recompute' supports full attention"
# (family, mode) -> what its refusal says; every other cell is supported
REFUSED: dict[tuple[str, str], str] = {
    ("mistral-window", "skip-recompute"): _WINDOW,
    ("gemma2", "skip-recompute"): _WINDOW,
    ("gemma3", "skip-recompute"): _WINDOW,
    **{("phi3", mode): _PARTS for mode in ("skip-propagate", "skip-recompute")},
    **{(family, mode): _PARTS for family in ("gpt2", "gpt_neox", "opt", "falcon")
       for mode in ("skip-propagate", "skip-recompute")},
    **{(family, "speculative"): _DEPTH for family in ("gpt2", "gpt_neox", "opt", "falcon")},
}
CELLS = [(family, mode) for family in FAMILIES for mode in MODES]
# families on which a plain attach (mode "auto") falls back to select mode: skip mode with kv="recompute" is refused
FALLS_BACK = {family for family, mode in REFUSED if mode == "skip-recompute"}


@functools.cache
def setup(family: str) -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor]:
    """(the family's tiny random model, a 2-row prompt, stock's greedy tokens for it)."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(FAMILIES[family]()).eval()
    ids = torch.randint(3, FAMILY_VOCAB, (2, 6), generator=torch.Generator().manual_seed(1))
    return model, ids, generate(model, ids)


def generate(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                          min_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)


def attach(model: torch.nn.Module, logit: float | None, threshold: float, mode: str) -> tide_hf.runtime.TideHandle:
    """Attach a router scoring sigmoid(`logit`) everywhere (None: a random router) at checkpoints 2 and 4."""
    router = new_router(model, checkpoint_interval=2) if logit is None else \
        constant_router(model, logit, checkpoint_interval=2)
    return tide_hf.attach(model, router, exit_threshold=threshold, min_layers=CHECKPOINT, **MODES[mode])


@torch.no_grad()
def assert_picked_from_the_checkpoint(model: torch.nn.Module, prompt: torch.Tensor, out: torch.Tensor) -> None:
    """Each generated token is the argmax (up to float noise; EOS barred by min_new_tokens) of the model's head
    on layer CHECKPOINT's state of the sequence so far, read by hand from a plain forward of the output."""
    adapter, states = get_adapter(model), []
    hook = adapter.layers[CHECKPOINT - 1].register_forward_hook(lambda _m, _a, o: states.append(layer_output(o)))
    try:
        model(input_ids=out, attention_mask=torch.ones_like(out), use_cache=False)
    finally:
        hook.remove()
    logits = adapter.logits(states[0]).float()[:, prompt.shape[1] - 1 : -1]
    logits[..., FAMILY_EOS] = -float("inf")
    picked = logits.gather(-1, out[:, prompt.shape[1]:, None]).squeeze(-1)
    assert torch.all(picked >= logits.max(-1).values - 1e-4), (picked, logits.max(-1).values)


@pytest.mark.parametrize(("family", "mode"), [cell for cell in CELLS if cell not in REFUSED])
def test_supported_cell(family: str, mode: str) -> None:
    model, ids, stock = setup(family)
    for logit, threshold in ((None, 1.0), (-30.0, 0.5)):  # exits off; open checkpoints that never exit
        with attach(model, logit, threshold, mode):
            assert torch.equal(generate(model, ids), stock), (logit, threshold)
    with attach(model, 30.0, 0.5, mode) as handle:  # every token exits at the first checkpoint
        out = generate(model, ids)
        stats = handle.last_stats
    if mode == "speculative":  # drafts from layer 2, verified by the full model: stock's tokens
        assert torch.equal(out, stock)
        spec = stats.speculative  # the router opened every step's gate; the planner weighed drafting (random
        # weights: drafts are rejected, and it may stop drafting after the first calls)
        assert spec["gate_skips"] == 0 and spec["planned"] + spec["plan_skips"] > 0, spec
        return
    decoded = ids.shape[0] * (NEW_TOKENS - 1)
    assert dict(stats.decode.exits) == {CHECKPOINT: decoded}
    if mode != "select":  # the layers after the checkpoint never ran for a decoded token
        assert dict(stats.decode.executed) == {CHECKPOINT: decoded}
    assert_picked_from_the_checkpoint(model, ids, out)


@pytest.mark.parametrize(("family", "mode"), sorted(REFUSED))
def test_refused_cell(family: str, mode: str) -> None:
    model, _, _ = setup(family)
    before = hooks(model)
    with pytest.raises(TideError, match=REFUSED[family, mode]) as info:
        attach(model, 30.0, 0.5, mode)
    message = str(info.value)
    assert type(model).__name__ in message and f"mode='{MODES[mode]['mode']}'" in message, message
    assert "use mode='select'" in message or "use kv='propagate' or mode='select'" in message, message  # way out
    if mode == "speculative" and (family, "skip-propagate") in REFUSED:  # no way out that is refused too
        assert "'skip'" not in message, message
    assert tide_hf.get_handle(model) is None and hooks(model) == before


@pytest.mark.parametrize("family", list(FAMILIES))
def test_plain_attach(family: str) -> None:
    """A plain `attach(model, router)` serves speculative mode (stock's tokens); where the family refuses it, skip
    mode with kv="recompute", else select mode (every layer; no compute saved), with a `ModeFallbackWarning`
    naming each refusal. An exit setting given alone asks for skip mode first."""
    model, _, _ = setup(family)
    router = constant_router(model, 30.0, checkpoint_interval=2)
    for options, first in (({}, "speculative"), ({"exit_threshold": 0.5}, "skip-recompute")):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with tide_hf.attach(model, router, **options) as handle:
                served, reason = (handle.options.mode, handle.options.kv), handle.options.reason
        fallbacks = [str(w.message) for w in caught if issubclass(w.category, ModeFallbackWarning)]
        order = list(dict.fromkeys((first, "skip-recompute", "select")))
        served_cell = next(mode for mode in order if (family, mode) not in REFUSED)  # the first the family serves
        refused = order[:order.index(served_cell)]
        expected = served_cell.split("-")[0]
        assert served[0] == expected and reason.startswith("attach's default"), (options, served, reason)
        if expected == "skip":
            assert served[1] == "recompute"
        if not refused:
            assert not fallbacks, (options, fallbacks)
            continue
        assert len(fallbacks) == 1 and all(re.search(REFUSED[family, mode], fallbacks[0]) for mode in refused)
        assert ("no compute saved" in fallbacks[0]) == (expected == "select"), fallbacks
