"""The session model's implementation under its name before the names said what they serve: a repository
written then names this module in its config (`implementation`) until it is renamed (serving/triton/repository.py
`rename_legacy_models`, which `python -m serving` and `ensure` run); it loads `sessions`."""

from serving.triton.models.sessions import TritonPythonModel

__all__ = ["TritonPythonModel"]
