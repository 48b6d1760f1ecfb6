"""`python -m export train`: a small Llama-shaped decoder and its byte-level BPE tokenizer, trained here from
nothing on a text a Debian package ships, written as a Hugging Face checkpoint folder that `python -m export
build --weights FOLDER --layout hf` imports like any other.

The text: Debian's `fortunes` package (fortune-mod's data files, BSD license, /usr/share/doc/fortunes/copyright):
15,213 quotations, jokes and poems in 2.58 MB of UTF-8 under /usr/share/games/fortunes. Every 20th one is held
out (never seen by the tokenizer's training or the model's); the report gives the held-out loss in bits per byte
(so that tokenizers compare) against a unigram and a bigram model of the same tokens. Training is seeded: the
same settings give the same weights on the same machine (torch's CPU kernels, the threads fixed).

The model is the project's own (export/model.py): RoPE, RMSNorm, grouped-query attention, a gated SiLU MLP, the
LM head tied to the embeddings; trained at fixed sequence length on windows drawn from the training text, each
fortune ended by <|endoftext|>.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from contract.config import ModelConfig
from contract.files import (
    CHAT_TEMPLATE_FILENAME,
    GENERATION_CONFIG_FILENAME,
    HELD_OUT_FILENAME,
    MODEL_CONFIG_FILENAME,
    TOKENIZER_CONFIG_FILENAME,
    TOKENIZER_FILENAME,
)
from export.importers import LAYOUTS, LLAMA_NAMES
from export.model import AttentionModel
from export.progress import Progress
from export.training import (
    CHAT_TEMPLATE,
    END_OF_TEXT,
    FORTUNES_PACKAGE,
    REPORT_FILE,
    SEPARATOR,
    WEIGHTS_FILE,
    Corpus,
    TrainSettings,
)


def train_tokenizer(texts: Sequence[str], vocab_size: int) -> Tokenizer:
    """A byte-level BPE (GPT-2's pre-tokenization: every byte has a token, so any text encodes) with
    <|endoftext|> at id 0."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[END_OF_TEXT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer)
    return tokenizer


def token_stream(tokenizer: Tokenizer, texts: Sequence[str]) -> np.ndarray:
    """The texts' ids as one int64 stream: <|endoftext|> first, then each text followed by <|endoftext|> (so
    that every text token and every end is predicted from what came before)."""
    end = tokenizer.token_to_id(END_OF_TEXT)
    ids = [end]
    for encoding in tokenizer.encode_batch(list(texts), add_special_tokens=False):
        ids += [*encoding.ids, end]
    return np.asarray(ids, dtype=np.int64)


def stream_bytes(texts: Sequence[str]) -> int:
    """The UTF-8 bytes the stream encodes: each text and its end (one newline's worth: the `%` line it replaces
    is not text the model is scored on), so bits per byte compare across tokenizers."""
    return sum(len(text.encode("utf-8")) + 1 for text in texts)


def learning_rate(step: int, s: TrainSettings) -> float:
    """Linear warmup, then cosine decay to a tenth."""
    if step < s.warmup:
        return s.learning_rate * (step + 1) / s.warmup
    progress = (step - s.warmup) / max(1, s.steps - s.warmup)
    return s.learning_rate * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def windows(stream: np.ndarray, context: int) -> list[torch.Tensor]:
    """Consecutive windows of at most context + 1 ids (inputs and next-token targets) that score every id after
    the first exactly once: the last one shorter."""
    return [torch.from_numpy(stream[i : i + context + 1]) for i in range(0, len(stream) - 1, context)]


@torch.no_grad()
def held_out_nats(model: AttentionModel, stream: np.ndarray, context: int, batch: int = 16) -> float:
    """Summed next-token loss (nats) of every id in the stream after the first, in windows of `context`."""
    rows = windows(stream, context)
    full = [row for row in rows if len(row) == context + 1]
    groups = [torch.stack(full[i : i + batch]) for i in range(0, len(full), batch)]
    groups += [row[None] for row in rows if len(row) < context + 1]  # the shorter last window, alone
    total = 0.0
    for group in groups:
        logits = model(group[:, :-1]).output
        total += float(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), group[:, 1:].reshape(-1), reduction="sum"))
    return total


def ngram_baselines(train: np.ndarray, held: np.ndarray, vocab: int) -> dict[str, float]:
    """Held-out nats per token of a unigram (add-one) and an interpolated bigram (Jelinek-Mercer, the weight
    that scores best on the held-out text itself: the baseline's best case) over the same tokens."""
    unigram = (np.bincount(train, minlength=vocab) + 1.0) / (len(train) + vocab)
    pairs = np.zeros((vocab, vocab))
    np.add.at(pairs, (train[:-1], train[1:]), 1.0)
    rows = pairs.sum(1, keepdims=True)
    bigram = np.divide(pairs, rows, out=np.zeros_like(pairs), where=rows > 0)
    previous, following = held[:-1], held[1:]
    uni = unigram[following]
    best = min(
        -np.log(weight * bigram[previous, following] + (1 - weight) * uni).mean() for weight in np.linspace(0, 0.95, 20)
    )
    return {"unigram": float(-np.log(uni).mean()), "bigram": float(best)}


def train(
    settings: TrainSettings, corpus: Corpus, progress: Progress, on_step: Callable[[int, float], None] | None = None
) -> tuple[AttentionModel, Tokenizer, dict]:
    """The tokenizer and the model, trained; the report (held-out loss, baselines, tokens seen, time)."""
    torch.manual_seed(settings.seed)
    threads = torch.get_num_threads()
    torch.set_num_threads(settings.threads)
    try:
        return _train(settings, corpus, progress, on_step)
    finally:
        torch.set_num_threads(threads)  # the caller's, as it was


def _train(
    settings: TrainSettings, corpus: Corpus, progress: Progress, on_step: Callable[[int, float], None] | None
) -> tuple[AttentionModel, Tokenizer, dict]:
    started = time.perf_counter()
    with progress.stage(f"training a {settings.vocab_size}-token byte-level BPE on {len(corpus.train):,} fortunes"):
        tokenizer = train_tokenizer(corpus.train, settings.vocab_size)
    train_ids, held_ids = token_stream(tokenizer, corpus.train), token_stream(tokenizer, corpus.held_out)
    cfg = settings.model_config()
    model = AttentionModel(cfg, seed=settings.seed)
    scale_initial_weights(model, settings.n_layers)
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=settings.learning_rate, betas=(0.9, 0.95), weight_decay=settings.weight_decay
    )
    generator = np.random.default_rng(settings.seed)
    label = f"training {cfg.n_params() / 1e6:.2f}M parameters for {settings.steps} steps"
    losses = []
    with progress.stage(label):
        for step in range(settings.steps):
            starts = generator.integers(0, len(train_ids) - settings.context - 1, settings.batch)
            rows = torch.from_numpy(np.stack([train_ids[s : s + settings.context + 1] for s in starts]))
            for group in optimizer.param_groups:
                group["lr"] = learning_rate(step, settings)
            logits = model(rows[:, :-1]).output
            loss = F.cross_entropy(logits.reshape(-1, cfg.vocab_size), rows[:, 1:].reshape(-1))
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            losses.append(loss.item())
            report_step(progress, step, settings.steps, losses)
            if on_step is not None:
                on_step(step, losses[-1])
    model.eval()
    with progress.stage("scoring the held-out text"):
        nats = held_out_nats(model, held_ids, settings.context)
        baselines = ngram_baselines(train_ids, held_ids, cfg.vocab_size)
    seconds = round(time.perf_counter() - started, 1)
    return model, tokenizer, _report(settings, corpus, cfg, (train_ids, held_ids), losses, nats, baselines, seconds)


def _report(
    settings: TrainSettings,
    corpus: Corpus,
    cfg,
    ids: tuple[np.ndarray, np.ndarray],
    losses: list[float],
    nats: float,
    baselines: dict[str, float],
    seconds: float,
) -> dict:
    """What the training did and how the model scores the held-out text, against the n-gram baselines."""
    train_ids, held_ids = ids
    held_bytes, scored = stream_bytes(corpus.held_out), len(held_ids) - 1
    per_token = nats / scored
    report = {
        "settings": dataclasses.asdict(settings),
        "corpus": {
            "source": FORTUNES_PACKAGE,
            "train_fortunes": len(corpus.train),
            "held_out_fortunes": len(corpus.held_out),
            "train_bytes": stream_bytes(corpus.train),
            "held_out_bytes": held_bytes,
            "train_tokens": len(train_ids),
            "held_out_tokens": len(held_ids),
        },
        "parameters": cfg.n_params(),
        "tokens_seen": settings.steps * settings.batch * settings.context,
        "seconds": seconds,
        "load_average_at_end": [round(load, 2) for load in os.getloadavg()],  # 1, 5, 15 min: others' work slows it
        "final_train_loss": float(np.mean(losses[-20:])),
        "held_out": {
            "nats_per_token": per_token,
            "perplexity": math.exp(per_token),
            "bits_per_byte": nats / math.log(2) / held_bytes,
            "tokens_scored": scored,
        },
        "baselines": {
            name: {
                "nats_per_token": value,
                "perplexity": math.exp(value),
                "bits_per_byte": value * scored / math.log(2) / held_bytes,
            }
            for name, value in baselines.items()
        },
    }
    return report


@torch.no_grad()
def scale_initial_weights(model: AttentionModel, n_layers: int) -> None:
    """GPT-2's start for training (export/model.py's init is unit-variance, for parity tests): embeddings and
    projections at 0.02, the projections into the residual stream at 0.02 / sqrt(2 * layers)."""
    for name, parameter in model.named_parameters():
        if parameter.dim() == 2:
            std = 0.02 / math.sqrt(2 * n_layers) if name.endswith(("W_o.weight", "W_down.weight")) else 0.02
            parameter.normal_(0.0, std)
        elif name.endswith("norm.weight"):
            parameter.fill_(1.0)


def report_step(progress: Progress, step: int, steps: int, losses: list[float]) -> None:
    """A bar with the loss on a terminal; elsewhere a line every tenth of the run."""
    done = step + 1
    recent = float(np.mean(losses[-20:]))
    filled = int(30 * done / steps)
    progress.update(f"[{'#' * filled}{'.' * (30 - filled)}] {done}/{steps} loss {recent:.3f}")
    if done % max(1, steps // 10) == 0 or done == steps:
        progress.note(f"  step {done}/{steps}: training loss {recent:.3f} nats/token")


# --- the Hugging Face folder ---------------------------------------------------------------------


def hf_state_dict(model: AttentionModel) -> dict[str, torch.Tensor]:
    """Our weights under Llama's names (the importer's table read backwards: export/importers.py)."""
    names, projections = LLAMA_NAMES, LAYOUTS["hf"].projections
    ours = model.state_dict()
    theirs = {
        f"model.{names.embed}.weight": ours["embed.weight"],
        f"model.{names.final_norm}.weight": ours["final_norm.weight"],
    }
    for i in range(model.cfg.n_layers):
        block, mine = f"model.layers.{i}.", f"layers.{i}."
        theirs[f"{block}{LAYOUTS['hf'].norm}.weight"] = ours[f"{mine}norm.weight"]
        theirs |= {
            f"{block}self_attn.{projections[p]}.weight": ours[f"{mine}attn.{p}.weight"]
            for p in ("W_q", "W_k", "W_v", "W_o")
        }
        theirs[f"{block}{names.mlp_norm}.weight"] = ours[f"{mine}mlp_norm.weight"]
        for source, target in (("W_gate", names.gate), ("W_up", names.up), ("W_down", names.down)):
            theirs[f"{block}{target}.weight"] = ours[f"{mine}mlp.{source}.weight"]
    return {key: tensor.detach().clone().contiguous() for key, tensor in theirs.items()}


def hf_config(cfg: ModelConfig, end_id: int) -> dict:
    """transformers 5's LlamaConfig for `cfg` (export/hf_config.py reads it back)."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": cfg.d_model,
        "intermediate_size": cfg.mlp_width,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": cfg.norm_eps,
        "rope_parameters": {"rope_theta": cfg.rope_theta, "rope_type": "default"},
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "tie_word_embeddings": True,
        "vocab_size": cfg.vocab_size,
        "bos_token_id": end_id,
        "eos_token_id": end_id,
        "pad_token_id": end_id,
        "dtype": "float32",
    }


def write_folder(out: Path, model: AttentionModel, tokenizer: Tokenizer, report: dict, held_out: Sequence[str]) -> None:
    """config.json, model.safetensors, the tokenizer's files, the chat template, training.json and the held-out
    fortunes (held_out.txt, in fortune's format)."""
    out.mkdir(parents=True, exist_ok=True)
    end = tokenizer.token_to_id(END_OF_TEXT)
    save_file(hf_state_dict(model), out / WEIGHTS_FILE, metadata={"format": "pt"})
    write_json(out / MODEL_CONFIG_FILENAME, hf_config(model.cfg, end))
    tokenizer.save(str(out / TOKENIZER_FILENAME))
    write_json(
        out / TOKENIZER_CONFIG_FILENAME,
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": END_OF_TEXT,
            "eos_token": END_OF_TEXT,
            "pad_token": END_OF_TEXT,
            "model_max_length": model.cfg.max_seq_len,
            "add_bos_token": False,
            "clean_up_tokenization_spaces": False,
        },
    )
    write_json(out / GENERATION_CONFIG_FILENAME, {"bos_token_id": end, "eos_token_id": end, "pad_token_id": end})
    (out / CHAT_TEMPLATE_FILENAME).write_text(CHAT_TEMPLATE)
    write_json(out / REPORT_FILE, report)
    (out / HELD_OUT_FILENAME).write_text(SEPARATOR.join(held_out) + SEPARATOR)


def write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n")
