"""Streaming checkpoints (jaxgpt/convert/stream.py): load_hf from memory-mapped safetensors, save_hf a
shard at a time, and the sharded load that reads only each device's slice.

References: the files' own tensors, read by safetensors' NumPy API (not the loader under test), against
the loaded params mapped back by the unchanged export rule (``params_to_state_dict`` +
``params_to_hf``); the earlier loader upcast every tensor exactly to float32 and then cast it to the
requested dtype, so that is the expected value, compared bit for bit. Memory: tracemalloc's peak
(NumPy reports its buffers to it) while loading / saving, against the params' bytes.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tracemalloc
from pathlib import Path

import jax
import numpy as np
import pytest
import torch
from safetensors.numpy import load_file, save_file

from conftest import require_module, xla_flags
from jaxgpt.config import ModelConfig
from jaxgpt.convert import hf, load_hf, save_hf
from jaxgpt.convert.rule import params_to_state_dict
from jaxgpt.convert.stream import open_safetensors
from jaxgpt.models import abstract_params, stacked_paths

transformers = require_module("transformers", allow_module_level=True)
WORKER = Path(__file__).with_name("stream_worker.py")
LLAMA = dict(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64)
MODELS = {
    "llama": lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA)),
    "llama-tied": lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA, tie_word_embeddings=True)),
    "gpt2": lambda: transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=50,
                                                                         n_positions=64)),
}


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    """{(model, stored dtype): directory}, each in index + shards (4KB), weights at unit scale."""
    root, out = tmp_path_factory.mktemp("stream"), {}
    torch.manual_seed(0)
    for name, make in MODELS.items():
        model = make()
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(torch.randn(p.shape))
        for dtype in ("float32", "bfloat16"):
            path = root / f"{name}-{dtype}"
            model.to(getattr(torch, dtype)).save_pretrained(path, max_shard_size="4KB")
            assert (path / "model.safetensors.index.json").is_file()
            out[name, dtype] = path
    return out


def file_tensors(path: Path) -> dict[str, np.ndarray]:
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def as_file(config, params) -> dict[str, np.ndarray]:
    """Loaded params back in the file's keys and layout, as float32 (exact for every dtype here)."""
    family = hf._family_of(config)
    return family.params_to_hf(config, params_to_state_dict(params, stacked=stacked_paths(config)))


@pytest.mark.parametrize("name,stored,dtype,scan", [
    ("llama", "float32", None, True), ("llama", "float32", "bfloat16", True), ("llama", "bfloat16", "bfloat16", True),
    ("llama", "bfloat16", None, False), ("llama-tied", "bfloat16", "float16", True), ("gpt2", "bfloat16", None, True),
    ("gpt2", "float32", "bfloat16", False)])
def test_streaming_load_is_the_files_tensors_bit_for_bit(dirs, name, stored, dtype, scan):
    """float32 / bf16 files, kept or cast, tied and untied, stacked (nn.scan) and unscanned layers."""
    path = dirs[name, stored]
    config, params = load_hf(path, dtype=dtype)
    if not scan:  # the same files into the unscanned layout (layers_0, layers_1, ...)
        tensors = {}
        for shard in hf._shards(path):
            tensors.update(open_safetensors(shard))
        from jaxgpt.config import Execution
        from jaxgpt.models import abstract_params

        template = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, np.dtype(hf._dtype(dtype) or np.float32)),
                                abstract_params(config, Execution(scan_layers=False)))
        params = hf._family_of(config).params_from_hf(config, tensors, None, template)
        assert "layers_1" in params
    want = np.dtype(dtype or "float32")
    assert {np.dtype(a.dtype) for a in jax.tree.leaves(params)} == {want}
    got, files = as_file(config, params), file_tensors(path)
    assert sorted(got) == sorted(files)
    for key, a in files.items():
        expected = a.astype(np.float32).astype(want).astype(np.float32)  # the earlier loader: upcast, then cast
        assert np.array_equal(got[key], expected), key


def test_many_chunks_per_tensor_change_nothing(dirs, tmp_path, monkeypatch):
    """Self-consistency: with a 1500-byte chunk (rows of 64-256 bytes: many chunks per tensor, the last
    one short) a load gives the same params and a save the same bytes as with the default 1 MiB chunk,
    under which the tests above read and write every tensor in one chunk."""
    from jaxgpt.core import mapped

    path = dirs["llama", "bfloat16"]
    config, want = load_hf(path)
    save_hf(tmp_path / "one", config, want)
    monkeypatch.setattr(mapped, "_CHUNK", 1500)
    config, got = load_hf(path)
    save_hf(tmp_path / "many", config, got)
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)))
    assert (tmp_path / "one" / "model.safetensors").read_bytes() == (tmp_path / "many" / "model.safetensors").read_bytes()


def test_strict_checks_still_name_every_key(dirs, tmp_path):
    path = dirs["llama", "float32"]
    tensors = {k: v for k, v in file_tensors(path).items() if k != "model.norm.weight"}
    tensors["model.layers.0.mlp.up_proj.weight"] = tensors["model.layers.0.mlp.up_proj.weight"][:, :3]
    tensors["model.extra.weight"] = np.zeros(2, np.float32)
    (tmp_path / "d").mkdir()
    save_file(tensors, str(tmp_path / "d" / "model.safetensors"), metadata={"format": "pt"})
    (tmp_path / "d" / "config.json").write_text((path / "config.json").read_text())
    with pytest.raises(ValueError, match=r"missing keys \['norm.scale'\]; unexpected keys \['model.extra.weight'\]; "
                                         r"shape mismatches \['layers.0.mlp.up_proj.weight: got \(64, 3\)"):
        load_hf(tmp_path / "d")


def test_header_that_does_not_fit_the_file_is_named(tmp_path):
    save_file({"w": np.zeros((4, 4), np.float32)}, str(tmp_path / "m.safetensors"))
    raw = (tmp_path / "m.safetensors").read_bytes()
    (tmp_path / "m.safetensors").write_bytes(raw[:-8])  # the data cut short
    with pytest.raises(ValueError, match=r"tensor 'w' \(F32 \[4, 4\]\) has data_offsets \[0, 64\], which do not hold"):
        open_safetensors(tmp_path / "m.safetensors")


TENSOR = 256 * 512 * 2  # WIDE's largest tensor (bf16), what a load or save holds besides the params
WIDE = ModelConfig(vocab_size=64, d_model=256, n_layer=2, n_head=4, n_kv_head=2, d_ff=512, max_len=64, pos="rope",
                   norm="rmsnorm", mlp="swiglu")


@pytest.fixture(scope="module")
def wide(tmp_path_factory):
    """A bf16 directory whose weights (1.4 MiB) dwarf the loader's own bookkeeping."""
    path = tmp_path_factory.mktemp("wide") / "hf"
    rng = np.random.default_rng(0)
    params = jax.tree.map(lambda s: rng.standard_normal(s.shape).astype("bfloat16"), abstract_params(WIDE))
    save_hf(path, WIDE, params, max_shard_size=400_000)
    return path, params


def peak_bytes(fn):
    tracemalloc.start()
    try:
        out = fn()
        return out, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_load_and_save_hold_the_params_plus_about_one_tensor_or_shard(wide, tmp_path):
    """Peak traced bytes: a load <= the params + one tensor (a 256 x 512 MLP weight, 256 KiB, the largest)
    + 5% of the params, a save (3 shards of <= 1 MB) <= one tensor + 5% (measured: 1.10x, 0.11x)."""
    path, params = wide
    load_hf(path, dtype="bfloat16")  # warm: abstract_params' trace is cached
    (config, loaded), peak = peak_bytes(lambda: load_hf(path, dtype="bfloat16"))
    nbytes = sum(a.nbytes for a in jax.tree.leaves(loaded))
    assert nbytes == sum(a.nbytes for a in jax.tree.leaves(params)) and peak <= 1.05 * nbytes + TENSOR, (peak, nbytes)
    _, peak = peak_bytes(lambda: save_hf(tmp_path / "out", config, loaded, max_shard_size=1_000_000))
    assert len(list((tmp_path / "out").glob("*.safetensors"))) == 3  # a shard held whole would break the bound
    assert peak <= 0.05 * nbytes + TENSOR, (peak, nbytes)


def test_save_is_byte_identical_to_one_save_file_of_export_hf(wide, tmp_path):
    _, params = wide
    save_hf(tmp_path / "ours", WIDE, params)
    _, sd = hf.export_hf(WIDE, params)
    save_file(sd, str(tmp_path / "ref.safetensors"), metadata={"format": "pt"})
    assert (tmp_path / "ours" / "model.safetensors").read_bytes() == (tmp_path / "ref.safetensors").read_bytes()
    float32 = jax.tree.map(lambda a: np.asarray(a, np.float32), params)  # the same tensors, upcast on the way
    save_hf(tmp_path / "f32", WIDE, float32, max_shard_size=400_000)
    index = json.loads((tmp_path / "f32" / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == 2 * sum(a.nbytes for a in sd.values())
    back = file_tensors(tmp_path / "f32")
    assert sorted(back) == sorted(sd) and all(np.array_equal(back[k], sd[k].astype(np.float32)) for k in sd)


def test_sharded_load_reads_only_each_devices_slice(wide):
    """4 CPU devices, fsdp=2 x tensor=2: every callback reads exactly its slice's bytes; q_proj's kernel,
    split both ways, is read a quarter per device; the arrays equal the NumPy load bit for bit."""
    root = str(Path(__file__).resolve().parents[1])  # this checkout's jaxgpt, whatever is installed
    env = {**os.environ, "XLA_FLAGS": xla_flags("--xla_force_host_platform_device_count=4"), "JAX_PLATFORMS": "cpu",
           "PYTHONPATH": os.pathsep.join(filter(None, (root, os.environ.get("PYTHONPATH"))))}
    p = subprocess.run([sys.executable, str(WORKER), str(wide[0])], env=env, capture_output=True, text=True,
                       timeout=120, cwd=WORKER.parent)
    lines = [x for x in p.stdout.splitlines() if x.startswith("RESULT ")]
    assert p.returncode == 0 and lines, p.stderr[-3000:]
    r = json.loads(lines[-1][len("RESULT "):])
    assert r["devices"] == 4 and r["equal"]
    assert r["q_spec"] == ["None", "fsdp", "tensor"] and r["q_shard_shapes"] == [[2, 128, 128]] * 4
    for _, part, nbytes, itemsize in r["reads"]:
        assert nbytes == int(np.prod(part)) * itemsize  # a read is its slice, no more
    q = [(whole, part) for whole, part, _, _ in r["reads"] if whole == [256, 256]]  # q_proj / o_proj, per layer
    assert q and all(part == [128, 128] for _, part in q), q
