"""Nothing exported or imported wrongly: every HF exporter refuses the configs it cannot express,
every importer refuses the HF options it does not implement, each naming every offending field or
option in one ValueError. The tables behind them cover every ModelConfig / BertConfig field."""
import dataclasses

import numpy as np
import pytest
import torch

from conftest import assert_close, require_module
from jaxgpt import PRESETS, build
from jaxgpt.config import (MLPS, NORMS, PLACEMENTS, POS, QK_NORMS, RESIDUALS, ROPE_LAYOUTS, BertConfig, ModelConfig,
                           MoEConfig, RopeScaling)
from jaxgpt.convert import bert, from_hf, gemma, gpt2, gpt_neox, llama, mixtral, olmo2, phi3, qwen2_moe, qwen3, to_hf
from jaxgpt.convert.common import check_options
from jaxgpt.models import abstract_params

transformers = require_module("transformers", allow_module_level=True)  # CI=true: missing is a failure
TINY = dict(vocab_size=48, d_model=32, n_head=4, n_layer=2, max_len=32)
GPT2 = PRESETS["gpt2-small"].replace(**TINY, dropout=0.0, attn_dropout=0.0)
LLAMA = PRESETS["llama-tiny"].replace(**TINY, n_kv_head=2, d_ff=48)
BERT = PRESETS["bert-base"].replace(encoder=PRESETS["bert-base"].encoder.replace(**TINY, d_ff=64))
MIXTRAL = LLAMA.replace(moe=MoEConfig(n_experts=4))
QWEN2_MOE = LLAMA.replace(qkv_bias=True, moe=MoEConfig(n_experts=4, d_ff=16, norm_topk=False, shared_d_ff=24))
QWEN3 = LLAMA.replace(qk_norm="head", d_head=16)
OLMO2 = LLAMA.replace(qk_norm="full", norm_placement="post_sublayer")
NEOX = PRESETS["pythia-160m"].replace(**TINY, rotary_dim=2)
PHI3 = LLAMA.replace(rotary_dim=4)
GEMMA = PRESETS["gemma-2b"].replace(**TINY, n_kv_head=1, d_head=8, d_ff=48)
GEMMA2 = PRESETS["gemma2-2b"].replace(**TINY, n_kv_head=2, d_head=8, d_ff=48, attn_scale=0.25, window_layers=(0,))
GEMMA3 = GEMMA2.replace(qk_norm="head", rope_local_base=100.0, attn_softcap=None, logit_softcap=None, sliding_window=8,
                        d_head=None)
FAMILIES = {"gpt2": (gpt2, gpt2.FIELDS, GPT2), "llama": (llama, llama.FIELDS, LLAMA),
            "mixtral": (mixtral, mixtral.FIELDS, MIXTRAL), "qwen2_moe": (qwen2_moe, qwen2_moe.FIELDS, QWEN2_MOE),
            "qwen3": (qwen3, qwen3.FIELDS, QWEN3), "olmo2": (olmo2, olmo2.FIELDS, OLMO2),
            "gpt_neox": (gpt_neox, gpt_neox.FIELDS, NEOX), "phi3": (phi3, phi3.FIELDS, PHI3),
            "gemma2": (gemma, gemma.FIELDS, GEMMA2)}
# Candidate values for a field, to find one its family's rule refuses.
CANDIDATES = {"pos": POS, "norm": NORMS, "mlp": MLPS, "norm_placement": PLACEMENTS, "rope_layout": ROPE_LAYOUTS,
              "residual": RESIDUALS, "dropout": (0.0, 0.1), "n_kv_head": (None, 1, 2, 4), "type_vocab_size": (0, 2),
              "pooler": ("cls", "tanh"), "pad_token_id": (None, 0), "d_head": (None, 4, 100), "sliding_window": (None, 8), "window_layers": (None, (0,)), "valid_vocab": (None, 40), "qk_norm": QK_NORMS, "rotary_dim": (None, 4), "moe": (None, MoEConfig(n_experts=4), MoEConfig(n_experts=4, norm_topk=False)),
              "rope_scaling": (None, RopeScaling("linear", factor=2.0)),
              "attn_scale": (None, 0.3), "attn_softcap": (None, 50.0), "logit_softcap": (None, 30.0),
              "rope_local_base": (None, 100.0)}


def _params(config):
    return abstract_params(config)  # shapes only: the refusal comes before any weight is read


@pytest.mark.parametrize("table,cls", [(gpt2.FIELDS, ModelConfig), (llama.FIELDS, ModelConfig),
                                       (mixtral.FIELDS, ModelConfig), (qwen2_moe.FIELDS, ModelConfig),
                                       (qwen3.FIELDS, ModelConfig), (olmo2.FIELDS, ModelConfig),
                                       (gpt_neox.FIELDS, ModelConfig), (phi3.FIELDS, ModelConfig),
                                       (gemma.FIELDS, ModelConfig),
                                       (bert._ENCODER, ModelConfig), (bert.FIELDS, BertConfig)])
def test_every_config_field_has_an_export_rule(table, cls):
    """A new config field must be given a rule per family (maps to / must be / unused)."""
    assert set(table) == {f.name for f in dataclasses.fields(cls)}


def _violations(table, base):
    """(field, config) pairs: ``base`` with one field changed to a value the family refuses; a field
    whose every refused value is an invalid config anyway (attnres with post-LN) pairs with None."""
    out = []
    for name, rule in table.items():
        value = getattr(base, name)
        options = CANDIDATES.get(name, (not value,) if isinstance(value, bool) else ())
        refused = [c for c in options if c != value and not rule.ok(c, base)]
        for candidate in refused:
            try:
                out.append((name, base.replace(**{name: candidate})))
                break
            except ValueError:
                continue
        else:
            if refused:
                out.append((name, None))
    return out


def _fixed(table):
    """The fields a family constrains (neither mapped onto an HF option nor unused)."""
    return sorted(n for n, r in table.items() if not r.needs.startswith(("-> ", "unused", "see ")))


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_exporters_refuse_each_field_they_cannot_express(family):
    module, table, base = FAMILIES[family]
    module.config_to_hf(base)  # the base config itself is expressible
    cases = _violations(table, base)
    assert sorted({n for n, _ in cases}) == _fixed(table)  # every constrained field is exercised
    for name, config in cases:
        if config is not None:
            with pytest.raises(ValueError, match=rf"cannot export this config as HF \S+ exactly: .*\b{name}="):
                module.config_to_hf(config)


def test_gemma_exporter_refuses_gemma2_fields_in_a_gemma_config():
    """Without norm_placement='sandwich' the export is Gemma 1, which has neither soft-cap nor another
    score multiplier: each is named (the table's '-> ' rules, which the test above leaves out)."""
    gemma.config_to_hf(GEMMA)
    assert gemma.config_to_hf(GEMMA.replace(attn_scale=GEMMA.head_dim ** -0.5))["model_type"] == "gemma"
    config = GEMMA.replace(attn_scale=0.3, attn_softcap=50.0, logit_softcap=30.0)
    with pytest.raises(ValueError, match=r"cannot export this config as HF Gemma exactly: attn_scale=0.3 .*"
                                         r"attn_softcap=50.0 .*logit_softcap=30.0"):
        to_hf(config, _params(config))


def test_gemma3_export_and_its_refusals():
    """qk_norm='head' makes the export Gemma 3, RoPE nested by layer type; a scaled RoPE on sliding layers
    without rope_local_base (Gemma 3's local layers are unscaled) is refused, as is rope_local_base on Gemma 2."""
    d = gemma.config_to_hf(GEMMA3.replace(rope_scaling=RopeScaling("linear", factor=8.0)))
    assert d["model_type"] == "gemma3_text" and d["rope_parameters"]["sliding_attention"]["rope_theta"] == 100.0
    assert gemma.config_from_hf(d, "Gemma3ForCausalLM") == GEMMA3.replace(rope_scaling=RopeScaling("linear", factor=8.0))
    for config, name in [(GEMMA3.replace(rope_local_base=None, rope_scaling=RopeScaling("linear", factor=8.0)),
                          "rope_scaling"), (GEMMA2.replace(rope_local_base=100.0), "rope_local_base")]:
        with pytest.raises(ValueError, match=rf"cannot export this config as HF Gemma\d exactly: .*\b{name}="):
            gemma.config_to_hf(config)


def test_bert_exporter_refuses_each_field_it_cannot_express():
    bert.config_to_hf(BERT)
    cases = [(n, c) for n, c in _violations(bert.FIELDS, BERT)]
    cases += [(f"encoder.{n}", c and BERT.replace(encoder=c)) for n, c in _violations(bert._ENCODER, BERT.encoder)]
    fixed = _fixed(bert.FIELDS) + [f"encoder.{n}" for n in _fixed(bert._ENCODER)]
    assert sorted({n for n, _ in cases}) == sorted(fixed)
    for name, config in cases:
        if config is not None:
            with pytest.raises(ValueError, match=rf"cannot export this config as HF BERT exactly: .*\b{name}="):
                bert.config_to_hf(config)


@pytest.mark.parametrize("config,message", [
    # measured on the old exporter: max logit difference 0.106, 0.30 and 0.149 after export
    (GPT2.replace(norm_placement="post"), r"norm_placement='post' \(HF GPT-2 needs 'pre'\)"),
    (GPT2.replace(embed_scale=True), r"embed_scale=True \(HF GPT-2 needs False\)"),
    (LLAMA.replace(norm="layernorm"), r"norm='layernorm' \(HF LLaMA needs 'rmsnorm'\)"),
    (LLAMA.replace(pos="sinusoidal"), r"no Hugging Face family has pos='sinusoidal'"),
    (PRESETS["seed-transformer"], r"supports decoder \(ModelConfig\) and BERT configs, got EncDecConfig"),
])
def test_to_hf_refuses_the_measured_cases(config, message):
    with pytest.raises(ValueError, match=message):
        to_hf(config, _params(config))


def test_export_names_every_offending_field_at_once():
    config = GPT2.replace(norm_placement="post", embed_scale=True, n_kv_head=2, final_norm=False)
    with pytest.raises(ValueError) as err:
        to_hf(config, _params(config))
    for part in ("norm_placement='post'", "embed_scale=True", "n_kv_head=2", "final_norm=False"):
        assert part in str(err.value)


def _hf_dict(config_cls, **kw):
    return getattr(transformers, config_cls)(**kw).to_dict()


@pytest.mark.parametrize("config_cls,family,changes,needs", [
    ("GPT2Config", gpt2, {"scale_attn_by_inverse_layer_idx": True}, "False"),
    ("GPT2Config", gpt2, {"scale_attn_weights": False}, "True"),
    ("GPT2Config", gpt2, {"activation_function": "silu"}, "one of"),
    ("GPT2Config", gpt2, {"add_cross_attention": True}, "False"),
    ("GPT2Config", gpt2, {"embd_pdrop": 0.3}, "equal to resid_pdrop"),
    ("LlamaConfig", llama, {"hidden_act": "gelu"}, "'silu'"),
    ("LlamaConfig", llama, {"rope_parameters": {"rope_type": "proportional", "rope_theta": 1e4}}, "'default'"),
    ("LlamaConfig", llama, {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4,
                                                "partial_rotary_factor": 0.5}}, "here: partial_rotary_factor=0.5"),
    ("LlamaConfig", llama, {"rope_parameters": {"rope_type": "longrope", "factor": 4.0, "rope_theta": 1e4,
                                                "original_max_position_embeddings": 16, "short_factor": [1.0] * 4,
                                                "long_factor": [2.0] * 4}},
     "here: rope_scaling longrope: max_len=2048 exceeds original_max_position_embeddings=16; past it HF switches"),
    ("LlamaConfig", llama, {"rope_parameters": {"rope_type": "linear", "factor": 0.5, "rope_theta": 1e4}},
     "here: rope_scaling.factor must be >= 1"),
    ("LlamaConfig", llama, {"pretraining_tp": 2}, "1"),
    ("LlamaConfig", llama, {"pruned_heads": {0: [1]}}, "pruned heads"),
    ("LlamaConfig", llama, {"quantization_config": {"bits": 4}}, "does not implement"),
    ("GPTNeoXConfig", gpt_neox, {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, "default RoPE"),
    ("GPTNeoXConfig", gpt_neox, {"hidden_act": "gelu_fast"}, "one of"),
    ("Phi3Config", phi3, {"rope_scaling": {"rope_type": "longrope", "short_factor": [1.0] * 4,
                                           "long_factor": [1.0] * 4}}, "default RoPE"),
    ("Phi3Config", phi3, {"resid_pdrop": 0.1}, "0.0"),
    ("Qwen3Config", qwen3, {"use_sliding_window": True, "sliding_window": 16, "max_position_embeddings": 64},
     ">= max_position_embeddings"),
    ("Gemma2Config", gemma, {"sliding_window": 0}, "a window of >= 1 positions"),
    ("Gemma2Config", gemma, {"layer_types": ["chunked_attention", "full_attention"], "num_hidden_layers": 2},
     "per layer"),
    ("Gemma2Config", gemma, {"hidden_activation": "gelu"}, "'gelu_pytorch_tanh'"),
    ("Gemma3TextConfig", gemma, {"rope_parameters": {"sliding_attention": {"rope_type": "linear", "factor": 2.0}}},
     "only 'default'"),
    ("GemmaConfig", gemma, {"use_bidirectional_attention": True}, "None or False"),
    ("Qwen2Config", llama, {"use_sliding_window": True, "sliding_window": 0}, "a window of >= 1 positions"),
    ("Qwen2Config", llama, {"layer_types": ["full_attention", "chunked_attention"], "num_hidden_layers": 2},
     "per layer"),
    ("Qwen2Config", llama, {"layer_types": ["sliding_attention", "full_attention"], "num_hidden_layers": 2},
     "need use_sliding_window"),
    ("MistralConfig", llama, {"sliding_window": 0}, "a window of >= 1 positions"),
    ("Qwen2MoeConfig", qwen2_moe, {"use_sliding_window": True, "sliding_window": 8, "max_position_embeddings": 64},
     "Qwen2-MoE's windows are not implemented"),
    ("BertConfig", bert, {"position_embedding_type": "relative_key"}, "'absolute'"),
    ("BertConfig", bert, {"hidden_act": "silu"}, "one of"),
    ("BertConfig", bert, {"is_decoder": True}, "False"),
    ("BertConfig", bert, {"classifier_dropout": 0.3}, "hidden_dropout_prob"),
    ("BertConfig", bert, {"problem_type": "regression"}, "single_label_classification"),
])
def test_importers_refuse_options_they_do_not_implement(config_cls, family, changes, needs):
    sizes = {} if family is gpt2 else dict(hidden_size=32, num_attention_heads=4)
    d = {**_hf_dict(config_cls, **sizes), **changes}
    arch = {"GPT2Config": "GPT2LMHeadModel", "BertConfig": "BertModel"}.get(config_cls)
    key = [k for k in changes if k not in ("max_position_embeddings", "use_sliding_window", "num_hidden_layers")][0]
    with pytest.raises(ValueError, match="not supported exactly by jaxgpt") as err:
        family.config_from_hf(d, arch)
    assert f"{key}=" in str(err.value) and needs in str(err.value)


def test_import_names_every_problem_at_once():
    d = {**_hf_dict("LlamaConfig"), "hidden_act": "gelu", "pretraining_tp": 4, "mystery": 1}
    with pytest.raises(ValueError) as err:
        check_options(d, llama.OPTIONS["llama"], "LLaMA")
    for part in ("hidden_act='gelu'", "pretraining_tp=4", "mystery=1 (an option jaxgpt does not implement)"):
        assert part in str(err.value)


def test_live_models_go_through_the_same_checks():
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4, vocab_size=40,
        hidden_act="gelu"))
    with pytest.raises(ValueError, match=r"HF LLaMA config not supported exactly by jaxgpt: hidden_act='gelu'"):
        from_hf(hf)
    with pytest.raises(ValueError, match=r"from_hf supports .* got LlamaForSequenceClassification"):
        from_hf(transformers.LlamaForSequenceClassification(hf.config))


def test_llama_attention_bias_and_gpt2_reorder_are_exact():
    """attention_bias (q, k, v, o biases) maps to qkv_bias + o_bias; reorder_and_upcast_attn only
    changes rounding, so it is accepted and the logits still agree."""
    g = torch.Generator().manual_seed(0)
    models = [
        transformers.LlamaForCausalLM(transformers.LlamaConfig(
            hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=40, attention_bias=True, attn_implementation="eager")),
        transformers.GPT2LMHeadModel(transformers.GPT2Config(
            n_layer=2, n_embd=32, n_head=4, vocab_size=40, n_positions=16, reorder_and_upcast_attn=True,
            attn_implementation="eager")),
    ]
    tok = np.random.default_rng(0).integers(0, 40, (2, 9))
    for hf in models:
        with torch.no_grad():
            for p in hf.parameters():
                p.add_(torch.randn(p.shape, generator=g) / np.sqrt(p.shape[-1]))
        config, params = from_hf(hf.eval())
        if isinstance(hf, transformers.LlamaForCausalLM):
            assert config.qkv_bias and config.o_bias and not config.mlp_bias
        with torch.no_grad():
            want = hf(torch.from_numpy(tok)).logits
        assert_close(build(config).apply({"params": params}, tok), want, f"HF {type(hf).__name__} options import")
        back = to_hf(config, params).state_dict()
        assert all(torch.equal(back[k], v) for k, v in hf.state_dict().items())
