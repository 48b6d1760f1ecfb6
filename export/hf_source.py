"""The proof of a Hugging Face import against the checkpoint's own model. A whole import
(`check_causal_lm`): transformers' own *ForCausalLM from the folder against the imported decoder over a
left-padded batch prefill and greedy decode steps. An attention-only import (`check`): transformers' classes for
its family (`LlamaAttention`, `Qwen3Attention`, `Phi3Attention`, ... with the family's RMSNorm as the
layer's `input_layernorm` and its rotary embedding module), built from the `config.json` beside the
weights (no download), loaded with the same weights, and run over a causal prefill and decode steps
beside the imported model: each layer is x + attention(input_layernorm(x)), the part of a decoder layer
this product serves.

transformers is a test dependency, not a serving one: without it the report says the import was not
checked and why.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor, nn

from contract.files import MODEL_CONFIG_FILENAME
from contract.inputs import default_positions

SLIDING = "sliding_attention"


def check(
    config_dir: Path,
    tensors: dict[str, Tensor],
    attention_prefixes: list[str],
    norm_keys: list[str],
    ours: Callable[[Tensor], Tensor],
    scenario: tuple[int, int, int],
) -> dict:
    """`ours(x)` is the imported model over x (B, T, d) as a prefill and decode steps; `scenario` is
    (batch, prefill, total tokens). Returns whether it could check and, if so, the module and both
    outputs (the caller judges them)."""
    try:
        import transformers
    except ImportError:
        return {
            "checked": False,
            "reason": "transformers is not installed here, so the checkpoint's own attention "
            "class could not be built (pip install transformers, then build again)",
        }
    if not (config_dir / MODEL_CONFIG_FILENAME).is_file():
        return {
            "checked": False,
            "reason": f"no {MODEL_CONFIG_FILENAME} beside the weights to build the attention class from",
        }
    try:
        config = transformers.AutoConfig.from_pretrained(str(config_dir))
        classes = family_classes(config.model_type)
    except (ValueError, ImportError, KeyError) as error:
        return {"checked": False, "reason": f"transformers has no attention class for this config: {error}"}
    config._attn_implementation = "eager"
    layers = [
        source_layer(classes, config, i, tensors, prefix, norm_key)
        for i, (prefix, norm_key) in enumerate(zip(attention_prefixes, norm_keys, strict=True))
    ]
    rotary = classes["RotaryEmbedding"](config)
    batch, _, total = scenario
    x = torch.randn(batch, total, config.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = forward(layers, rotary, x, windows(config))
        actual = ours(x)
    names = " and ".join(classes[kind].__name__ for kind in ("RMSNorm", "RotaryEmbedding"))
    return {
        "checked": True,
        "module": f"transformers {transformers.__version__} {classes['Attention'].__name__} with {names} "
        f"x {len(layers)}, each with a residual",
        "expected": expected,
        "actual": actual,
    }


def family_classes(model_type: str) -> dict[str, type]:
    """The family's Attention, RMSNorm and RotaryEmbedding classes (e.g. Qwen3Attention)."""
    module = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
    found = {}
    for suffix in ("Attention", "RMSNorm", "RotaryEmbedding"):
        matches = [name for name in dir(module) if name.endswith(suffix) and not name.startswith("_")]
        found[suffix] = getattr(module, min(matches, key=len))  # "LlamaAttention", not "LlamaFlashAttention2"
    return found


class SourceLayer(nn.Module):
    """One layer as the checkpoint computes it: x + attention(input_layernorm(x))."""

    def __init__(self, attention: nn.Module, norm: nn.Module) -> None:
        super().__init__()
        self.attention, self.norm = attention, norm


def source_layer(classes, config, index: int, tensors: dict[str, Tensor], prefix: str, norm_key: str) -> SourceLayer:
    attention = classes["Attention"](config, layer_idx=index)
    state = {
        key.removeprefix(prefix): tensor
        for key, tensor in tensors.items()
        if key.startswith(prefix) and not key.endswith("rotary_emb.inv_freq")
    }
    attention.load_state_dict(state, strict=True)
    norm = classes["RMSNorm"](config.hidden_size, eps=config.rms_norm_eps)
    norm.load_state_dict({"weight": tensors[norm_key]}, strict=True)
    return SourceLayer(attention.eval(), norm.eval())


def windows(config) -> list[int | None]:
    """Each layer's sliding window as the config says (layer_types, or a window on every layer)."""
    window, types = getattr(config, "sliding_window", None), getattr(config, "layer_types", None)
    layers = config.num_hidden_layers
    if window is None:
        return [None] * layers
    return [window if types is None or types[i] == SLIDING else None for i in range(layers)]


def forward(layers: list[SourceLayer], rotary: nn.Module, x: Tensor, layer_windows: list[int | None]) -> Tensor:
    """The layers over all of x at once, each query seeing itself and the past (within its window)."""
    B, T, _ = x.shape
    positions = torch.arange(T)[None].expand(B, T)
    position_embeddings = rotary(x, positions)
    query, key = torch.arange(T)[:, None], torch.arange(T)[None, :]
    for layer, window in zip(layers, layer_windows, strict=False):
        allowed = key <= query
        if window is not None:
            allowed = allowed & (query - key < window)  # transformers' sliding window: kv > q - window
        mask = torch.zeros(T, T).masked_fill(~allowed, torch.finfo(torch.float32).min)[None, None]  # (1, 1, T, T)
        attended = layer.attention(layer.norm(x), position_embeddings=position_embeddings, attention_mask=mask)[0]
        x = x + attended
    return x


# --- a whole decoder: transformers' *ForCausalLM against the imported model -------------------------


def check_causal_lm(folder: Path, model: nn.Module, batch: int, prefill: int, padding: int, steps: int) -> dict:
    """transformers' AutoModelForCausalLM from `folder` (local files only, fp32, eager attention) and
    `model` over the same left-padded batch: random token ids (row 0's first `padding` positions padding),
    a prefill of `prefill` positions, then `steps` greedy decode steps (the token transformers picks fed to
    both), the attention mask and the positions counted from it (contract.inputs.default_positions) given
    to both. Returns whether it could check and, if so, the module and both sides' logits at every real
    position, (N, vocab) each (the caller judges them)."""
    try:
        import transformers
    except ImportError:
        return {
            "checked": False,
            "reason": "transformers is not installed here, so the checkpoint's own model could not be built "
            "(pip install transformers, then build again)",
        }
    if not (folder / MODEL_CONFIG_FILENAME).is_file():
        return {"checked": False, "reason": f"no {MODEL_CONFIG_FILENAME} beside the weights to build the model from"}
    try:
        source = transformers.AutoModelForCausalLM.from_pretrained(
            str(folder), dtype=torch.float32, attn_implementation="eager", local_files_only=True
        ).eval()
    except (ValueError, ImportError, KeyError, OSError) as error:
        return {"checked": False, "reason": f"transformers cannot build a CausalLM from {folder}: {error}"}
    cfg = model.cfg
    steps = max(0, min(steps, cfg.max_seq_len - prefill))
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (batch, prefill), generator=generator)  # (B, T)
    mask = torch.ones(batch, prefill, dtype=torch.int64)  # (B, T)
    mask[0, :padding] = 0
    theirs_all, ours_all, real = [], [], [mask.bool()]
    past_theirs, past_ours = None, None
    with torch.no_grad():
        for _ in range(steps + 1):
            positions = torch.from_numpy(default_positions(mask.numpy(), ids.shape[1]))  # (B, T)
            out = source(input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=past_theirs)
            step = model(ids, mask, past_ours, position_ids=positions)
            past_theirs, past_ours = out.past_key_values, step.present
            theirs_all.append(out.logits.float())
            ours_all.append(step.output)
            ids = out.logits[:, -1:].argmax(-1)  # (B, 1): transformers' greedy token, fed to both
            mask = torch.cat([mask, torch.ones(batch, 1, dtype=torch.int64)], dim=1)
            real.append(torch.ones(batch, 1, dtype=torch.bool))
    real = torch.cat(real[:-1], dim=1)  # (B, prefill + steps): the positions that are not padding
    return {
        "checked": True,
        "module": f"transformers {transformers.__version__} {type(source).__name__}",
        "scenario": f"batch {batch}, left-padded (row 0: {padding} padding positions): a prefill of {prefill} "
        f"then {steps} greedy decode steps, attention_mask and position_ids given to both",
        "expected": torch.cat(theirs_all, dim=1)[real],  # (N, vocab)
        "actual": torch.cat(ours_all, dim=1)[real],
    }
