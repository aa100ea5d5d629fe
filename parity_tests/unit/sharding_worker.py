"""Subprocess side of test_sharding.py: runs with N simulated CPU devices (set by the caller through
XLA_FLAGS before JAX starts) and prints one JSON line of measurements; the test asserts on them.

    python sharding_worker.py steps MODEL MESH [MESH...]  # the sharded step vs the single-device step
    python sharding_worker.py save DIR MESH OUT.npz       # sharded init + 1 step, checkpoint, dump values
    python sharding_worker.py restore DIR MESH OUT.npz    # restore onto MESH ('' = one device), dump values
    python sharding_worker.py dist PORT PID NPROC MESH    # one process of a jax.distributed run
    python sharding_worker.py serial                      # the same 3 steps on one device
"""
from __future__ import annotations

import json
import sys

import jax
import jax.numpy as jnp
import numpy as np

jax.config.update("jax_default_matmul_precision", "highest")

from jaxgpt.config import Execution, ModelConfig, MoEConfig, RopeScaling, TrainConfig  # noqa: E402 - after the setup above, which must run first
from jaxgpt.parallel.sharding import bytes_per_device, gathers_in_scan, make_mesh, shard_batch  # noqa: E402 - after the setup above, which must run first
from jaxgpt.train.step import init_state, make_train_step  # noqa: E402 - after the setup above, which must run first

MODELS = {  # tiny, so the 8 compilations per model stay a few seconds each
    "gpt": ModelConfig(vocab_size=64, d_model=32, n_layer=2, n_head=4, max_len=16, pos="learned", norm="layernorm",
                       mlp="gelu_tanh", mlp_bias=True, qkv_bias=True, o_bias=True, tie_embeddings=True),
    # GQA: 8 query heads, 2 kv heads; on tensor=8 k_proj/v_proj cannot be split by head
    "llama": ModelConfig(vocab_size=64, d_model=32, n_layer=2, n_head=8, n_kv_head=2, d_ff=48, max_len=16,
                         pos="rope", norm="rmsnorm", norm_eps=1e-6, mlp="swiglu"),
    # Mixture of Experts: 8 experts, top-2, the router losses in the objective (TrainConfig defaults)
    "moe": ModelConfig(vocab_size=64, d_model=32, n_layer=2, n_head=4, d_ff=48, max_len=16, pos="rope",
                       moe=MoEConfig(n_experts=8, top_k=2, d_ff=16)),
    # The newer layer options at once (Qwen3 / Gemma 2 / Llama 3 / Mistral): q/k norms, heads apart from d_model,
    # (1 + w) sandwich norms, GeGLU, soft-caps, a sliding layer beside a global one, llama3 RoPE scaling
    "modern": ModelConfig(vocab_size=64, d_model=32, n_layer=2, n_head=8, n_kv_head=2, d_head=8, d_ff=48, max_len=16,
                          pos="rope", rope_scaling=RopeScaling("llama3", factor=4.0, original_max_position_embeddings=4,
                                                              low_freq_factor=1.0, high_freq_factor=4.0),
                          norm="rmsnorm", norm_unit_offset=True, norm_placement="sandwich", qk_norm="head",
                          mlp="geglu_tanh", attn_softcap=50.0, logit_softcap=30.0, sliding_window=4, window_layers=(1,)),
    # GPT-NeoX: parallel residual, partial rotary, biased LayerNorms
    "neox": ModelConfig(vocab_size=64, d_model=32, n_layer=2, n_head=4, d_ff=48, max_len=16, pos="rope", rotary_dim=4,
                        norm="layernorm", mlp="gelu", mlp_bias=True, qkv_bias=True, o_bias=True, parallel_residual=True),
}
MODELS["moe-grouped"] = MODELS["moe"].replace(moe=MODELS["moe"].moe.replace(impl="grouped"))
# default AdamW lr 3e-4, clipping 1.0; mesh='': the reference step runs on one device, not TrainConfig's 'auto';
# rolled layer scans (not the CPU's 'auto' unrolling), so FSDP's per-layer gathers sit in the while body
TC = TrainConfig(steps=10, batch_size=8, seq_len=8, mesh="", execution=Execution(scan_unroll=1))


def batch(step: int = 0) -> dict:
    rng = np.random.default_rng(step)
    x = rng.integers(0, 64, (1, 8, 8)).astype(np.int32)  # (A, B, T)
    return {"x": x, "y": np.roll(x, -1, axis=-1)}


def max_diff(a, b) -> float:
    return max(float(jnp.max(jnp.abs(jnp.asarray(x, jnp.float32) - jnp.asarray(y, jnp.float32))))
               for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def steps(name: str, *meshes: str) -> dict:
    out, cfg = {}, MODELS[name]
    ref0 = init_state(cfg, TC)
    ref1, m_ref = make_train_step(cfg, TC)(init_state(cfg, TC), batch())
    for spec in meshes:
        mesh = make_mesh(spec)
        s0 = init_state(cfg, TC, mesh=mesh)
        init_diff = max_diff(ref0.params, s0.params)
        step, placed = make_train_step(cfg, TC, mesh=mesh), shard_batch(batch(), mesh)
        s1, m = step(s0, placed)
        hlo = step.lower(s1, placed).compile().as_text()  # the same program (jax caches it): no second compile
        kv = s1.params["layers"]["attn"]["k_proj"]["kernel"]
        out[f"{name} {spec}"] = {
            "init": init_diff, "loss": abs(float(m["loss"]) - float(m_ref["loss"])),
            "grad_norm": abs(float(m["grad_norm"]) - float(m_ref["grad_norm"])),
            "params": max_diff(ref1.params, s1.params), "opt_state": max_diff(ref1.opt_state, s1.opt_state),
            "param_bytes": max(bytes_per_device(s1.params).values()),
            "opt_bytes": max(bytes_per_device(s1.opt_state).values()),
            "total_param_bytes": sum(x.nbytes for x in jax.tree.leaves(ref1.params)),
            "total_opt_bytes": sum(x.nbytes for x in jax.tree.leaves(ref1.opt_state)),
            "gather_in_scan": gathers_in_scan(hlo), "k_proj_spec": str(kv.sharding.spec),
            "k_proj_shard": list(kv.addressable_shards[0].data.shape),
        }
        if cfg.moe is not None:
            ex = s1.params["layers"]["mlp"]["experts"]["gate_proj"]
            out[f"{name} {spec}"].update(expert_spec=str(ex.sharding.spec),
                                         expert_shard=list(ex.addressable_shards[0].data.shape))
    return out


def dump(state, path: str) -> None:
    leaves = jax.tree_util.tree_leaves_with_path(state.to_dict())
    np.savez(path, **{jax.tree_util.keystr(p): np.asarray(jax.device_get(x)) for p, x in leaves})


def save(directory: str, spec: str, path: str) -> dict:
    from jaxgpt.train.checkpoint import Checkpoints

    cfg, mesh = MODELS["llama"], make_mesh(spec)
    state, _ = make_train_step(cfg, TC, mesh=mesh)(init_state(cfg, TC, mesh=mesh), shard_batch(batch(), mesh))
    ck = Checkpoints(directory, mesh=mesh)
    ck.save(state, {"config": cfg.to_dict(), "train": TC.to_dict()})
    ck.wait()
    ck.close()
    dump(state, path)
    return {"devices": jax.device_count(), "shards": len(state.params["lm_head"]["kernel"].addressable_shards)}


def restore(directory: str, spec: str, path: str) -> dict:
    from jaxgpt.train.checkpoint import Checkpoints

    mesh = make_mesh(spec) if spec else None
    ck = Checkpoints(directory, create=False, mesh=mesh)
    _, _, state, _ = ck.restore()
    _, params, _ = ck.restore_params()
    ck.close()
    dump(state, path)
    return {"devices": jax.device_count(), "params_only": max_diff(params, state.params),
            "shards": len(state.params["lm_head"]["kernel"].addressable_shards),
            "spec": str(getattr(state.params["lm_head"]["kernel"].sharding, "spec", "single device"))}


def dist(port: str, pid: str, nproc: str, spec: str) -> dict:
    from jax.experimental import multihost_utils

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=int(nproc), process_id=int(pid))
    cfg, mesh = MODELS["llama"], make_mesh(spec)
    state, step, losses = init_state(cfg, TC, mesh=mesh), make_train_step(cfg, TC, mesh=mesh), []
    for i in range(3):
        state, m = step(state, shard_batch(batch(i), mesh))  # each process hands over only its rows
        losses.append(float(m["loss"]))
    full = multihost_utils.process_allgather(state.params, tiled=True)  # every shard, from every process
    total = float(sum(np.abs(np.asarray(x, np.float64)).sum() for x in jax.tree.leaves(full)))
    return {"process": jax.process_index(), "processes": jax.process_count(), "devices": jax.device_count(),
            "local_devices": jax.local_device_count(), "losses": losses, "param_abs_sum": total}


def serial() -> dict:
    cfg, losses = MODELS["llama"], []
    state, step = init_state(cfg, TC), make_train_step(cfg, TC)
    for i in range(3):
        state, m = step(state, batch(i))
        losses.append(float(m["loss"]))
    return {"losses": losses, "param_abs_sum": float(sum(np.abs(np.asarray(x, np.float64)).sum()
                                                         for x in jax.tree.leaves(state.params)))}


if __name__ == "__main__":
    cmd, *rest = sys.argv[1:]
    print("RESULT " + json.dumps({"steps": steps, "save": save, "restore": restore, "dist": dist,
                                         "serial": serial}[cmd](*rest)),
          flush=True)
