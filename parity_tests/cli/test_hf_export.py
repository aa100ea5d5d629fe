"""Exports that lose nothing: `jaxgpt convert ... --to hf` writes the tokenizer (tokenizer.json,
tokenizer_config.json, the chat template), the special ids (config.json, generation_config.json) and
the source's sampling defaults, from an HF directory and from a run fine-tuned on one with `train --init`.

The reference is transformers itself on the source directory: AutoTokenizer's ids (texts with unicode,
whitespace runs and special-token strings; a chat template), GenerationConfig, and the model's logits,
which must equal jaxgpt's on the exported params (1e-5, float32). Tokenizers HF has no class for
(character, pair, id-only) export their weights with an ExportWarning naming what is missing."""
from __future__ import annotations

import json
import shutil

import jax
import numpy as np
import pytest
import torch

from conftest import assert_close, require_module
from parity_tests.hf_dirs import TEXT, bpe_tokenizer, llama_dir
from jaxgpt import build
from jaxgpt.cli import main
from jaxgpt.convert import save_hf
from jaxgpt.convert.files import load_weights, save_weights
from jaxgpt.convert.hf_files import ExportWarning

transformers = require_module("transformers", allow_module_level=True)
require_module("jinja2", allow_module_level=True)

SPECIALS = ("<pad>", "<s>", "</s>", "<|user|>", "<|assistant|>")  # ids 0..4: the trainer puts them first
TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")
TEXTS = ["the cat sat on the mat.", "  two  spaces,\ttab\n\nnewlines   ", "naïve café 猫 ☃ 🙂",
         "<s>special</s> strings <pad><|user|>hi<|assistant|>", ""]
CHAT = [{"role": "user", "content": "the cat sat"}, {"role": "assistant", "content": "on the mat"},
        {"role": "user", "content": "naïve 猫?"}]
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")
IDS = ("bos_token_id", "eos_token_id", "pad_token_id")


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    """A LLaMA directory (bos 1, eos 2, pad 0) with a BPE trained here whose post-processor adds <s>,
    a chat template, and a generation config with two EOS ids and sampling defaults."""
    from tokenizers import processors
    from transformers import GenerationConfig, PreTrainedTokenizerFast

    path = llama_dir(tmp_path_factory.mktemp("src") / "llama", pad_token_id=0)
    tok = bpe_tokenizer(specials=SPECIALS)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                            chat_template=TEMPLATE).save_pretrained(path)
    GenerationConfig(bos_token_id=1, eos_token_id=[2, 4], pad_token_id=0, do_sample=True, temperature=0.7,
                     top_p=0.9).save_pretrained(path)
    return path


def chat_ids(tok):
    out = tok.apply_chat_template(CHAT, tokenize=True, add_generation_prompt=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def check_export(src, out, params):
    """``out`` reads back in transformers as ``src`` does (tokenizer, chat, ids, generation config), and
    its model's logits are jaxgpt's on ``params``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    ref, got = AutoTokenizer.from_pretrained(src), AutoTokenizer.from_pretrained(out)
    for text in TEXTS:
        assert got(text).input_ids == ref(text).input_ids, text
    assert chat_ids(got) == chat_ids(ref) and chat_ids(got)[-1] == 4
    assert [got.bos_token_id, got.eos_token_id, got.pad_token_id] == [1, 2, 0]
    config_of = lambda d: json.loads((d / "config.json").read_text())
    assert {k: config_of(out)[k] for k in IDS} == {k: config_of(src)[k] for k in IDS} == dict(zip(IDS, (1, 2, 0)))
    assert GenerationConfig.from_pretrained(out).to_dict() == GenerationConfig.from_pretrained(src).to_dict()
    model = AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
    assert model.generation_config.eos_token_id == [2, 4] and model.generation_config.temperature == 0.7
    tokens = np.asarray([ref(TEXTS[0]).input_ids], np.int32)  # (1, T)
    with torch.no_grad():
        theirs = model(torch.from_numpy(tokens).long()).logits.numpy()
    config, _, _ = load_weights(out, "hf")
    assert_close(np.asarray(build(config).apply({"params": params}, tokens)), theirs, "hf export logits")


def sample_matches_generate(out, capsys):
    """`jaxgpt sample` on the export: its text prompt, greedy to transformers' first EOS."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    ids = tok("the cat", return_tensors="pt").input_ids
    with torch.no_grad():
        want = tok.decode(model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False,
                                         eos_token_id=2)[0], skip_special_tokens=True)
    assert main(["sample", "--ckpt", str(out), "--prompt", "the cat", "--temperature", "0",
                 "--max-new-tokens", "6"]) == 0
    assert capsys.readouterr().out.split("--- greedy ---\n")[1].rstrip("\n") == want


def test_hf_dir_to_hf_keeps_tokenizer_ids_and_generation_config(src, tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["convert", str(src), str(out), "--to", "hf"]) == 0
    assert "warning" not in capsys.readouterr().err
    for name in TOKENIZER_FILES:  # verbatim: the round trip is the identity on what transformers reads
        assert (out / name).read_bytes() == (src / name).read_bytes(), name
    _, params, _ = load_weights(src, "hf")
    check_export(src, out, params)
    sample_matches_generate(out, capsys)


def test_safetensors_and_torch_files_keep_the_hf_tokenizer(src, tmp_path):
    config, params, extras = load_weights(src, "hf")
    assert extras["tokenizer"]["files"]["chat_template.jinja"] == TEMPLATE
    save_weights(tmp_path / "w.safetensors", "safetensors", config, params, extras)
    save_weights(tmp_path / "w.pt", "torch", *load_weights(tmp_path / "w.safetensors"))
    config, params, extras2 = load_weights(tmp_path / "w.pt")
    assert extras2["tokenizer"] == extras["tokenizer"]
    save_weights(tmp_path / "out", "hf", config, params, extras2)
    for name in TOKENIZER_FILES:
        assert (tmp_path / "out" / name).read_bytes() == (src / name).read_bytes(), name


def test_older_layouts_and_older_checkpoints(src, tmp_path):
    """A template inside tokenizer_config.json, special_tokens_map.json and named templates come back
    verbatim; a tokenizer dict saved before the files were carried still exports a loadable tokenizer
    with its special ids (tokenizer_config.json written from its special tokens)."""
    from transformers import AutoTokenizer

    old = shutil.copytree(src, tmp_path / "old")
    cfg = json.loads((old / "tokenizer_config.json").read_text())
    (old / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": TEMPLATE}))
    (old / "chat_template.jinja").unlink()
    (old / "special_tokens_map.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    config, params, extras = load_weights(old, "hf")
    save_weights(tmp_path / "out", "hf", config, params, extras)
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        assert (tmp_path / "out" / name).read_bytes() == (old / name).read_bytes(), name
    assert chat_ids(AutoTokenizer.from_pretrained(tmp_path / "out")) == chat_ids(AutoTokenizer.from_pretrained(src))
    named = shutil.copytree(src, tmp_path / "named")  # transformers 5's named templates beside the default
    (named / "additional_chat_templates").mkdir()
    (named / "additional_chat_templates" / "tool.jinja").write_text("{{ messages[0]['content'] }}")
    save_weights(tmp_path / "out2", "hf", *load_weights(named, "hf"))
    name = "additional_chat_templates/tool.jinja"
    assert (tmp_path / "out2" / name).read_bytes() == (named / name).read_bytes()

    bare = {k: v for k, v in extras["tokenizer"].items() if k not in ("files", "config_ids")}
    save_weights(tmp_path / "bare", "hf", config, params, {**extras, "tokenizer": bare})
    ref, got = AutoTokenizer.from_pretrained(src), AutoTokenizer.from_pretrained(tmp_path / "bare")
    assert [got(t).input_ids for t in TEXTS] == [ref(t).input_ids for t in TEXTS]
    assert [got.bos_token_id, got.eos_token_id, got.pad_token_id] == [1, 2, 0]
    generation = json.loads((tmp_path / "bare" / "generation_config.json").read_text())
    assert generation == {"bos_token_id": 1, "eos_token_id": [2, 4], "pad_token_id": 0}
    with pytest.raises(ValueError, match=r"tokenizer file name '../x.json' leaves the directory"):
        save_hf(tmp_path / "evil", config, params, tokenizer={**bare, "files": {"../x.json": "{}"}})
    save_hf(tmp_path / "tf", config, params, tokenizer=ref)  # a transformers tokenizer: save_pretrained + its ids
    written = [json.loads((tmp_path / "tf" / name).read_text()) for name in ("config.json", "generation_config.json")]
    assert [{k: d[k] for k in IDS} for d in written] == [dict(zip(IDS, (1, 2, 0)))] * 2


def test_finetuned_run_exports_its_tokenizer(src, tmp_path, capsys):
    data = tmp_path / "text.txt"
    data.write_text(TEXT)
    run, out = tmp_path / "run", tmp_path / "out"
    assert main(["train", "--init", str(src), "--data", str(data), "--set", "steps=2", "--set", "batch_size=2",
                 "--set", "seq_len=16", "--set", "eval_batches=1", "--out", str(run), "--quiet"]) == 0
    assert main(["convert", str(run), str(out), "--to", "hf"]) == 0
    assert "warning" not in capsys.readouterr().err
    _, tuned, _ = load_weights(run)
    _, before, _ = load_weights(src, "hf")
    assert not np.array_equal(tuned["tok_embed"]["embedding"], before["tok_embed"]["embedding"])  # it trained
    check_export(src, out, tuned)
    sample_matches_generate(out, capsys)


def tiny_rope_config(vocab):
    from jaxgpt.config import ModelConfig

    return ModelConfig(vocab_size=vocab, max_len=16, d_model=16, n_layer=1, n_head=2, pos="rope", norm="rmsnorm",
                       mlp="swiglu")


def test_tokenizers_without_an_hf_class_warn_and_export_the_weights(tmp_path, capsys):
    from transformers import AutoTokenizer

    from jaxgpt.data.tokenizers import CharTokenizer, PairTokenizer, train_bpe
    from jaxgpt.models import init_params

    char = CharTokenizer.from_text("abc ")
    config = tiny_rope_config(char.vocab_size)
    params = init_params(config, jax.random.PRNGKey(0))
    with pytest.warns(ExportWarning, match=r"the 'char' tokenizer has no Hugging Face class, so .* gets no "
                                           r"tokenizer files: AutoTokenizer cannot load it"):
        save_weights(tmp_path / "char", "hf", config, params, {"tokenizer": char.to_dict()})
    assert (tmp_path / "char" / "model.safetensors").is_file() and not (tmp_path / "char" / "tokenizer.json").exists()
    pair = PairTokenizer.from_texts(["ab"])
    with pytest.warns(ExportWarning, match=r"'pair' tokenizer .* its special ids .* are kept"):
        save_weights(tmp_path / "pair", "hf", tiny_rope_config(pair.vocab_size),
                     init_params(tiny_rope_config(pair.vocab_size), jax.random.PRNGKey(0)), {"tokenizer": pair.to_dict()})
    written = json.loads((tmp_path / "pair" / "config.json").read_text())
    assert {k: written[k] for k in IDS} == {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}
    with pytest.warns(ExportWarning, match="no tokenizer came with these weights"):
        save_weights(tmp_path / "none", "hf", config, params, {})
    # the command line says it in one line, and still writes the weights
    save_weights(tmp_path / "char.safetensors", "safetensors", config, params, {"tokenizer": char.to_dict()})
    assert main(["convert", str(tmp_path / "char.safetensors"), str(tmp_path / "cli"), "--to", "hf"]) == 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("jaxgpt convert: warning: the 'char' tokenizer has no Hugging Face")
    # jaxgpt's own byte-level BPE has one: a PreTrainedTokenizerFast with the same ids
    bpe = train_bpe(TEXT, 300)
    save_weights(tmp_path / "bpe", "hf", tiny_rope_config(bpe.vocab_size),
                 init_params(tiny_rope_config(bpe.vocab_size), jax.random.PRNGKey(0)), {"tokenizer": bpe.to_dict()})
    hf = AutoTokenizer.from_pretrained(tmp_path / "bpe")
    for text in TEXTS[:3]:
        assert hf(text).input_ids == bpe.encode(text).tolist()


def test_serve_reads_the_chat_template_a_run_carries(src, tmp_path):
    """A jaxgpt checkpoint converted from the HF directory serves chat with the directory's template."""
    from jaxgpt.cli.serve import chat_template_of
    from jaxgpt.data import tokenizer_from_dict

    ckpt = tmp_path / "ckpt"
    shutil.rmtree(ckpt, ignore_errors=True)
    save_weights(ckpt, "jaxgpt", *load_weights(src, "hf"))
    _, _, meta = load_weights(ckpt)
    assert chat_template_of(str(ckpt), tokenizer_from_dict(meta["tokenizer"])) == TEMPLATE
    assert chat_template_of(str(src)) == TEMPLATE
