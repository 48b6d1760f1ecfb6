"""The Python-backend models Triton loads through the shims in model_repository/<model>/1/model.py.

`mha` and `mha_session` import `triton_python_backend_utils`, which exists only inside Triton's
Python stub; `shim.py` is the file copied into the repository.
"""
