"""Framework-free rules shared by jaxgpt and torch_ref (NumPy and the configs only): the parameter
layout (``layout``), host-side input checks (``validate``) and the batch conventions (``constants``)."""
