"""Experiments and benchmarks around jaxgpt; not part of the installed package.

Run them as modules from the repository root, e.g.

    .venv/bin/python -m scripts.experiments.exp_attnres --smoke
    .venv/bin/python -m scripts.benchmarks.bench_train --quick

``scripts.harness`` holds what both share (worker subprocesses, timing, matmul peak, load average,
HLO text); ``scripts.experiments.expkit`` what the experiments share (arguments, the training call,
statistics, figures, result files).
"""
from jaxgpt import use_host_devices

# Every script measures what the jaxgpt command runs: one CPU device per core, set before JAX starts
# (a no-op where XLA_FLAGS or JAXGPT_HOST_DEVICES already chose; the library itself sets nothing on import).
use_host_devices()
