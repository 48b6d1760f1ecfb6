"""Export the PyTorch original to ONNX: the `fp32` variant, every op decomposed.

See docs/design.md, "Artifacts and variants".

Names and dynamic axes come from the naming table; the config rides along in `metadata_props`.
"""

from __future__ import annotations

import hashlib
import logging
import warnings
from pathlib import Path

import onnx
import torch
from torch import Tensor, nn

from contract import names
from contract.config import ModelConfig
from export.model import AttentionModel, KVCache

# Opset 18 keeps the plain graph loadable by every runtime we target (TensorRT 10's parser,
# ONNX Runtime 1.16+); the fused variants raise it where their attention op needs it.
PLAIN_OPSET = 18
# ONNX Runtime 1.31 refuses onnx 1.23's default IR version; 10 loads everywhere we run.
IR_VERSION = 10
CONFIG_METADATA_KEY = "model_config"

# Tracing sizes: all above 1 so the exporter does not specialize an axis to 0 or 1.
_TRACE_BATCH, _TRACE_NEW, _TRACE_PAST = 2, 3, 5


class GraphSignature(nn.Module):
    """The model with the graph's flat signature: past and present as one tensor per name."""

    def __init__(self, model: AttentionModel) -> None:
        super().__init__()
        self.model = model

    def forward(self, new_tokens: Tensor, attention_mask: Tensor, past: list[tuple[Tensor, Tensor]]):
        result = self.model(new_tokens, attention_mask, [KVCache(k, v) for k, v in past])
        return (result.output, *(tensor for cache in result.present for tensor in cache))


class PositionedGraphSignature(GraphSignature):
    """The same with the new tokens' positions (a model with rotary embeddings or learned positions)."""

    def forward(self, new_tokens, attention_mask, position_ids, past):  # type: ignore[override]
        result = self.model(new_tokens, attention_mask, [KVCache(k, v) for k, v in past], position_ids=position_ids)
        return (result.output, *(tensor for cache in result.present for tensor in cache))


def trace_inputs(cfg: ModelConfig) -> tuple:
    """(new tokens, attention_mask, [position_ids,] past): example inputs of the graph's signature, the
    new tokens' hidden states or, for a whole model, their ids."""
    generator = torch.Generator().manual_seed(0)
    B, T, P = _TRACE_BATCH, _TRACE_NEW, _TRACE_PAST
    if cfg.whole:
        new_tokens = torch.randint(cfg.vocab_size, (B, T), generator=generator)  # (B, T)
    else:
        new_tokens = torch.randn(B, T, cfg.d_model, generator=generator)  # (B, T, d_model)
    attention_mask = torch.ones(B, P + T, dtype=torch.int64)  # (B, P+T)
    cache_shape = (B, cfg.n_kv_heads, P, cfg.head_dim)
    past = [
        (torch.randn(cache_shape, generator=generator), torch.randn(cache_shape, generator=generator))
        for _ in range(cfg.n_layers)
    ]
    if cfg.positioned:
        position_ids = (torch.arange(T) + P).expand(B, T).contiguous()  # (B, T)
        return new_tokens, attention_mask, position_ids, past
    return new_tokens, attention_mask, past


def dynamic_shapes(cfg: ModelConfig) -> dict:
    """torch.export dims for every dynamic axis, one Dim per axis name of the naming table."""
    Dim = torch.export.Dim
    dims = {
        names.BATCH: Dim(names.BATCH),
        names.SEQUENCE: Dim(names.SEQUENCE, max=cfg.max_seq_len),
        names.PAST_SEQUENCE: Dim(names.PAST_SEQUENCE, min=0, max=cfg.max_seq_len),
        names.TOTAL_SEQUENCE: Dim("total_sequence_length", max=2 * cfg.max_seq_len),
    }
    specs = {
        spec.name: {axis: dims[name] for axis, name in spec.dynamic_axes.items()} for spec in names.input_specs(cfg)
    }
    past = [(specs[names.past_name(i, names.KEY)], specs[names.past_name(i, names.VALUE)]) for i in range(cfg.n_layers)]
    shapes = {"new_tokens": specs[names.model_input(cfg)], "attention_mask": specs[names.ATTENTION_MASK]}
    if cfg.positioned:
        shapes["position_ids"] = specs[names.POSITION_IDS]
    return shapes | {"past": past}


def name_axes(model_proto: onnx.ModelProto, cfg: ModelConfig, specs: list[names.TensorSpec] | None = None) -> None:
    """Give every graph input and output the axis names of the naming table (the stateless specs
    unless `specs` are given)."""
    specs = {spec.name: spec for spec in specs or [*names.input_specs(cfg), *names.output_specs(cfg)]}
    for value in [*model_proto.graph.input, *model_proto.graph.output]:
        dims = value.type.tensor_type.shape.dim
        spec = specs[value.name]
        assert len(dims) == len(spec.shape), f"{value.name}: rank {len(dims)} != {len(spec.shape)}"
        for dim, axis in zip(dims, spec.shape, strict=True):
            if isinstance(axis, str):
                dim.dim_param = axis
            else:
                assert dim.dim_value == axis, f"{value.name}: fixed axis {dim.dim_value} != {axis}"


def attach_config(model_proto: onnx.ModelProto, cfg: ModelConfig) -> None:
    del model_proto.metadata_props[:]
    onnx.helper.set_model_props(model_proto, {CONFIG_METADATA_KEY: cfg.to_json()})


def config_from_onnx(model_proto: onnx.ModelProto) -> ModelConfig:
    props = {prop.key: prop.value for prop in model_proto.metadata_props}
    if CONFIG_METADATA_KEY not in props:
        raise ValueError(f"the ONNX model carries no '{CONFIG_METADATA_KEY}' metadata")
    return ModelConfig.from_json(props[CONFIG_METADATA_KEY])


def check_onnx(model_proto: onnx.ModelProto) -> None:
    """onnx.checker with full (strict) shape inference."""
    onnx.checker.check_model(model_proto, full_check=True)


def save_onnx(model_proto: onnx.ModelProto, path: Path) -> Path:
    check_onnx(model_proto)
    onnx.save_model(model_proto, str(path))
    return path


def export_onnx(model: AttentionModel, path: str | Path) -> Path:
    """Write the plain fp32 graph of `model` to `path` and return it."""
    return save_onnx(plain_graph(model), Path(path))


# The models exported last, by a fingerprint of their config and weights, most recent last: the
# fused variants start from the plain graph, and one build should pay for the exporter (seconds) once,
# not per variant; a process that builds the same model again (a rebuild, the tests) pays nothing.
# Bounded by count and by bytes: the serialized graphs hold the weights.
_recent_exports: dict[bytes, bytes] = {}
EXPORT_CACHE_ENTRIES, EXPORT_CACHE_BYTES = 16, 256 << 20


def plain_graph(model: AttentionModel) -> onnx.ModelProto:
    """The plain graph of `model` (every op decomposed, opset 18), exported once per config and weights."""
    key = _fingerprint(model)
    serialized = _recent_exports.pop(key, None)
    if serialized is None:
        serialized = _export(model).SerializeToString()
    _recent_exports[key] = serialized  # the most recent last
    while len(_recent_exports) > 1 and (
        len(_recent_exports) > EXPORT_CACHE_ENTRIES or sum(map(len, _recent_exports.values())) > EXPORT_CACHE_BYTES
    ):
        del _recent_exports[next(iter(_recent_exports))]  # the least recently used
    return onnx.load_from_string(serialized)


def _fingerprint(model: AttentionModel) -> bytes:
    digest = hashlib.blake2b(model.cfg.to_json().encode(), digest_size=16)
    for name, tensor in model.state_dict().items():
        digest.update(name.encode())
        digest.update(tensor.detach().contiguous().numpy().tobytes())
    return digest.digest()


def _export(model: AttentionModel) -> onnx.ModelProto:
    cfg = model.cfg
    graph = (PositionedGraphSignature if cfg.positioned else GraphSignature)(model.eval())
    with warnings.catch_warnings(), _quiet_exporter():
        warnings.simplefilter("ignore")
        program = torch.onnx.export(
            graph,
            trace_inputs(cfg),
            dynamo=True,
            opset_version=PLAIN_OPSET,
            input_names=names.input_names(cfg),
            output_names=names.output_names(cfg),
            dynamic_shapes=dynamic_shapes(cfg),
            external_data=False,
            verbose=False,
        )
    model_proto = program.model_proto
    model_proto.ir_version = IR_VERSION
    model_proto.producer_name = "export"
    name_axes(model_proto, cfg)
    attach_config(model_proto, cfg)
    return model_proto


class _quiet_exporter:
    """The exporter logs every stage and warns about optional packages; our CLI shows its own
    progress."""

    _loggers = ("torch.onnx", "torch.export", "torch._export", "onnxscript", "torch.fx.experimental.symbolic_shapes")

    def __enter__(self) -> None:
        self._levels = {name: logging.getLogger(name).level for name in self._loggers}
        for name in self._loggers:
            logging.getLogger(name).setLevel(logging.ERROR)

    def __exit__(self, *exc: object) -> None:
        for name, level in self._levels.items():
            logging.getLogger(name).setLevel(level)
