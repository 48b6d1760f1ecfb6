"""What a training run is (`python -m export train`, export/train.py): its settings and its text, read from
Debian's `fortunes` package. No torch and no numpy here: the command's --help reads the defaults."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from contract.config import GATED, HALF, RMSNORM, SILU, ModelConfig

FORTUNES = Path("/usr/share/games/fortunes")
FORTUNES_PACKAGE = "fortunes (Debian, fortune-mod 1:1.99.1; BSD license)"
END_OF_TEXT = "<|endoftext|>"  # id 0: between fortunes, the model's bos, eos and pad
SEPARATOR = "\n%\n"  # fortune's file format: one entry, then a line of `%`
WEIGHTS_FILE = "model.safetensors"
REPORT_FILE = "training.json"
# The model continues text: a conversation is rendered as its messages' text, one after another, so that
# /v1/chat/completions gives the model what it was trained on (it has no chat turns of its own).
CHAT_TEMPLATE = "{%- for message in messages %}{{- message['content'] + '\\n' }}{%- endfor %}\n"


class TrainingError(ValueError):
    """The corpus or the settings cannot train a model; the message says which and why."""


@dataclasses.dataclass(frozen=True)
class TrainSettings:
    vocab_size: int = 2048
    d_model: int = 256
    n_layers: int = 4
    n_heads: int = 8
    n_kv_heads: int = 4
    mlp_width: int = 640
    context: int = 256  # tokens per training window; also the model's max_position_embeddings
    batch: int = 16
    steps: int = 600
    learning_rate: float = 3e-3
    warmup: int = 60
    weight_decay: float = 0.1
    held_out_every: int = 20  # every N-th fortune is held out
    seed: int = 0
    threads: int = 2

    def model_config(self) -> ModelConfig:
        return ModelConfig(
            d_model=self.d_model,
            n_heads=self.n_heads,
            n_kv_heads=self.n_kv_heads,
            n_layers=self.n_layers,
            max_seq_len=self.context,
            bias=False,
            norm=RMSNORM,
            norm_eps=1e-5,
            rope_theta=10000.0,
            rope_pairing=HALF,
            vocab_size=self.vocab_size,
            mlp=GATED,
            mlp_width=self.mlp_width,
            mlp_activation=SILU,
            tie_embeddings=True,
        )


@dataclasses.dataclass(frozen=True)
class Corpus:
    train: list[str]
    held_out: list[str]

    @classmethod
    def read(cls, folder: Path, held_out_every: int) -> Corpus:
        """Every fortune file in `folder` (not the .dat indexes or .u8 links), split into entries, in name order."""
        if not folder.is_dir():
            raise TrainingError(
                f"{folder} is not there: install Debian's fortunes package (apt-get install fortunes), or give "
                "--corpus a folder of fortune files"
            )
        entries = []
        for path in sorted(p for p in folder.iterdir() if p.is_file() and not p.suffix and not p.is_symlink()):
            entries += entries_of(path.read_text(encoding="utf-8"))
        if len(entries) < 2 * held_out_every:
            raise TrainingError(f"{folder} holds {len(entries)} fortunes: too few to hold every {held_out_every}th out")
        held = [entry for i, entry in enumerate(entries) if i % held_out_every == 0]
        train = [entry for i, entry in enumerate(entries) if i % held_out_every != 0]
        return cls(train, held)


def entries_of(text: str) -> list[str]:
    """A fortune file's entries: the texts between lines of `%`, blank ones left out."""
    return [entry.strip("\n") for entry in text.split(SEPARATOR) if entry.strip()]
