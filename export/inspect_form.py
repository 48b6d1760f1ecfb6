"""The inspection form: the fused graph (`export/fusion.py`, one `Attention` node per layer with its
past and present) whose every layer also returns its attention weights, so that the maps a user
looks at are those of the graph that serves, not of a second copy of the model.

ONNX's `Attention` (opset 23) has an optional fourth output, `qk_matmul_output`, which with
`qk_matmul_output_mode=3` holds the softmax probabilities (B, n_heads, T, P+T), the same for the 3D
form (`FuseAttention`) and the 4D one of rotary and QK-norm models (`FuseAttention4D`): the output is
per query head whatever the input layout, GQA included. Measured on ONNX Runtime 1.31's CPU kernel
(tests/export/test_inspect.py):

- a key the boolean mask excludes (the future, padding, outside a sliding window) weighs exactly 0,
  as in the PyTorch original (its fill exp(min - max) is 0 too);
- a query with no key it may attend (a padded query) gets a row of zeros, where the original gets a
  uniform row: the contract leaves such rows unspecified, so neither the parity nor the statistics
  (`contract/heads.py`) read them;
- in an fp16 graph the output is fp16 like the graph's (the op's T1), its softmax computed in fp32
  (`softmax_precision`, export/fp16.py); where attention runs in fp32 between Casts (a model without
  a norm, `attention_needs_fp32`), the map is cast back to fp16 like the context.

Made on demand from an artifact (`python -m export inspect`), and built as the variant
`fp32-fused-inspect` (export/build.py), which `forward` and `sessions` run only for a request that asks
for the maps: serving pays nothing otherwise. The maps are graph outputs named `attention.{layer}`
(`contract.names.attention_map_name`).
"""

from __future__ import annotations

import dataclasses
import math
import unicodedata
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import onnx
import onnx_ir as ir
import torch
from onnx_ir.passes import common as common_passes

from contract import files, names
from contract.config import ModelConfig
from contract.heads import head_statistics
from contract.names import attention_map_name
from export import hf_config
from export.choices import FP16_FUSED, FP32_FUSED, INSPECTED_VARIANTS
from export.model import AttentionModel, attention_allowed
from export.onnx_export import IR_VERSION, check_onnx, config_from_onnx, plain_graph, save_onnx
from export.progress import Progress
from serving.engine.ort import CPU_PROVIDER, Arrays, ort_runner, session_options

if TYPE_CHECKING:  # matplotlib is a dev dependency, imported where the maps are drawn
    import matplotlib.figure

# `Attention`'s qk_matmul_output_mode: 0 the raw scores, 1 masked, 2 soft-capped, 3 the softmax's output
SOFTMAX_PROBABILITIES = 3
PROBABILITIES_OUTPUT = 3  # Attention's outputs: Y, present_key, present_value, qk_matmul_output


class InspectionError(ValueError):
    """A graph or an artifact the inspection form cannot be made from (the reason says why)."""


def _attention_nodes(graph: ir.Graph) -> list[ir.Node]:
    return [node for node in graph if node.op_type == "Attention" and node.domain in ("", "ai.onnx")]


def with_attention_maps(fused: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of a fused graph (fp32 or fp16) whose layers also return their weights, `attention.{i}`
    (B, n_heads, T, P+T), in the graph's float type."""
    cfg = config_from_onnx(fused)
    model = ir.from_proto(fused)
    common_passes.ShapeInferencePass()(model)  # the queries' type, also behind export/fp16.py's Casts
    graph = model.graph
    # in graph order the Attention nodes are the layers in order: each layer reads the one before it
    attention = _attention_nodes(graph)
    if len(attention) != cfg.n_layers:
        raise InspectionError(
            f"the graph has {len(attention)} Attention nodes for {cfg.n_layers} layers: not a fused graph"
        )
    # the graph's float: its first output's (`output`, or a whole model's `logits`; its first input may be ids)
    floats = graph.outputs[0]
    for layer, node in enumerate(attention):
        node.attributes["qk_matmul_output_mode"] = ir.AttrInt64("qk_matmul_output_mode", SOFTMAX_PROBABILITIES)
        node.resize_outputs(PROBABILITIES_OUTPUT + 1)
        weights = node.outputs[PROBABILITIES_OUTPUT]
        weights.type = node.inputs[0].type  # the op's T1: the query's type
        if weights.type is None:
            raise InspectionError(f"{node.name}: the type of its queries is unknown")
        if weights.type != floats.type:  # attention computed in fp32 inside an fp16 graph: back to its type
            weights.name = f"{node.name}_out{PROBABILITIES_OUTPUT}_fp32"  # as export/fp16.py names the others
            cast = ir.node("Cast", [weights], {"to": floats.type.dtype})
            graph.insert_after(node, cast)
            weights = cast.outputs[0]
            weights.type = floats.type
        weights.name = attention_map_name(layer)
        weights.shape = ir.Shape([names.BATCH, cfg.n_heads, names.SEQUENCE, names.TOTAL_SEQUENCE])
        graph.outputs.append(weights)
    proto = ir.to_proto(model)
    proto.ir_version = IR_VERSION
    check_onnx(proto)
    return proto


def inspection_proto(model: AttentionModel, variant: str = FP32_FUSED) -> onnx.ModelProto:
    """The inspection form of `model`'s `variant` (fp32-fused or fp16-fused), made as the build makes
    that variant's fused graph, its norms left plain (fp32-fused folds its residual Adds into them: the same
    math, rounded in another order)."""
    from export.fp16 import to_fp16
    from export.fusion import fused_proto

    _check_variant(variant)
    fused, _ = fused_proto(plain_graph(model))
    return with_attention_maps(to_fp16(fused, model.cfg) if variant == FP16_FUSED else fused)


def make_inspection_graph(model: AttentionModel, path: Path, variant: str = FP32_FUSED) -> Path:
    return save_onnx(inspection_proto(model, variant), path)


def artifact_inspection_proto(directory: Path, variant: str = FP32_FUSED) -> tuple[onnx.ModelProto, str]:
    """(the inspection form of an artifact's `variant`, where it came from). From the artifact's own
    `model.<variant>.onnx` where it has one (the graph that serves, byte for byte), else made from its
    config and weights as the build would make it."""
    from export.artifacts import load_model

    _check_variant(variant)
    built = Path(directory) / files.model_filename(variant)
    if built.is_file():
        return with_attention_maps(onnx.load_model(str(built))), str(built)
    return inspection_proto(load_model(directory), variant), f"{directory}: made from its config and weights"


def _check_variant(variant: str) -> None:
    if variant not in INSPECTED_VARIANTS:
        raise InspectionError(f"variant {variant!r} has no inspection form; choose one of {list(INSPECTED_VARIANTS)}")


def inspection_graph_runner(proto: onnx.ModelProto):
    """The inspection graph on ONNX Runtime's CPU provider, with the settings every session here has;
    a left-out mask, past or positions filled as the original reads them (`ort_runner`)."""
    import onnxruntime as ort

    session = ort.InferenceSession(proto.SerializeToString(), session_options(), providers=[CPU_PROVIDER])
    return ort_runner(session)


def attention_maps(outputs: Mapping[str, np.ndarray], n_layers: int) -> list[np.ndarray]:
    """Each layer's weights (B, n_heads, T, P+T) from an inspection graph's outputs."""
    return [outputs[name] for name in names.attention_map_names(n_layers)]


def run_maps(proto: onnx.ModelProto, cfg: ModelConfig, inputs: Mapping[str, np.ndarray]) -> tuple[Arrays, list]:
    """(every output, the maps per layer) of one call of an inspection graph."""
    outputs = inspection_graph_runner(proto)(inputs)
    return outputs, attention_maps(outputs, cfg.n_layers)


# What `python -m export inspect` does, behind its thin CLI (export/__main__.py).


@dataclasses.dataclass(frozen=True)
class Inspection:
    """One call's maps of an artifact's variant, what they came from and what they say."""

    variant: str
    source: str  # the graph's file, or how it was made
    hidden_states: np.ndarray  # (1, T, d_model), fp32; a whole model's token ids (1, T) int64
    maps: list[np.ndarray]  # per layer (1, n_heads, T, T), the variant's float type
    statistics: list[dict]  # contract/heads.py
    difference: list[np.ndarray] | None = None  # per layer, the variant's maps minus fp32-fused's (fp32)

    def largest_difference(self) -> tuple[float, tuple[int, ...]]:
        """(the largest |difference|, where: layer, head, query, key)."""
        layer = int(np.argmax([np.abs(d).max() for d in self.difference]))
        where = np.unravel_index(np.argmax(np.abs(self.difference[layer])), self.difference[layer].shape)
        return float(np.abs(self.difference[layer][where])), (layer, *(int(i) for i in where[1:]))


def artifact_config(directory: Path) -> ModelConfig:
    """The config of the artifact at `directory` (InspectionError when there is none)."""
    config = Path(directory) / files.MODEL_CONFIG_FILENAME
    checkpoint = hf_config.checkpoint_instead(Path(directory), "an artifact")
    if checkpoint:
        raise InspectionError(checkpoint)
    if not config.is_file():
        raise InspectionError(
            f"{directory}: no artifact there (no {files.MODEL_CONFIG_FILENAME}); "
            f"build one with `python -m export build --out {directory}`"
        )
    return ModelConfig.load(directory)


def hidden_states_from_file(path: Path, cfg: ModelConfig) -> np.ndarray:
    """A user's hidden states (1, T, d_model) or (T, d_model), float, as (1, T, d_model) fp32."""
    expected = f"expected a float array of shape (1, T, {cfg.d_model}) or (T, {cfg.d_model})"
    try:
        array = np.load(path, allow_pickle=False)
    except (OSError, ValueError) as error:  # missing, unreadable, not a .npy, a pickled object
        raise InspectionError(f"{path}: cannot read it as a .npy array ({error}); {expected}") from None
    if not isinstance(array, np.ndarray):  # an .npz archive
        raise InspectionError(f"{path}: an archive of several arrays; {expected}")
    batch_of_one = array.ndim == 3 and array.shape[0] == 1
    if array.dtype.kind != "f" or not (array.ndim == 2 or batch_of_one) or array.shape[-1] != cfg.d_model:
        raise InspectionError(f"{path}: {expected}, got {array.dtype} of shape {tuple(array.shape)}")
    hidden = array.reshape(1, -1, cfg.d_model).astype(np.float32)
    _check_tokens(cfg, hidden.shape[1], str(path))
    if not np.isfinite(hidden).all():
        raise InspectionError(f"{path}: {expected} with finite values, got NaN or infinity")
    return hidden


@dataclasses.dataclass(frozen=True)
class TextTokens:
    """A text as a whole model reads it: its ids (1, T) int64 and each token's label, for the axes."""

    ids: np.ndarray
    labels: list[str]


def text_tokens(directory: Path, cfg: ModelConfig, text: str) -> TextTokens:
    """`text` encoded by the artifact's tokenizer (the checkpoint's text files the build copied into it),
    with the special tokens the tokenizer adds, as transformers' `tokenizer(text)`; InspectionError for an
    attention model, an artifact without a tokenizer (naming the missing file) or a text of no tokens."""
    from client.text import TextError, TextModel, TextUnavailable

    if not cfg.whole:
        raise InspectionError(
            f"--text: {directory} is an attention model (hidden states in): only a whole model reads text; "
            "give --tokens or --input"
        )
    try:
        model = TextModel.from_folder(directory)
    except TextUnavailable as error:
        raise InspectionError(
            f"--text: {directory} has no {error.filename}: the model was built without a tokenizer (build from "
            "a checkpoint folder that has one: docs/importing.md); give --tokens instead"
        ) from None
    except TextError as error:
        raise InspectionError(f"--text: {directory}: {error}") from None
    ids = model.encode(text)
    if not ids:
        raise InspectionError(f"--text: {text!r} encodes to no tokens")
    _check_tokens(cfg, len(ids), "--text")
    return TextTokens(np.array([ids], np.int64), [token_label(model.token_text(token)) for token in ids])


BYTES_PREFIX = "bytes:"  # client/text.py token_text's mark of a token that is no whole UTF-8 text (OpenAI's)
VISIBLE_SPACE = "\u2423"  # an open box: a space on an axis, where a blank would be invisible
ESCAPED = {"\n": "\\n", "\t": "\\t", "\r": "\\r"}


def token_label(token_text: str) -> str:
    """A token's text (`TextModel.token_text`) as an axis shows it, with no blank in it: a space as an open
    box, other spacing and control characters as escapes (\\n, \\u00a0), and bytes that are no whole
    character as their escapes (\\xe4\\xbd) without token_text's "bytes:". The /inspect page's
    `tokenLabel` (serving/gateway/static/inspect.js) follows the same rule."""
    if token_text.startswith(BYTES_PREFIX):
        return token_text[len(BYTES_PREFIX) :]
    return "".join(_visible(char) for char in token_text)


def _visible(char: str) -> str:
    if char == " ":
        return VISIBLE_SPACE
    if char in ESCAPED:
        return ESCAPED[char]
    if unicodedata.category(char)[0] in "ZC":  # separators (no-break space...) and controls, format characters
        return escaped(char)
    return char


def escaped(char: str) -> str:
    """A character as Python writes its escape: \\u00a0, or \\U0001f642 beyond the 16-bit ones."""
    return f"\\u{ord(char):04x}" if ord(char) <= 0xFFFF else f"\\U{ord(char):08x}"


def random_hidden_states(cfg: ModelConfig, tokens: int, seed: int) -> np.ndarray:
    """Standard normal hidden states (1, tokens, d_model) fp32, the same for the same seed; for a whole
    model token ids (1, tokens) int64 uniform over its vocabulary."""
    _check_tokens(cfg, tokens, "--tokens")
    if cfg.whole:
        return np.random.default_rng(seed).integers(0, cfg.vocab_size, (1, tokens), dtype=np.int64)
    return np.random.default_rng(seed).standard_normal((1, tokens, cfg.d_model)).astype(np.float32)


def repeated_random_ids(cfg: ModelConfig, count: int, seed: int) -> np.ndarray:
    """A whole model's token ids (1, 2 * count) int64: `count` ids uniform over its vocabulary but id 0 (often
    a special token: BOS, padding), then the same `count` again, the same for the same seed. The second
    copy is where an induction head shows (contract/heads.py `induction_share`); InspectionError for an
    attention model or a sequence longer than the model's."""
    if not cfg.whole:
        raise InspectionError("--repeat: an attention model (hidden states in) reads no token ids; give --tokens")
    if count < 1:
        raise InspectionError(f"--repeat: at least 1 token, got {count}")
    _check_tokens(cfg, 2 * count, f"--repeat {count} (twice {count})")
    first = np.random.default_rng(seed).integers(1, cfg.vocab_size, (1, count), dtype=np.int64)
    return np.concatenate([first, first], axis=1)


def _check_tokens(cfg: ModelConfig, tokens: int, what: str) -> None:
    if tokens < 1:
        raise InspectionError(f"{what}: at least 1 token, got {tokens}")
    if tokens > cfg.max_seq_len:
        raise InspectionError(f"{what}: {tokens} tokens, more than the model's max_seq_len {cfg.max_seq_len}")


def inspect_artifact(
    directory: Path,
    hidden: np.ndarray,
    variant: str = FP32_FUSED,
    diff: bool = False,
    progress: Progress | None = None,
) -> Inspection:
    """One stateless call (no past, no padding) of `variant`'s inspection form on `hidden` (1, T, d) (a
    whole model's ids (1, T)), its maps and head statistics (with a whole model's ids, the induction share
    too); with `diff`, also fp32-fused's maps, subtracted."""
    progress = progress or Progress(enabled=False)
    if diff and variant == FP32_FUSED:
        raise InspectionError(f"--diff compares a variant with {FP32_FUSED}: choose --variant {FP16_FUSED}")
    maps, source = _artifact_maps(directory, variant, hidden, progress)
    mask = np.ones(hidden.shape[:2], np.int64)  # (1, T): one sequence, nothing padded
    difference = None
    if diff:
        reference, _ = _artifact_maps(directory, FP32_FUSED, hidden, progress)
        difference = [m.astype(np.float32) - r for m, r in zip(maps, reference, strict=True)]
    token_ids = hidden if artifact_config(directory).whole else None
    return Inspection(variant, source, hidden, maps, head_statistics(maps, mask, token_ids), difference)


def _artifact_maps(directory: Path, variant: str, hidden: np.ndarray, progress) -> tuple[list[np.ndarray], str]:
    cfg = artifact_config(directory)
    with progress.stage(f"{variant}: inspection graph"):
        proto, source = artifact_inspection_proto(directory, variant)
    with progress.stage(f"{variant}: attention maps of {hidden.shape[1]} tokens"):
        dtype = np.float16 if variant == FP16_FUSED else np.float32
        new_tokens = hidden if cfg.whole else hidden.astype(dtype)  # a whole model's ids stay int64
        _, maps = run_maps(proto, cfg, {names.model_input(cfg): new_tokens})
    return maps, source


def allowed_keys(cfg: ModelConfig, tokens: int) -> list[np.ndarray]:
    """Per layer (T, T): which keys each query of one unpadded call without a past may see, by the
    model's own rule (`attention_allowed`: causal, the layer's window)."""
    mask = torch.ones(1, tokens, dtype=torch.int64)
    return [attention_allowed(mask, 0, tokens, cfg.window(layer))[0, 0].numpy() for layer in range(cfg.n_layers)]


PANEL_INCHES = 1.8  # a head's map; with token labels it grows with the tokens, up to LABELLED_PANEL_INCHES
LABELLED_PANEL_INCHES = 6.0
LABEL_POINTS = (4.0, 7.0)  # the token labels' smallest and largest font size: fewer labels below the smallest


def draw_maps(
    inspection: Inspection, cfg: ModelConfig, out: Path, title: str, labels: Sequence[str] | None = None
) -> Path:
    """A PNG of the maps at `out` (`maps_figure`)."""
    maps_figure(inspection, cfg, title, labels).savefig(out, dpi=110)
    return out


def maps_figure(
    inspection: Inspection, cfg: ModelConfig, title: str, labels: Sequence[str] | None = None
) -> matplotlib.figure.Figure:
    """The maps as a matplotlib Figure: a grid of layers x heads on one color scale, query positions down
    and key positions across (or the tokens' `labels`, one per position), the keys a query may not see in
    gray; with a difference, that instead, on a diverging scale centered at 0. matplotlib's object API: no
    pyplot state, no display needed."""
    try:
        from matplotlib import colors
        from matplotlib.figure import Figure
    except ImportError as error:  # a dev dependency (pyproject.toml), not the export's
        raise InspectionError(f"drawing the maps needs matplotlib ({error}): pip install matplotlib") from None

    tokens = inspection.hidden_states.shape[1]
    if labels is not None and len(labels) != tokens:
        raise InspectionError(f"{len(labels)} token labels for {tokens} tokens")
    shown = inspection.difference or [m.astype(np.float32) for m in inspection.maps]
    allowed = allowed_keys(cfg, tokens)
    if inspection.difference is None:
        # one scale for every panel; its square root, so that the weights spread over many keys do not
        # all look alike beside the 1.0 of the first query (which can see only itself)
        norm, cmap = colors.PowerNorm(0.5, 0.0, max(float(m.max()) for m in shown)), "viridis"
        label = "attention weight (sqrt scale)"
    else:
        largest = max(inspection.largest_difference()[0], np.finfo(np.float32).tiny)
        norm, cmap = colors.TwoSlopeNorm(0.0, -largest, largest), "RdBu_r"
        label = f"{inspection.variant} - {FP32_FUSED}"
    palette = _palette(cmap)
    rows, columns = cfg.n_layers, cfg.n_heads
    inches = PANEL_INCHES if labels is None else min(max(PANEL_INCHES, 0.12 * tokens), LABELLED_PANEL_INCHES)
    figure = Figure(figsize=(inches * columns + 1.2, inches * rows + 1.1), layout="constrained")
    axes = figure.subplots(rows, columns, squeeze=False, sharex=True, sharey=True)
    axis = "position" if labels is None else "token"
    for layer, weights in enumerate(shown):
        for head in range(columns):
            panel = axes[layer, head]
            image = panel.imshow(
                np.ma.masked_where(~allowed[layer], weights[0, head]), cmap=palette, norm=norm, interpolation="nearest"
            )
            panel.set_title(f"layer {layer}, head {head}", fontsize=9)
            panel.tick_params(labelsize=7)
            if head == 0:
                panel.set_ylabel(f"query {axis}", fontsize=8)
            if layer == rows - 1:
                panel.set_xlabel(f"key {axis}", fontsize=8)
    if labels is not None:
        _label_tokens(axes, labels, inches)
    bar = figure.colorbar(image, ax=axes, shrink=0.9, pad=0.01)
    bar.set_label(label, fontsize=8)
    bar.ax.tick_params(labelsize=7)
    figure.suptitle(title, fontsize=10)
    return figure


def _label_tokens(axes: np.ndarray, labels: Sequence[str], panel_inches: float) -> None:
    """The tokens as both axes' tick labels: as large as a position's share of the panel allows, every
    `step`-th token where even the smallest size does not fit them all; characters the font cannot draw
    (CJK, emoji in matplotlib's own DejaVu Sans) as escapes rather than empty boxes."""
    points_per_token = panel_inches * 72 / len(labels)
    size = min(max(points_per_token * 0.85, LABEL_POINTS[0]), LABEL_POINTS[1])
    step = max(1, math.ceil(size / points_per_token))
    positions = list(range(0, len(labels), step))
    drawable = _drawable_labels([labels[p] for p in positions])
    axes[0, 0].set_xticks(positions, drawable)  # the panels share their axes: every one takes these ticks
    axes[0, 0].set_yticks(positions, drawable)
    for panel in axes.flat:  # but each draws its own tick labels
        panel.tick_params(axis="x", labelrotation=90, labelsize=size)
        panel.tick_params(axis="y", labelsize=size)


def _drawable_labels(labels: Sequence[str]) -> list[str]:
    from matplotlib import font_manager

    font = font_manager.get_font(font_manager.findfont(font_manager.FontProperties()))
    drawn = font.get_charmap()
    return ["".join(c if ord(c) in drawn else escaped(c) for c in label) for label in labels]


def _palette(name: str):
    """A copy of a matplotlib color map whose masked cells (keys a query may not see) are light gray."""
    from matplotlib import colormaps

    return colormaps[name].with_extremes(bad="#dddddd")
