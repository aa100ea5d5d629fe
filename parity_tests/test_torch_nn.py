"""torch's own nn.Transformer / TransformerEncoderLayer / TransformerDecoderLayer (seed 004) imported
into jaxgpt's Block and EncoderDecoder: hidden states and logits at 1e-5 in float32, both
norm_first settings, with key padding (torch True = masked out, jaxgpt True = attend)."""
import numpy as np
import pytest
import torch
from torch import nn

from conftest import assert_close
from jaxgpt.nn.block import Block
from jaxgpt.convert.torch_nn import (attend_mask, decoder_layer_params, encoder_layer_params,
                                     from_torch_transformer, layer_config, transformer_config)
from jaxgpt.models.encdec import EncoderDecoder

D, H, FF = 32, 4, 64


def perturb(module, seed=0):
    """Norm scales off one, biases off zero, so a swapped norm or a dropped bias shows up."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            if p.dim() == 1:
                p.add_(0.3 * torch.randn(p.shape))
    return module.eval()


def padding(b=3, t=7):
    """(B, T) torch key padding mask, True = padding: full, partly and mostly padded rows."""
    pad = np.zeros((b, t), bool)
    pad[1, 5:] = True
    pad[2, 2:] = True
    return pad


@pytest.mark.parametrize("norm_first", [False, True])
@pytest.mark.parametrize("activation", ["relu", "gelu"])
def test_encoder_layer(norm_first, activation):
    layer = perturb(nn.TransformerEncoderLayer(D, H, FF, activation=activation, batch_first=True,
                                               norm_first=norm_first))
    config = layer_config(layer)
    assert config.norm_placement == ("pre" if norm_first else "post") and config.mlp == activation
    x = np.random.default_rng(0).standard_normal((3, 7, D)).astype(np.float32)
    pad = padding()
    params = encoder_layer_params(layer.state_dict(), config)
    y, _, _ = Block(config, causal=False).apply({"params": params}, x, mask=attend_mask(pad)[:, None, None, :])
    with torch.no_grad():
        want = layer(torch.from_numpy(x), src_key_padding_mask=torch.from_numpy(pad))
    assert_close(y, want, "nn.TransformerEncoderLayer vs Block")


@pytest.mark.parametrize("norm_first", [False, True])
def test_decoder_layer(norm_first):
    layer = perturb(nn.TransformerDecoderLayer(D, H, FF, batch_first=True, norm_first=norm_first), seed=1)
    config = layer_config(layer)
    r = np.random.default_rng(1)
    x, memory = (r.standard_normal((3, n, D)).astype(np.float32) for n in (6, 7))
    mem_pad, tgt_pad = padding(), padding(t=6)
    causal = nn.Transformer.generate_square_subsequent_mask(6)  # float: 0 / -inf
    self_mask = attend_mask(causal)[None, None] & attend_mask(tgt_pad)[:, None, None, :]  # (B, 1, T, T)
    params = decoder_layer_params(layer.state_dict(), config)
    y, _, _ = Block(config, causal=True, cross=True).apply(
        {"params": params}, x, memory, mask=self_mask, context_mask=attend_mask(mem_pad)[:, None, None, :])
    with torch.no_grad():
        want = layer(torch.from_numpy(x), torch.from_numpy(memory), tgt_mask=causal.bool(), tgt_is_causal=True,
                     tgt_key_padding_mask=torch.from_numpy(tgt_pad),
                     memory_key_padding_mask=torch.from_numpy(mem_pad))
    assert_close(y, want, "nn.TransformerDecoderLayer vs Block")


class Seq2Seq(nn.Module):
    """The usual model around nn.Transformer: token + learned position embeddings, a generator."""

    def __init__(self, norm_first, src_vocab=40, tgt_vocab=30, max_len=16):
        super().__init__()
        self.src_embed, self.tgt_embed = nn.Embedding(src_vocab, D), nn.Embedding(tgt_vocab, D)
        self.src_pos, self.tgt_pos = nn.Embedding(max_len, D), nn.Embedding(max_len, D)
        self.transformer = nn.Transformer(D, H, num_encoder_layers=2, num_decoder_layers=3, dim_feedforward=FF,
                                          batch_first=True, norm_first=norm_first)
        self.generator = nn.Linear(D, tgt_vocab)

    def forward(self, src, tgt, src_pad):
        s = self.src_embed(src) + self.src_pos(torch.arange(src.shape[1]))
        t = self.tgt_embed(tgt) + self.tgt_pos(torch.arange(tgt.shape[1]))
        causal = nn.Transformer.generate_square_subsequent_mask(tgt.shape[1], dtype=torch.bool)
        memory = self.transformer.encoder(s, src_key_padding_mask=src_pad)
        h = self.transformer.decoder(t, memory, tgt_mask=causal, tgt_is_causal=True,
                                     memory_key_padding_mask=src_pad)
        return memory, h, self.generator(h)


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors:UserWarning",
                            "ignore:enable_nested_tensor is True:UserWarning")
@pytest.mark.parametrize("norm_first", [False, True])
def test_nn_transformer_into_encdec(norm_first):
    model = perturb(Seq2Seq(norm_first), seed=2)
    config = transformer_config(model.transformer, src_vocab=40, tgt_vocab=30, max_len=16)
    assert config.encoder.final_norm and config.decoder.n_layer == 3
    params = from_torch_transformer(model.state_dict(), config)
    r = np.random.default_rng(3)
    src, tgt = r.integers(0, 40, (3, 7)).astype(np.int32), r.integers(0, 30, (3, 6)).astype(np.int32)
    pad = padding()
    with torch.no_grad():
        t_memory, t_hidden, t_logits = model(torch.from_numpy(src).long(), torch.from_numpy(tgt).long(),
                                             torch.from_numpy(pad))
    ours = EncoderDecoder(config)
    src_mask = attend_mask(pad)  # (B, S), True = real token
    memory = ours.apply({"params": params}, src, src_mask, method=EncoderDecoder.encode)
    hidden = ours.apply({"params": params}, tgt, memory, src_mask,
                        method=lambda m, t, mem, sm: m.decoder(t, mem, attend_mask(pad)[:, None, None, :]))
    logits = ours.apply({"params": params}, src, tgt, src_mask)
    # torch's nested-tensor fast path leaves padded encoder positions at norm(0): compare real ones.
    assert_close(np.asarray(memory)[src_mask], t_memory.numpy()[src_mask], "nn.Transformer memory")
    assert_close(hidden, t_hidden, "nn.Transformer decoder hidden states")
    assert_close(logits, t_logits, "nn.Transformer logits")


def test_import_is_strict_and_masks_are_checked():
    model = Seq2Seq(norm_first=False)
    config = transformer_config(model.transformer, src_vocab=40, tgt_vocab=30, max_len=16)
    sd = {k: v for k, v in model.state_dict().items() if not k.startswith("generator.")}
    with pytest.raises(ValueError, match=r"missing keys \['out_proj.bias', 'out_proj.weight'\]"):
        from_torch_transformer(sd, config)
    with pytest.raises(ValueError, match=r"missing keys \[.out_proj.weight.\]; unexpected keys \[.generator.weight.\]"):
        from_torch_transformer(model.state_dict(), config, names={"out_proj.weight": "head.weight"})
    with pytest.raises(ValueError, match="float mask value 0.5 is neither 0"):
        attend_mask(torch.tensor([[0.0, 0.5]]))
    assert attend_mask(torch.tensor([[True, False]])).tolist() == [[False, True]]
    with pytest.raises(ValueError, match="activation .* is not supported"):
        layer_config(nn.TransformerEncoderLayer(D, H, FF, activation=nn.SiLU()))
