"""The Python-backend models, loaded by Triton through the shim (serving/triton/shim.py) named by
each model's `implementation` parameter. They import `triton_python_backend_utils`, which exists
only inside Triton's Python stub."""
