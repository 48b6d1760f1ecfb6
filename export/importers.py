"""Bring your own model: a trained attention model's state dict, in the layout it was saved in, mapped
onto this product's weights (docs/design.md, "Model math") with the config its weights determine.

- `seeds`: `W_q`, `W_k`, `W_v`, `W_o` Linear modules (the teaching texts' MultiHeadAttention, MHA or
  GQA), a bias on all four or on none. Bare attention: `norm: none`, no residual.
- `torch-mha`: `torch.nn.MultiheadAttention`: `in_proj_weight` (or `q_proj_weight`, `k_proj_weight`,
  `v_proj_weight`), `in_proj_bias`, `out_proj.weight`, `out_proj.bias`. Bare attention, n_kv_heads =
  n_heads.
- `hf`: `model.layers.{i}.self_attn.{q,k,v,o}_proj.{weight,bias}` and an optional pre-norm
  `model.layers.{i}.input_layernorm.{weight,bias}`; each projection's bias optional (the same ones in
  every layer); no rotary embeddings. With the norm a pre-norm residual block, without it bare attention.
- `native`: this product's `weights.safetensors`, with the `config.json` beside it.

A layer's keys may sit under a prefix (`attn.W_q.weight`), a list of layers under a numbered one
(`blocks.0.attn.W_q.weight`, `blocks.1.attn.W_q.weight`). A file is safetensors (`.safetensors`) or a
`torch.save`d state dict read with `torch.load(weights_only=True)`: tensors only, no arbitrary object
is ever unpickled. The weights determine d_model, n_layers, bias and norm, and n_kv_heads once n_heads
is known; n_heads comes from what the caller gives (n_heads, or n_kv_heads) or from a Hugging Face
`config.json` beside the weights; anything else (max_seq_len, norm_eps, residual) from the caller's
partial config. Projection biases the file lacks where others have one (`hf`: Qwen2-style q/k/v biases
without an o bias) are imported as zeros: adding zero is exact in fp32 and fp16, and the config keeps
its one `bias` field.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch
from torch import Tensor, nn

from contract.config import DENSE, GATED, LAYERNORM, NO_NORM, RMSNORM, ModelConfig
from contract.files import MAX_TOKENIZER_BYTES, MODEL_CONFIG_FILENAME, TEXT_FILES, TOKENIZER_FILENAME, sha256
from export import hf_config, hf_source
from export.choices import LAYOUT_NAMES
from export.model import AttentionModel

PROJECTIONS = ("W_q", "W_k", "W_v", "W_o")
NORM_KINDS = ("weight", "bias")
QK_NORMS = ("q_norm", "k_norm")  # Qwen3's per-head norms, under the attention module (ours under attn.)
PACKED_QKV = "qkv_proj"  # Phi-3: q, k and v in one Linear
# The user's module against ours: a causal prefill, then decode steps (`check_against_source`)
SOURCE_BATCH, SOURCE_PREFILL, SOURCE_STEPS = 2, 7, 32
# Both sides are the same fp32 math summed in another order (measured below 1e-6 at our init's scale)
SOURCE_TOLERANCE = 1e-5
# A whole import against transformers' *ForCausalLM: a left-padded batch (row 0 padded), its prefill, then
# decode steps; fp32 logits within WHOLE_TOLERANCE of their largest magnitude (the same math summed in
# another order)
WHOLE_BATCH, WHOLE_PREFILL, WHOLE_PADDING = 2, 7, 3
WHOLE_TOLERANCE = 1e-5


class WeightsError(ValueError):
    """Weights that cannot be imported: every problem names the key or field, what was expected and what
    was found. Raised before anything is written."""

    def __init__(self, source: str | Path, problems: list[str]) -> None:
        self.problems = problems
        listed = problems[0] if len(problems) == 1 else "\n  " + "\n  ".join(problems)
        super().__init__(f"{source}: {listed}")


class SourceMismatchError(RuntimeError):
    """The imported model does not compute what the module it came from computes."""


@dataclasses.dataclass(frozen=True)
class SourceLayer:
    """Where one layer's keys sit: its attention module's prefix, and its block's (where a norm sits)."""

    attention: str
    block: str


@dataclasses.dataclass(frozen=True)
class Imported:
    model: AttentionModel  # in eval mode
    weights: dict  # where the weights came from: file, layout, sha256 (report.json)
    source_check: dict  # the imported model against the module it came from (report.json)
    # a whole checkpoint's tokenizer, special tokens and chat template beside its weights (files.TEXT_FILES
    # found there): the build copies them into the artifact, so the tokenizer travels with the model
    text_files: tuple[Path, ...] = ()

    @property
    def origin(self) -> dict:
        """What the build's report says of where the model came from."""
        return {"weights": self.weights, "source_check": self.source_check}


# --- reading a file --------------------------------------------------------------------------------


INDEX_SUFFIX = ".safetensors.index.json"  # a sharded checkpoint's map from key to shard file


class SafetensorsFiles(Mapping):
    """The tensors of one safetensors file or of a sharded checkpoint's shards, by key, read when asked
    for (as fp32): a whole checkpoint's MLPs and embeddings are never loaded, only their keys listed."""

    def __init__(self, files: dict[str, Path]) -> None:
        self._files = files  # key -> the file holding it
        self._read: dict[str, Tensor] = {}

    @classmethod
    def open(cls, path: Path) -> SafetensorsFiles:
        from safetensors import safe_open

        if path.name.endswith(INDEX_SUFFIX):
            weight_map = json.loads(path.read_text())["weight_map"]
            return cls({key: path.parent / shard for key, shard in weight_map.items()})
        with safe_open(str(path), "pt") as handle:
            return cls(dict.fromkeys(handle.keys(), path))

    @property
    def shards(self) -> list[Path]:
        return sorted(set(self._files.values()))

    def __getitem__(self, key: str) -> Tensor:
        if key not in self._read:
            from safetensors import safe_open

            with safe_open(str(self._files[key]), "pt") as handle:
                tensor = handle.get_tensor(key)
            if not tensor.is_floating_point():
                raise WeightsError(self._files[key], [f"{key}: dtype {tensor.dtype}, not floating point"])
            self._read[key] = tensor.to(torch.float32).contiguous()
        return self._read[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._files)

    def __len__(self) -> int:
        return len(self._files)


# What a checkpoint folder holds its weights in, looked for in this order (transformers' names)
CHECKPOINT_FILES = ("model" + INDEX_SUFFIX, "model.safetensors")


def weights_file(path: Path) -> Path:
    """The file to read the weights from: `path` itself, or in a checkpoint folder its sharded index or
    its one safetensors file (WeightsError naming what the folder holds when neither is there)."""
    if not path.is_dir():
        return path
    for name in CHECKPOINT_FILES:
        if (path / name).is_file():
            return path / name
    indexes = sorted(path.glob(f"*{INDEX_SUFFIX}"))
    single = sorted(path.glob("*.safetensors"))
    if len(indexes) == 1 or (not indexes and len(single) == 1):
        return (indexes or single)[0]
    found = sorted(p.name for p in path.iterdir())[:12]
    raise WeightsError(
        path,
        [
            f"a folder without one checkpoint to read: expected {' or '.join(CHECKPOINT_FILES)}, one "
            f"*{INDEX_SUFFIX} or one *.safetensors; it holds {found or 'nothing'}; give --weights the file"
        ],
    )


def read_state_dict(path: Path) -> Mapping[str, Tensor]:
    """Tensors by key, floating point ones as fp32: a `torch.save`d state dict, a safetensors file or a
    sharded checkpoint's `model.safetensors.index.json` (the last two read key by key when needed)."""
    if not path.is_file():
        raise WeightsError(path, ["no such file"])
    try:
        if path.suffix == ".safetensors" or path.name.endswith(INDEX_SUFFIX):
            return SafetensorsFiles.open(path)
        else:
            loaded = torch.load(str(path), map_location="cpu", weights_only=True)
    except Exception as error:  # any reader's failure means the same to the user: not a file of weights
        raise WeightsError(
            path, [f"neither safetensors nor a state dict torch.load(weights_only=True) reads ({error})"]
        ) from error
    if not isinstance(loaded, dict):
        raise WeightsError(path, [f"holds a {type(loaded).__name__}, not a state dict: save module.state_dict()"])
    problems = [
        f"{key}: a {type(value).__name__}, not a tensor: save module.state_dict() itself"
        for key, value in loaded.items()
        if not isinstance(value, Tensor)
    ]
    problems += [
        f"{key}: dtype {value.dtype}, not floating point"
        for key, value in loaded.items()
        if isinstance(value, Tensor) and not value.is_floating_point()
    ]
    if problems:
        raise WeightsError(path, problems)
    return {str(key): value.detach().to(torch.float32).contiguous() for key, value in loaded.items()}


class LayoutProblems(Exception):
    """Internal: what is wrong with a file's keys; import_weights raises it as a WeightsError naming the file."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__(problems)
        self.problems = problems


def find_prefixes(keys: list[str], anchor: str) -> list[str]:
    """The prefixes of the keys ending in `anchor`, one per layer, in layer order: one layer under any
    prefix, or several whose prefixes differ in one numbered component (`blocks.0.`, `blocks.1.`)."""
    prefixes = [key[: -len(anchor)] for key in keys if key == anchor or key.endswith("." + anchor)]
    if len(prefixes) <= 1:
        return prefixes
    parts = [prefix.split(".") for prefix in prefixes]
    varying = [i for i in range(len(parts[0])) if len({p[i] if i < len(p) else None for p in parts}) > 1]
    if len({len(p) for p in parts}) > 1 or len(varying) != 1 or not all(p[varying[0]].isdigit() for p in parts):
        raise LayoutProblems([f"'{anchor}' sits under prefixes that are not one numbered list: {sorted(prefixes)}"])
    ordered = sorted(prefixes, key=lambda prefix: int(prefix.split(".")[varying[0]]))
    numbers = [int(prefix.split(".")[varying[0]]) for prefix in ordered]
    if numbers != list(range(len(numbers))):
        raise LayoutProblems([f"the layers under '{anchor}' are numbered {numbers}, not 0 to {len(numbers) - 1}"])
    return ordered


# --- layouts ---------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Layout:
    """A layout whose projections are Linear modules (`.weight`, maybe `.bias`) named one per ours."""

    name: str
    what: str  # for messages: what the layout's keys look like
    projections: dict[str, str]  # ours (W_q, ...) -> the module under a layer's attention prefix
    norm: str | None = None  # the pre-norm module under a layer's block prefix (None: the layout has none)
    block_suffix: str = ""  # what a layer's attention prefix adds to its block's
    independent_biases: bool = False  # each projection may have a bias or not (the same ones in every layer)
    bare: bool = False  # the module is bare attention (no residual) whatever the weights say

    def layers(self, tensors: dict[str, Tensor]) -> list[SourceLayer]:
        anchor = f"{self.projections['W_q']}.weight"
        prefixes = find_prefixes(list(tensors), anchor)
        if not prefixes:
            raise LayoutProblems([f"no '{anchor}' key: not the `{self.name}` layout ({self.what})"])
        return [SourceLayer(prefix, prefix.removesuffix(self.block_suffix)) for prefix in prefixes]

    def biased(self, tensors: dict[str, Tensor], layers: list[SourceLayer]) -> tuple[str, ...]:
        """Our projections with a bias in the file: the ones found if independent, else all four or none."""
        found = tuple(p for p in PROJECTIONS if any(f"{self.module(layer, p)}.bias" in tensors for layer in layers))
        return found if self.independent_biases or not found else PROJECTIONS

    def has_norm(self, tensors: dict[str, Tensor], layers: list[SourceLayer]) -> bool:
        return self.norm is not None and any(f"{layer.block}{self.norm}.weight" in tensors for layer in layers)

    def norm_kind(self, tensors: dict[str, Tensor], layers: list[SourceLayer]) -> str:
        """The block's norm: a weight and a bias are a LayerNorm, a weight alone an RMSNorm."""
        if not self.has_norm(tensors, layers):
            return NO_NORM
        return LAYERNORM if any(f"{layer.block}{self.norm}.bias" in tensors for layer in layers) else RMSNORM

    def has_qk_norm(self, tensors: dict[str, Tensor], layers: list[SourceLayer]) -> bool:
        return any(f"{layer.attention}{QK_NORMS[0]}.weight" in tensors for layer in layers)

    def widths(self, tensors: dict[str, Tensor], layer: SourceLayer, given: dict) -> tuple[int, int, int]:
        """(d_model, the query projection's width, the key projection's width) as the first layer's
        weights give them."""
        w_q, w_k = (tensors.get(f"{self.module(layer, p)}.weight") for p in ("W_q", "W_k"))
        if w_q is None or w_k is None or w_q.dim() != 2 or w_k.dim() != 2:
            shapes = [None if w is None else list(w.shape) for w in (w_q, w_k)]
            raise LayoutProblems([f"the first layer's W_q and W_k are {shapes}, not two matrices"])
        return int(w_q.shape[1]), int(w_q.shape[0]), int(w_k.shape[0])

    def expected(
        self, tensors: dict[str, Tensor], cfg: ModelConfig, layer: SourceLayer, biased: tuple[str, ...]
    ) -> dict[str, tuple[int, ...]]:
        """Every key of one layer of `cfg` in this layout, with its shape."""
        shapes = our_shapes(cfg)
        keys = {f"{self.module(layer, p)}.weight": shapes[f"attn.{p}.weight"] for p in PROJECTIONS}
        keys |= {f"{self.module(layer, p)}.bias": shapes[f"attn.{p}.bias"] for p in biased}
        if cfg.norm != NO_NORM and self.norm is not None:
            kinds = NORM_KINDS if cfg.norm == LAYERNORM else NORM_KINDS[:1]
            keys |= {f"{layer.block}{self.norm}.{kind}": (cfg.d_model,) for kind in kinds}
        if cfg.qk_norm == RMSNORM:
            keys |= {f"{layer.attention}{name}.weight": (cfg.head_dim,) for name in QK_NORMS}
        return keys

    def convert(self, tensors: dict[str, Tensor], cfg: ModelConfig, layer: SourceLayer) -> dict[str, Tensor]:
        """One layer's tensors under our names (`attn.W_q.weight`, ...); a bias the file lacks is zeros."""
        shapes = our_shapes(cfg)
        ours = {f"attn.{p}.weight": tensors[f"{self.module(layer, p)}.weight"] for p in PROJECTIONS}
        for p in PROJECTIONS if cfg.bias else ():
            ours[f"attn.{p}.bias"] = tensors.get(f"{self.module(layer, p)}.bias", torch.zeros(shapes[f"attn.{p}.bias"]))
        if cfg.norm != NO_NORM:
            kinds = NORM_KINDS if cfg.norm == LAYERNORM else NORM_KINDS[:1]
            ours |= {f"norm.{kind}": tensors[f"{layer.block}{self.norm}.{kind}"] for kind in kinds}
        if cfg.qk_norm == RMSNORM:
            ours |= {f"attn.{name}.weight": tensors[f"{layer.attention}{name}.weight"] for name in QK_NORMS}
        return ours

    def refusals(self, tensors: dict[str, Tensor], layers: list[SourceLayer]) -> list[str]:
        """What the file holds that this model cannot express (each with the reason)."""
        return []

    def left_out(self, key: str, layers: list[SourceLayer]) -> bool:
        """Whether `key` belongs to a part of a whole model this one does not serve (listed, not refused)."""
        return False

    def module(self, layer: SourceLayer, projection: str) -> str:
        return layer.attention + self.projections[projection]


class HuggingFaceLayout(Layout):
    """A Hugging Face decoder's attention blocks (Llama, Mistral, Qwen2, Qwen3, Phi-3): each layer's
    `input_layernorm` and `self_attn` (q/k/v/o projections, or Phi-3's packed `qkv_proj`; Qwen3's
    `q_norm`/`k_norm`). The rest of a whole checkpoint (embeddings, MLPs, other norms, the LM head) is
    left out and listed by key group (`left_out`)."""

    def layers(self, tensors: dict[str, Tensor]) -> list[SourceLayer]:
        if not any(key.endswith(f".{PACKED_QKV}.weight") for key in tensors):
            return super().layers(tensors)
        prefixes = find_prefixes(list(tensors), f"{PACKED_QKV}.weight")
        return [SourceLayer(prefix, prefix.removesuffix(self.block_suffix)) for prefix in prefixes]

    def widths(self, tensors: dict[str, Tensor], layer: SourceLayer, given: dict) -> tuple[int, int, int]:
        if not self.packs_qkv(tensors, layer):
            return super().widths(tensors, layer, given)
        qkv = tensors[f"{layer.attention}{PACKED_QKV}.weight"]  # (q + 2 kv widths, d_model)
        n_heads, n_kv_heads = given.get("n_heads"), given.get("n_kv_heads")
        if not n_heads or not n_kv_heads or qkv.shape[0] % (n_heads + 2 * n_kv_heads):
            raise LayoutProblems(
                [
                    f"{layer.attention}{PACKED_QKV}.weight is {list(qkv.shape)}: the config.json beside it must give "
                    "num_attention_heads and num_key_value_heads that split it"
                ]
            )
        head_dim = qkv.shape[0] // (n_heads + 2 * n_kv_heads)
        return int(qkv.shape[1]), n_heads * head_dim, n_kv_heads * head_dim

    def expected(
        self, tensors: dict[str, Tensor], cfg: ModelConfig, layer: SourceLayer, biased: tuple[str, ...]
    ) -> dict[str, tuple[int, ...]]:
        keys = super().expected(tensors, cfg, layer, biased)
        if self.packs_qkv(tensors, layer):
            for p in ("W_q", "W_k", "W_v"):
                del keys[f"{self.module(layer, p)}.weight"]
                keys.pop(f"{self.module(layer, p)}.bias", None)
            keys[f"{layer.attention}{PACKED_QKV}.weight"] = (cfg.q_dim + 2 * cfg.kv_dim, cfg.d_model)
        return keys

    def convert(self, tensors: dict[str, Tensor], cfg: ModelConfig, layer: SourceLayer) -> dict[str, Tensor]:
        if self.packs_qkv(tensors, layer):  # rows: q, then k, then v (Phi3Attention splits them so)
            w_q, w_k, w_v = tensors[f"{layer.attention}{PACKED_QKV}.weight"].split([cfg.q_dim, cfg.kv_dim, cfg.kv_dim])
            tensors = {
                **tensors,
                **{
                    f"{self.module(layer, p)}.weight": w
                    for p, w in zip(("W_q", "W_k", "W_v"), (w_q, w_k, w_v), strict=True)
                },
            }
        return super().convert(tensors, cfg, layer)

    def packs_qkv(self, tensors: dict[str, Tensor], layer: SourceLayer) -> bool:
        return f"{layer.attention}{PACKED_QKV}.weight" in tensors

    def left_out(self, key: str, layers: list[SourceLayer]) -> bool:
        """Keys of a whole checkpoint this model does not serve: outside every layer's attention module
        and input norm, or the rotary buffers older checkpoints saved (derived from the config here)."""
        if key.endswith("rotary_emb.inv_freq"):
            return True
        return not any(key.startswith((layer.attention, f"{layer.block}{self.norm}.")) for layer in layers)


class TorchMHALayout(Layout):
    """`torch.nn.MultiheadAttention`: q, k and v packed in `in_proj_weight`, or one by one
    (`q_proj_weight`, ...), and one `in_proj_bias`; `out_proj` is a Linear."""

    def layers(self, tensors: dict[str, Tensor]) -> list[SourceLayer]:
        prefixes = find_prefixes(list(tensors), "out_proj.weight")
        if not prefixes:
            raise LayoutProblems([f"no 'out_proj.weight' key: not the `{self.name}` layout ({self.what})"])
        return [SourceLayer(prefix, prefix) for prefix in prefixes]

    def biased(self, tensors: dict[str, Tensor], layers: list[SourceLayer]) -> tuple[str, ...]:
        names = ("in_proj_bias", "out_proj.bias")
        return PROJECTIONS if any(layer.attention + name in tensors for layer in layers for name in names) else ()

    def has_norm(self, tensors: dict[str, Tensor], layers: list[SourceLayer]) -> bool:
        return False

    def widths(self, tensors: dict[str, Tensor], layer: SourceLayer, given: dict) -> tuple[int, int, int]:
        out = tensors[f"{layer.attention}out_proj.weight"]
        if out.dim() != 2:
            raise LayoutProblems([f"{layer.attention}out_proj.weight is {list(out.shape)}, not a matrix"])
        return int(out.shape[0]), int(out.shape[0]), int(out.shape[0])

    def expected(
        self, tensors: dict[str, Tensor], cfg: ModelConfig, layer: SourceLayer, biased: tuple[str, ...]
    ) -> dict[str, tuple[int, ...]]:
        d, prefix = cfg.d_model, layer.attention
        if packed(tensors, layer):
            keys = {f"{prefix}in_proj_weight": (3 * d, d)}
        else:  # kdim, vdim != embed_dim would be cross-attention: self-attention needs (d, d)
            keys = {f"{prefix}{x}_proj_weight": (d, d) for x in "qkv"}
        keys[f"{prefix}out_proj.weight"] = (d, d)
        if biased:
            keys |= {f"{prefix}in_proj_bias": (3 * d,), f"{prefix}out_proj.bias": (d,)}
        return keys

    def convert(self, tensors: dict[str, Tensor], cfg: ModelConfig, layer: SourceLayer) -> dict[str, Tensor]:
        prefix = layer.attention
        if packed(tensors, layer):
            w_q, w_k, w_v = tensors[f"{prefix}in_proj_weight"].chunk(3)  # (3E, E) -> 3 x (E, E), q k v
        else:
            w_q, w_k, w_v = (tensors[f"{prefix}{x}_proj_weight"] for x in "qkv")
        ours = {"attn.W_q.weight": w_q, "attn.W_k.weight": w_k, "attn.W_v.weight": w_v}
        ours["attn.W_o.weight"] = tensors[f"{prefix}out_proj.weight"]
        if cfg.bias:
            b_q, b_k, b_v = tensors[f"{prefix}in_proj_bias"].chunk(3)  # (3E,) -> 3 x (E,)
            ours |= {"attn.W_q.bias": b_q, "attn.W_k.bias": b_k, "attn.W_v.bias": b_v}
            ours["attn.W_o.bias"] = tensors[f"{prefix}out_proj.bias"]
        return ours

    def refusals(self, tensors: dict[str, Tensor], layers: list[SourceLayer]) -> list[str]:
        return [
            f"{key}: add_bias_kv appends a learned key and value to every sequence, which this model's "
            "KV cache has no place for"
            for key in tensors
            if key.endswith(("bias_k", "bias_v"))
        ]


def packed(tensors: dict[str, Tensor], layer: SourceLayer) -> bool:
    """Whether a torch-mha layer keeps q, k and v in one `in_proj_weight`."""
    return f"{layer.attention}q_proj_weight" not in tensors


LAYOUTS: dict[str, Layout] = {
    "seeds": Layout("seeds", "W_q, W_k, W_v, W_o Linear modules", projections={p: p for p in PROJECTIONS}, bare=True),
    "torch-mha": TorchMHALayout(
        "torch-mha",
        "torch.nn.MultiheadAttention: in_proj_weight, in_proj_bias, out_proj",
        projections={},
        bare=True,
    ),
    "hf": HuggingFaceLayout(
        "hf",
        "q_proj, k_proj, v_proj, o_proj under model.layers.{i}.self_attn.",
        projections={"W_q": "q_proj", "W_k": "k_proj", "W_v": "v_proj", "W_o": "o_proj"},
        norm="input_layernorm",
        block_suffix="self_attn.",
        independent_biases=True,
    ),
    "native": Layout(
        "native",
        "this product's weights.safetensors: layers.{i}.attn.W_q.weight, ...",
        projections={p: f"attn.{p}" for p in PROJECTIONS},
        norm="norm",
        block_suffix="",
    ),
}


assert tuple(LAYOUTS) == LAYOUT_NAMES, "export/choices.py names the layouts the CLI offers"


def our_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Our keys under `layers.{i}.` -> shape (docs/design.md, "Model math")."""
    d, q, kv = cfg.d_model, cfg.q_dim, cfg.kv_dim
    shapes = {"W_q": (q, d), "W_k": (kv, d), "W_v": (kv, d), "W_o": (d, q)}
    return {f"attn.{p}.weight": shapes[p] for p in PROJECTIONS} | {f"attn.{p}.bias": shapes[p][:1] for p in PROJECTIONS}


# --- the config the weights determine --------------------------------------------------------------


def beside(path: Path, layout: Layout) -> dict:
    """Config fields from a `config.json` beside the weights: ours (`native`) or a Hugging Face one
    (`hf`: export/hf_config.py reads it, refusing what this model cannot represent)."""
    sidecar = path.parent / MODEL_CONFIG_FILENAME
    if layout.name not in ("native", "hf") or not sidecar.is_file():
        return {}
    data = json.loads(sidecar.read_text())
    if not isinstance(data, dict):
        return {}
    if layout.name == "native":
        return ModelConfig.load(sidecar).to_dict() if "d_model" in data else {}
    try:
        return hf_config.fields_from(data)
    except hf_config.ConfigRefusal as refused:
        raise LayoutProblems([f"{sidecar}: {refused}"]) from None


def heads(d_model: int, q_width: int, kv_width: int, given: dict) -> tuple[int, int, int]:
    """(n_heads, n_kv_heads, head_dim): a given head_dim splits the widths; else n_heads given, else
    n_kv_heads given (head_dim = kv_width / n_kv_heads), with head_dim = q_width / n_heads."""
    n_heads, n_kv_heads, head_dim = given.get("n_heads"), given.get("n_kv_heads"), given.get("head_dim")
    if n_kv_heads is not None and (not isinstance(n_kv_heads, int) or n_kv_heads <= 0):
        raise LayoutProblems([f"n_kv_heads must be a positive integer, got {n_kv_heads!r}"])
    if head_dim is None and n_heads is None and n_kv_heads:
        head_dim = kv_width // n_kv_heads if kv_width % n_kv_heads == 0 else None
        if head_dim is None or q_width % head_dim:
            widths = f"the key width {kv_width} into heads of the query width {q_width}"
            raise LayoutProblems([f"n_kv_heads {n_kv_heads} does not divide {widths}"])
    if head_dim is None and n_heads is None:
        divisors = [h for h in range(1, q_width + 1) if q_width % h == 0 and kv_width % (q_width // h) == 0]
        why = f"the weights do not tell the number of heads: give --n-heads (the query width {q_width}"
        raise LayoutProblems([f"{why}: one of {divisors})"])
    if head_dim is None:
        if not isinstance(n_heads, int) or n_heads <= 0 or q_width % n_heads:
            raise LayoutProblems([f"n_heads {n_heads!r} does not divide the query width {q_width}"])
        head_dim = q_width // n_heads
    if q_width % head_dim or kv_width % head_dim:
        raise LayoutProblems(
            [f"the query width {q_width} and key width {kv_width} are not whole numbers of heads of {head_dim}"]
        )
    return q_width // head_dim, kv_width // head_dim, head_dim


def import_config(
    path: Path,
    layout: Layout,
    tensors: dict[str, Tensor],
    layers: list[SourceLayer],
    given: dict,
    also_determined: dict | None = None,
) -> ModelConfig:
    """The config: what the weights determine (the attention's, and `also_determined`: a whole model's
    rest), then what is given, then defaults; a given field that contradicts the weights is refused."""
    given = {**beside(path, layout), **given}
    d_model, q_width, kv_width = layout.widths(tensors, layers[0], given)
    n_heads, n_kv_heads, head_dim = heads(d_model, q_width, kv_width, given)
    has_norm = layout.has_norm(tensors, layers)
    given = hf_config.rotary_dim(given, head_dim)
    determined = {
        "d_model": d_model,
        "n_heads": n_heads,
        "n_kv_heads": n_kv_heads,
        "head_dim": head_dim,
        "n_layers": len(layers),
        "bias": bool(layout.biased(tensors, layers)),
        "norm": layout.norm_kind(tensors, layers),
        "qk_norm": RMSNORM if layout.has_qk_norm(tensors, layers) else NO_NORM,
    } | (also_determined or {})
    names = hf_config.NAMES_IN_CONFIG if layout.name == "hf" else {}  # a config.json's own names for its fields
    conflicts = [
        f"{names.get(field, field)}: the config gives {given[field]!r}, the weights {value!r}"
        for field, value in determined.items()
        if field in given and given[field] != value
    ]
    if conflicts:
        raise LayoutProblems(conflicts)
    defaults = {"residual": has_norm and not layout.bare}
    try:
        return ModelConfig.from_dict({**defaults, **given, **determined})
    except ValueError as error:
        raise LayoutProblems([str(error)]) from error


# --- the import -------------------------------------------------------------------------------------


def left_out_groups(keys: list[str]) -> dict[str, str]:
    """Keys this model does not serve, by group (a layer's keys counted once per layer): e.g.
    {"model.layers.{i}.mlp": "3 keys per layer x 2 layers", "lm_head": "1 key"}."""
    groups: dict[str, set] = {}
    for key in keys:
        parts = key.split(".")
        numbered = next((i for i, part in enumerate(parts) if part.isdigit()), None)
        if numbered is not None and numbered + 1 < len(parts) - 1:
            group = ".".join([*parts[:numbered], "{i}", parts[numbered + 1]])
            groups.setdefault(group, set()).add((parts[numbered], ".".join(parts[numbered + 2 :])))
        else:
            groups.setdefault(".".join(parts[:-1]) or key, set()).add(("", parts[-1]))
    described = {}
    for group, members in sorted(groups.items()):
        layers = {layer for layer, _ in members if layer}
        names = {name for _, name in members}
        if layers:
            described[group] = f"{len(names)} key{'s' * (len(names) != 1)} per layer x {len(layers)} layers"
        else:
            described[group] = f"{len(names)} key{'s' * (len(names) != 1)}"
    return described


ATTENTION_ONLY = "this product serves attention layers only: an MLP, embeddings or a head cannot be served"


def key_problems(
    tensors: dict[str, Tensor], expected: dict[str, tuple[int, ...]], why_unexpected: str = ATTENTION_ONLY
) -> list[str]:
    """Each key missing, of the wrong shape, or unexpected, with the expected and the actual shape; an
    unexpected key adds `why_unexpected` (why this import has no place for it)."""
    problems = [
        f"missing: {key} (expected shape {list(shape)})" for key, shape in expected.items() if key not in tensors
    ]
    problems += [
        f"wrong shape: {key} is {list(tensors[key].shape)}, expected {list(shape)}"
        for key, shape in expected.items()
        if key in tensors and tuple(tensors[key].shape) != shape
    ]
    unexpected = [key for key in tensors if key not in expected]
    problems += [f"unexpected: {key} (shape {list(tensors[key].shape)})" for key in unexpected]
    if unexpected:
        problems.append(why_unexpected)
    return problems


def layers_or_the_layout_that_fits(layout: Layout, tensors: dict[str, Tensor]) -> list[SourceLayer]:
    """The layout's layers in `tensors`; where it finds none, the error names the layouts that do."""
    try:
        return layout.layers(tensors)
    except LayoutProblems as error:
        fits = [name for name, other in LAYOUTS.items() if other is not layout and _finds_layers(other, tensors)]
        if fits:
            error.problems.append(f"these keys are the `{fits[0]}` layout: give --layout {fits[0]}")
        raise


def _finds_layers(layout: Layout, tensors: dict[str, Tensor]) -> bool:
    try:
        return bool(layout.layers(tensors))
    except LayoutProblems:
        return False


def import_weights(
    path: str | Path, layout_name: str, given: dict | None = None, attention_only: bool = False
) -> Imported:
    """Read `path` in layout `layout_name`, check every key, build the model and prove it against the
    module the weights came from where that can be rebuilt; raises WeightsError (bad input) or
    SourceMismatchError (the proof failed). `given`: config fields the weights do not determine.
    `hf` imports the whole decoder (`import_whole`) unless `attention_only`: then its attention blocks,
    the rest of the checkpoint left out and listed."""
    path = weights_file(Path(path))
    if layout_name not in LAYOUTS:
        raise WeightsError(path, [f"unknown layout {layout_name!r}; choose one of {sorted(LAYOUTS)}"])
    if attention_only and layout_name != "hf":
        raise WeightsError(
            path, [f"attention_only goes with the `hf` layout (a whole checkpoint), not {layout_name!r}"]
        )
    layout, tensors = LAYOUTS[layout_name], read_state_dict(path)
    if layout_name == "hf" and not attention_only:
        return import_whole(path, tensors, given or {})
    try:
        layers = layers_or_the_layout_that_fits(layout, tensors)
        refused = layout.refusals(tensors, layers)
        if refused:
            raise LayoutProblems(refused)
        cfg = import_config(path, layout, tensors, layers, given or {})
        biased = layout.biased(tensors, layers)
        expected = {k: v for layer in layers for k, v in layout.expected(tensors, cfg, layer, biased).items()}
        left_out = [key for key in tensors if key not in expected and layout.left_out(key, layers)]
        problems = key_problems({k: v for k, v in tensors.items() if k not in left_out}, expected)
        if problems:
            raise LayoutProblems(problems)
    except LayoutProblems as error:
        raise WeightsError(path, error.problems) from None
    model = loaded_model(cfg, layout, tensors, layers)
    weights = provenance(path, layout.name, tensors, cfg, biased)
    if left_out:
        weights["left_out"] = left_out_groups(left_out)
    return Imported(model, weights, check_against_source(layout, tensors, layers, model, path))


def loaded_model(
    cfg: ModelConfig, layout: Layout, tensors: Mapping[str, Tensor], layers: list[SourceLayer], rest: dict | None = None
) -> AttentionModel:
    """The model of `cfg` holding each layer's tensors under our names (and `rest`: a whole model's
    embeddings, MLPs, final norm and head), every key of it given (strict), in eval mode."""
    model = AttentionModel(cfg)
    state = {
        f"layers.{i}.{key}": tensor
        for i, layer in enumerate(layers)
        for key, tensor in layout.convert(tensors, cfg, layer).items()
    }
    model.load_state_dict(state | (rest or {}), strict=True)
    return model.eval()


def provenance(
    path: Path, layout: str, tensors: Mapping[str, Tensor], cfg: ModelConfig, biased: tuple[str, ...]
) -> dict:
    """Where the weights came from (report.json `weights`): the file, its layout and sha256, a sharded
    checkpoint's shards, and the projection biases imported as zeros."""
    weights = {"file": str(path), "layout": layout, "sha256": sha256(path)}
    if isinstance(tensors, SafetensorsFiles) and len(tensors.shards) > 1:
        weights["shards"] = {shard.name: sha256(shard) for shard in tensors.shards}
    if cfg.bias and len(biased) < len(PROJECTIONS):
        weights["zero_biases"] = [p for p in PROJECTIONS if p not in biased]
    return weights


# --- a whole Hugging Face decoder --------------------------------------------------------------------


class GPT2AttentionLayout(Layout):
    """GPT-2's attention: `attn.c_attn` packs q, k and v along its outputs and `attn.c_proj` is the
    output projection, both `Conv1D`s (weight stored (in, out): nn.Linear's transposed), all with biases;
    `ln_1` the LayerNorm before it."""

    def layers(self, tensors: dict[str, Tensor]) -> list[SourceLayer]:
        prefixes = find_prefixes(list(tensors), "attn.c_attn.weight")  # the block's prefix: transformer.h.{i}.
        if not prefixes:
            raise LayoutProblems(["no 'attn.c_attn.weight' key: not GPT-2's attention"])
        return [SourceLayer(f"{prefix}attn.", prefix) for prefix in prefixes]

    def biased(self, tensors: dict[str, Tensor], layers: list[SourceLayer]) -> tuple[str, ...]:
        return PROJECTIONS if any(f"{layer.attention}c_attn.bias" in tensors for layer in layers) else ()

    def has_qk_norm(self, tensors: dict[str, Tensor], layers: list[SourceLayer]) -> bool:
        return False

    def widths(self, tensors: dict[str, Tensor], layer: SourceLayer, given: dict) -> tuple[int, int, int]:
        qkv = tensors[f"{layer.attention}c_attn.weight"]  # (d_model, 3 d_model)
        if qkv.dim() != 2 or qkv.shape[1] != 3 * qkv.shape[0]:
            raise LayoutProblems([f"{layer.attention}c_attn.weight is {list(qkv.shape)}, not (d_model, 3 d_model)"])
        return int(qkv.shape[0]), int(qkv.shape[0]), int(qkv.shape[0])

    def expected(
        self, tensors: dict[str, Tensor], cfg: ModelConfig, layer: SourceLayer, biased: tuple[str, ...]
    ) -> dict[str, tuple[int, ...]]:
        d, prefix = cfg.d_model, layer.attention
        keys = {f"{prefix}c_attn.weight": (d, 3 * d), f"{prefix}c_proj.weight": (d, d)}
        if biased:
            keys |= {f"{prefix}c_attn.bias": (3 * d,), f"{prefix}c_proj.bias": (d,)}
        kinds = NORM_KINDS if cfg.norm == LAYERNORM else NORM_KINDS[:1]
        return keys | {f"{layer.block}{self.norm}.{kind}": (d,) for kind in kinds}

    def convert(self, tensors: dict[str, Tensor], cfg: ModelConfig, layer: SourceLayer) -> dict[str, Tensor]:
        prefix = layer.attention
        w_q, w_k, w_v = tensors[f"{prefix}c_attn.weight"].t().split(cfg.d_model)  # (3d, d) -> 3 x (d, d), q k v
        ours = {"attn.W_q.weight": w_q, "attn.W_k.weight": w_k, "attn.W_v.weight": w_v}
        ours["attn.W_o.weight"] = tensors[f"{prefix}c_proj.weight"].t()
        if cfg.bias:
            b_q, b_k, b_v = tensors[f"{prefix}c_attn.bias"].split(cfg.d_model)
            ours |= {"attn.W_q.bias": b_q, "attn.W_k.bias": b_k, "attn.W_v.bias": b_v}
            ours["attn.W_o.bias"] = tensors[f"{prefix}c_proj.bias"]
        kinds = NORM_KINDS if cfg.norm == LAYERNORM else NORM_KINDS[:1]
        return ours | {f"norm.{kind}": tensors[f"{layer.block}{self.norm}.{kind}"] for kind in kinds}


GPT2_ATTENTION = GPT2AttentionLayout("hf", "GPT-2: attn.c_attn, attn.c_proj under transformer.h.{i}.", {}, norm="ln_1")


@dataclasses.dataclass(frozen=True)
class DecoderNames:
    """Where a family keeps the rest of a decoder: the embeddings and final norm under the model's root
    (`model.`, `transformer.`), each block's MLP norm and MLP under the block's prefix, the head at the top."""

    embed: str
    final_norm: str
    mlp_norm: str
    up: str  # the MLP's input projection (GPT-2's c_fc), or Phi-3's packed gate_up
    down: str
    gate: str | None = None  # a gated MLP's gate (None: dense, or packed with up)
    packed_gate_up: bool = False  # Phi-3: rows [gate; up] in one Linear (Phi3MLP.forward chunks them so)
    positions: str | None = None  # GPT-2's learned position embeddings
    conv1d: bool = False  # GPT-2: the MLP's weights stored (in, out), nn.Linear's transposed
    buffers: tuple[str, ...] = ("rotary_emb.inv_freq",)  # derived from the config, not weights (ignored)
    head: str = "lm_head"


LLAMA_NAMES = DecoderNames(
    "embed_tokens", "norm", "post_attention_layernorm", "mlp.up_proj", "mlp.down_proj", "mlp.gate_proj"
)
PHI3_NAMES = dataclasses.replace(LLAMA_NAMES, up="mlp.gate_up_proj", gate=None, packed_gate_up=True)
GPT2_NAMES = DecoderNames(
    "wte",
    "ln_f",
    "ln_2",
    "mlp.c_fc",
    "mlp.c_proj",
    positions="wpe",
    conv1d=True,
    buffers=(".attn.bias", ".attn.masked_bias"),
)
# Why a whole import has no place for a key: every weight must land somewhere
WHOLE_UNEXPECTED = (
    "a whole import maps every key (nothing is dropped silently): an unexpected key is a part of the model "
    "this product cannot represent; --attention-only imports the attention blocks alone"
)
MOE_KEYS = (".experts.", "block_sparse_moe", ".router.", "shared_expert")


class Decoder:
    """A whole checkpoint's keys beyond the attention layout's: what they determine, expect and become."""

    def __init__(self, names: DecoderNames, layers: list[SourceLayer]) -> None:
        self.names, self.layers = names, layers
        block = layers[0].block.rstrip(".").split(".")  # model.layers.0 -> the root, model.
        self.root = ".".join(block[:-2]) + "." if len(block) > 2 else ""

    def key(self, where: str, name: str, kind: str = "weight") -> str:
        return f"{where}{name}.{kind}"

    def determined(self, tensors: dict[str, Tensor]) -> dict:
        """vocab_size, the MLP's kind, width and biases, learned positions and a tied head, from the weights."""
        n, first = self.names, self.layers[0].block
        embed, up = tensors.get(self.key(self.root, n.embed)), tensors.get(self.key(first, n.up))
        if embed is None or embed.dim() != 2:
            raise LayoutProblems(
                [
                    f"no token embeddings ({self.key(self.root, n.embed)}): not a whole checkpoint; "
                    "--attention-only imports its attention blocks alone"
                ]
            )
        if up is None or up.dim() != 2:
            raise LayoutProblems([f"no MLP ({self.key(first, n.up)}) in the first layer: not a decoder this imports"])
        width = up.shape[1] if n.conv1d else up.shape[0] // (2 if n.packed_gate_up else 1)
        gated = n.packed_gate_up or (n.gate is not None and self.key(first, n.gate) in tensors)
        determined = {
            "vocab_size": int(embed.shape[0]),
            "mlp": GATED if gated else DENSE,
            "mlp_width": int(width),
            "mlp_bias": self.key(first, n.up, "bias") in tensors,
            "learned_positions": n.positions is not None and self.key(self.root, n.positions) in tensors,
            "tie_embeddings": self.key("", n.head) not in tensors,
        }
        return determined

    def expected(self, tensors: dict[str, Tensor], cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
        """Every key beyond the attention layout's, with its shape."""
        n, d, width = self.names, cfg.d_model, cfg.mlp_width
        kinds = NORM_KINDS if cfg.norm == LAYERNORM else NORM_KINDS[:1]
        keys = {self.key(self.root, n.embed): (cfg.vocab_size, d)}
        if cfg.learned_positions:  # as many rows as the file has, max_seq_len of them used
            rows = tensors[self.key(self.root, n.positions)].shape[0]
            keys[self.key(self.root, n.positions)] = (max(rows, cfg.max_seq_len), d)
        keys |= {self.key(self.root, n.final_norm, kind): (d,) for kind in kinds}
        if not cfg.tie_embeddings:
            keys[self.key("", n.head)] = (cfg.vocab_size, d)
        for layer in self.layers:
            block = layer.block
            keys |= {self.key(block, n.mlp_norm, kind): (d,) for kind in kinds}
            if n.packed_gate_up:
                shapes = {n.up: (2 * width, d), n.down: (d, width)}
            elif n.conv1d:
                shapes = {n.up: (d, width), n.down: (width, d)}
            else:
                shapes = {n.up: (width, d), n.down: (d, width)} | ({n.gate: (width, d)} if cfg.mlp == GATED else {})
            keys |= {self.key(block, name): shape for name, shape in shapes.items()}
            if cfg.mlp_bias:
                out_width = 1 if n.conv1d else 0  # a bias has the width of its projection's outputs
                keys |= {self.key(block, name, "bias"): shape[out_width:][:1] for name, shape in shapes.items()}
        return keys

    def convert(self, tensors: dict[str, Tensor], cfg: ModelConfig) -> dict[str, Tensor]:
        """The tensors under our names (embed.weight, layers.{i}.mlp.W_up.weight, ...)."""
        n = self.names
        kinds = NORM_KINDS if cfg.norm == LAYERNORM else NORM_KINDS[:1]
        ours = {"embed.weight": tensors[self.key(self.root, n.embed)]}
        if cfg.learned_positions:  # a position past max_seq_len is refused at the edges: its rows are unused
            ours["position_embed.weight"] = tensors[self.key(self.root, n.positions)][: cfg.max_seq_len]
        ours |= {f"final_norm.{kind}": tensors[self.key(self.root, n.final_norm, kind)] for kind in kinds}
        if not cfg.tie_embeddings:
            ours["lm_head.weight"] = tensors[self.key("", n.head)]
        for i, layer in enumerate(self.layers):
            mine, block = f"layers.{i}.", layer.block
            ours |= {f"{mine}mlp_norm.{kind}": tensors[self.key(block, n.mlp_norm, kind)] for kind in kinds}
            kinds_here = ("weight", "bias") if cfg.mlp_bias else ("weight",)
            for kind in kinds_here:
                up, down = tensors[self.key(block, n.up, kind)], tensors[self.key(block, n.down, kind)]
                if n.conv1d and kind == "weight":
                    up, down = up.t(), down.t()
                if n.packed_gate_up:  # rows: the gate's, then up's
                    ours[f"{mine}mlp.W_gate.{kind}"], up = up.chunk(2)
                elif cfg.mlp == GATED:
                    ours[f"{mine}mlp.W_gate.{kind}"] = tensors[self.key(block, n.gate, kind)]
                ours |= {f"{mine}mlp.W_up.{kind}": up, f"{mine}mlp.W_down.{kind}": down}
        return {key: tensor.contiguous() for key, tensor in ours.items()}

    def buffer(self, key: str) -> bool:
        """Whether `key` is a buffer older checkpoints saved that the config determines (not a weight)."""
        return key.endswith(self.names.buffers)


def hf_config_json(path: Path) -> tuple[Path, dict]:
    """The Hugging Face config.json beside the weights ({} when there is none)."""
    sidecar = path.parent / MODEL_CONFIG_FILENAME
    data = json.loads(sidecar.read_text()) if sidecar.is_file() else {}
    return sidecar, data if isinstance(data, dict) else {}


def import_whole(path: Path, tensors: Mapping[str, Tensor], given: dict) -> Imported:
    """A whole Hugging Face decoder (Llama, Mistral, Qwen2, Qwen3, Phi-3, GPT-2): embeddings, each block's
    attention and MLP with their norms, the final norm and the LM head, every key mapped or refused, and
    proven against transformers' own *ForCausalLM (`check_whole`)."""
    gpt2 = any(key.endswith(".attn.c_attn.weight") for key in tensors)
    attention = GPT2_ATTENTION if gpt2 else LAYOUTS["hf"]
    try:
        layers = layers_or_the_layout_that_fits(attention, tensors)
        packed_mlp = any(key.endswith(".mlp.gate_up_proj.weight") for key in tensors)
        decoder = Decoder(GPT2_NAMES if gpt2 else PHI3_NAMES if packed_mlp else LLAMA_NAMES, layers)
        sidecar, data = hf_config_json(path)
        refused = [
            f"{key}: a mixture of experts, {hf_config.MOE}" for key in tensors if any(m in key for m in MOE_KEYS)
        ][:3]
        try:
            whole_fields = hf_config.whole_fields(data)
        except hf_config.ConfigRefusal as refusal:
            refused.append(f"{sidecar}: {refusal}")
        if refused:
            raise LayoutProblems(refused)
        determined = decoder.determined(tensors)
        if "mlp_activation" not in {**whole_fields, **given}:
            raise LayoutProblems(
                [f"no hidden_act in a config.json beside the weights ({sidecar}): give mlp_activation in --config"]
            )
        cfg = import_config(path, attention, tensors, layers, {**whole_fields, **given}, determined)
        biased = attention.biased(tensors, layers)
        expected = {k: v for layer in layers for k, v in attention.expected(tensors, cfg, layer, biased).items()}
        expected |= decoder.expected(tensors, cfg)
        weights_only = {key: tensor for key, tensor in tensors.items() if not decoder.buffer(key)}
        problems = key_problems(weights_only, expected, WHOLE_UNEXPECTED)
        if problems:
            raise LayoutProblems(problems)
    except LayoutProblems as error:
        raise WeightsError(path, error.problems) from None
    try:
        text = checked_text_files(path.parent, cfg.vocab_size)  # before transformers builds anything from the folder
    except LayoutProblems as error:
        raise WeightsError(path, error.problems) from None
    model = loaded_model(cfg, attention, tensors, layers, decoder.convert(tensors, cfg))
    weights = {**provenance(path, "hf", tensors, cfg, biased), "whole": True}
    return Imported(model, weights, check_whole(path.parent, model), text)


def text_files(folder: Path) -> tuple[Path, ...]:
    """The checkpoint's text files (files.TEXT_FILES) that `folder` has."""
    return tuple(folder / name for name in TEXT_FILES if (folder / name).is_file())


def checked_text_files(folder: Path, vocab_size: int) -> tuple[Path, ...]:
    """`text_files(folder)`, its tokenizer.json refused (LayoutProblems) past MAX_TOKENIZER_BYTES, when it
    names ids the model's vocabulary does not have, or when it fails on a text a prompt may hold."""
    tokenizer = folder / TOKENIZER_FILENAME
    if tokenizer.is_file():
        size = tokenizer.stat().st_size
        if size > MAX_TOKENIZER_BYTES:
            raise LayoutProblems(
                [f"{tokenizer}: {size >> 20} MiB, more than the {MAX_TOKENIZER_BYTES >> 20} MiB taken"]
            )
        text = tokenizer.read_text()
        try:
            data = json.loads(text)
            ids = tokenizer_ids(data)
        except (ValueError, TypeError, AttributeError) as error:
            raise LayoutProblems([f"{tokenizer}: not a tokenizer ({error})"]) from None
        if ids > vocab_size:
            raise LayoutProblems(
                [f"{tokenizer}: its ids run to {ids - 1}, the model's vocabulary (vocab_size) has {vocab_size}"]
            )
        if failed := _probe_failure(text, data):
            raise LayoutProblems([f"{tokenizer}: {failed}"])
    return text_files(folder)


def _probe_failure(text: str, data: dict) -> str | None:
    """client.text's probes of a tokenizer.json (`text`, parsed: `data`), which the gateway refuses to load
    when they fail; an unreadable one is the gateway's to name."""
    from tokenizers import Tokenizer

    from client.text import tokenizer_probe_failure

    try:
        loaded = Tokenizer.from_str(text)
    except Exception:  # the library raises bare Exceptions for a malformed file
        return None
    return tokenizer_probe_failure(loaded, data)


def tokenizer_ids(data: dict) -> int:
    """The number of ids a tokenizer.json uses (its largest id + 1): its model's vocabulary and added tokens."""
    vocab = data.get("model", {}).get("vocab") or {}
    largest = max(vocab.values(), default=-1) if isinstance(vocab, dict) else len(vocab) - 1  # Unigram: a list
    added = [token["id"] for token in data.get("added_tokens") or []]
    return max([largest, *added]) + 1


def check_whole(folder: Path, model: AttentionModel) -> dict:
    """transformers' own *ForCausalLM from `folder` against the imported model (hf_source.check_causal_lm):
    raises SourceMismatchError unless the logits agree within WHOLE_TOLERANCE of their scale and the
    greedy token is the same at every real position."""
    checked = hf_source.check_causal_lm(folder, model, WHOLE_BATCH, WHOLE_PREFILL, WHOLE_PADDING, SOURCE_STEPS)
    if not checked["checked"]:
        return checked
    expected, actual = checked.pop("expected"), checked.pop("actual")  # logits of the real positions (N, vocab)
    error, scale = float((actual - expected).abs().max()), float(expected.abs().max())
    different = int((actual.argmax(-1) != expected.argmax(-1)).sum())
    passed = error <= WHOLE_TOLERANCE * scale and different == 0
    result = {
        **checked,
        "max_abs": error,
        "scale": scale,
        "relative": error / scale,
        "greedy_different": different,
        "tolerance": f"{WHOLE_TOLERANCE} of the logits' scale (largest |logit|), every greedy token the same",
        "passed": passed,
    }
    if not passed:
        raise SourceMismatchError(f"the imported model differs from {result['module']}: {result}")
    return result


# --- the proof against the user's own module ------------------------------------------------------

NOT_REBUILT = {
    "seeds": "the teaching texts' MultiHeadAttention is teaching code, not a library class to rebuild here; "
    "its W_q, W_k, W_v, W_o Linear modules are this model's one to one",
    "native": "the weights are this product's own: they load unchanged",
}


def check_against_source(
    layout: Layout, tensors: dict[str, Tensor], layers: list[SourceLayer], model: AttentionModel, path: Path
) -> dict:
    """Where the user's module can be rebuilt (torch.nn.MultiheadAttention; a Hugging Face family's
    attention with transformers installed), both over a causal prefill and decode steps; raises
    SourceMismatchError when they differ."""
    cfg = model.cfg
    prefill = min(SOURCE_PREFILL, cfg.max_seq_len)
    total = min(prefill + SOURCE_STEPS, cfg.max_seq_len)
    scenario = (SOURCE_BATCH, prefill, total)
    if layout.name == "hf":
        norms = [f"{layer.block}{layout.norm}.weight" for layer in layers]
        ours = lambda x: prefill_and_decode(model, x, prefill)  # noqa: E731  (the imported model, stepwise)
        checked = hf_source.check(path.parent, tensors, [layer.attention for layer in layers], norms, ours, scenario)
    elif layout.name == "torch-mha":
        checked = check_torch_mha(tensors, layers, model, scenario)
    else:
        return {"checked": False, "reason": NOT_REBUILT[layout.name]}
    if not checked["checked"]:
        return checked
    expected, actual = checked.pop("expected"), checked.pop("actual")
    error = (actual - expected).abs()
    passed = bool((error <= SOURCE_TOLERANCE + SOURCE_TOLERANCE * expected.abs()).all())
    result = {
        **checked,
        "scenario": f"batch {SOURCE_BATCH}: a causal prefill of {prefill} tokens then {total - prefill} decode steps, "
        f"against the module over all {total} tokens with a causal mask",
        "max_abs": float(error.max()),
        "tolerance": f"{SOURCE_TOLERANCE} absolute + {SOURCE_TOLERANCE} relative",
        "passed": passed,
    }
    if not passed:
        raise SourceMismatchError(f"the imported model differs from {result['module']}: {result}")
    return result


def check_torch_mha(
    tensors: dict[str, Tensor], layers: list[SourceLayer], model: AttentionModel, scenario: tuple[int, int, int]
) -> dict:
    cfg = model.cfg
    batch, prefill, total = scenario
    modules = [rebuild_torch_mha(tensors, layer, cfg) for layer in layers]
    x = torch.randn(batch, total, cfg.d_model, generator=torch.Generator().manual_seed(0))  # (B, T, d)
    with torch.no_grad():
        expected = torch_mha_forward(modules, x, cfg.residual)
        actual = prefill_and_decode(model, x, prefill)
    module = (
        f"torch.nn.MultiheadAttention(embed_dim={cfg.d_model}, num_heads={cfg.n_heads}, bias={cfg.bias}, "
        f"batch_first=True) x {len(modules)}" + (", each with a residual" if cfg.residual else "")
    )
    return {"checked": True, "module": module, "expected": expected, "actual": actual}


def rebuild_torch_mha(tensors: dict[str, Tensor], layer: SourceLayer, cfg: ModelConfig) -> nn.MultiheadAttention:
    """The user's module from the user's keys (batch_first only changes the input layout, not the weights)."""
    module = nn.MultiheadAttention(cfg.d_model, cfg.n_heads, bias=cfg.bias, batch_first=True)
    state = {
        key.removeprefix(layer.attention): tensor for key, tensor in tensors.items() if key.startswith(layer.attention)
    }
    if not packed(tensors, layer):  # how the module itself packs separate q, k, v weights of one width
        state["in_proj_weight"] = torch.cat([state.pop(f"{x}_proj_weight") for x in "qkv"])
    module.load_state_dict(state, strict=True)
    return module.eval()


def torch_mha_forward(modules: list[nn.MultiheadAttention], x: Tensor, residual: bool) -> Tensor:
    """The modules in sequence over the whole of `x` at once, each query seeing itself and the past."""
    T = x.shape[1]
    future = torch.ones(T, T, dtype=torch.bool).triu(1)  # (T, T): True = may not attend (torch's convention)
    for module in modules:
        attended = module(x, x, x, attn_mask=future, need_weights=False)[0]  # (B, T, d)
        x = x + attended if residual else attended
    return x


def prefill_and_decode(model: AttentionModel, x: Tensor, prefill: int) -> Tensor:
    """Our model over `x`: one prefill of `prefill` tokens, then one token per step with the KV cache."""
    step = model(x[:, :prefill])
    outputs, past = [step.output], step.present
    for t in range(prefill, x.shape[1]):
        step = model(x[:, t : t + 1], past=past)
        outputs.append(step.output)
        past = step.present
    return torch.cat(outputs, dim=1)  # (B, T, d)
