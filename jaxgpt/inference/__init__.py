"""Inference: sampling, cached generation (decoder LMs and the encoder-decoder) and translation."""
