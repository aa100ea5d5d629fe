"""Experiments and benchmarks around jaxgpt; not part of the installed package.

Run them as modules from the repository root, e.g.

    .venv/bin/python -m scripts.experiments.exp_attnres --smoke
    .venv/bin/python -m scripts.benchmarks.bench_train --quick

``scripts.harness`` holds what both share (worker subprocesses, timing, matmul peak, load average,
HLO text); ``scripts.experiments.expkit`` what the experiments share (arguments, the training call,
statistics, figures, result files).
"""
