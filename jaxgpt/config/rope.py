"""RopeScaling: how a RoPE model stretches its frequencies past its training context (``ModelConfig.rope_scaling``).

The variants and parameter names are transformers' (``modeling_rope_utils.py``, ``rope_parameters``):

- 'linear': every inverse frequency divided by ``factor`` (position interpolation);
- 'dynamic': NTK scaling that HF applies only once a sequence passes ``max_position_embeddings``;
  jaxgpt's context (``max_len``) never does, so within it the frequencies are plain RoPE's, as HF's;
- 'yarn': frequencies blended between interpolated and original by a ramp over the dimensions
  (``beta_fast``, ``beta_slow``), cos/sin scaled by ``attention_factor`` (from ``mscale`` if not given);
- 'llama3': Llama 3.1's: low frequencies divided by ``factor``, high ones kept, a smooth band between
  (``low_freq_factor``, ``high_freq_factor`` over ``original_max_position_embeddings``);
- 'longrope': Phi-3's per-frequency ``short_factor`` (``long_factor`` past the original context,
  which HF switches to per call from the batch's longest position), cos/sin scaled by ``attention_factor``.

Framework-free: the frequencies themselves are ``jaxgpt.nn.rope_scaling`` / ``torch_ref.nn.rope_scaling``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields

from jaxgpt.config.base import _Config, _choice, _positive

ROPE_TYPES = ("linear", "dynamic", "yarn", "llama3", "longrope")
# The parameters each variant reads (besides rope_type); the others must stay None.
ROPE_PARAMS = {
    "linear": ("factor",),
    "dynamic": ("factor",),
    "yarn": ("factor", "original_max_position_embeddings", "attention_factor", "beta_fast", "beta_slow", "mscale",
             "mscale_all_dim", "truncate"),
    "llama3": ("factor", "original_max_position_embeddings", "low_freq_factor", "high_freq_factor"),
    "longrope": ("factor", "original_max_position_embeddings", "attention_factor", "short_factor", "long_factor"),
}
# Those a variant cannot do without (yarn's betas default to 32 and 1, its truncate to True, as HF's).
_REQUIRED = {"llama3": ("original_max_position_embeddings", "low_freq_factor", "high_freq_factor"),
             "yarn": ("original_max_position_embeddings",),
             "longrope": ("original_max_position_embeddings", "short_factor", "long_factor")}


@dataclass(frozen=True)
class RopeScaling(_Config):
    """One RoPE scaling variant and its parameters (transformers' names and meanings).

    ``factor`` is required by every variant (HF's longrope / yarn derive a missing one as
    ``max_position_embeddings / original_max_position_embeddings``: converters store that value).
    """

    rope_type: str
    factor: float | None = None
    original_max_position_embeddings: int | None = None
    low_freq_factor: float | None = None  # llama3
    high_freq_factor: float | None = None  # llama3
    beta_fast: float | None = None  # yarn; None: 32
    beta_slow: float | None = None  # yarn; None: 1
    mscale: float | None = None  # yarn: attention_factor = mscale(factor, mscale) / mscale(factor, mscale_all_dim)
    mscale_all_dim: float | None = None  # yarn
    truncate: bool | None = None  # yarn: round the ramp's ends outwards; None: True
    attention_factor: float | None = None  # yarn / longrope: the cos/sin multiplier; None: from factor
    short_factor: tuple | list | None = None  # longrope: (head_dim // 2,) divisors within the original context
    long_factor: tuple | list | None = None  # longrope: the same past it

    def _validate(self) -> None:
        _choice("rope_scaling.rope_type", self.rope_type, ROPE_TYPES)
        used = ROPE_PARAMS[self.rope_type]
        extra = [f.name for f in fields(self) if f.name != "rope_type" and f.name not in used
                 and getattr(self, f.name) is not None]
        if extra:
            raise ValueError(f"rope_scaling {self.rope_type!r} does not use {extra}; it reads {list(used)}")
        missing = [n for n in ("factor",) + _REQUIRED.get(self.rope_type, ()) if getattr(self, n) is None]
        if missing:
            raise ValueError(f"rope_scaling {self.rope_type!r} needs {missing}")
        least = 0.0 if self.rope_type == "longrope" else 1.0  # Phi-3's factor is max / original context, may be < 1
        if not (self.factor > 0 and self.factor >= least):
            raise ValueError(f"rope_scaling.factor must be >= 1 (> 0 for longrope), got {self.factor}")
        if self.original_max_position_embeddings is not None:
            _positive("rope_scaling.original_max_position_embeddings", self.original_max_position_embeddings)
        if self.rope_type == "llama3" and not 0 < self.low_freq_factor < self.high_freq_factor:
            raise ValueError(f"rope_scaling llama3 needs 0 < low_freq_factor < high_freq_factor, got "
                             f"{self.low_freq_factor} and {self.high_freq_factor}")
        if self.rope_type == "yarn" and not (self.beta_fast or 32) > (self.beta_slow or 1) > 0:
            raise ValueError(f"rope_scaling yarn needs beta_fast > beta_slow > 0 (None: 32 and 1), got "
                             f"{self.beta_fast} and {self.beta_slow}")
        if self.attention_factor is not None and not self.attention_factor > 0:
            raise ValueError(f"rope_scaling.attention_factor must be > 0 (None: from factor), got {self.attention_factor}")
        for name in ("short_factor", "long_factor"):
            value = getattr(self, name)
            if value is not None:
                try:
                    value = tuple(float(v) for v in value)
                except (TypeError, ValueError):
                    raise ValueError(f"rope_scaling.{name} must be a list of numbers, got {value!r}") from None
                if not value or not all(v > 0 for v in value):
                    raise ValueError(f"rope_scaling.{name} must be a non-empty list of numbers > 0, got {list(value)}")
                object.__setattr__(self, name, value)
        if self.short_factor is not None and len(self.short_factor) != len(self.long_factor):
            raise ValueError(f"rope_scaling longrope: short_factor has {len(self.short_factor)} values, long_factor "
                             f"{len(self.long_factor)}")

    def check_model(self, head_dim: int, max_len: int) -> None:
        """ValueError where this scaling cannot run exactly in a model of ``head_dim`` and context ``max_len``."""
        if self.rope_type != "longrope":
            return
        if len(self.short_factor) != head_dim // 2:
            raise ValueError(f"rope_scaling longrope: short_factor and long_factor need head_dim // 2 = {head_dim // 2} "
                             f"values, got {len(self.short_factor)}")
        if max_len > self.original_max_position_embeddings:
            raise ValueError(
                f"rope_scaling longrope: max_len={max_len} exceeds original_max_position_embeddings="
                f"{self.original_max_position_embeddings}; past it HF switches every position's frequencies to "
                "long_factor per call, which keys already in a KV cache (or an earlier prefill chunk) cannot follow")

    @classmethod
    def from_hf(cls, params, max_position_embeddings: int) -> "RopeScaling | None":
        """transformers' ``rope_parameters`` (or older ``rope_scaling``) dict -> a RopeScaling, None for plain
        RoPE; keys HF does not read for the variant are dropped, a partial rotary factor is refused. A
        model whose top-level original_max_position_embeddings HF prefers (Phi-3) passes it in ``params``."""
        kind = params.get("rope_type", params.get("type", "default"))
        if kind == "default":
            return None
        if kind not in ROPE_TYPES:
            raise ValueError(f"rope_type={kind!r} is not one of {('default',) + ROPE_TYPES}")
        if params.get("partial_rotary_factor", 1.0) != 1.0:
            raise ValueError(f"partial_rotary_factor={params['partial_rotary_factor']!r} (rotating part of each head) "
                             "is not implemented")
        kw = {k: params[k] for k in ROPE_PARAMS[kind] if params.get(k) is not None}
        if kind == "yarn" and "truncate" in params:
            kw["truncate"] = bool(params["truncate"])  # HF reads .get("truncate", True): a stored None is False
        if kind in ("yarn", "llama3", "longrope"):  # HF's standardize_rope_params and its factor fallback
            kw.setdefault("original_max_position_embeddings", max_position_embeddings)
            if "factor" not in kw and kind != "llama3":
                kw["factor"] = max_position_embeddings / kw["original_max_position_embeddings"]
        return cls(kind, **kw)

    @property
    def attention_scaling(self) -> float:
        """The factor HF multiplies cos and sin by (yarn, longrope; 1.0 for the others)."""
        if self.rope_type not in ("yarn", "longrope"):
            return 1.0
        if self.attention_factor is not None:
            return float(self.attention_factor)
        if self.rope_type == "longrope":
            return 1.0 if self.factor <= 1 else math.sqrt(
                1 + math.log(self.factor) / math.log(self.original_max_position_embeddings))
        if self.mscale and self.mscale_all_dim:
            return _yarn_mscale(self.factor, self.mscale) / _yarn_mscale(self.factor, self.mscale_all_dim)
        return _yarn_mscale(self.factor)

    def yarn_ramp(self, dim: int, base: float) -> tuple[float, float]:
        """yarn: the dimensions (low, high) between which frequencies go from kept to interpolated."""
        # The dimension at which a frequency turns `rotations` times over the original context.
        at = lambda rotations: dim * math.log(self.original_max_position_embeddings / (rotations * 2 * math.pi)) / (
            2 * math.log(base))
        low, high = at(self.beta_fast or 32), at(self.beta_slow or 1)
        if self.truncate is not False:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        return low, (high + 0.001 if low == high else high)  # HF's guard against a zero-width ramp

    def to_hf(self, theta: float) -> dict:
        """transformers' ``rope_parameters`` dict of this scaling with ``rope_theta=theta``."""
        out = {"rope_type": self.rope_type, "rope_theta": theta}
        for name in ROPE_PARAMS[self.rope_type]:
            value = getattr(self, name)
            if value is not None:
                out[name] = list(value) if isinstance(value, tuple) else value
        return out


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


__all__ = ["ROPE_PARAMS", "ROPE_TYPES", "RopeScaling"]
