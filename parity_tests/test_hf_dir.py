"""Hugging Face model directories in and out without torch: ``load_hf`` / ``save_hf``.

Every family is built locally from its transformers config class (random weights, nothing
downloaded) and ``save_pretrained``: load_hf's logits must match the transformers model's (1e-5,
float32); save_hf's directory must load with transformers' ``from_pretrained`` and give our logits
(1e-5); directory -> jaxgpt -> directory must give back the same tensors, bit for bit.
"""
import json
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
import torch
from safetensors import safe_open

from conftest import assert_close, require_module
from jaxgpt import build
from jaxgpt.config import BertConfig
from jaxgpt.convert import load_hf, save_hf
from jaxgpt.models.bert import BertClassifier

transformers = require_module("transformers", allow_module_level=True)  # CI=true: missing is a failure
VOCAB, CTX = 50, 64
LLAMA = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=CTX, head_dim=8, bos_token_id=0, eos_token_id=0)
DECODERS = {
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", dict(n_layer=2, n_embd=32, n_head=4, vocab_size=VOCAB, n_positions=CTX,
                                                   bos_token_id=0, eos_token_id=0)),
    "gpt2-untied-relu": ("GPT2Config", "GPT2LMHeadModel", dict(
        n_layer=2, n_embd=32, n_head=4, n_inner=48, vocab_size=VOCAB, n_positions=CTX, activation_function="relu",
        tie_word_embeddings=False, bos_token_id=0, eos_token_id=0)),
    "llama-gqa": ("LlamaConfig", "LlamaForCausalLM", LLAMA),
    "llama-mqa-tied-theta": ("LlamaConfig", "LlamaForCausalLM", {
        **LLAMA, "num_key_value_heads": 1, "tie_word_embeddings": True,
        "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}}),
    "llama-biases": ("LlamaConfig", "LlamaForCausalLM", {**LLAMA, "attention_bias": True, "mlp_bias": True}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", LLAMA),
    "llama-head-dim": ("LlamaConfig", "LlamaForCausalLM", {**LLAMA, "head_dim": 12}),  # head_dim != hidden / heads
    "mistral": ("MistralConfig", "MistralForCausalLM", {**LLAMA, "sliding_window": None}),
    "mistral-window-covers-context": ("MistralConfig", "MistralForCausalLM", {**LLAMA, "sliding_window": CTX}),
}
BERT = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
            max_position_embeddings=16, type_vocab_size=2, num_labels=3)


def perturb(model, seed=0):
    """Unit-scale weights (norms and biases moved off 1 / 0), so 1e-5 is a meaningful bound."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) / np.sqrt(p.shape[-1]) + (p if p.ndim == 1 else 0))
    return model.eval()


def hf_decoder(name, seed=0):
    config_cls, model_cls, kw = DECODERS[name]
    config = getattr(transformers, config_cls)(**kw, attn_implementation="eager")
    return perturb(getattr(transformers, model_cls)(config), seed)


def hf_bert(arch, seed=0):
    config = transformers.BertConfig(**BERT, attn_implementation="eager")
    return perturb(getattr(transformers, arch)(config), seed)


def tokens(seed=0, b=2, t=12):
    return np.random.default_rng(seed).integers(0, VOCAB, (b, t))


def bert_inputs(seed=0):
    ids = tokens(seed, 3, 9)
    mask = np.ones_like(ids)
    mask[1, 6:] = 0
    types = (np.arange(9) >= 4).astype(np.int64)[None].repeat(3, 0) * mask
    return ids, mask, types


def hf_out(model, inputs):
    with torch.no_grad():
        if isinstance(model, transformers.BertModel):
            return model(*[torch.from_numpy(x) for x in inputs]).last_hidden_state.float()
        if len(inputs) == 3:
            return model(*[torch.from_numpy(x) for x in inputs]).logits.float()
        return model(torch.from_numpy(inputs[0])).logits.float()


def our_out(config, params, inputs):
    if isinstance(config, BertConfig):
        method = BertClassifier.encode if "classifier" not in params else None
        return BertClassifier(config).apply({"params": params}, *inputs, method=method)
    return build(config).apply({"params": params}, inputs[0])


def read_dir(path):
    """{key: array} of every safetensors file in a model directory."""
    out = {}
    for f in sorted(Path(path).glob("*.safetensors")):
        with safe_open(str(f), framework="np") as st:
            out.update({k: st.get_tensor(k) for k in st.keys()})
    return out


def assert_same_tensors(a, b):
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert np.array_equal(a[k].view(np.uint8), b[k].view(np.uint8)), k  # bit-exact, NaN-proof


def check_family(hf, inputs, tmp_path, name, auto, **save_kw):
    """save_pretrained -> load_hf (vs HF), save_hf -> ``auto``.from_pretrained (vs ours), bit-exact
    round trip; returns (config, params, the model transformers loaded from save_hf's directory)."""
    hf.save_pretrained(tmp_path / "hf", **save_kw)
    config, params = load_hf(tmp_path / "hf")
    want = hf_out(hf, inputs)
    ours = our_out(config, params, inputs)
    assert_close(ours, want, f"load_hf {name}")
    save_hf(tmp_path / "ours", config, params, max_shard_size=save_kw.get("max_shard_size", "5GB"))
    assert_same_tensors(read_dir(tmp_path / "ours"), read_dir(tmp_path / "hf"))
    back = getattr(transformers, auto).from_pretrained(tmp_path / "ours", attn_implementation="eager").eval()
    assert_close(ours, hf_out(back, inputs), f"save_hf {name} -> from_pretrained")
    return config, params, back


@pytest.mark.parametrize("name", sorted(DECODERS))
def test_decoder_directories(name, tmp_path):
    hf = hf_decoder(name)
    config, _, back = check_family(hf, (tokens(),), tmp_path, name, "AutoModelForCausalLM")
    assert config.kv_heads == hf.config.to_dict().get("num_key_value_heads", 4)
    if name == "llama-mqa-tied-theta":
        assert config.rope_base == 500000.0 and config.tie_embeddings
        assert json.loads((tmp_path / "ours" / "config.json").read_text())["tie_word_embeddings"] is True
    # A Mistral whose window covers the context is a LLaMA, and is written as one.
    assert type(back).__name__ == ("LlamaForCausalLM" if name.startswith("mistral") else type(hf).__name__)


def test_gpt2_model_directory(tmp_path):
    """A bare GPT2Model (no lm_head; GPT-2 ties it) loads as the full tied LM."""
    hf = hf_decoder("gpt2")
    hf.transformer.save_pretrained(tmp_path / "base")
    assert json.loads((tmp_path / "base" / "config.json").read_text())["architectures"] == ["GPT2Model"]
    config, params = load_hf(tmp_path / "base")
    assert_close(our_out(config, params, (tokens(),)), hf_out(hf, (tokens(),)), "load_hf GPT2Model")


@pytest.mark.parametrize("arch", ["BertModel", "BertForSequenceClassification"])
def test_bert_directories(arch, tmp_path):
    auto = "AutoModel" if arch == "BertModel" else "AutoModelForSequenceClassification"
    config, params, back = check_family(hf_bert(arch), bert_inputs(), tmp_path, arch, auto)
    assert ("classifier" in params) == (arch != "BertModel") and config.pooler == "tanh" and config.n_classes == 3
    assert type(back).__name__ == arch


def test_sharded_bf16_directory(tmp_path):
    """A bf16 checkpoint in shards (with an index): float32 by default, bf16 on request, bit-exact back."""
    hf = hf_decoder("llama-gqa").to(torch.bfloat16)
    hf.save_pretrained(tmp_path / "hf", max_shard_size="4KB")
    assert (tmp_path / "hf" / "model.safetensors.index.json").is_file()
    config, params = load_hf(tmp_path / "hf")
    assert {x.dtype for x in jax.tree.leaves(params)} == {np.dtype(np.float32)}
    ref = hf_decoder("llama-gqa")  # float32 model (and RoPE buffers) holding the bf16 values
    ref.load_state_dict({k: v.float() for k, v in hf.state_dict().items()})
    assert_close(our_out(config, params, (tokens(),)), hf_out(ref, (tokens(),)), "load_hf bf16 shards")
    config, params = load_hf(tmp_path / "hf", dtype="bfloat16")
    assert {x.dtype.name for x in jax.tree.leaves(params)} == {"bfloat16"}
    save_hf(tmp_path / "ours", config, params, max_shard_size="4KB")
    index = json.loads((tmp_path / "ours" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    assert json.loads((tmp_path / "ours" / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert_same_tensors(read_dir(tmp_path / "ours"), read_dir(tmp_path / "hf"))
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ours")
    assert back.dtype == torch.bfloat16
    want = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert torch.equal(hf_out(back, (tokens(),)), hf_out(want, (tokens(),)))  # the same bf16 model


def test_tokenizer_is_written(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "a": 1, "b": 2}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    hf = hf_decoder("gpt2")
    config, params = load_hf((hf.save_pretrained(tmp_path / "hf"), tmp_path / "hf")[1])
    save_hf(tmp_path / "ours", config, params, tokenizer=tok)
    assert Tokenizer.from_file(str(tmp_path / "ours" / "tokenizer.json")).encode("a b").ids == [1, 2]
    with pytest.raises(ValueError, match="tokenizer must be a jaxgpt tokenizer .* or have save_pretrained"):
        save_hf(tmp_path / "bad", config, params, tokenizer={"a": 1})


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    hf_decoder("llama-gqa").save_pretrained(path)
    return path


def edited(src, dst, **changes):
    shutil.copytree(src, dst)
    d = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**d, **changes}))
    return dst


@pytest.mark.parametrize("changes,message", [
    ({"model_type": "bloom", "architectures": ["BloomForCausalLM"]},
     r"model_type='bloom' \(architectures=\['BloomForCausalLM'\]\) is not supported"),
    ({"architectures": ["LlamaForSequenceClassification"]},
     r"architecture 'LlamaForSequenceClassification' is not supported for model_type='llama'"),
    ({"rope_parameters": {"rope_type": "proportional", "rope_theta": 10000.0}},
     r"rope_parameters=\{'rope_type': 'proportional'.*\(supported: rope_type 'default' or one of"),
    ({"rope_parameters": None, "rope_theta": 10000.0,
      "rope_scaling": {"type": "dynamic", "factor": 2.0, "partial_rotary_factor": 0.5}},
     r"rope_scaling=\{'type': 'dynamic', 'factor': 2.0, 'partial_rotary_factor': 0.5\}"),
    ({"hidden_act": "gelu"}, r"hidden_act='gelu' \(supported: 'silu'\)"),
    ({"model_type": "mistral", "architectures": ["MistralForCausalLM"], "sliding_window": 0},
     r"HF Mistral config .*sliding_window=0 \(supported: None or a window of >= 1 positions"),
])
def test_load_hf_refusals(llama_dir, tmp_path, changes, message):
    with pytest.raises(ValueError, match=message):
        load_hf(edited(llama_dir, tmp_path / "edited", **changes))


def test_load_hf_reads_the_older_rope_scaling_key(llama_dir, tmp_path):
    from jaxgpt.config import RopeScaling

    path = edited(llama_dir, tmp_path / "edited", rope_parameters=None, rope_theta=5e5,
                  rope_scaling={"type": "dynamic", "factor": 2.0})
    config, _ = load_hf(path)
    assert config.rope_scaling == RopeScaling("dynamic", factor=2.0) and config.rope_base == 5e5


def test_load_hf_names_every_problem_at_once(llama_dir, tmp_path):
    path = edited(llama_dir, tmp_path / "edited", hidden_act="relu", pretraining_tp=2, quantization_config={})
    with pytest.raises(ValueError) as err:
        load_hf(path)
    for part in ("hidden_act='relu'", "pretraining_tp=2", "quantization_config={} (an option jaxgpt does not"):
        assert part in str(err.value)


def test_missing_files_are_named(llama_dir, tmp_path):
    with pytest.raises(ValueError, match="no config.json"):
        load_hf(tmp_path)
    path = edited(llama_dir, tmp_path / "nofile")
    (path / "model.safetensors").unlink()
    with pytest.raises(ValueError, match="has neither model.safetensors nor model.safetensors.index.json"):
        load_hf(path)
    with pytest.raises(ValueError, match=r"dtype='int8' is not one of \('float32', 'bfloat16', 'float16'\)"):
        load_hf(llama_dir, dtype="int8")
    with pytest.raises(ValueError, match=r"max_shard_size='lots' is not a positive size"):
        save_hf(tmp_path / "x", *load_hf(llama_dir), max_shard_size="lots")


def test_directories_never_import_torch_or_transformers(llama_dir, tmp_path):
    code = f"""
import sys
from jaxgpt.convert import load_hf, save_hf
config, params = load_hf({str(llama_dir)!r}, dtype="bfloat16")
save_hf({str(tmp_path / "out")!r}, config, params, max_shard_size=2000)
print(sorted(m for m in ("torch", "transformers") if m in sys.modules))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=Path(__file__).resolve().parents[1])
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[]"
    assert (tmp_path / "out" / "model.safetensors.index.json").is_file()
