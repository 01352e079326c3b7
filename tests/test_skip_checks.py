"""Skip mode's checks and state against hostile use: architectures whose K/V propagate cannot rebuild, recurrent
layers, attention weights it cannot return, interrupted calls, finished rows, a second decoding stream."""

from __future__ import annotations

import pytest
import torch
import transformers
from helpers import constant_router, hooks, left_padded, make_model, mixed_router, new_router

import tide_hf
from tide_hf.errors import TideUnsupportedError

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")
TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2)


def build(config_class: str, **extra) -> torch.nn.Module:
    torch.manual_seed(0)
    config = getattr(transformers, config_class)(**{**TINY, **extra})
    return transformers.AutoModelForCausalLM.from_config(config).eval()


def test_propagate_is_refused_where_the_rebuilt_kv_differ_from_the_layers_own() -> None:
    """Cohere2's full-attention layers use no rotary embedding and HunYuan's key norm has another name: the K/V
    propagate would write differ from the layer's, so attach refuses (naming the layer) and leaves the model as
    found; on Llama the same check passes and the forced-exit output equals the truncated model's (test_skip)."""
    for model, layer in ((build("Cohere2Config", logit_scale=0.3, sliding_window=4), 8),
                         (build("HunYuanDenseV1Config", head_dim=16), 5)):
        before = hooks(model)
        router = constant_router(model, 30.0)
        try:
            tide_hf.attach(model, router, exit_threshold=0.5, min_layers=4, mode="skip", kv="propagate")
        except TideUnsupportedError as err:
            assert f"on layer {layer}" in str(err) and "kv='recompute'" in str(err)
        else:
            raise AssertionError(f"{type(model).__name__}: kv='propagate' accepted")
        assert hooks(model) == before and tide_hf.get_handle(model) is None


def test_recurrent_layers_refuse_skip_mode() -> None:
    """A Mamba model's layers carry a recurrent state that a skipped layer would not advance."""
    torch.manual_seed(0)
    model = transformers.MambaForCausalLM(transformers.MambaConfig(
        vocab_size=256, hidden_size=64, num_hidden_layers=8, state_size=8, pad_token_id=0)).eval()
    router = constant_router(model, 30.0)
    for kv in ("propagate", "recompute"):
        try:
            tide_hf.attach(model, router, exit_threshold=0.5, min_layers=4, mode="skip", kv=kv)
        except TideUnsupportedError as err:
            assert "recurrent state" in str(err)
        else:
            raise AssertionError("skip mode accepted on Mamba")


def test_output_attentions_in_skip_mode_is_refused_and_the_model_stays_usable() -> None:
    model = make_model()
    ids = torch.tensor([[17, 99, 45, 3, 200, 31, 7]])
    stock = model.generate(ids, max_new_tokens=4, do_sample=False)
    with tide_hf.attach(model, constant_router(model, -30.0), exit_threshold=0.5, min_layers=4, mode="skip",
                        kv="propagate"):
        try:
            model.generate(ids, max_new_tokens=4, do_sample=False, output_attentions=True,
                           return_dict_in_generate=True)
        except TideUnsupportedError as err:
            assert "output_attentions" in str(err)
        else:
            raise AssertionError("skip mode returned attentions it did not compute")
        assert torch.equal(model.generate(ids, max_new_tokens=4, do_sample=False), stock)  # never exits


def test_hidden_states_in_skip_mode_are_refused_as_attentions_are() -> None:
    """Skip mode returned, for the layers a token skipped, copies of its exit layer's state the model never
    computed; select mode runs every layer and returns stock's."""
    model = make_model()
    ids = torch.tensor([[17, 99, 45, 3, 200, 31, 7]])
    stock = model.generate(ids, max_new_tokens=4, do_sample=False, output_hidden_states=True,
                           return_dict_in_generate=True)
    with tide_hf.attach(model, constant_router(model, 30.0), exit_threshold=0.5, min_layers=4, mode="skip",
                        kv="propagate"):
        for call in (lambda: model.generate(ids, max_new_tokens=4, do_sample=False, output_hidden_states=True,
                                            return_dict_in_generate=True),
                     lambda: model(ids, output_hidden_states=True)):
            try:
                call()
            except TideUnsupportedError as err:
                assert "output_hidden_states with mode='skip'" in str(err)
            else:
                raise AssertionError("skip mode returned hidden states of layers it skipped")
    with tide_hf.attach(model, constant_router(model, 30.0), exit_threshold=0.5, min_layers=4,
                        mode="select"):  # select mode
        out = model.generate(ids, max_new_tokens=1, do_sample=False, output_hidden_states=True,
                             return_dict_in_generate=True)
    ours, theirs = out.hidden_states[0], stock.hidden_states[0]  # embeddings, then each layer's output (normed)
    assert all(torch.equal(a, b) for a, b in zip(ours[:-1], theirs[:-1], strict=True))  # every layer computed
    assert not torch.equal(ours[-1], theirs[-1])  # the last: the exited positions' exit states


def test_an_interrupted_call_leaves_no_exit_decisions_behind() -> None:
    """A forward that raises mid-generate (Ctrl-C, out of memory) must not leave its exit decisions to the next
    call of the decoder itself (`model.model(ids)`, which TIDE leaves stock)."""
    model = make_model()
    ids = torch.tensor([[17, 99, 45, 3, 200, 31, 7]])
    with torch.no_grad():
        clean = model.model(ids).last_hidden_state
    for mode in ("select", "skip"):
        for error in (KeyboardInterrupt, RuntimeError):
            with tide_hf.attach(model, constant_router(model, 30.0), exit_threshold=0.5, min_layers=4, mode=mode):
                calls = [0]

                def interrupt(*_args, error=error, calls=calls) -> None:
                    calls[0] += 1
                    if calls[0] == 2:
                        raise error("interrupted")
                hook = model.model.layers[-1].register_forward_hook(interrupt)
                try:
                    model.generate(ids, max_new_tokens=5, do_sample=False)
                except error:
                    pass
                finally:
                    hook.remove()
                with torch.no_grad():
                    assert torch.equal(model.model(ids).last_hidden_state, clean), (mode, error)


@torch.no_grad()
def test_finished_rows_do_not_hold_skip_mode_for_the_others() -> None:
    """After a row's EOS, generate feeds it padding whose outputs it discards: a router that exits every real
    token at layer 4 but not the pad token must still let the live row's steps skip (4 layers, as alone)."""
    model = make_model()
    model.model.embed_tokens.weight[0].zero_()
    model.model.embed_tokens.weight[0, 0] = 50.0  # the pad embedding, recognisable at layer 4
    ids = torch.tensor([[17, 99, 45, 3, 200], [31, 77, 120, 66, 5]])
    width = ids.shape[1]
    out = model(torch.cat([ids, torch.zeros(2, 3, dtype=torch.long)], 1), output_hidden_states=True)
    feature = model.model.norm(out.hidden_states[4])[..., 0]
    real, pad = feature[:, :width].max().item(), feature[:, width:].min().item()
    assert pad > real
    router = new_router(model)
    for mlp in router.routers.values():  # exit iff feature 0 is below the cut between real tokens and padding
        for p in mlp.parameters():
            p.zero_()
        mlp.fc1.weight[0, 0], mlp.fc1.bias[0] = 1.0, -(real + pad) / 2
        mlp.fc2.weight[0, 0], mlp.fc2.bias[0] = -1000.0, 30.0
    model.generation_config.eos_token_id = None
    settings = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)
    with tide_hf.attach(model, router, exit_threshold=0.5, min_layers=4, mode="skip", kv="propagate") as handle:
        free = model.generate(ids, attention_mask=torch.ones_like(ids), **settings)
        eos = int(free[1, width])  # row 1's first new token becomes its EOS: it finishes at once
        assert eos not in free[0, width:].tolist()
        model.generate(ids, attention_mask=torch.ones_like(ids), eos_token_id=eos, **settings)
        assert handle.last_stats.decode.exits == {4: 7}
        assert handle.last_stats.decode.mean_executed == 4.0


def test_recompute_with_guidance_on_a_static_cache_equals_select() -> None:
    """Classifier-free guidance runs a second stream of forwards (its own cache, a 2-D mask) between the
    static-cache steps: the running mask of one stream must not be dropped by the other's forwards."""
    model = make_model()
    model.generation_config.eos_token_id = None
    ids, mask = left_padded(seed=7, lengths=(3, 9))
    router = mixed_router(model, ids, mask, seed=8, quantiles=(0.5, 0.5))
    settings = dict(attention_mask=mask, max_new_tokens=14, do_sample=False, guidance_scale=1.5,
                    cache_implementation="static")
    outs, counts = [], []
    for options in (dict(mode="select"), dict(mode="skip", kv="recompute")):
        with tide_hf.attach(model, router, exit_threshold=0.5, min_layers=4, **options) as handle:
            outs.append(model.generate(ids, **settings))
            counts.append((handle.last_stats.prefill.tokens, handle.last_stats.decode.tokens))
    assert torch.equal(outs[0], outs[1])
    # the guidance stream's forwards are not the call's tokens: 12 prompt tokens, 13 decode steps x 2 rows
    assert counts == [(12, 26), (12, 26)]


def test_a_model_given_no_cache_before_its_first_forward_counts_every_step() -> None:
    """generate passes MiniMax no cache at first (no default dynamic cache) and the model's own later: the call's
    stream is the first cache seen, so the decode steps still count (they were all dropped)."""
    torch.manual_seed(0)
    config = transformers.MiniMaxConfig(**{**TINY, "num_hidden_layers": 9}, head_dim=16, num_local_experts=2,
                                        num_experts_per_tok=1)
    model = transformers.MiniMaxForCausalLM(config).eval()
    assert not model._supports_default_dynamic_cache()
    ids = torch.tensor([[17, 99, 45, 3, 200, 31, 7]])
    with tide_hf.attach(model, constant_router(model, -30.0), exit_threshold=0.5, min_layers=4,
                        mode="select") as handle:
        model.generate(ids, max_new_tokens=6, min_new_tokens=6, do_sample=False, pad_token_id=0)
        assert (handle.last_stats.prefill.tokens, handle.last_stats.decode.tokens) == (7, 5)


def test_user_chosen_assisted_decoding_in_speculative_mode_runs_stock_and_counts_its_tokens() -> None:
    """The fallback's nested assistant generate calls must stay stock (not re-enter TIDE's drafting)."""
    import tide_hf.integrations.generate as entry

    model = make_model()
    model.generation_config.eos_token_id = None
    ids = torch.tensor([[17, 99, 45, 3, 200, 31, 7]])
    router = mixed_router(model, ids)
    settings = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)
    original, entered = entry.speculative_generate, []
    entry.speculative_generate = lambda *a, **k: entered.append(1) or original(*a, **k)
    try:
        for extra in (dict(assistant_early_exit=4), dict(prompt_lookup_num_tokens=3), dict(assistant_model=model)):
            stock = model.generate(ids, **settings, **extra)
            entered.clear()
            with tide_hf.attach(model, router, exit_threshold=0.5, min_layers=4, mode="speculative") as handle:
                assert torch.equal(model.generate(ids, **settings, **extra), stock)
                stats = handle.last_stats
            assert len(entered) == 1 and stats.speculative["fallback"] is not None, extra
            assert (stats.prefill.tokens, stats.decode.tokens) == (7, 7), extra
    finally:
        entry.speculative_generate = original
