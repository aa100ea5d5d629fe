"""Build and load the C++ CPU kernels in ``kernels/cpu/`` as XLA FFI targets.

A source is compiled on first use with the host's C++ compiler against jaxlib's FFI headers (a few
seconds, once), cached under ``$JAXGPT_CACHE`` (default ``~/.cache/jaxgpt``), keyed by the source and
the headers beside it (simd.h), the flags, jax's version and the CPU. Callers decide what to do when
that cannot be done (no compiler, another backend): each kernel has a pure-JAX path with the same
numbers.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import warnings
from pathlib import Path

import jax

CPU = Path(__file__).with_name("cpu")
FLAGS = ("-O3", "-shared", "-fPIC", "-std=c++17")
# JAXGPT_KERNEL_ISA: what the kernels are compiled for. 'native' (default) is this CPU's instruction
# sets; 'avx2' caps an x86 build at AVX2 + FMA (what most laptops and cloud VMs have: a benchmark on an
# AVX-512 machine measures them with it, scripts/harness.py::isa_env); 'portable' is the compiler's
# baseline for the architecture (its vectors are GCC's generic ones, simd.h).
ISA_ENV = "JAXGPT_KERNEL_ISA"
ISA_FLAGS = {"native": ("-march=native",), "avx2": ("-march=haswell", "-mtune=generic"), "portable": ()}


# JAXGPT_KERNELS=off: every kernel falls back to its pure-JAX path, with the one warning a failed build gives
OFF_ENV = "JAXGPT_KERNELS"


def isa_flags() -> tuple[str, ...]:
    isa = os.environ.get(ISA_ENV, "native")
    if isa not in ISA_FLAGS:
        raise ValueError(f"{ISA_ENV}={isa!r} is not one of {tuple(ISA_FLAGS)}")
    if isa == "avx2" and platform.machine().lower() not in ("x86_64", "amd64"):
        raise ValueError(f"{ISA_ENV}=avx2 is an x86 instruction set; this machine is {platform.machine()}")
    return ISA_FLAGS[isa]


def _cpu_id() -> str:
    try:  # the instruction sets -march=native compiles for
        return next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def cache_dir() -> Path:
    return Path(os.environ.get("JAXGPT_CACHE", Path.home() / ".cache" / "jaxgpt")) / "kernels"


def build(source: Path) -> Path:
    """The shared library of ``source``, compiled now unless the cache holds it."""
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    if cxx is None:
        raise RuntimeError("no C++ compiler found (set CXX)")
    headers = [h.read_text() for h in sorted(source.parent.glob("*.h"))]  # what the sources include (simd.h)
    flags = (*FLAGS, *isa_flags())
    key = hashlib.sha256("\0".join([source.read_text(), *headers, *flags, cxx, jax.__version__, _cpu_id()]).encode())
    out = cache_dir() / f"{source.stem}-{key.hexdigest()[:16]}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:  # then an atomic rename: parallel builds are safe
        so = Path(tmp) / out.name
        cmd = [cxx, *flags, f"-I{jax.ffi.include_dir()}", str(source), "-o", str(so)]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{r.stderr[-2000:]}")
        os.replace(so, out)
    return out


def register(source: Path, targets: dict[str, str]) -> None:
    """Build ``source`` and register its handler symbols as CPU FFI targets: {target name: symbol}."""
    lib = ctypes.cdll.LoadLibrary(str(build(source)))
    for name, symbol in targets.items():
        jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(getattr(lib, symbol)), platform="cpu")


# An 'auto' knob (norm_impl, act_impl) runs its kernel on inputs of at least this many floats (a train
# step's activations). A decode step's few rows keep XLA's op, which fuses with its neighbours
# (docs/performance.md).
AUTO_MIN_SIZE = 1 << 15


def use_kernel(knob: str, impl: str, choices: tuple[str, ...], x, unsupported, applies: bool = True) -> bool:
    """Whether the engine knob ``knob`` = ``impl`` (one of ``choices``: 'auto', 'xla', 'ffi') runs its
    CPU kernel on x: 'xla' never; 'auto' on at least AUTO_MIN_SIZE floats the kernel supports; 'ffi'
    always, a ValueError where ``unsupported(x)`` says why it cannot. ``applies``: the call is one the
    kernel computes at all (the knob is still checked)."""
    if impl not in choices:
        raise ValueError(f"{knob}={impl!r} is not one of {choices}")
    if not applies or impl == "xla" or (impl == "auto" and x.size < AUTO_MIN_SIZE):
        return False
    why = unsupported(x)
    if why is not None and impl == "ffi":
        raise ValueError(f"{knob}='ffi' cannot run here: {why}; use {knob}='auto' or 'xla'")
    return why is None


def available(source: Path, targets: dict[str, str], fallback: str) -> bool:
    """Whether ``source``'s kernels are built and registered (CPU backend only). When they cannot be,
    warn once (callers cache the answer) that ``fallback`` runs instead."""
    if jax.default_backend() != "cpu":
        return False
    try:
        if os.environ.get(OFF_ENV, "").lower() in ("0", "off", "false"):
            raise RuntimeError(f"{OFF_ENV}={os.environ[OFF_ENV]} turns the C++ kernels off")
        register(source, targets)
        return True
    except Exception as e:  # noqa: BLE001  any failure leaves the pure-JAX path, which is always there
        warnings.warn(f"the CPU kernel {source.name} is unavailable, so {fallback} (slower, same results): {e}",
                      stacklevel=3)
        return False


def kernels(source: str, targets: dict[str, str], fallback: str):
    """A kernel module's ``available()``: whether ``CPU / source``'s ``targets`` are built and registered,
    asked once per process (``available`` warns, once, that ``fallback`` runs when they cannot be)."""
    return functools.cache(lambda: available(CPU / source, targets, fallback))


__all__ = ["AUTO_MIN_SIZE", "ISA_ENV", "OFF_ENV", "available", "build", "cache_dir", "isa_flags", "kernels", "register",
           "use_kernel"]
