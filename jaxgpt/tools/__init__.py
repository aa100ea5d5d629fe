"""Torch-side extras, imported lazily: ``parity`` (a torch checkpoint vs its conversion) and ``bench``."""
