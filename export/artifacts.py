"""An artifact directory: `config.json`, `weights.safetensors`, `model.<variant>.onnx`, `report.json`
(the names in contract/files.py); the PyTorch side of it: saving and loading the weights.

The config is always rebuilt from the directory's `config.json`, never from memory.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from contract.config import ModelConfig
from contract.files import WEIGHTS_FILENAME
from export.model import AttentionModel


def save_weights(model: AttentionModel, directory: str | Path) -> Path:
    """Weights as safetensors (never pickle), keyed `layers.{i}.attn.W_q.weight` and so on."""
    path = Path(directory) / WEIGHTS_FILENAME
    tensors = {name: tensor.detach().contiguous() for name, tensor in model.state_dict().items()}
    save_file(tensors, str(path), metadata={"format": "pt"})
    return path


def load_weights(model: AttentionModel, path: str | Path) -> AttentionModel:
    tensors = load_file(str(path))
    expected, actual = set(model.state_dict()), set(tensors)
    if expected != actual:
        raise ValueError(
            f"{path}: weights do not fit the config; missing {sorted(expected - actual)}, "
            f"unexpected {sorted(actual - expected)}"
        )
    for name, tensor in model.state_dict().items():
        if tensors[name].shape != tensor.shape:
            raise ValueError(f"{path}: {name} has shape {list(tensors[name].shape)}, expected {list(tensor.shape)}")
    model.load_state_dict(tensors)
    return model


def save_artifact(model: AttentionModel, directory: str | Path) -> Path:
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    model.cfg.save(directory)
    save_weights(model, directory)
    return directory


def load_model(directory: str | Path) -> AttentionModel:
    """The PyTorch original of an artifact directory, in eval mode."""
    directory = Path(directory)
    cfg = ModelConfig.load(directory)
    model = AttentionModel(cfg)
    with torch.no_grad():
        load_weights(model, directory / WEIGHTS_FILENAME)
    return model.eval()
