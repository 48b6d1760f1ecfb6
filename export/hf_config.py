"""A Hugging Face `config.json` read into this model's config fields: Llama, Mistral, Qwen2, Qwen3 and
Phi-3 attention (and any decoder whose attention is theirs), with a reason for each thing this model
cannot represent.

Both spellings of the rotary settings are read: transformers 5's `rope_parameters` ({rope_theta,
rope_type, factor, ...}) and the older top-level `rope_theta` with `rope_scaling` ({type or
rope_type, factor, ...}). Windows: Mistral's `sliding_window` (every layer), Qwen2/Qwen3's
`use_sliding_window` with `max_window_layers`, and transformers 5's `layer_types` list, mapped onto
`sliding_window` with `sliding_window_pattern` where they fit it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# the families whose attention is proven against transformers' own classes (tests/export/test_hf_families.py);
# another model_type with the same keys imports too, and its proof runs where transformers has its classes
FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gpt2")
SCALINGS = {"default": "none", "linear": "linear", "llama3": "llama3"}
FULL, SLIDING = "full_attention", "sliding_attention"


MAX_POSITIONS = 1 << 21  # 2M: above the longest context shipped (Qwen2.5-1M's 1,010,000)
# ours -> config.json's names, for a refusal that names the field the user wrote
NAMES_IN_CONFIG = {
    "n_layers": "num_hidden_layers",
    "d_model": "hidden_size",
    "n_heads": "num_attention_heads",
    "n_kv_heads": "num_key_value_heads",
    "max_seq_len": "max_position_embeddings",
    "mlp_width": "intermediate_size",
}


class ConfigRefusal(ValueError):
    """The config asks for something this model cannot represent; the message says what and why."""


def fields_from(data: dict[str, Any]) -> dict[str, Any]:
    """This model's config fields a Hugging Face config determines (the weights determine the rest)."""
    fields: dict[str, Any] = {}
    for theirs, ours in (
        ("num_attention_heads", "n_heads"),
        ("n_head", "n_heads"),  # GPT-2's names
        ("num_key_value_heads", "n_kv_heads"),
        ("max_position_embeddings", "max_seq_len"),
        ("n_positions", "max_seq_len"),
        ("head_dim", "head_dim"),
    ):
        if data.get(theirs) is not None:
            fields[ours] = data[theirs]
    positions = fields.get("max_seq_len")
    if isinstance(positions, int) and positions > MAX_POSITIONS:
        raise ConfigRefusal(
            f"max_position_embeddings {positions}: more than {MAX_POSITIONS} positions, the most a model here is "
            "built for (its rotary tables and KV budget are sized by it before any weight is read)"
        )
    eps = next((data[name] for name in ("rms_norm_eps", "layer_norm_eps", "layer_norm_epsilon") if name in data), None)
    if eps is not None:
        fields["norm_eps"] = eps
    return fields | rotary_fields(data) | window_fields(data)


# The MLP's activation as transformers names it (`hidden_act`, GPT-2's `activation_function`) -> ours
ACTIVATIONS = {
    "silu": "silu",
    "swish": "silu",
    "gelu": "gelu",
    "gelu_new": "gelu_tanh",
    "gelu_pytorch_tanh": "gelu_tanh",
}
MOE = "a mixture of experts routes each token to some MLPs: this model has one MLP per block"
# Config settings a whole import cannot represent, each with the reason (checked where the key is set and
# not the value that means "off"): (key, its harmless values, why)
UNREPRESENTED = (
    (
        "num_local_experts",
        (None, 0, 1),
        MOE,
    ),
    (
        "num_experts",
        (None, 0, 1),
        MOE,
    ),
    (
        "n_routed_experts",
        (None, 0),
        MOE,
    ),
    (
        "use_parallel_residual",
        (None, False),
        "a parallel residual adds attention and MLP of the same input: this "
        "model's blocks run them one after the other",
    ),
    (
        "parallel_attn",
        (None, False),
        "a parallel residual adds attention and MLP of the same input: this "
        "model's blocks run them one after the other",
    ),
    (
        "scale_attn_by_inverse_layer_idx",
        (None, False),
        "scores divided by the layer's number too: this model scales every layer's by 1/sqrt(head_dim) alone",
    ),
    ("reorder_and_upcast_attn", (None, False), "GPT-2's reordered, upcast score computation is not this model's"),
    ("scale_attn_weights", (None, True), "unscaled scores: this model divides them by sqrt(head_dim)"),
    ("attn_logit_softcapping", (None,), "attention softcapping (tanh of the scores) is not in this model"),
    ("final_logit_softcapping", (None,), "logit softcapping (tanh of the logits) is not in this model"),
    ("embedding_multiplier", (None, 1, 1.0), "a multiplier on the embeddings is not in this model"),
    ("scale_emb", (None, 1, 1.0), "a multiplier on the embeddings is not in this model"),
    ("logits_scaling", (None, 1, 1.0), "a divisor on the logits is not in this model"),
    ("residual_multiplier", (None, 1, 1.0), "a multiplier on the residual branches is not in this model"),
    ("attention_multiplier", (None,), "a scale of the scores other than 1/sqrt(head_dim) is not in this model"),
    ("pretraining_tp", (None, 0, 1), "tensor-parallel slicing of the projections is not in this model"),
)
# Families whose math differs from this model's where their configs do not say so
GEMMA = "Gemma scales the embeddings by sqrt(d_model) and its RMSNorms by (1 + weight): not this model's math"
PARALLEL = "runs attention and the MLP in parallel off one norm: this model's blocks run them one after the other"
UNREPRESENTED_FAMILIES = {
    "gemma": GEMMA,
    "gemma2": GEMMA,
    "gemma3_text": GEMMA,
    "phi": f"Phi-2 {PARALLEL}",
    "gptj": f"GPT-J {PARALLEL}",
    "gpt_neox": f"GPT-NeoX {PARALLEL}",
}


def whole_fields(data: dict[str, Any]) -> dict[str, Any]:
    """The config fields of a whole decoder the config.json gives (the MLP's activation; its vocabulary,
    width and tied head, which the weights must agree with); refuses,
    with the reason, what a whole model here cannot represent (ConfigRefusal)."""
    refused = (
        [f"model_type {data['model_type']!r}: {UNREPRESENTED_FAMILIES[data['model_type']]}"]
        if data.get("model_type") in UNREPRESENTED_FAMILIES
        else []
    )
    refused += [
        f"{key} {data[key]!r}: {why}" for key, off, why in UNREPRESENTED if key in data and data[key] not in off
    ]
    activation = data.get("hidden_act", data.get("activation_function"))
    if activation is not None and activation not in ACTIVATIONS:
        refused.append(f"hidden_act {activation!r}: this model's MLP activations are {sorted(ACTIVATIONS)}")
    if refused:
        raise ConfigRefusal("; ".join(refused))
    fields: dict[str, Any] = {} if activation is None else {"mlp_activation": ACTIVATIONS[activation]}
    # the sizes the weights determine too: a config.json that says otherwise is refused as a conflict
    width = data.get("intermediate_size", data.get("n_inner"))
    if width is None and data.get("model_type") == "gpt2" and data.get("n_embd"):
        width = 4 * data["n_embd"]  # GPT-2's n_inner None: four times the width
    for ours, value in (
        ("vocab_size", data.get("vocab_size")),
        ("mlp_width", width),
        ("tie_embeddings", data.get("tie_word_embeddings")),
        ("n_layers", data.get("num_hidden_layers", data.get("n_layer"))),
        ("d_model", data.get("hidden_size", data.get("n_embd"))),
    ):
        if value is not None:
            fields[ours] = value
    return fields


def rotary_fields(data: dict[str, Any]) -> dict[str, Any]:
    """rope_theta, the rotated width and the scaling, from either spelling; none when the model has no
    rotary embeddings."""
    parameters = dict(data.get("rope_parameters") or {})
    legacy = dict(data.get("rope_scaling") or {})
    theta = parameters.get("rope_theta", data.get("rope_theta"))
    if theta is None:
        return {}
    kind = parameters.get("rope_type") or legacy.get("rope_type") or legacy.get("type") or "default"
    if kind not in SCALINGS:
        raise ConfigRefusal(
            f"rope scaling {kind!r}: this model scales rotary frequencies as {sorted(SCALINGS)} only "
            "(a checkpoint extended with another scheme would attend differently at every position)"
        )
    scaling = {**legacy, **parameters}
    fields: dict[str, Any] = {"rope_theta": float(theta), "rope_scaling": SCALINGS[kind]}
    if kind != "default":
        fields["rope_scaling_factor"] = float(scaling["factor"])
    if kind == "llama3":
        fields |= {
            "rope_low_freq_factor": float(scaling["low_freq_factor"]),
            "rope_high_freq_factor": float(scaling["high_freq_factor"]),
            "rope_original_max_position": int(scaling["original_max_position_embeddings"]),
        }
    partial = scaling.get("partial_rotary_factor", data.get("partial_rotary_factor"))
    if partial is not None and float(partial) != 1.0:
        fields["partial_rotary_factor"] = float(partial)  # made a rotary_dim once head_dim is known
    return fields


def window_fields(data: dict[str, Any]) -> dict[str, Any]:
    """sliding_window and its pattern, or nothing when every layer attends everything."""
    window = data.get("sliding_window")
    types = data.get("layer_types")
    if types is None and data.get("use_sliding_window") is not None:  # Qwen2/Qwen3 before layer_types
        layers, first = data.get("num_hidden_layers", 0), data.get("max_window_layers", 0)
        types = [SLIDING if data["use_sliding_window"] and i >= first else FULL for i in range(layers)]
    if window is None or (types is not None and SLIDING not in types):
        return {}
    if types is None:  # Mistral: every layer
        return {"sliding_window": int(window)}
    return {"sliding_window": int(window), "sliding_window_pattern": pattern_of(types)}


def pattern_of(types: list[str]) -> int:
    """N such that every N-th layer (counting from 1) is global and the others windowed; refused when
    the layers follow no such pattern."""
    for every in range(1, len(types) + 2):
        expected = [FULL if every > 1 and (i + 1) % every == 0 else SLIDING for i in range(len(types))]
        if expected == list(types):
            return every
    raise ConfigRefusal(
        f"layer_types {types}: this model windows all layers but every N-th; a window on other layers "
        "(e.g. the first ones global) is not one it represents"
    )


def rotary_dim(fields: dict[str, Any], head_dim: int) -> dict[str, Any]:
    """`partial_rotary_factor` as this model's rotary_dim (the rotated width of a head)."""
    fields = dict(fields)
    partial = fields.pop("partial_rotary_factor", None)
    if partial is not None:
        fields["rotary_dim"] = int(head_dim * partial)
    return fields


def checkpoint_instead(path: Path, expected: str) -> str | None:
    """Where an artifact or one of our configs is expected (`expected` names it) and `path` (a folder
    or its config.json) is a Hugging Face checkpoint instead (its config has a `model_type`): a line
    that says so and how to build an artifact from it; None otherwise."""
    folder, config = (path, path / "config.json") if path.is_dir() else (path.parent, path)
    try:
        data = json.loads(config.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or "model_type" not in data:
        return None
    return (
        f"{path} is a Hugging Face checkpoint (model_type {data['model_type']!r}), not {expected}; build an "
        f"artifact from it: python -m export build --weights {folder} --layout hf --out DIR"
    )
