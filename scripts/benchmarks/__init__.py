"""Timing and memory measurements of jaxgpt (and torch_ref): results/engine/."""
