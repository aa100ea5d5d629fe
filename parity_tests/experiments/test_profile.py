"""scripts/benchmarks/profile_step.py --quick: the per-op profile of one jaxgpt and one torch train step runs,
every category is there with finite, non-negative times, and the HLO classifier sorts ops."""
from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from scripts.benchmarks.profile_ops import CATEGORIES, classify_hlo, jax_category, torch_category
from scripts.harness import parse_hlo

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.smoke  # the script end to end in a subprocess: make test-slow
def test_quick_profile(tmp_path):
    out = tmp_path / "profile.json"
    subprocess.run([sys.executable, "-m", "scripts.benchmarks.profile_step", "--quick", "--out", str(out)],
                   check=True, cwd=ROOT, timeout=300, capture_output=True)
    result = json.loads(out.read_text())
    assert out.with_suffix(".md").exists()
    shape = result["shapes"]["quick"]
    assert set(shape["runs"]) == {"jaxgpt-default", "torch-eager"}
    for name, run in shape["runs"].items():
        assert "error" not in run, run
        for key in ("categories_ms", "categories_best_ms", "op_counts", "step_ms", "profiled_wall_ms",
                    "peak_gflops", "top_ops"):
            assert key in run, (name, key)
        assert set(run["categories_ms"]) == set(CATEGORIES)
        assert all(math.isfinite(v) and v >= 0 for v in run["categories_ms"].values())
        assert run["op_counts"]["matmul fwd"] > 0 and run["op_counts"]["matmul bwd"] > 0, name
        assert run["op_counts"]["optimizer + clip"] > 0, name
        assert name in shape["matmul_bounds"]
    # the jaxgpt dots counted from the HLO (2 layers x q, k, v, o, fc_in, fc_out + the tied lm head, fwd and
    # bwd) agree with the 6 N tokens estimate within a factor 1.5
    flops = shape["runs"]["jaxgpt-default"]["matmul_flops"]
    torch_bound = shape["matmul_bounds"]["torch-eager"]["projection_gflop"]
    assert 0.5 < flops["projection"] / 1e9 / torch_bound < 1.5


def test_classifier():
    hlo = """HloModule m
%fused_computation (p0: f32[4,8], p1: f32[8,2]) -> f32[4,2] {
  %p0 = f32[4,8]{1,0} parameter(0)
  %p1 = f32[8,2]{1,0} parameter(1)
  ROOT %dot.1 = f32[4,2]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}
%fused_copy (p0: f32[4,8]) -> f32[8,4] {
  %p0 = f32[4,8]{1,0} parameter(0)
  ROOT %t = f32[8,4]{1,0} transpose(%p0), dimensions={1,0}
}
ENTRY %main (a: f32[4,8], b: f32[8,2]) -> f32[4,2] {
  %a = f32[4,8]{1,0} parameter(0)
  %b = f32[8,2]{1,0} parameter(1)
  %tr = f32[8,4]{1,0} fusion(%a), kind=kLoop, calls=%fused_copy, metadata={op_name="jit(f)/transpose(jvp(M))/x"}
  ROOT %mm = f32[4,2]{1,0} fusion(%a, %b), kind=kCustom, calls=%fused_computation, metadata={op_name="jit(f)/jvp(M)/dot"}
}
"""
    info = classify_hlo(parse_hlo(hlo))
    assert info["mm"]["kind"] == "matmul" and info["mm"]["phase"] == "fwd"
    assert info["mm"]["flops"] == 2 * 4 * 2 * 8 and not info["mm"]["batched"]
    assert info["tr"]["kind"] == "layout" and info["tr"]["phase"] == "bwd"
    assert jax_category(info["mm"]) == "matmul fwd"
    assert jax_category(info["tr"]) == "layout copy/transpose"
    assert torch_category("aten::mm", "bwd") == "matmul bwd"
    assert torch_category("aten::_scaled_dot_product_flash_attention_for_cpu", "fwd") == "attention core"
    assert torch_category("aten::add_", "opt") == "optimizer + clip"
