"""Tiny Hugging Face model directories built locally (random weights, save_pretrained; nothing is
downloaded), each with a byte-level BPE tokenizer trained here and saved through transformers'
PreTrainedTokenizerFast. Shared by test_hf_cli.py and test_parity_tool.py."""
from __future__ import annotations

from pathlib import Path

import torch

TEXT = ("the cat sat on the mat. the dog sat on the log. a cat and a dog met on the mat.\n" * 20
        + "to be or not to be, that is the question.\n" * 10)
VOCAB = 320  # the model's vocabulary; the trained tokenizer has at most this many tokens


def bpe_tokenizer(vocab: int = VOCAB, specials=("<|endoftext|>",)):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=list(specials), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(TEXT.splitlines(keepends=True), trainer=trainer)
    return tok


def save_tokenizer(tok, path: Path, **special_tokens) -> None:
    from transformers import PreTrainedTokenizerFast

    PreTrainedTokenizerFast(tokenizer_object=tok, **special_tokens).save_pretrained(path)


def randomize_(model, seed: int = 0, scale: float = 0.3):
    """Norm weights off one and biases off zero (HF inits them to 1 / 0), so layout bugs show."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(scale * torch.randn(p.shape, generator=g))
    return model.eval()


def gpt2_dir(path: Path, *, n_layer: int = 2, tokenizer: bool = True) -> Path:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    eos = 0  # <|endoftext|> is the first special token of the trained tokenizer
    model = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=64, n_embd=32, n_layer=n_layer, n_head=4,
                                       bos_token_id=eos, eos_token_id=eos))
    randomize_(model).save_pretrained(path)
    if tokenizer:
        save_tokenizer(bpe_tokenizer(), path, eos_token="<|endoftext|>", bos_token="<|endoftext|>")
    return path


def llama_dir(path: Path, *, n_layer: int = 2, pad_token_id: int | None = None, family: str = "llama",
              tied: bool = False, tokenizer: bool = False) -> Path:
    """A LLaMA directory, or with ``family='qwen2'`` / 'mistral' that family's (the same layout);
    ``tokenizer``: with a BPE trained here (<pad> 0, <s> 1 = bos, </s> 2 = eos)."""
    import transformers

    names = {"llama": "Llama", "qwen2": "Qwen2", "mistral": "Mistral"}[family]
    torch.manual_seed(1)
    cfg = getattr(transformers, f"{names}Config")(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=n_layer, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, bos_token_id=1, eos_token_id=2, pad_token_id=pad_token_id,
        tie_word_embeddings=tied)
    model = getattr(transformers, f"{names}ForCausalLM")(cfg)
    randomize_(model, seed=1).save_pretrained(path)
    if tokenizer:
        save_tokenizer(bpe_tokenizer(specials=("<pad>", "<s>", "</s>")), path, pad_token="<pad>", bos_token="<s>",
                       eos_token="</s>")
    return path


def bert_dir(path: Path, *, n_layer: int = 2) -> Path:
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(2)
    model = BertForSequenceClassification(BertConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=n_layer, num_attention_heads=4, intermediate_size=64,
        max_position_embeddings=64, num_labels=3))
    randomize_(model, seed=2).save_pretrained(path)
    return path


def nanogpt_ckpt(path: Path, *, bias: bool = True, compiled: bool = False) -> Path:
    """A nanoGPT ``ckpt.pt`` (model_args + model, Linear weights (out, in), tied lm_head) with unit-scale
    random weights, written the way nanoGPT's train.py saves it."""
    g = torch.Generator().manual_seed(3)
    d, v, t, n_layer = 32, 64, 32, 2
    rnd = lambda *shape: torch.randn(*shape, generator=g) / shape[-1] ** 0.5
    sd = {"transformer.wte.weight": rnd(v, d), "transformer.wpe.weight": rnd(t, d)}
    for i in range(n_layer):
        h = f"transformer.h.{i}."
        for ln in ("ln_1", "ln_2"):
            sd[h + ln + ".weight"] = 1 + 0.3 * torch.randn(d, generator=g)
        for name, (o, n_in) in {"attn.c_attn": (3 * d, d), "attn.c_proj": (d, d), "mlp.c_fc": (4 * d, d),
                                "mlp.c_proj": (d, 4 * d)}.items():
            sd[h + name + ".weight"] = rnd(o, n_in)
            if bias:
                sd[h + name + ".bias"] = 0.3 * torch.randn(o, generator=g)
        if bias:
            for ln in ("ln_1", "ln_2"):
                sd[h + ln + ".bias"] = 0.3 * torch.randn(d, generator=g)
    sd["transformer.ln_f.weight"] = 1 + 0.3 * torch.randn(d, generator=g)
    if bias:
        sd["transformer.ln_f.bias"] = 0.3 * torch.randn(d, generator=g)
    sd["lm_head.weight"] = sd["transformer.wte.weight"]
    if compiled:
        sd = {"_orig_mod." + k: x for k, x in sd.items()}
    torch.save({"model_args": dict(n_layer=n_layer, n_head=4, n_embd=d, block_size=t, bias=bias, vocab_size=v,
                                   dropout=0.0), "model": sd, "iter_num": 0}, path)
    return path


def randomize_moe_(model, seed: int = 3):
    """Unit-scale weights for a MoE model (HF's 0.02 init makes near-uniform routers whose top-k
    a rounding could flip): every matrix N(0, 1/fan_in), then randomize_."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.copy_(p.shape[-1] ** -0.5 * torch.randn(p.shape, generator=g))
    return randomize_(model, seed)


def mixtral_model(n_layer: int = 2, **config):
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(3)
    cfg = MixtralConfig(**{**dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=24, num_hidden_layers=n_layer,
                                  num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                  num_experts_per_tok=2, max_position_embeddings=64, bos_token_id=1, eos_token_id=2,
                                  tie_word_embeddings=False), **config})
    return randomize_moe_(MixtralForCausalLM(cfg))


def mixtral_dir(path: Path, *, fused: bool = False, n_layer: int = 2, **config) -> Path:
    """save_pretrained's layout (block_sparse_moe.experts.N.w1/w2/w3), or with ``fused`` the in-memory
    transformers 5 layout (mlp.experts.gate_up_proj / down_proj) written as it is. ``config``: MixtralConfig
    keys to change."""
    model = mixtral_model(n_layer, **config)
    model.save_pretrained(path)
    if fused:
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path / "model.safetensors"),
                  metadata={"format": "pt"})
    return path


def qwen2_moe_dir(path: Path, *, norm_topk: bool = False, mlp_only_layers=(), n_layer: int = 2, **config) -> Path:
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    torch.manual_seed(4)
    cfg = Qwen2MoeConfig(**{**dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=40, moe_intermediate_size=16,
                                   shared_expert_intermediate_size=24, num_hidden_layers=n_layer, num_attention_heads=4,
                                   num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
                                   norm_topk_prob=norm_topk, mlp_only_layers=list(mlp_only_layers),
                                   max_position_embeddings=64, tie_word_embeddings=False), **config})
    randomize_moe_(Qwen2MoeForCausalLM(cfg), seed=4).save_pretrained(path)
    return path
