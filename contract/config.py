"""The model's configuration: one frozen dataclass, shipped as `config.json` with every artifact.

This module imports nothing heavy (no torch, no onnx): the Triton runner and the client read
configs too.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from contract.files import MODEL_CONFIG_FILENAME

LAYERNORM, NO_NORM = "layernorm", "none"
NORMS = (LAYERNORM, NO_NORM)  # what a block applies to its input before attention


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    d_model: int = 512
    n_heads: int = 8
    n_kv_heads: int = 8  # = n_heads for MHA; fewer for GQA (MQA at 1); must divide n_heads
    n_layers: int = 1
    max_seq_len: int = 4096  # longest past + new tokens a deployment is sized for
    bias: bool = True
    norm_eps: float = 1e-5
    # The block around attention: today's pre-norm residual block by default; `norm: none` and
    # `residual: false` give a bare attention module (torch.nn.MultiheadAttention, the teaching texts')
    norm: str = LAYERNORM
    residual: bool = True

    def __post_init__(self) -> None:
        for name in ("d_model", "n_heads", "n_kv_heads", "n_layers", "max_seq_len"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"{name} must be an integer, got {value!r}")
            if value <= 0:
                raise ValueError(f"{name} must be positive, got {value}")
        for name in ("bias", "residual"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if self.norm not in NORMS:
            raise ValueError(f"norm must be one of {list(NORMS)}, got {self.norm!r}")
        if isinstance(self.norm_eps, bool) or not isinstance(self.norm_eps, (int, float)) or not self.norm_eps > 0:
            raise ValueError(f"norm_eps must be a positive number, got {self.norm_eps!r}")
        if self.d_model % self.n_heads:
            raise ValueError(f"n_heads ({self.n_heads}) must divide d_model ({self.d_model})")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_kv_heads ({self.n_kv_heads}) must divide n_heads ({self.n_heads})")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def kv_dim(self) -> int:
        """Width of the key and value projections: n_kv_heads * head_dim."""
        return self.n_kv_heads * self.head_dim

    @property
    def n_rep(self) -> int:
        """Query heads per kv head (1 for MHA)."""
        return self.n_heads // self.n_kv_heads

    def n_params(self) -> int:
        per_layer = 2 * self.d_model if self.norm == LAYERNORM else 0  # LayerNorm weight and bias
        per_layer += 2 * self.d_model * self.d_model + 2 * self.kv_dim * self.d_model  # W_q, W_o, W_k, W_v
        if self.bias:
            per_layer += 2 * self.d_model + 2 * self.kv_dim
        return per_layer * self.n_layers

    def kv_cache_bytes(self, batch: int, length: int, itemsize: int = 4) -> int:
        """Bytes of keys plus values over all layers for `length` positions."""
        return 2 * self.n_layers * batch * self.n_kv_heads * length * self.head_dim * itemsize

    # --- serialization -------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n"

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelConfig:
        if not isinstance(data, dict):
            raise ValueError(f"a model config must be a JSON object, got {type(data).__name__}")
        known = {field.name for field in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown config field(s) {unknown}; known fields are {sorted(known)}")
        return cls(**data)

    @classmethod
    def from_json(cls, text: str) -> ModelConfig:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as error:
            raise ValueError(f"config is not valid JSON: {error}") from error
        return cls.from_dict(data)

    @classmethod
    def load(cls, path: str | Path) -> ModelConfig:
        """Read a `config.json` file, or the one inside an artifact directory."""
        path = Path(path)
        if path.is_dir():
            path = path / MODEL_CONFIG_FILENAME
        if not path.is_file():
            raise FileNotFoundError(f"no model config at {path}")
        try:
            return cls.from_json(path.read_text())
        except ValueError as error:
            raise ValueError(f"{path}: {error}") from error

    def save(self, directory: str | Path) -> Path:
        path = Path(directory) / MODEL_CONFIG_FILENAME
        path.write_text(self.to_json())
        return path


PRESETS: dict[str, ModelConfig] = {
    # the product's default: one layer of 8-head attention, 512 wide
    "seed": ModelConfig(d_model=512, n_heads=8, n_kv_heads=8, n_layers=1),
    # small enough that a test builds and checks it in well under a second
    "tiny": ModelConfig(d_model=32, n_heads=4, n_kv_heads=4, n_layers=2, max_seq_len=512),
    # grouped-query attention: two query heads per kv head
    "gqa": ModelConfig(d_model=256, n_heads=8, n_kv_heads=4, n_layers=2, max_seq_len=2048),
    # benchmark size: a realistic width with GQA and several layers
    "large": ModelConfig(d_model=2048, n_heads=16, n_kv_heads=4, n_layers=4, max_seq_len=8192),
}

DEFAULT_PRESET = "seed"


def preset(name: str) -> ModelConfig:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}") from None
