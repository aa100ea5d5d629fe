"""Mixtral and Qwen2-MoE directories against transformers: load_hf (both Mixtral expert layouts),
save_hf back (bit-exact tensors, read by from_pretrained), logits 1e-5 both ways; Qwen2-MoE with
norm_topk_prob off and on, its shared expert, and mixed dense/MoE layers; refusals by name.

The routers are unit-scale (hf_dirs.randomize_moe_) and every test asserts a gap between the k-th
and the (k+1)-th router logit, so no top-k choice is a tie (torch documents no tie order)."""
import json

import numpy as np
import pytest
import torch
import transformers

from parity_tests import hf_dirs
from conftest import assert_close
from jaxgpt import Execution, build
from jaxgpt.convert import from_hf, load_hf, save_hf, to_hf
from test_hf_dir import assert_same_tensors, read_dir

TOKENS = np.random.default_rng(0).integers(0, hf_dirs.VOCAB, (2, 12)).astype(np.int32)


def hf_logits(model, with_gaps=True):
    out = model(torch.from_numpy(TOKENS).long(), output_router_logits=True)
    if with_gaps:  # no near-ties in any layer's top-k: the k-th and (k+1)-th router logits differ
        k = model.config.num_experts_per_tok
        for logits in out.router_logits:
            z = logits.detach().float().sort(-1, descending=True).values
            assert float((z[:, k - 1] - z[:, k]).min()) > 1e-4
    return out.logits.detach().numpy()


def ours(config, params):
    return np.asarray(build(config).apply({"params": params}, TOKENS))


def roundtrip(path, tmp_path, name, same_tensors=True):
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").eval()
    want = hf_logits(hf)
    config, params = load_hf(path)
    got = ours(config, params)
    assert_close(got, want, f"load_hf {name}")
    save_hf(tmp_path / "ours", config, params)
    if same_tensors:
        assert_same_tensors(read_dir(tmp_path / "ours"), read_dir(path))
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ours", attn_implementation="eager").eval()
    assert type(back).__name__ == type(hf).__name__
    assert_close(got, hf_logits(back, False), f"save_hf {name} -> from_pretrained")
    return config, params


@pytest.mark.parametrize("fused", [False, True], ids=["saved-layout", "fused-layout"])
def test_mixtral_directories(fused, tmp_path):
    path = hf_dirs.mixtral_dir(tmp_path / "hf", fused=fused)
    keys = read_dir(path)
    assert any(("experts.gate_up_proj" if fused else "block_sparse_moe.experts.0.w1") in k for k in keys)
    config, _ = roundtrip(path, tmp_path, "Mixtral", same_tensors=not fused)
    assert config.moe.norm_topk and config.moe.n_experts == 4 and config.moe.top_k == 2


def test_mixtral_live_model_fused_state_dict():
    """from_hf reads transformers 5's in-memory (fused gate_up_proj) layout; to_hf gives it back."""
    hf = hf_dirs.mixtral_model().eval()
    config, params = from_hf(hf)
    got = ours(config, params)
    assert_close(got, hf_logits(hf), "from_hf Mixtral (fused)")
    back = to_hf(config, params)
    assert type(back).__name__ == "MixtralForCausalLM"
    assert_close(got, hf_logits(back, False), "to_hf Mixtral")


@pytest.mark.parametrize("norm_topk,dense", [(False, ()), (True, (1,))], ids=["raw-topk", "renorm-mixed-layers"])
def test_qwen2_moe_directories(norm_topk, dense, tmp_path):
    path = hf_dirs.qwen2_moe_dir(tmp_path / "hf", norm_topk=norm_topk, mlp_only_layers=dense)
    config, _ = roundtrip(path, tmp_path, f"Qwen2-MoE norm_topk={norm_topk}")
    assert config.moe.norm_topk is norm_topk and config.moe.shared_d_ff == 24 and config.qkv_bias
    # mixed dense/MoE layers cannot share one scanned body: their default Execution keeps them separate
    assert Execution.for_model(config).scan_layers is not bool(dense)
    saved = json.loads((tmp_path / "ours" / "config.json").read_text())
    assert saved["norm_topk_prob"] is norm_topk and saved["mlp_only_layers"] == list(dense)


@pytest.mark.parametrize("changes,message", [
    ({"router_jitter_noise": 0.1}, "router_jitter_noise=0.1"),
    ({"sliding_window": 0}, "sliding_window=0"),
])
def test_mixtral_refusals_name_the_option(changes, message, tmp_path):
    path = hf_dirs.mixtral_dir(tmp_path / "hf", n_layer=1)
    d = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**d, **changes}))
    with pytest.raises(ValueError, match=message):
        load_hf(path)


def test_moe_export_refusals_name_the_field():
    from jaxgpt.config import ModelConfig, MoEConfig

    cfg = ModelConfig(pos="rope", moe=MoEConfig(n_experts=4, norm_topk=False))  # Mixtral renormalises
    with pytest.raises(ValueError, match="moe=MoEConfig"):
        save_hf("/nonexistent", cfg, {})
    # a capacity factor drops tokens, HF's MoE layers never do: refused, not exported without it
    dropping = ModelConfig(pos="rope", moe=MoEConfig(n_experts=4, impl="alltoall", capacity_factor=1.25))
    with pytest.raises(ValueError, match="capacity_factor=None"):
        save_hf("/nonexistent", dropping, {})
    shared = MoEConfig(n_experts=4, norm_topk=False, shared_d_ff=8, impl="alltoall", capacity_factor=1.25)
    with pytest.raises(ValueError, match="capacity_factor=None"):
        save_hf("/nonexistent", ModelConfig(pos="rope", qkv_bias=True, moe=shared), {})


@pytest.mark.slow
@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe"])
def test_parity_tool_with_grads_passes(family, tmp_path):
    """What ``jaxgpt parity DIR --grads`` runs: logits, per-layer outputs, every gradient, an AdamW
    step and greedy decoding, each within 1e-5 of transformers."""
    from jaxgpt.tools.parity import run

    path = (hf_dirs.mixtral_dir(tmp_path / "hf") if family == "mixtral"
            else hf_dirs.qwen2_moe_dir(tmp_path / "hf", mlp_only_layers=(1,)))
    report = run(path, grads=True, generate=4)
    assert report["ok"], report
    assert not report["grads"]["over_tol"] and report["grads"]["scaled"] <= 1e-5


@pytest.mark.slow  # ~2 min on the shared 2-core machine: five commands, each compiling its own programs
def test_cli_trains_samples_evaluates_and_converts_a_moe_model(tmp_path, capsys):
    """train (MoE from --set moe.*), sample, eval, convert --to hf (read back by transformers as a
    Mixtral), and train --init from the converted directory: the commands users run."""
    from jaxgpt.cli import main

    run, hf = tmp_path / "run", tmp_path / "hf"
    common = ["--corpus", "seed-synthetic", "--set", "batch_size=4", "--set", "seq_len=16", "--quiet"]
    assert main(["train", "--preset", "llama-tiny", "--set", "n_layer=1", "--set", "d_model=32", "--set", "n_head=4",
                 "--set", "moe.n_experts=4", "--set", "moe.d_ff=32", "--set", "steps=4", "--out", str(run), *common]) == 0
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert any("router_aux" in m for m in metrics)
    load = [m for m in metrics if "expert_load" in m]  # per-expert load, a list of 4 shares a logged step
    assert load and all(len(m["expert_load"]) == 4 and m["expert_load_max"] >= 1.0 for m in load)
    assert (run / "expert_load.png").stat().st_size > 10_000  # and plotted beside loss.png
    assert main(["sample", "--ckpt", str(run), "--prompt-ids", "1,2", "--max-new-tokens", "4"]) == 0
    assert main(["eval", "--ckpt", str(run), "--corpus", "seed-synthetic", "--batches", "1"]) == 0
    assert main(["convert", str(run), str(hf), "--to", "hf"]) == 0
    assert json.loads((hf / "config.json").read_text())["model_type"] == "mixtral"
    config, params = load_hf(hf)
    back = transformers.AutoModelForCausalLM.from_pretrained(hf, attn_implementation="eager").eval()
    tokens = TOKENS % config.vocab_size
    want = back(torch.from_numpy(tokens).long()).logits.detach().numpy()
    assert_close(np.asarray(build(config).apply({"params": params}, tokens)), want, "jaxgpt convert --to hf (MoE)")
    assert main(["train", "--init", str(run), "--set", "steps=2", "--out", str(tmp_path / "ft"), *common]) == 0
    capsys.readouterr()


@pytest.mark.parametrize("family,coef", [("mixtral", None), ("mixtral", 0.02), ("qwen2_moe", 0.005)])
def test_router_aux_loss_coef_is_read_written_and_trained_with(family, coef, tmp_path):
    """An HF config's router_aux_loss_coef (absent: the config class's 0.001) becomes moe.aux_loss_coef,
    export writes it back, and the training objective uses it unless TrainConfig.router_aux_coef is set."""
    from jaxgpt.config import TrainConfig
    from jaxgpt.train.losses import objective

    kw = {} if coef is None else {"router_aux_loss_coef": coef}
    build_dir = hf_dirs.mixtral_dir if family == "mixtral" else hf_dirs.qwen2_moe_dir
    path = build_dir(tmp_path / "hf", n_layer=1, **kw)
    if coef is None:  # a config.json without the key
        d = json.loads((path / "config.json").read_text())
        (path / "config.json").write_text(json.dumps({k: v for k, v in d.items() if k != "router_aux_loss_coef"}))
    want = 0.001 if coef is None else coef
    config, params = load_hf(path)
    assert config.moe.aux_loss_coef == want
    save_hf(tmp_path / "ours", config, params)
    assert json.loads((tmp_path / "ours" / "config.json").read_text())["router_aux_loss_coef"] == want
    terms = {"loss_sum": 3.0, "router_aux_sum": 2.0, "router_z_sum": 5.0}
    assert float(objective(terms, TrainConfig(), config)) == pytest.approx(3.0 + want * 2.0)
    assert float(objective(terms, TrainConfig(router_aux_coef=0.1, router_z_coef=0.01), config)) == \
        pytest.approx(3.0 + 0.1 * 2.0 + 0.01 * 5.0)


def test_torch_ref_trains_with_the_models_aux_loss_coef():
    """torch_ref.train uses the same coefficient: its step's loss moves with moe.aux_loss_coef."""
    import torch_ref
    from jaxgpt.config import ModelConfig, MoEConfig, TrainConfig
    from torch_ref.train import make_optimizer, train_step

    batch = {"x": TOKENS[None, :, :-1], "y": TOKENS[None, :, 1:]}
    norms = []
    for coef in (0.0, 10.0):
        cfg = ModelConfig(vocab_size=hf_dirs.VOCAB, d_model=16, n_layer=1, n_head=2, pos="rope",
                          moe=MoEConfig(n_experts=4, aux_loss_coef=coef))
        torch.manual_seed(0)
        model = torch_ref.build(cfg)
        tc = TrainConfig(batch_size=2, seq_len=11, grad_clip=None)
        norms.append(train_step(model, *make_optimizer(model, tc), tc, batch)["grad_norm"])
    assert norms[1] > norms[0] * 1.01  # the load-balancing term reaches the gradients
