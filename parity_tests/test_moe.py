"""Mixture of Experts (jaxgpt/nn/moe.py) bottom-up: routing against transformers' routers, the
layer and whole MoE decoders (forward and gradients) against torch_ref, the dense and grouped
implementations against each other (self-consistency), the router losses against transformers'
load_balancing_loss_func, and a 20-step training curve with both router losses against torch_ref.

Tolerances: float32 1e-5 (gradients / max(1, max|g|)), as everywhere. Every routing input has a
gap > 1e-4 between its k-th and (k+1)-th router logit (asserted), so no top-k choice is a tie."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import torch_ref
from conftest import (assert_close, assert_self_consistent, check_module, load_into, random_params, randomize,
                      torch_grads)
from jaxgpt import build
from jaxgpt.config import Execution, ModelConfig, MoEConfig, TrainConfig
from jaxgpt.models import stacked_paths
from jaxgpt.nn.moe import EXPERT_IMPLS, MoE, route, router_losses
from jaxgpt.train import init_state, make_train_step
from jaxgpt.data.tasks import fit_config, load_task
from torch_ref.convert import load_params
from torch_ref.nn.moe import MoE as TMoE
from torch_ref.train import train

BASE = dict(vocab_size=40, d_model=16, n_head=2, n_layer=2, max_len=32, pos="rope", d_ff=24)
MIXTRAL = ModelConfig(**BASE, moe=MoEConfig(n_experts=4, top_k=2, d_ff=12))
QWEN = ModelConfig(**BASE, qkv_bias=True,  # mixed dense and MoE layers: built as separate layers (Execution.for_model)
                   moe=MoEConfig(n_experts=4, top_k=2, d_ff=12, norm_topk=False, shared_d_ff=20, dense_layers=(1,)))
TOKENS = np.random.default_rng(0).integers(0, 40, (2, 9)).astype(np.int32)


def assert_no_ties(logits, k):
    z = -np.sort(-np.asarray(logits, np.float64).reshape(-1, np.shape(logits)[-1]), axis=-1)
    assert (z[:, k - 1] - z[:, k]).min() > 1e-4, "a near-tie in the router's top-k: pick other weights"


@pytest.mark.parametrize("norm", [True, False], ids=["mixtral", "qwen2-moe"])
def test_route_matches_transformers_routers(norm):
    """Softmax over all experts, then top-k, then renormalising (Mixtral) or not (Qwen2-MoE, by default)."""
    from transformers import MixtralConfig, Qwen2MoeConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeTopKRouter

    rng = np.random.default_rng(1)
    x, w = rng.standard_normal((64, 16)).astype(np.float32), rng.standard_normal((6, 16)).astype(np.float32)
    if norm:
        router = MixtralTopKRouter(MixtralConfig(hidden_size=16, num_local_experts=6, num_experts_per_tok=3))
    else:
        router = Qwen2MoeTopKRouter(Qwen2MoeConfig(hidden_size=16, num_experts=6, num_experts_per_tok=3))
    with torch.no_grad():
        router.weight.copy_(torch.from_numpy(w))
        logits, scores, idx = router(torch.from_numpy(x))
    assert_no_ties(logits, 3)
    _, weights, ours = route(jnp.asarray(x @ w.T), 3, norm)
    assert np.array_equal(np.asarray(ours), idx.numpy())
    assert_close(weights, scores, f"MoE route ({'mixtral' if norm else 'qwen2-moe'})")


@pytest.mark.parametrize("impl", ["dense", "grouped"])
def test_moe_layer_matches_torch_ref(impl):
    """The MoE layer with a shared expert, unrenormalised weights: forward and every gradient."""
    cfg = QWEN.replace(moe=QWEN.moe.replace(impl=impl))
    x = np.random.default_rng(2).standard_normal((2, 7, 16)).astype(np.float32)
    p = random_params(MoE(cfg), x, seed=2)
    assert_no_ties(x @ np.asarray(p["router"]["kernel"]), 2)
    check_module(f"MoE layer ({impl})", MoE(cfg), TMoE(cfg), [x], params=p)


def test_dense_and_grouped_layers_agree_forward_and_backward():
    """Self-consistency (fast tier): the two implementations on one layer, output and every gradient."""
    cfg = QWEN
    x = np.random.default_rng(3).standard_normal((2, 7, 16)).astype(np.float32)
    p = random_params(MoE(cfg), x, seed=3)
    assert_no_ties(x @ np.asarray(p["router"]["kernel"]), 2)
    cot = np.random.default_rng(4).standard_normal(x.shape).astype(np.float32)
    out = {}
    for impl in ("dense", "grouped"):
        layer = MoE(cfg.replace(moe=cfg.moe.replace(impl=impl)))
        out[impl] = jax.value_and_grad(lambda q, a: jnp.sum(layer.apply({"params": q}, a) * cot), (0, 1))(p, x)  # noqa: B023 - called in this iteration
    assert_self_consistent(out["grouped"][0], out["dense"][0], "MoE layer grouped vs dense (sum y * cot)")
    for a, b in zip(jax.tree.leaves(out["grouped"][1]), jax.tree.leaves(out["dense"][1])):
        assert_self_consistent(a, b, "MoE layer grouped vs dense grads", unit_scale=True)


def test_auto_impl_is_dense_on_the_cpu():
    """moe.impl='auto' (the default) runs 'dense' in a CPU program: the same numbers, bit for bit
    ('grouped' differs by rounding); test_lowering.py checks that CUDA and TPU get 'grouped'."""
    rng = np.random.default_rng(5)
    x, gate, up = (rng.standard_normal(s).astype(np.float32) for s in ((12, 16), (4, 16, 8), (4, 16, 8)))
    down = rng.standard_normal((4, 8, 16)).astype(np.float32)
    _, weights, idx = route(jnp.asarray(x @ rng.standard_normal((16, 4)).astype(np.float32)), 2, True)
    out = {impl: np.asarray(jax.jit(EXPERT_IMPLS[impl])(x, gate, up, down, weights, idx)) for impl in ("auto", "dense")}
    np.testing.assert_array_equal(out["auto"], out["dense"])
    assert MoEConfig().impl == "auto"  # the default


def _loss(cfg, p, aux=0.3, z=0.05):
    """Mean next-token cross entropy + aux * load balancing + z * z-loss."""
    logits, state = build(cfg).apply({"params": p}, TOKENS[:, :-1], mutable=["router"])
    nll = -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), TOKENS[:, 1:, None], -1))
    lb, zl = router_losses(state["router"], cfg.moe.n_experts, cfg.moe.aux_loss_scope)
    return nll + aux * lb + z * zl, logits


def _value_and_grad(cfg, p):
    # jitted (cached per config): eager op-by-op dispatch of a whole decoder's backward is slower
    return _JITTED.setdefault(cfg, jax.jit(jax.value_and_grad(lambda q: _loss(cfg, q), has_aux=True)))(p)


_JITTED: dict = {}


@pytest.fixture(scope="module", params=["mixtral", "mixtral-layer-aux", pytest.param("qwen2-moe-mixed",
                                                                                      marks=pytest.mark.slow)])
def model_case(request):
    cfg = {"mixtral": MIXTRAL, "qwen2-moe-mixed": QWEN,  # the load-balancing loss per layer, averaged
           "mixtral-layer-aux": MIXTRAL.replace(moe=MIXTRAL.moe.replace(aux_loss_scope="layer"))}[request.param]
    p = random_params(build(cfg), TOKENS[:1, :1], seed=5)
    return request.param, cfg, p


def test_moe_decoder_logits_loss_and_grads_match_torch_ref(model_case):
    """Logits, and gradients of CE + both router losses (so the router's own gradient is checked)."""
    name, cfg, p = model_case
    stacked = stacked_paths(cfg)
    (value, logits), grads = _value_and_grad(cfg, p)
    t = load_into(torch_ref.build(cfg), p, stacked)
    tlogits = t(torch.from_numpy(TOKENS[:, :-1]).long())
    from torch_ref.nn.moe import router_losses as trl

    lb, zl = trl(t, cfg.moe.aux_loss_scope)
    tl = torch.nn.functional.cross_entropy(tlogits.flatten(0, 1), torch.from_numpy(TOKENS[:, 1:]).long().flatten())
    (tl + 0.3 * lb + 0.05 * zl).backward()
    assert_close(logits, tlogits, f"MoE decoder {name} logits")
    assert_close(value, (tl + 0.3 * lb + 0.05 * zl).item(), f"MoE decoder {name} loss + router losses")
    err = max(float(np.max(np.abs(np.asarray(g) - np.asarray(r)))) / max(1.0, float(np.max(np.abs(np.asarray(r)))))
              for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(torch_grads(t, p, stacked))))
    assert_close(err, 0.0, f"MoE decoder {name} grads (/ max(1, max|g|))")


@pytest.mark.slow
def test_dense_and_grouped_agree_forward_and_backward(model_case):
    """Self-consistency: the two implementations of the same math, logits and every gradient."""
    name, cfg, p = model_case
    grouped = cfg.replace(moe=cfg.moe.replace(impl="grouped"))
    (v1, l1), g1 = _value_and_grad(cfg, p)
    (v2, l2), g2 = _value_and_grad(grouped, p)
    assert_self_consistent(l2, l1, f"MoE {name} grouped vs dense logits")
    err = max(float(jnp.max(jnp.abs(a - b))) / max(1.0, float(jnp.max(jnp.abs(b))))
              for a, b in zip(jax.tree.leaves(g2), jax.tree.leaves(g1)))
    assert_self_consistent(err, 0.0, f"MoE {name} grouped vs dense grads (/ max(1, max|g|))")


def test_router_losses_match_transformers_load_balancing_loss():
    """Pooled over layers as transformers does (not a mean of per-layer losses)."""
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    cfg = MIXTRAL
    p = random_params(build(cfg), TOKENS[:1, :1], seed=6)
    _, state = build(cfg).apply({"params": p}, TOKENS, mutable=["router"])
    lb, _ = router_losses(state["router"], 4)
    # the router logits of each layer, recomputed by torch_ref's forward hooks
    t = load_into(torch_ref.build(cfg), p, ("layers",))
    logits = []
    hooks = [m.router.register_forward_hook(lambda mod, i, o: logits.append(o.detach())) for m in t.modules()
             if isinstance(m, TMoE)]
    t(torch.from_numpy(TOKENS).long())
    for h in hooks:
        h.remove()
    for z in logits:
        assert_no_ties(z.numpy(), 2)
    want = load_balancing_loss_func(tuple(logits), 4, 2)
    assert_close(lb, want.item(), "MoE load-balancing loss vs transformers")


def test_aux_loss_scope_sees_layers_that_favour_different_experts():
    """Hand-made statistics: layer 0 routes every pick to experts 0-1, layer 1 to experts 2-3.
    Pooled (transformers), the two layers together look balanced (the loss's floor, k); per layer,
    each layer's imbalance counts (twice the floor)."""
    n, e, k = 8.0, 4, 2
    def layer(hot):  # n rows, each picking the two `hot` experts with all of its probability
        counts, probs = np.zeros(e, np.float32), np.zeros(e, np.float32)
        counts[hot], probs[hot] = n, n / 2
        return {"counts": jnp.asarray(counts), "probs": jnp.asarray(probs), "z": jnp.float32(0.0),
                "rows": jnp.float32(n)}
    stats = {"layers_0": {"stats": (layer([0, 1]),)}, "layers_1": {"stats": (layer([2, 3]),)}}
    pooled, _ = router_losses(stats, e, "pooled")
    per_layer, _ = router_losses(stats, e, "layer")
    # pooled over 2n rows: f_e = n / 2n = 0.5, P_e = (n / 2) / 2n = 0.25 for every e: 4 * 4 * 0.5 * 0.25 = 2 = k
    assert float(pooled) == pytest.approx(k)
    # per layer over n rows: f = (1, 1, 0, 0), P = (0.5, 0.5, 0, 0): 4 * 1 = 4 in each layer
    assert float(per_layer) == pytest.approx(2 * k)
    with pytest.raises(ValueError, match="aux_loss_scope"):
        MoEConfig(aux_loss_scope="global")


@pytest.mark.slow
def test_training_curve_with_router_losses_matches_torch_ref():
    """20 AdamW steps of a Mixtral-style model with load-balancing and z losses, from unit-scale
    weights (clear routing margins), against torch_ref's loop on the same batches."""
    tc = TrainConfig(steps=20, batch_size=4, seq_len=16, lr=3e-3, seed=3, router_aux_coef=0.1, router_z_coef=0.01)
    task = load_task(MIXTRAL, tc, corpus="seed-synthetic")
    config = fit_config(MIXTRAL, task)
    state = init_state(config, tc)
    state = state.replace(params=randomize(state.params, 7))
    model = load_params(torch_ref.build(config), jax.device_get(state.params))
    step = make_train_step(config, tc)
    ours, aux, load = [], [], []
    for s in range(tc.steps):
        state, m = step(state, task.batch(tc, s))
        ours.append(float(m["loss"]))
        aux.append(float(m["router_aux"]))
        load.append(np.append(m["expert_load"], m["expert_load_max"]))
    ref = train(model, tc, task)
    assert ours[-1] < ours[0]
    assert_close(np.array(ours), np.array([m["loss"] for m in ref]), "training: 20-step MoE losses vs torch_ref")
    assert_close(np.array(aux), np.array([m["router_aux"] for m in ref]), "training: 20-step MoE aux loss vs torch_ref")
    # per-expert load: each expert's share of the top-k picks, and the busiest over its fair share
    assert_close(np.array(load), np.array([m["expert_load"] + [m["expert_load_max"]] for m in ref]),
                 "training: 20-step MoE per-expert load vs torch_ref")
    assert np.allclose(np.array(load)[:, :-1].sum(1), 1.0) and np.all(np.array(load)[:, -1] >= 1.0)


@pytest.mark.parametrize("kwargs,message", [
    (lambda: dict(moe=MoEConfig(n_experts=2, top_k=3)), "top_k=3 exceeds moe.n_experts=2"),
    (lambda: dict(moe=MoEConfig(dense_layers=(0,)), execution=Execution()), r"needs Execution\(scan_layers=False\)"),
    (lambda: dict(moe=MoEConfig(dense_layers=(9,))), "past n_layer"),
    (lambda: dict(moe=MoEConfig(impl="sparse")), "moe.impl='sparse'"),
], ids=["top_k", "mixed-scan", "dense-layers", "impl"])
def test_config_errors_name_the_value(kwargs, message):
    with pytest.raises(ValueError, match=message):
        kw = kwargs()
        execution = kw.pop("execution", None)  # checked where the model is built
        build(ModelConfig(**{**BASE, **kw}), execution)


def test_config_round_trips_through_json():
    import json

    assert ModelConfig.from_dict(json.loads(json.dumps(QWEN.to_dict()))) == QWEN
