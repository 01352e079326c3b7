"""The measurement helpers behind `tide-hf bench`: each checked against a computation done another way."""

from __future__ import annotations

import copy

import torch
from helpers import ByteTokenizer, make_documents, make_tiny_llama
from transformers import AutoModelForCausalLM

from tide_hf.calibration import held_out_texts, make_samples
from tide_hf.config import TideRouterConfig
from tide_hf.eval.measure import match_rate, perplexity
from tide_hf.eval.modes import fit_line, truncated


def test_truncated_context_runs_exactly_a_shallower_model_and_restores_depth():
    model = make_tiny_llama()
    config = copy.deepcopy(model.config)
    config.num_hidden_layers = 4
    small = AutoModelForCausalLM.from_config(config).eval()
    small.load_state_dict(model.state_dict(), strict=False)
    ids = torch.randint(3, 256, (2, 6), generator=torch.Generator().manual_seed(0))
    with truncated(model, 4):
        ours = model.generate(input_ids=ids, max_new_tokens=5, do_sample=False)
    assert torch.equal(ours, small.generate(input_ids=ids, max_new_tokens=5, do_sample=False))
    assert model.config.num_hidden_layers == 9
    assert not torch.equal(model.generate(input_ids=ids, max_new_tokens=5, do_sample=False), ours)


def test_fit_recovers_a_linear_cost_model():
    a, b = fit_line([8, 16, 24, 30], [0.002 + 0.001 * d for d in (8, 16, 24, 30)])
    assert abs(a - 0.002) < 1e-12 and abs(b - 0.001) < 1e-12


def test_match_rate_counts_exact_rows_and_prefixes():
    stock = torch.tensor([[1, 2, 3, 4], [1, 2, 3, 4]])
    ours = torch.tensor([[1, 2, 3, 4], [1, 9, 3, 4]])  # row 2 diverges after one token, later tokens don't count
    assert match_rate(ours, stock) == (0.5, (1.0 + 0.25) / 2)


def test_perplexity_equals_exp_of_mean_token_nll():
    model = make_tiny_llama()
    chunks = [torch.randint(3, 256, (n,), generator=torch.Generator().manual_seed(n)) for n in (5, 8)]
    ppl, exits = perplexity(model, chunks, batch_size=2)
    nll, count = 0.0, 0
    with torch.no_grad():
        for c in chunks:  # one at a time, no padding
            logp = torch.log_softmax(model(input_ids=c[None]).logits[0, :-1].float(), -1)
            nll -= float(logp.gather(1, c[1:, None]).sum())
            count += len(c) - 1
    assert abs(ppl - torch.exp(torch.tensor(nll / count)).item()) < 1e-3 * ppl
    assert exits is None  # no router attached: no exit statistics


def test_held_out_texts_are_exactly_the_documents_calibration_never_read():
    tok = ByteTokenizer()
    texts = make_documents(20, 30, seed=4)
    cfg = TideRouterConfig(hidden_size=8, num_hidden_layers=9, num_samples=7, seq_len=64, seed=3)
    samples = make_samples(tok, texts, cfg.num_samples, cfg.seq_len, cfg.seed)
    held = held_out_texts(tok, texts, cfg)
    used = {bytes(s.tolist()) for s in samples}
    assert held and len(held) < len(texts)
    for text in held:  # no chunk of a held-out document was a calibration sample
        ids = tok(text)["input_ids"]
        assert all(bytes(ids[i : i + cfg.seq_len]) not in used for i in range(0, len(ids), cfg.seq_len))
    read = [t for t in texts if t not in held]  # and every other document contributed a sample
    assert all(any(bytes(tok(t)["input_ids"][:cfg.seq_len]) == u for u in used) for t in read)


def test_speculative_section_reports_identical_output_and_consistent_counters():
    from helpers import constant_router, make_model

    from tide_hf.eval.measure import left_pad
    from tide_hf.eval.modes import speculative

    model = make_model()
    model.generation_config.eos_token_id = None
    router = constant_router(model, 30.0)  # always says "converged": drafting is attempted
    prompts = [torch.randint(3, 256, (n,), generator=torch.Generator().manual_seed(n)) for n in (5, 7)]
    batches = [left_pad([p], 0) for p in prompts]
    res = speculative(model, router, batches, left_pad(prompts, 0), new_tokens=6, reps=1)
    assert res["identical_all_prompts"] and res["identical_batched"] and res["batched_rows"] == 2
    assert res["prompts"] == 2 and res["speed_ratio"] > 0
    assert res["acceptance_rate"] == (res["accepted"] / res["drafted"] if res["drafted"] else 0.0)
    assert res["mean_draft_length"] == (res["drafted"] / res["rounds"] if res["rounds"] else 0.0)


def test_synthetic_forced_exits_and_table() -> None:
    """The synthetic bench's constant routers force exactly the decisions its rows are named after."""
    from types import SimpleNamespace

    import tide_hf
    from tide_hf.eval.synthetic import build_model, configurations, run_synthetic

    model = build_model("tiny", "cpu", torch.float32)
    ids = torch.randint(3, 256, (2, 6))
    configs = configurations(model, 4)
    for key, depth in (("select-exit", 4), ("select-scored", 8), ("skip-recompute", 4)):
        with configs[key][1]() as handle:
            model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=3, min_new_tokens=3,
                           do_sample=False, pad_token_id=0)
            assert dict(handle.last_stats.decode.exits) == {depth: 2 * 2}, key  # 2 rows x 2 decode steps
    assert tide_hf.get_handle(model) is None
    args = SimpleNamespace(device="cpu", dtype="float32", synthetic="tiny", synthetic_depth=4, configs=["select-exit"],
                           compile=["eager"], batch_sizes=[1], prompt_len=6, new_tokens=3, reps=1)
    rows = run_synthetic(args)["rows"]
    assert [r["config"] for r in rows] == ["stock", "select, all exit at 4"]
    assert "vs_ideal" not in rows[1]  # no truncated model was timed
    args.configs = ["select-exit", "truncated"]
    rows = run_synthetic(args)["rows"]
    assert rows[1]["vs_ideal"] == rows[2]["ms_per_token"] / rows[1]["ms_per_token"]
