"""Easy-model fixtures: near-identity deep layers, checked against a copy of the weights and against the
agreement of the exit at `keep` with the final layer before and after."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import make_tiny_llama
from transformers import GPT2Config, GPT2LMHeadModel

from tide_bench.easy import make_near_identity
from tide_hf.errors import TideArgumentError


@torch.no_grad()
def exit_agreement(model, ids: torch.Tensor, layer: int) -> float:
    out = model(ids, output_hidden_states=True)
    exit_top1 = model.lm_head(model.model.norm(out.hidden_states[layer])).argmax(-1)
    return float((exit_top1 == out.logits.argmax(-1)).float().mean())


def test_only_deep_residual_writers_are_scaled():
    model = make_tiny_llama(num_layers=9, hidden=32)
    before = copy.deepcopy(model.state_dict())
    make_near_identity(model, 4, scale=0.25)
    for name, tensor in model.state_dict().items():
        deep = name.startswith("model.layers.") and int(name.split(".")[2]) >= 4
        scaled = deep and name.endswith(("self_attn.o_proj.weight", "mlp.down_proj.weight"))
        assert torch.equal(tensor, before[name] * 0.25 if scaled else before[name]), name


def test_exit_at_keep_agrees_with_the_final_layer():
    model = make_tiny_llama(num_layers=9, hidden=32)
    ids = torch.randint(3, 256, (4, 48), generator=torch.Generator().manual_seed(0))
    plain = exit_agreement(model, ids, 4)
    make_near_identity(model, 4, scale=1e-3)
    assert plain < 0.5 < 0.98 < exit_agreement(model, ids, 4)


def test_bad_input_is_refused():
    model = make_tiny_llama(num_layers=9, hidden=32)
    with pytest.raises(TideArgumentError, match=r"keep must be in \[1, 8\]"):
        make_near_identity(model, 9)
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_embd=16, n_layer=3, n_head=2, n_positions=32))
    with pytest.raises(TideArgumentError, match="no self_attn.o_proj"):
        make_near_identity(gpt2, 1)
