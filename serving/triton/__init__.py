"""How Triton runs the model: the generated `config.pbtxt` of each model (`config`), the model
repository filled from an artifact directory (`repository`), the TensorRT settings (`tensorrt`), the
shim Triton loads as each Python model's `model.py` (`shim`) and the Python-backend models
themselves (`models`, which import `triton_python_backend_utils` and so load only inside Triton's
Python stub). Nothing here imports torch: a repository is written from an artifact's files."""
