"""`get_adapter` against the model's own forward: the head applied to the last layer's output must give the
model's logits exactly, for every registered family (norm, projection, logit scale and soft-capping included);
`check_head` confirms it on the model or refuses the model; encoder-decoders are refused."""

from __future__ import annotations

import pytest
import torch
import transformers as tf
from helpers import ByteTokenizer, hooks, new_router
from torch import nn
from transformers import AutoModelForCausalLM, PretrainedConfig

import tide_hf
import tide_hf.modeling.adapters as adapters_mod
from tide_hf.errors import TideCompatibilityError
from tide_hf.modeling import ModelAdapter, get_adapter, layer_output, register_adapter
from tide_hf.modeling.head import check_head

VOCAB = 160
LAYERS = 5  # checkpoint interval 4 -> one checkpoint before the last layer
IDS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)
DECODER = dict(vocab_size=VOCAB, hidden_size=48, intermediate_size=96, num_hidden_layers=LAYERS,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, **IDS)
OPT = dict(vocab_size=VOCAB, hidden_size=48, ffn_dim=96, num_hidden_layers=LAYERS, num_attention_heads=4,
           max_position_embeddings=64, **IDS)
SOFTCAP = 1.5  # small against the logits below, so tanh is far from the identity
MLA = dict(kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16)
# families whose forward scales the head's logits, and the factor (Cohere: x logit_scale, Granite: / logits_scaling,
# MiniCPM3: the state / (hidden / dim_model_base) before its bias-free head)
SCALED = {"cohere": 0.3, "granite": 0.25, "minicpm3": 0.25}

FAMILIES = {
    "llama": lambda: tf.LlamaConfig(**DECODER),
    "mistral": lambda: tf.MistralConfig(**DECODER),
    "qwen2": lambda: tf.Qwen2Config(**DECODER),
    "qwen3": lambda: tf.Qwen3Config(**DECODER, head_dim=12),
    "gemma": lambda: tf.GemmaConfig(**DECODER, head_dim=12),
    "gemma2": lambda: tf.Gemma2Config(**DECODER, head_dim=12, final_logit_softcapping=SOFTCAP),
    "gemma3_text": lambda: tf.Gemma3TextConfig(**DECODER, head_dim=12, final_logit_softcapping=SOFTCAP),
    "phi": lambda: tf.PhiConfig(**DECODER),
    "phi3": lambda: tf.Phi3Config(**DECODER),
    "gpt2": lambda: tf.GPT2Config(vocab_size=VOCAB, n_embd=48, n_layer=LAYERS, n_head=4, n_positions=64,
                                  bos_token_id=1, eos_token_id=2),
    "gpt_neox": lambda: tf.GPTNeoXConfig(vocab_size=VOCAB, hidden_size=48, intermediate_size=96,
                                         num_hidden_layers=LAYERS, num_attention_heads=4,
                                         max_position_embeddings=64, **IDS),
    "opt": lambda: tf.OPTConfig(**OPT),
    "opt_project_out": lambda: tf.OPTConfig(**OPT, word_embed_proj_dim=32),
    # OPT-350m style: post-layer norm, no final norm at all (the adapter uses Identity), plus project_out
    "opt_post_norm": lambda: tf.OPTConfig(**OPT, word_embed_proj_dim=32, do_layer_norm_before=False),
    "falcon": lambda: tf.FalconConfig(vocab_size=VOCAB, hidden_size=48, num_hidden_layers=LAYERS,
                                      num_attention_heads=4, **IDS),
    "falcon_new_arch": lambda: tf.FalconConfig(vocab_size=VOCAB, hidden_size=48, num_hidden_layers=LAYERS,
                                               num_attention_heads=4, num_kv_heads=2,
                                               new_decoder_architecture=True, **IDS),
    "cohere": lambda: tf.CohereConfig(**DECODER, logit_scale=SCALED["cohere"]),
    "granite": lambda: tf.GraniteConfig(**DECODER, logits_scaling=1 / SCALED["granite"], embedding_multiplier=3.0,
                                        residual_multiplier=0.5, attention_multiplier=0.2),
    "minicpm3": lambda: tf.MiniCPM3Config(**{**DECODER, "num_key_value_heads": 4}, **MLA,
                                          dim_model_base=int(48 * SCALED["minicpm3"])),
}


def build(config: PretrainedConfig, seed: int = 0) -> nn.Module:
    """A seeded random model whose norms, biases and head are far from their init values.

    At init every norm weight is 1 (or 0 for Gemma's 1 + w) and biases are 0, so a wrong or missing
    final norm / projection could still match; random 1-D parameters and a scaled head rule that out.
    """
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 1:
                param.copy_(torch.randn_like(param) * 0.5 + 1.0)
        model.get_output_embeddings().weight.mul_(20.0)
    return model


def last_layer_output_and_logits(model: nn.Module, layer: nn.Module, ids: torch.Tensor):
    captured = {}
    handle = layer.register_forward_hook(lambda _m, _a, out: captured.__setitem__("h", layer_output(out)))
    try:
        with torch.no_grad():
            logits = model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False).logits
    finally:
        handle.remove()
    return captured["h"], logits


@pytest.mark.parametrize("family", list(FAMILIES))
def test_adapter_head_reproduces_model_logits(family: str) -> None:
    config = FAMILIES[family]()
    model = build(config)
    adapter = get_adapter(model)
    assert isinstance(adapter, ModelAdapter)
    assert adapter.num_layers == config.num_hidden_layers == LAYERS
    assert adapter.lm_head is model.get_output_embeddings()
    assert adapter.embeddings is model.get_input_embeddings()

    ids = torch.randint(3, VOCAB, (2, 7), generator=torch.Generator().manual_seed(1))
    hidden, logits = last_layer_output_and_logits(model, adapter.layers[-1], ids)
    with torch.no_grad():
        mine = adapter.logits(hidden)
    assert mine.shape == logits.shape == (2, 7, VOCAB)
    torch.testing.assert_close(mine, logits, atol=1e-5, rtol=1e-5)
    if not isinstance(adapter.final_norm, nn.Identity):
        # the reference is sensitive: the raw last-layer state through the bare head is far off
        with torch.no_grad():
            bare = model.get_output_embeddings()(hidden if adapter.pre_head is None else adapter.pre_head(hidden))
        assert (bare - logits).abs().max() > 1e-2

    assert adapter.logit_scale == pytest.approx(SCALED.get(family, 1.0))
    if family in SCALED:  # the scale matters: without it the logits are off by the factor
        adapter.logit_scale = 1.0
        with torch.no_grad():
            torch.testing.assert_close(adapter.logits(hidden) * SCALED[family], logits, atol=1e-5, rtol=1e-5)
    if family in ("gemma2", "gemma3_text"):
        assert adapter.logit_softcap == SOFTCAP
        assert logits.abs().max() <= SOFTCAP
        adapter.logit_softcap = None  # without the cap the logits leave [-cap, cap]
        with torch.no_grad():
            uncapped = adapter.logits(hidden)
        assert uncapped.abs().max() > 2 * SOFTCAP
    else:
        assert not adapter.logit_softcap
    if family in ("opt_project_out", "opt_post_norm"):
        assert adapter.pre_head is model.model.decoder.project_out is not None
    if family == "opt_post_norm":
        assert isinstance(adapter.final_norm, nn.Identity)


# --- custom models: register_adapter, probing fallback, error messages ---------------------------------


class TinyConfig(PretrainedConfig):
    model_type = "tide_test_tiny"

    def __init__(self, vocab_size: int = 40, hidden_size: int = 16, num_hidden_layers: int = 5, **kwargs) -> None:
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.num_hidden_layers = num_hidden_layers
        super().__init__(**kwargs)


class Block(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.fc = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor]:
        return (x + torch.tanh(self.fc(x)),)  # tuple output, like many HF decoder layers


class Body(nn.Module):
    def __init__(self, cfg: TinyConfig, *, sequential: bool, norm_name: str | None, extra_list: bool) -> None:
        super().__init__()
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        blocks = [Block(cfg.hidden_size) for _ in range(cfg.num_hidden_layers)]
        self.stack = nn.Sequential(*blocks) if sequential else nn.ModuleList(blocks)
        if extra_list:  # a second list of the same length makes the layer list ambiguous
            self.adapters = nn.ModuleList(nn.Identity() for _ in range(cfg.num_hidden_layers))
        self.norm_name = norm_name
        if norm_name:
            setattr(self, norm_name, nn.LayerNorm(cfg.hidden_size))
        self.proj = nn.Linear(cfg.hidden_size, cfg.hidden_size // 2, bias=False)


class TinyLM(nn.Module):
    """A causal-LM-shaped module with configurable attribute names (not a transformers model)."""

    def __init__(self, *, sequential: bool = False, norm_name: str | None = "out_ln", extra_list: bool = False,
                 head: bool = True) -> None:
        super().__init__()
        self.config = TinyConfig()
        self.body = Body(self.config, sequential=sequential, norm_name=norm_name, extra_list=extra_list)
        self.head = nn.Linear(self.config.hidden_size // 2, self.config.vocab_size, bias=False) if head else None
        with torch.no_grad():
            for param in self.parameters():
                if param.dim() == 1:
                    param.copy_(torch.randn_like(param) * 0.5 + 1.0)

    def get_input_embeddings(self) -> nn.Module:
        return self.body.embed

    def get_output_embeddings(self) -> nn.Module | None:
        return self.head

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.body.embed(ids)
        for block in self.body.stack:
            x = block(x)[0]
        if self.body.norm_name:
            x = getattr(self.body, self.body.norm_name)(x)
        return self.head(self.body.proj(x))


@pytest.fixture
def registry(monkeypatch: pytest.MonkeyPatch) -> dict:
    """An isolated copy of the adapter registry, so registrations in a test do not leak."""
    paths = dict(adapters_mod._PATHS)
    monkeypatch.setattr(adapters_mod, "_PATHS", paths)
    monkeypatch.setattr(adapters_mod, "_LOGIT_SCALES", dict(adapters_mod._LOGIT_SCALES))
    return paths


def last_layer_output_and_logits_tiny(model: TinyLM, layer: nn.Module, ids: torch.Tensor):
    captured = {}
    handle = layer.register_forward_hook(lambda _m, _a, out: captured.__setitem__("h", layer_output(out)))
    try:
        with torch.no_grad():
            logits = model(ids)
    finally:
        handle.remove()
    return captured["h"], logits


def test_register_adapter_for_custom_model_type(registry: dict) -> None:
    torch.manual_seed(0)
    model = TinyLM(norm_name="out_ln").eval()
    # before registration: the probe finds the layers but not a norm called `out_ln`, and says so
    with pytest.raises(ValueError, match=r"no final norm") as info:
        get_adapter(model)
    assert "body.stack" in str(info.value) and "register_adapter" in str(info.value)

    register_adapter("tide_test_tiny", layers="body.stack", norm="body.out_ln", pre_head="body.proj")
    adapter = get_adapter(model)
    assert adapter.num_layers == 5
    assert adapter.final_norm is model.body.out_ln and adapter.pre_head is model.body.proj
    ids = torch.randint(0, 40, (3, 6), generator=torch.Generator().manual_seed(0))
    hidden, _ = last_layer_output_and_logits_tiny(model, adapter.layers[-1], ids)
    torch.testing.assert_close(adapter.logits(hidden), model(ids), atol=1e-6, rtol=1e-6)


def test_register_adapter_wrong_layers_path_is_named(registry: dict) -> None:
    register_adapter("tide_test_tiny", layers="body.no_such_stack", norm="body.out_ln")
    with pytest.raises(ValueError, match=r"'body\.no_such_stack' is not the list of decoder layers"):
        get_adapter(TinyLM())


def test_probe_finds_layers_and_norm_of_unregistered_hf_model(registry: dict) -> None:
    model = build(FAMILIES["llama"]())
    model.config.model_type = "tide_test_unregistered_llama"
    assert model.config.model_type not in registry
    adapter = get_adapter(model)
    assert adapter.layers is model.model.layers and adapter.final_norm is model.model.norm
    ids = torch.randint(3, VOCAB, (2, 5), generator=torch.Generator().manual_seed(2))
    hidden, logits = last_layer_output_and_logits(model, adapter.layers[-1], ids)
    torch.testing.assert_close(adapter.logits(hidden), logits, atol=1e-5, rtol=1e-5)


def test_probe_finds_known_norm_name_on_custom_module(registry: dict) -> None:
    model = TinyLM(norm_name="ln_f")
    adapter = get_adapter(model)
    assert adapter.layers is model.body.stack and adapter.final_norm is model.body.ln_f
    assert adapter.num_layers == 5


def test_probe_error_names_missing_layer_list(registry: dict) -> None:
    with pytest.raises(ValueError) as info:
        get_adapter(TinyLM(sequential=True))
    message = str(info.value)
    assert "cannot find the decoder layers" in message and "TinyLM" in message
    assert "tide_test_tiny" in message and "nn.ModuleList of 5 layers" in message and "found: none" in message
    assert "register_adapter" in message


def test_probe_error_names_ambiguous_layer_lists(registry: dict) -> None:
    with pytest.raises(ValueError, match=r"found: body\.stack, body\.adapters"):
        get_adapter(TinyLM(extra_list=True))


def test_probe_error_names_missing_norm(registry: dict) -> None:
    with pytest.raises(ValueError) as info:
        get_adapter(TinyLM(norm_name=None))
    message = str(info.value)
    assert "'body.stack'" in message and "no final norm" in message
    assert all(name in message for name in adapters_mod._NORM_NAMES)


def test_missing_lm_head_is_named(registry: dict) -> None:
    with pytest.raises(ValueError, match=r"TinyLM has no output embeddings"):
        get_adapter(TinyLM(norm_name="ln_f", head=False))


@pytest.mark.parametrize("wrapper", ["gemma3", "paligemma"])
def test_multimodal_logits_are_the_models_own_capped_as_it_caps(wrapper: str) -> None:
    """Gemma 3's multimodal wrapper keeps `final_logit_softcapping` in its text config and does not apply it
    (the adapter capped its logits anyway); PaliGemma applies its Gemma 2 text config's cap (a first fix, reading
    the cap from the top-level config, lost it). Labels, exit heads and drafts must see the model's own logits."""
    torch.manual_seed(0)
    text = dict(**DECODER, head_dim=12, final_logit_softcapping=SOFTCAP)
    vision = tf.SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                                   image_size=32, patch_size=8)
    if wrapper == "gemma3":
        model = tf.Gemma3ForConditionalGeneration(tf.Gemma3Config(
            text_config=tf.Gemma3TextConfig(**text), vision_config=vision, mm_tokens_per_image=16))
    else:
        model = tf.PaliGemmaForConditionalGeneration(tf.PaliGemmaConfig(
            text_config={"model_type": "gemma2", **text}, vision_config=vision, projection_dim=32))
    model.eval()
    with torch.no_grad():  # logits far beyond the cap, as in `build`
        model.get_output_embeddings().weight.mul_(20.0)
    adapter = get_adapter(model)
    ids = torch.randint(3, VOCAB, (2, 7), generator=torch.Generator().manual_seed(0))
    hidden, logits = last_layer_output_and_logits(model, adapter.layers[-1], ids)
    capped = wrapper == "paligemma"
    assert adapter.logit_softcap == (SOFTCAP if capped else None)
    assert (logits.abs().max() <= SOFTCAP) == capped  # the model really caps (or does not)
    with torch.no_grad():
        torch.testing.assert_close(adapter.logits(hidden), logits, atol=1e-5, rtol=1e-5)


# --- check_head: the adapter's head against the model's own forward -------------------------------------


def module_state(model: nn.Module) -> tuple:
    """Everything a check could leave behind: weights, hooks, training flags, gradients."""
    hooks = [(name, dict(m._forward_hooks), dict(m._forward_pre_hooks)) for name, m in model.named_modules()]
    return ({k: v.clone() for k, v in model.state_dict().items()}, hooks,
            [m.training for m in model.modules()], [p.grad for p in model.parameters()])


@pytest.mark.parametrize("family", list(FAMILIES))
def test_check_head_accepts_every_family_and_leaves_the_model_as_found(family: str) -> None:
    model = build(FAMILIES[family]())
    model.train()
    model.get_input_embeddings().train(False)  # mixed flags: each must come back as it was
    before = module_state(model)
    check_head(model)
    after = module_state(model)
    assert before[0].keys() == after[0].keys() and all(torch.equal(before[0][k], after[0][k]) for k in before[0])
    assert before[1:] == after[1:]


def test_check_head_refuses_a_logit_scale_it_does_not_know(registry: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    """Granite divides its logits by `logits_scaling`; without that entry the adapter's head is 4x the model's and
    every label, analysis and draft would be at the wrong temperature: refused, naming the way out."""
    model = build(FAMILIES["granite"]())
    monkeypatch.delitem(adapters_mod._LOGIT_SCALES, "granite")
    assert get_adapter(model).logit_scale == 1.0
    with pytest.raises(TideCompatibilityError, match=r"GraniteForCausalLM \(model_type='granite'\): its head applies "
                       r"a transform tide_hf does not reproduce.*register_adapter\(.*logit_scale="):
        check_head(model)
    register_adapter("granite", layers="model.layers", norm="model.norm",
                     logit_scale=lambda config: 1 / config.logits_scaling)
    check_head(model)


def test_check_head_refuses_a_prediction_head_between_the_norm_and_the_logits(registry: dict) -> None:
    """ModernBERT's decoder runs a dense + activation + norm head before its output embeddings: no scale fixes it."""
    config = tf.ModernBertDecoderConfig(vocab_size=VOCAB, hidden_size=48, intermediate_size=96,
                                        num_hidden_layers=LAYERS, num_attention_heads=4, max_position_embeddings=64,
                                        **IDS)
    model = build(config)
    register_adapter(config.model_type, layers="model.layers", norm="model.final_norm")
    with pytest.raises(TideCompatibilityError, match="does not reproduce"):
        check_head(model)


@pytest.mark.parametrize("decoder_layers", [LAYERS, 2 * LAYERS])
def test_encoder_decoder_models_are_refused_before_any_change(decoder_layers: int) -> None:
    """T5 with a deeper encoder than decoder has exactly one block list of `num_hidden_layers` (the encoder's): a
    probe took it for the decoder layers and attach hooked the encoder. tide_hf serves decoder-only causal LMs."""
    torch.manual_seed(0)
    model = tf.T5ForConditionalGeneration(tf.T5Config(
        vocab_size=VOCAB, d_model=48, d_ff=96, num_layers=2 * LAYERS, num_decoder_layers=decoder_layers, num_heads=4,
        d_kv=12, decoder_start_token_id=0, **IDS)).eval()
    router = tide_hf.TideRouter(tide_hf.TideRouterConfig(hidden_size=48, num_hidden_layers=2 * LAYERS,
                                                         router_bottleneck_dim=8, exit_head="lens"))  # fits the encoder
    before = module_state(model)
    message = r"T5ForConditionalGeneration .* encoder-decoder model: tide_hf supports decoder-only causal LMs"
    with pytest.raises(TideCompatibilityError, match=message):
        get_adapter(model)
    with pytest.raises(TideCompatibilityError, match=message):
        tide_hf.attach(model, router, exit_threshold=0.5, ignore_fingerprint=True, mode="select")
    after = module_state(model)
    assert after[1:] == before[1:] and all(torch.equal(before[0][k], after[0][k]) for k in before[0])


def test_recurrent_gemma_cap_is_read_from_its_own_config_field(registry: dict) -> None:
    """RecurrentGemma caps its logits with `logits_soft_cap`, not `final_logit_softcapping`."""
    torch.manual_seed(0)
    model = tf.RecurrentGemmaForCausalLM(tf.RecurrentGemmaConfig(
        vocab_size=VOCAB, hidden_size=48, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, lru_width=48, attention_window_size=8, logits_soft_cap=SOFTCAP)).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(20.0)  # logits far beyond the cap
    register_adapter("recurrent_gemma", layers="model.layers", norm="model.final_norm")
    assert get_adapter(model).logit_softcap == SOFTCAP
    check_head(model)


# -- refusals and odd but valid input ---------------------------------------------------------------------------
def test_a_head_tide_hf_does_not_reproduce_is_refused_where_tide_hf_computes_logits(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Granite divides its logits by `logits_scaling`; with that entry gone the adapter's head is not the model's.
    Where tide_hf computes logits itself (calibration labels, analyze, drafts over the draft vocabulary) the model
    is refused before anything changes; speculative drafts through the model's own head still attach."""
    from helpers import make_documents
    from transformers import GraniteConfig, GraniteForCausalLM

    import tide_hf.modeling.adapters as adapters_mod
    from tide_hf.eval.analyze import convergence

    torch.manual_seed(0)
    model = GraniteForCausalLM(GraniteConfig(vocab_size=600, hidden_size=64, intermediate_size=128,
                                             num_hidden_layers=9, num_attention_heads=4, num_key_value_heads=2,
                                             max_position_embeddings=64, logits_scaling=4.0)).eval()
    drafting = new_router(model)
    drafting.set_draft_vocab(torch.arange(512), {"256": 0.5, "512": 0.9})
    tide_hf.attach(model, drafting, mode="speculative", draft_layer=4).detach()  # the scale known: accepted
    monkeypatch.delitem(adapters_mod._LOGIT_SCALES, "granite")
    before = hooks(model)
    refused = pytest.raises(TideCompatibilityError, match=r"GraniteForCausalLM .* does not reproduce")
    with refused:
        tide_hf.calibration.calibrate_tokens(model, [torch.arange(3, 40)] * 8, progress=False)
    with refused:
        convergence(model, ByteTokenizer(), make_documents(4, 30), num_samples=2, seq_len=16, batch_size=2,
                    checkpoint_interval=4, convergence_threshold=0.5, agreements=[0.9], bins=4, seed=0,
                    progress=False)
    with refused:
        tide_hf.attach(model, drafting, mode="speculative", draft_layer=4)
    assert hooks(model) == before and tide_hf.get_handle(model) is None
    tide_hf.attach(model, new_router(model), mode="speculative", draft_layer=4).detach()  # the model's own head
