"""torch.nn layers mirroring jaxgpt.nn file for file (same class and parameter names)."""
