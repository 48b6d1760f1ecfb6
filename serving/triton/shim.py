"""Triton Python-backend entry point, copied verbatim into model_repository/<model>/1/model.py by
`python -m serving repository`; the model's implementation lives in the `serving` package and is
named by the config parameter `implementation`.

Triton's stub runs the first `python3` on PATH but ignores PYTHONPATH for sys.path (measured), so
`serving` is found, in order: in the PYTHONPATH entries the launcher sets (the checkout that started
Triton, which may not be the one installed: a second work tree of the project), in that interpreter's
site-packages (`pip install -e .`), or in a checkout holding this repository.
"""

import importlib
import json
import os
import sys
from pathlib import Path


def _find_serving() -> None:
    launcher = [entry for entry in os.environ.get("PYTHONPATH", "").split(os.pathsep) if entry]
    sys.path[:0] = [entry for entry in launcher if entry not in sys.path]
    try:
        import serving.triton
    except ImportError:
        checkouts = [str(p) for p in Path(__file__).resolve().parents if (p / "serving" / "__init__.py").is_file()]
        sys.path[:0] = [c for c in checkouts if c not in sys.path]
        import serving.triton  # noqa: F401  (found now, or the load fails here with the reason)


class TritonPythonModel:
    def initialize(self, args):
        _find_serving()
        config = json.loads(args["model_config"])
        module = importlib.import_module(config["parameters"]["implementation"]["string_value"])
        self._model = module.TritonPythonModel()
        self._model.initialize(args)

    def execute(self, requests):
        return self._model.execute(requests)

    def finalize(self):
        model = getattr(self, "_model", None)
        if model is not None and hasattr(model, "finalize"):
            model.finalize()
