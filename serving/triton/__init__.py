"""The Triton adapter: how Triton runs the engine. The generated `config.pbtxt` of each model
(`config`, with the TensorRT accelerator's settings), the model repository filled from an artifact
directory (`repository`), the shim Triton loads as each Python model's `model.py` (`shim`), the
engines made from a model's folder and parameters (`engines`), the Python-backend models themselves
(`models`, which import `triton_python_backend_utils` and so load only inside Triton's Python stub),
and the `python -m serving repository|ensure` commands (`cli`). Nothing here imports torch: a
repository is written from an artifact's files."""
