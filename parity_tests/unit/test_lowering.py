"""The programs users compile, lowered from this CPU host for 'cpu', 'cuda' and 'tpu'.

Kernel choices are made per lowering platform (jaxgpt/nn/kernels/policy.py): a C++ CPU kernel
(custom call ``jaxgpt_*``) may appear only in the CPU program; the CUDA and TPU programs get the
portable paths, or their own kernels: on CUDA the engine's paged attention the Pallas (Triton) kernel
(``__gpu$xla.gpu.triton``, kernels/gpu_paged.py) and MoE experts ``ragged_dot`` ('grouped', where the
CPU keeps 'dense'); on a TPU the Pallas TPU kernels (``tpu_custom_call``: flash attention, JAX's
paged decode kernel over bfloat16 pools, our ragged paged kernel for mixed steps and other pools,
megablox's grouped matmul for MoE). Each program is traced once on
abstract inputs (jax.ShapeDtypeStruct, eval_shape: nothing is allocated) and lowered three times;
the test prints the custom calls each platform got.

What this host cannot show: cuDNN attention. JAX builds a cuDNN call only where cuDNN is installed
("cuDNN is not detected" here), so 'auto' stages cuDNN for CUDA on a GPU host only (kernels.attend,
policy.on_cuda); from this CPU host the CUDA program runs the portable 'blocked' kernel, which is
what this test checks lowers. No GPU or TPU runs here: the test proves the programs lower and carry
no CPU custom call, not that they compile on that hardware.
"""
from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import pytest

from jaxgpt.config import Execution, TrainConfig
from jaxgpt.config.moe import MoEConfig
from jaxgpt.config.presets import PRESETS
from jaxgpt.inference.engine import paged_forward
from jaxgpt.inference.generate import _generate_cached
from jaxgpt.inference.packed_head import pack_head
from jaxgpt.inference.paged_cache import init_pools, resolve_paged_kernel
from jaxgpt.models import abstract_params, build
from jaxgpt.nn.kernels import causal_ffi, native, norm_ffi, paged_ffi
from jaxgpt.parallel.sharding import make_mesh
from jaxgpt.train.step import init_state, make_train_step

PLATFORMS = ("cpu", "cuda", "tpu")
B, T = 4, 128  # 4 x 128 rows of d_model 64: native.AUTO_MIN_SIZE floats, so 'auto' picks the norm and GELU
# kernels; T a multiple of tpu_flash.BLOCK, so the TPU program runs the Pallas flash kernel
assert B * T * 64 >= native.AUTO_MIN_SIZE
GPT2 = PRESETS["gpt2-small"].replace(vocab_size=96, d_model=64, n_layer=2, n_head=4, max_len=T, dropout=0.0)
LLAMA = PRESETS["llama-tiny"].replace(vocab_size=96, d_model=64, n_layer=2, n_head=4, n_kv_head=2, d_ff=128,
                                      max_len=T)
MOE = LLAMA.replace(moe=MoEConfig(n_experts=8, top_k=2, d_ff=64))  # Mixtral's router: 8 experts, top-2
PAGED_BF16 = LLAMA.replace(d_model=256, n_head=2, n_kv_head=1, dtype="bfloat16")  # head_dim 128
SEPARATE = Execution(scan_layers=False)  # what generate() and the engine decode with
EXACT_GELU = GPT2.replace(mlp="gelu")  # the exact GELU: the one the GELU kernel computes
CUSTOM_CALL = re.compile(r'(?:custom_call_target\s*=\s*|stablehlo\.custom_call\s+@)"?([\w$.\-]+)"?')
KERNEL_NAME = re.compile(r'kernel_name = "(\w+)"')
TRITON, RAGGED_DOT = "__gpu$xla.gpu.triton", "chlo.ragged_dot"

def _train(config, dtype: str, ex: Execution | None = None):
    config = config.replace(dtype=dtype)
    tc = TrainConfig(batch_size=B, seq_len=T, steps=3, execution=ex)
    state = jax.eval_shape(lambda: init_state(config, tc, mesh=None))
    batch = {k: jax.ShapeDtypeStruct((1, B, T), jnp.int32) for k in ("x", "y")}
    return make_train_step(config, tc, mesh=None).trace(state, batch)


def _decode(config):
    """generate()'s cached program: prefill, then one decode step a token."""
    return _generate_cached.trace(abstract_params(config, SEPARATE), jax.ShapeDtypeStruct((2, 8), jnp.int32),
                                  jax.ShapeDtypeStruct((2,), jnp.uint32), config=config, max_new_tokens=8,
                                  temperature=0.0, top_k=None, top_p=None, eos_id=None)


def _paged(config, kv_dtype="auto", kernel="auto", t=1):
    """The engine's step (engine.paged_forward) of t tokens a row (1: decode; more: a prefill chunk or
    a mixed step) with the kernels the Engine resolves on this host: the in-place paged attention
    (each platform's, for 'auto') and the packed panel head."""
    params = abstract_params(config, SEPARATE)
    head = jax.eval_shape(functools.partial(pack_head, config), params)
    pools = jax.eval_shape(lambda: init_pools(config, 16, 8, kv_dtype))
    rows, pages = 4, 4
    i32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.int32)
    kernel = resolve_paged_kernel(kernel, config.dtype, pools[0][0].dtype, config.head_dim, 8)
    return paged_forward.trace(params, pools, i32(rows, t), i32(rows, t), i32(rows, t), i32(rows, pages), i32(rows),
                               head, config=config, kernel=kernel)


FLASH = ("_flash_attention_kernel", "_flash_attention_dkv_kernel", "_flash_attention_dq_kernel")  # fwd, bwd
GMM = ("kernel",)  # megablox's gmm and tgmm name their Pallas kernel 'kernel' (the dense MoE has none)
TPU_PAGED = ("paged_flash_attention_kernel_inline_seq_dim",)  # JAX's decode kernel (tpu_paged.py)
TPU_RAGGED = ("jaxgpt_tpu_ragged_paged_attention",)  # ours, for mixed steps and other pools (tpu_ragged.py)

# name: (traced program, the CPU kernels 'auto' puts in its CPU program where they are built, the
# Pallas kernels (tpu_custom_call kernel_name) its TPU program holds)
PROGRAMS = {
    "gpt2-train-bf16": (lambda: _train(GPT2, "bfloat16"), {norm_ffi: ("jaxgpt_norm_fwd", "jaxgpt_norm_bwd")}, FLASH),
    "llama-train-bf16": (lambda: _train(LLAMA, "bfloat16"), {norm_ffi: ("jaxgpt_norm_fwd", "jaxgpt_norm_bwd")}, FLASH),
    "moe-train-bf16": (lambda: _train(MOE, "bfloat16"), {norm_ffi: ("jaxgpt_norm_fwd",)}, FLASH + GMM),
    "gpt2-train-f32": (lambda: _train(EXACT_GELU, "float32"),
                       {norm_ffi: ("jaxgpt_norm_fwd",), causal_ffi: ("jaxgpt_causal_attention_fwd",)}, FLASH),
    "decode-f32": (lambda: _decode(LLAMA), {paged_ffi: ("jaxgpt_cached_attention",)}, ()),
    # on a TPU a decode step over bfloat16 pools of head_dim 128 runs JAX's decode kernel; a mixed step
    # (t > 1), float32 or int8 pools and windows our ragged kernel
    "paged-engine-f32": (lambda: _paged(LLAMA), {paged_ffi: ("jaxgpt_paged_attention",)},
                         TPU_RAGGED),
    "paged-engine-bf16": (lambda: _paged(PAGED_BF16), {}, TPU_PAGED),
    "paged-engine-bf16-mixed": (lambda: _paged(PAGED_BF16, t=8), {}, TPU_RAGGED),
    "paged-engine-bf16-int8": (lambda: _paged(LLAMA.replace(dtype="bfloat16"), "int8"), {},
                               TPU_RAGGED),
    # sliding windows: scanned layers mixing sliding and global ones (the window a scanned input; no flash
    # kernel, which has no window), and the engine's step with the window operand of the paged kernel
    "window-train-bf16": (lambda: _train(LLAMA.replace(sliding_window=8, window_layers=(1,)), "bfloat16"),
                          {norm_ffi: ("jaxgpt_norm_fwd",)}, ()),
    "window-paged-f32": (lambda: _paged(LLAMA.replace(sliding_window=8)),
                         {paged_ffi: ("jaxgpt_paged_attention",)}, TPU_RAGGED),
}
# name: {platform: what its program must hold there (custom-call targets, or RAGGED_DOT)}, beyond no CPU call
ACCELERATOR_KERNELS = {
    "paged-engine-f32": {"cuda": {TRITON}},
    "paged-engine-bf16": {"cuda": {TRITON}},
    "paged-engine-bf16-mixed": {"cuda": {TRITON}},
    "paged-engine-bf16-int8": {"cuda": {TRITON}},
    "moe-train-bf16": {"cuda": {RAGGED_DOT}},  # the TPU runs megablox's gmm (GMM) instead
}


def custom_calls(text: str) -> set[str]:
    """The custom-call targets in a lowered module's StableHLO text, and RAGGED_DOT where it holds one."""
    return set(CUSTOM_CALL.findall(text)) | ({RAGGED_DOT} if RAGGED_DOT in text else set())


def tpu_kernels(text: str) -> list[str]:
    """The Pallas kernels (kernel_name of each tpu_custom_call) in a lowered module's text, one entry a call."""
    return [m for line in text.splitlines() if "@tpu_custom_call" in line for m in KERNEL_NAME.findall(line)]


def tpu_target(device_kind: str = "TPU v5 lite", shape=(1,), axes=("target",)):
    """The context to trace and lower a program for a TPU in from a host without one: an abstract
    mesh (one device unless ``shape`` says more) naming the TPU, so Mosaic lowerings that ask for the chip generation get it
    (pltpu's ``get_device_kind`` reads the abstract mesh's device before the host's). jaxgpt's own
    programs lower without it (none of their kernels asks); tracing each program twice to use it
    everywhere would cost CI time for nothing, so only JAX's ragged kernel is lowered in it."""
    device = jax.sharding.AbstractDevice(device_kind=device_kind, num_cores=1, platform="tpu")
    return jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh(shape, axes, abstract_device=device))


@functools.cache
def _lowered(name: str) -> dict[str, tuple[set[str], list[str]]]:
    traced = PROGRAMS[name][0]()
    texts = {p: traced.lower(lowering_platforms=(p,)).as_text() for p in PLATFORMS}
    return {p: (custom_calls(t), tpu_kernels(t)) for p, t in texts.items()}


@pytest.mark.parametrize("name", sorted(PROGRAMS))
def test_program_lowers_for_every_platform_with_its_own_kernels(name):
    got = _lowered(name)
    print(f"\n{name}: " + "; ".join(f"{p}: {sorted(calls) or 'no custom call'}" + (f" {sorted(set(ks))}" if ks else "")
                                    for p, (calls, ks) in got.items()))
    for p in PLATFORMS[1:]:
        cpu_only = sorted(c for c in got[p][0] if c.startswith("jaxgpt_"))
        assert not cpu_only, f"{name} lowered for {p} holds the CPU custom calls {cpu_only}"
    for module, targets in PROGRAMS[name][1].items():  # the CPU program still runs its kernels
        if module.available():
            assert set(targets) <= got["cpu"][0], f"{name} for the CPU lacks {targets}: {sorted(got['cpu'][0])}"
    for p, kernels in ACCELERATOR_KERNELS.get(name, {}).items():  # and the accelerators theirs
        assert kernels <= got[p][0], f"{name} lowered for {p} lacks {sorted(kernels)}: {sorted(got[p][0])}"
    calls = {p: got[p][0] for p in PLATFORMS}
    assert TRITON not in calls["cpu"] | calls["tpu"] and RAGGED_DOT not in calls["cpu"], f"{name}: {calls}"
    for p in ("cpu", "cuda"):  # a Pallas TPU kernel only in the TPU program
        assert "tpu_custom_call" not in calls[p], f"{name} lowered for {p} holds Pallas TPU kernels {got[p][1]}"
    want = PROGRAMS[name][2]
    assert set(want) == set(got["tpu"][1]), f"{name} for the TPU: Pallas kernels {sorted(set(got['tpu'][1]))}, " \
                                            f"expected {sorted(want)}"


PRECISION = re.compile(r"precision = \[(\w+), (\w+)\]")


@pytest.mark.parametrize("platform", PLATFORMS)
def test_auto_unroll_and_precision_are_the_target_platforms(platform):
    """Execution(platform=p), as an AOT lowering for p names it: the layer loop's 'auto' unroll and the
    float32 'auto' matmul precision are p's (jaxgpt.nn.kernels.exec_policy), whatever host traces it: every layer
    in one iteration on the CPU and CUDA, a rolled loop on a TPU; full float32 dots off the CPU."""
    ex = Execution(platform=platform)
    forward = jax.jit(lambda p, x: build(LLAMA, ex).apply({"params": p}, x))
    text = forward.trace(abstract_params(LLAMA), jax.ShapeDtypeStruct((2, 16), jnp.int32)).lower(
        lowering_platforms=(platform,)).as_text()
    loops, precisions = text.count("stablehlo.while"), set(PRECISION.findall(text))
    assert loops == (1 if platform == "tpu" else 0), f"{platform}: {loops} layer loops"
    want = {("DEFAULT", "DEFAULT")} if platform == "cpu" else {("HIGHEST", "HIGHEST")}
    assert precisions == want, f"{platform}: dot precisions {precisions}"


def test_explicit_cpu_kernel_is_refused_off_the_cpu():
    """norm_impl='ffi' is honoured on the CPU and refused, naming the knob, when lowered for a TPU."""
    if not norm_ffi.available():
        pytest.skip("the CPU norm kernel is not built here")
    traced = _train(LLAMA, "float32", Execution(norm_impl="ffi"))
    assert "jaxgpt_norm_fwd" in custom_calls(traced.lower(lowering_platforms=("cpu",)).as_text())
    with pytest.raises(ValueError, match=r"norm_impl='ffi' runs a C\+\+ CPU kernel, but this program is lowered for tpu"):
        traced.lower(lowering_platforms=("tpu",))


def test_explicit_paged_kernels_are_refused_where_they_cannot_lower():
    """paged_kernel='ffi' (the C++ kernel) lowers for the CPU only; 'pallas' (the Triton kernel) for
    CUDA, and for the CPU interpreted (no Triton call there); neither for a TPU."""
    config = LLAMA
    with pytest.raises(ValueError, match=r"paged_kernel='ffi' runs a C\+\+ CPU kernel, but this program is lowered "
                                         r"for cuda"):
        _paged(config, kernel="ffi").lower(lowering_platforms=("cuda",))
    pallas = _paged(config, kernel="pallas")
    assert TRITON in custom_calls(pallas.lower(lowering_platforms=("cuda",)).as_text())
    assert not custom_calls(pallas.lower(lowering_platforms=("cpu",)).as_text()) & {TRITON, "jaxgpt_paged_attention"}
    with pytest.raises(ValueError, match="paged_kernel='pallas' runs a kernel for cpu, cuda only, but this program "
                                         "is lowered for tpu"):
        pallas.lower(lowering_platforms=("tpu",))


def test_sharded_train_step_runs_the_tpu_kernels_per_device():
    """A GSPMD train step under a mesh (the batch split over 'fsdp'): XLA cannot partition a Pallas
    call, so in the TPU program each runs inside a shard_map (flash attention on each device's rows,
    the MoE grouped matmul replicated; policy.pallas_mesh); the CPU program holds no Pallas kernel.
    A 'tensor' split of the heads: test_tpu_kernels.test_flash_runs_per_device_under_a_mesh."""
    if jax.device_count() < 2:
        pytest.skip("needs 2 devices")
    mesh = make_mesh("fsdp=2", jax.devices()[:2])
    config = MOE.replace(dtype="bfloat16")
    tc = TrainConfig(batch_size=B, seq_len=T, steps=3)
    state = jax.eval_shape(lambda: init_state(config, tc, mesh=mesh))
    batch = {k: jax.ShapeDtypeStruct((1, B, T), jnp.int32) for k in ("x", "y")}
    traced = make_train_step(config, tc, mesh=mesh).trace(state, batch)
    tpu = traced.lower(lowering_platforms=("tpu",)).as_text()
    assert "sdy.manual_computation" in tpu and set(FLASH + GMM) == set(tpu_kernels(tpu))
    assert "tpu_custom_call" not in custom_calls(traced.lower(lowering_platforms=("cpu",)).as_text())


def test_jax_ragged_paged_attention_lowers_only_for_a_named_tpu():
    """JAX's ragged_paged_attention asks for the TPU generation while lowering: from this host it
    lowers inside ``tpu_target`` and not without it. It still fails in TPU interpret mode
    (test_tpu_kernels.py's canary), so the engine runs our kernel (kernels/tpu_ragged.py)."""
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention import ragged_paged_attention

    i32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.int32)
    args = (jax.ShapeDtypeStruct((16, 4, 128), jnp.float32), jax.ShapeDtypeStruct((12, 8, 4, 128), jnp.float32),
            i32(4), i32(4, 4), i32(5), i32(1))  # q, kv pages (pages, page_size, 2 H_kv, D), lens, table, cu_q, seqs
    f = jax.jit(lambda q, kv, *a: ragged_paged_attention(q, kv, *a, num_kv_pages_per_block=2,
                                                          num_queries_per_block=8))
    with pytest.raises(ValueError, match="Unsupported TPU device kind"):
        f.trace(*args).lower(lowering_platforms=("tpu",))
    with tpu_target():
        text = f.trace(*args).lower(lowering_platforms=("tpu",)).as_text()
    assert tpu_kernels(text) == ["ragged_paged_attention_kernel"]


def test_ragged_paged_kernel_lowers_under_a_mesh_for_a_named_tpu():
    """Our ragged paged kernel (kernels/tpu_ragged.py) traced under a 2-device abstract mesh naming a
    TPU: it runs replicated inside a shard_map (XLA cannot partition a Pallas call; policy.replicated).
    No devices are needed: the mesh is abstract."""
    from jaxgpt.nn.kernels import tpu_ragged

    s = jax.ShapeDtypeStruct
    pool = s((12, 2, 16, 64), jnp.bfloat16)  # (pages, H_kv, page_size, D)
    args = (s((4, 4, 4, 64), jnp.bfloat16), pool, pool, s((4, 4), jnp.int32), s((4, 4), jnp.int32))
    with tpu_target(shape=(2,), axes=("fsdp",)):
        text = jax.jit(tpu_ragged.paged_attention).trace(*args).lower(lowering_platforms=("tpu",)).as_text()
    assert "sdy.manual_computation" in text and tpu_kernels(text) == list(TPU_RAGGED)
