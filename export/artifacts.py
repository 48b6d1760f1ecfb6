"""An artifact directory: `config.json`, `weights.safetensors`, `model.<variant>.onnx`, `report.json`
(the names in contract/files.py); the PyTorch side of it: saving and loading the weights; and
`staged`, how a build writes one so that a failure leaves nothing half-written.

The config is always rebuilt from the directory's `config.json`, never from memory.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import shutil
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from safetensors.torch import load_file, save

from contract.config import ModelConfig
from contract.files import REPORT_FILENAME, WEIGHTS_FILENAME
from export.model import AttentionModel


def save_weights(model: AttentionModel, directory: str | Path) -> Path:
    """Weights as safetensors (never pickle), keyed `layers.{i}.attn.W_q.weight` and so on."""
    path = Path(directory) / WEIGHTS_FILENAME
    tensors = {name: tensor.detach().contiguous() for name, tensor in model.state_dict().items()}
    # serialized here and written by Python: a full disk is then an OSError like any other write's
    path.write_bytes(save(tensors, metadata={"format": "pt"}))
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


@contextlib.contextmanager
def staged(out: Path, owned: Iterable[str]) -> Iterator[Path]:
    """A fresh directory beside `out` to write an artifact into, put in place once the block ends.

    A new `out` is the staging directory renamed (one atomic step); an existing one gets each written
    file by an atomic rename, `report.json` last, and loses the `owned` names this build did not
    write (a variant that failed now must not leave an older build's file). Any error removes the
    staging directory and leaves `out` as it was. An `out` that cannot be written fails before
    anything is built (OSError naming it).
    """
    nearest = next(path for path in (out, *out.parents) if path.exists())
    if not nearest.is_dir():  # `out`, or a folder it would be made in, is a file
        raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), str(nearest))
    out.parent.mkdir(parents=True, exist_ok=True)
    if out.is_dir() and not os.access(out, os.W_OK, effective_ids=True):  # found now rather than after the build
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(out))
    staging = out.parent / f".{out.name}.{secrets.token_hex(4)}.partial"
    staging.mkdir()
    try:
        yield staging
        _publish(staging, out, owned)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def _publish(staging: Path, out: Path, owned: Iterable[str]) -> None:
    if not out.exists():
        staging.rename(out)
        return
    written = sorted(path.name for path in staging.iterdir())
    for name in sorted(set(owned) - set(written)):
        (out / name).unlink(missing_ok=True)
    for name in sorted(written, key=lambda name: name == REPORT_FILENAME):  # the report, which lists them, last
        (staging / name).replace(out / name)
    staging.rmdir()
