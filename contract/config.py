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

LAYERNORM, RMSNORM, NO_NORM = "layernorm", "rmsnorm", "none"
NORMS = (LAYERNORM, RMSNORM, NO_NORM)  # what a block applies to its input before attention
QK_NORMS = (NO_NORM, RMSNORM)  # what q and k get per head before the rotation (Qwen3: rmsnorm)
# Rotary pairing: `half` rotates x[i] with x[i + rotary_dim/2] (Llama, GPT-NeoX); `interleaved`
# rotates x[2i] with x[2i+1] (GPT-J).
HALF, INTERLEAVED = "half", "interleaved"
ROPE_PAIRINGS = (HALF, INTERLEAVED)
# Rotary frequency scaling as shipped: none, `linear` (positions divided by a factor) and Llama 3's
# `llama3` (low frequencies divided by the factor, high ones kept, a smooth band between).
ROPE_SCALINGS = ("none", "linear", "llama3")
# The MLP after attention in each block of a whole model: none (an attention model), `dense`
# (W_down(act(W_up x)): GPT-2) or `gated` (W_down(act(W_gate x) * W_up x): Llama, Mistral, Qwen, Phi-3)
NO_MLP, DENSE, GATED = "none", "dense", "gated"
MLPS = (NO_MLP, DENSE, GATED)
# The MLP's activation: SiLU (Llama, Mistral, Qwen, Phi-3), GELU exact, GELU's tanh approximation (GPT-2's
# `gelu_new`, Gemma's `gelu_pytorch_tanh`)
SILU, GELU, GELU_TANH = "silu", "gelu", "gelu_tanh"
ACTIVATIONS = (SILU, GELU, GELU_TANH)


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
    # Width of one head; None: d_model // n_heads. Qwen3 and Gemma give their own (the query width
    # n_heads * head_dim then differs from d_model; W_o maps it back).
    head_dim: int | None = None
    # Rotary position embeddings (RoPE) of q and k: on when rope_theta is set. `rotary_dim` is the
    # rotated width of a head (None: all of it; less for partial rotary as Phi and GPT-NeoX use it).
    rope_theta: float | None = None
    rotary_dim: int | None = None
    rope_pairing: str = HALF
    rope_scaling: str = "none"
    rope_scaling_factor: float = 1.0
    rope_low_freq_factor: float = 1.0  # llama3: wavelengths above original_max / low_freq_factor are scaled
    rope_high_freq_factor: float = 4.0  # llama3: wavelengths below original_max / high_freq_factor are kept
    rope_original_max_position: int = 8192  # llama3: the context the frequencies were trained for
    qk_norm: str = NO_NORM
    # A query attends at most the last `sliding_window` positions (itself included), in every layer,
    # or with `sliding_window_pattern` N in all but every N-th layer (Gemma 3: N = 6, five local, one global)
    sliding_window: int | None = None
    sliding_window_pattern: int = 1
    # A whole decoder (token ids in, logits out) when vocab_size is set: token embeddings, an MLP after
    # attention in each block (pre-norm and residual like attention's), a final norm of the block's
    # kind and an LM head, tied to the embeddings or its own. Unset: hidden states in and out.
    vocab_size: int | None = None
    mlp: str = NO_MLP
    mlp_width: int | None = None  # the MLP's inner width (intermediate_size)
    mlp_activation: str = SILU
    mlp_bias: bool = False  # biases on the MLP's projections (GPT-2)
    learned_positions: bool = False  # a learned embedding per absolute position added to the tokens' (GPT-2)
    tie_embeddings: bool = False  # the LM head is the token embeddings' matrix

    def __post_init__(self) -> None:
        self._check_types()
        if self.head_dim is None:
            if self.d_model % self.n_heads:
                raise ValueError(f"n_heads ({self.n_heads}) must divide d_model ({self.d_model})")
            object.__setattr__(self, "head_dim", self.d_model // self.n_heads)
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_kv_heads ({self.n_kv_heads}) must divide n_heads ({self.n_heads})")
        self._check_rope()
        self._check_whole()

    def _check_whole(self) -> None:
        if self.vocab_size is None:
            changed = [name for name in WHOLE_ONLY_FIELDS if getattr(self, name) != _DEFAULTS[name]]
            if changed:
                raise ValueError(f"{', '.join(changed)} set without vocab_size: an attention model has none")
            return
        _check_positive_int("vocab_size", self.vocab_size)
        self._check_mlp()
        for name in ("learned_positions", "tie_embeddings"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if self.learned_positions and self.rotary:
            raise ValueError("learned_positions and rope_theta: a model places tokens one way")
        if not self.residual:
            raise ValueError("a whole model (vocab_size set) has residual blocks: residual must be true")

    def _check_mlp(self) -> None:
        if self.mlp not in MLPS:
            raise ValueError(f"mlp must be one of {list(MLPS)}, got {self.mlp!r}")
        if self.mlp_activation not in ACTIVATIONS:
            raise ValueError(f"mlp_activation must be one of {list(ACTIVATIONS)}, got {self.mlp_activation!r}")
        if (self.mlp == NO_MLP) != (self.mlp_width is None):
            raise ValueError(f"mlp_width must be set exactly when mlp is not {NO_MLP!r}, got {self.mlp_width!r}")
        if self.mlp_width is not None:
            _check_positive_int("mlp_width", self.mlp_width)
        if not isinstance(self.mlp_bias, bool):
            raise ValueError(f"mlp_bias must be true or false, got {self.mlp_bias!r}")

    def _check_types(self) -> None:
        for name in ("d_model", "n_heads", "n_kv_heads", "n_layers", "max_seq_len", "sliding_window_pattern"):
            _check_positive_int(name, getattr(self, name))
        for name in ("head_dim", "sliding_window"):
            if getattr(self, name) is not None:
                _check_positive_int(name, getattr(self, name))
        for name in ("bias", "residual"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")
        for name, value, choices in (("norm", self.norm, NORMS), ("qk_norm", self.qk_norm, QK_NORMS)):
            if value not in choices:
                raise ValueError(f"{name} must be one of {list(choices)}, got {value!r}")
        _check_positive_number("norm_eps", self.norm_eps)

    def _check_rope(self) -> None:
        if self.rope_theta is None:
            changed = [name for name in ROPE_ONLY_FIELDS if getattr(self, name) != _DEFAULTS[name]]
            if changed:
                raise ValueError(f"{', '.join(changed)} set without rope_theta: rotary embeddings are off")
            return
        _check_positive_number("rope_theta", self.rope_theta)
        if self.rotary_dim is not None:
            _check_positive_int("rotary_dim", self.rotary_dim)
            if self.rotary_dim % 2 or self.rotary_dim > self.head_dim:
                raise ValueError(f"rotary_dim must be even and at most head_dim {self.head_dim}, got {self.rotary_dim}")
        if self.rope_pairing not in ROPE_PAIRINGS:
            raise ValueError(f"rope_pairing must be one of {list(ROPE_PAIRINGS)}, got {self.rope_pairing!r}")
        if self.rope_scaling not in ROPE_SCALINGS:
            raise ValueError(f"rope_scaling must be one of {list(ROPE_SCALINGS)}, got {self.rope_scaling!r}")
        for name in ("rope_scaling_factor", "rope_low_freq_factor", "rope_high_freq_factor"):
            _check_positive_number(name, getattr(self, name))
        _check_positive_int("rope_original_max_position", self.rope_original_max_position)
        if self.rope_scaling == "llama3" and not self.rope_low_freq_factor < self.rope_high_freq_factor:
            raise ValueError(
                f"rope_low_freq_factor ({self.rope_low_freq_factor}) must be below rope_high_freq_factor "
                f"({self.rope_high_freq_factor})"
            )

    @property
    def rotary(self) -> bool:
        """Whether q and k are rotated by position (and the graph takes `position_ids`)."""
        return self.rope_theta is not None

    @property
    def rotated_width(self) -> int:
        """How many of a head's dims are rotated (0 without rotary embeddings)."""
        if not self.rotary:
            return 0
        return self.head_dim if self.rotary_dim is None else self.rotary_dim

    @property
    def whole(self) -> bool:
        """Whether this is a whole decoder: token ids in, logits out."""
        return self.vocab_size is not None

    @property
    def positioned(self) -> bool:
        """Whether the graph takes `position_ids`: rotary embeddings or learned positions read them."""
        return self.rotary or self.learned_positions

    def window(self, layer: int) -> int | None:
        """Layer `layer`'s sliding window (None: it attends everything before it)."""
        every = self.sliding_window_pattern
        if self.sliding_window is None or (every > 1 and (layer + 1) % every == 0):
            return None
        return self.sliding_window

    @property
    def q_dim(self) -> int:
        """Width of the query projection (and of W_o's input): n_heads * head_dim."""
        return self.n_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        """Width of the key and value projections: n_kv_heads * head_dim."""
        return self.n_kv_heads * self.head_dim

    @property
    def n_rep(self) -> int:
        """Query heads per kv head (1 for MHA)."""
        return self.n_heads // self.n_kv_heads

    def n_params(self) -> int:
        per_layer = {LAYERNORM: 2 * self.d_model, RMSNORM: self.d_model, NO_NORM: 0}[self.norm]  # weight (+ bias)
        per_layer += 2 * self.q_dim * self.d_model + 2 * self.kv_dim * self.d_model  # W_q, W_o, W_k, W_v
        if self.bias:
            per_layer += self.q_dim + self.d_model + 2 * self.kv_dim
        if self.qk_norm == RMSNORM:
            per_layer += 2 * self.head_dim
        return per_layer * self.n_layers + self.mlp_params() + self.embedding_params()

    def mlp_params(self) -> int:
        """The MLPs' weights and biases, with their norms, over all layers."""
        if self.mlp == NO_MLP:
            return 0
        matrices = 3 if self.mlp == GATED else 2
        per_layer = matrices * self.d_model * self.mlp_width
        per_layer += (matrices - 1) * self.mlp_width + self.d_model if self.mlp_bias else 0
        per_layer += {LAYERNORM: 2 * self.d_model, RMSNORM: self.d_model, NO_NORM: 0}[self.norm]
        return per_layer * self.n_layers

    def embedding_params(self) -> int:
        """Token (and position) embeddings, the final norm and the LM head of a whole model."""
        if not self.whole:
            return 0
        total = self.vocab_size * self.d_model * (1 if self.tie_embeddings else 2)
        total += self.max_seq_len * self.d_model if self.learned_positions else 0
        return total + {LAYERNORM: 2 * self.d_model, RMSNORM: self.d_model, NO_NORM: 0}[self.norm]

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


def _check_positive_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if value <= 0:
        raise ValueError(f"{name} must be positive, got {value}")


def _check_positive_number(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{name} must be a positive number, got {value!r}")


# What each field means, for users (the guide's reference is generated from this: docs/reference.md).
FIELD_HELP = {
    "d_model": "width of the hidden states in and out of every layer",
    "n_heads": "query heads per layer",
    "n_kv_heads": "key/value heads per layer: n_heads for MHA, fewer for GQA, 1 for MQA; divides n_heads",
    "n_layers": "attention layers, each fed the previous one's output",
    "max_seq_len": "the longest past + new tokens a sequence may hold; sizes the KV pool and the limits",
    "bias": "biases on the q, k, v and output projections",
    "norm_eps": "epsilon of the block's norm and of the q/k norms",
    "norm": f"the block's norm before attention: one of {list(NORMS)}",
    "residual": "add the block's input to the attention's output (x + Attention(Norm(x)))",
    "head_dim": "width of one head (unset: d_model // n_heads); Qwen3 and Gemma give their own",
    "rope_theta": "rotary position embeddings of q and k with this base (unset: no rotation)",
    "rotary_dim": "the rotated width of a head (unset: all of it; less for Phi's partial rotary)",
    "rope_pairing": f"which elements rotate together: one of {list(ROPE_PAIRINGS)} (half: Llama; interleaved: GPT-J)",
    "rope_scaling": f"rotary frequency scaling: one of {list(ROPE_SCALINGS)}",
    "rope_scaling_factor": "linear and llama3 scaling: the factor",
    "rope_low_freq_factor": "llama3: wavelengths above rope_original_max_position / this are scaled",
    "rope_high_freq_factor": "llama3: wavelengths below rope_original_max_position / this are kept",
    "rope_original_max_position": "llama3: the context the frequencies were trained for",
    "qk_norm": f"a per-head norm of q and k before the rotation: one of {list(QK_NORMS)} (Qwen3: rmsnorm)",
    "sliding_window": "a query attends at most this many last positions, itself included (unset: all)",
    "sliding_window_pattern": "with sliding_window: every N-th layer attends globally (1: every layer is local)",
    "vocab_size": "a whole decoder with this many tokens: token ids in, logits out (unset: hidden states in and out)",
    "mlp": f"the MLP after attention in each block of a whole model: one of {list(MLPS)}",
    "mlp_width": "the MLP's inner width (Hugging Face's intermediate_size)",
    "mlp_activation": f"the MLP's activation: one of {list(ACTIVATIONS)} (gelu_tanh: GPT-2's gelu_new)",
    "mlp_bias": "biases on the MLP's projections (GPT-2)",
    "learned_positions": "a learned embedding per position added to the tokens' (GPT-2), instead of rotation",
    "tie_embeddings": "the LM head reuses the token embeddings' matrix",
}
_DEFAULTS = {field.name: field.default for field in dataclasses.fields(ModelConfig)}
ROPE_ONLY_FIELDS = tuple(name for name in _DEFAULTS if name.startswith(("rope_", "rotary_")) and name != "rope_theta")
WHOLE_ONLY_FIELDS = ("mlp", "mlp_width", "mlp_activation", "mlp_bias", "learned_positions", "tie_embeddings")

PRESETS: dict[str, ModelConfig] = {
    # the product's default: one layer of 8-head attention, 512 wide
    "seed": ModelConfig(d_model=512, n_heads=8, n_kv_heads=8, n_layers=1),
    # small enough that a test builds and checks it in well under a second
    "tiny": ModelConfig(d_model=32, n_heads=4, n_kv_heads=4, n_layers=2, max_seq_len=512),
    # grouped-query attention: two query heads per kv head
    "gqa": ModelConfig(d_model=256, n_heads=8, n_kv_heads=4, n_layers=2, max_seq_len=2048),
    # benchmark size: a realistic width with GQA and several layers
    "large": ModelConfig(d_model=2048, n_heads=16, n_kv_heads=4, n_layers=4, max_seq_len=8192),
    # Llama-shaped (the large preset's sizes): RMSNorm, no biases, RoPE with Llama 3.1's theta and scaling
    "llama": ModelConfig(
        d_model=2048,
        n_heads=16,
        n_kv_heads=4,
        n_layers=4,
        max_seq_len=8192,
        bias=False,
        norm=RMSNORM,
        rope_theta=500000.0,
        rope_scaling="llama3",
        rope_scaling_factor=8.0,
    ),
    # a whole Llama-shaped decoder small enough to bench on 2 cores (20M parameters, docs/importing.md)
    "llama-whole": ModelConfig(
        d_model=512,
        n_heads=8,
        n_kv_heads=4,
        n_layers=4,
        max_seq_len=2048,
        bias=False,
        norm=RMSNORM,
        norm_eps=1e-6,
        rope_theta=500000.0,
        vocab_size=8192,
        mlp=GATED,
        mlp_width=1408,
    ),
}

DEFAULT_PRESET = "seed"


def preset(name: str) -> ModelConfig:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}") from None
