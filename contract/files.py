"""The file names of an artifact directory and of a Triton model's version folder, and the checkout's
default places for them."""

from __future__ import annotations

import hashlib
from pathlib import Path

MODEL_CONFIG_FILENAME = "config.json"  # the ModelConfig an artifact was built from (contract/config.py)
WEIGHTS_FILENAME = "weights.safetensors"
REPORT_FILENAME = "report.json"  # per variant: parity, fused ops, target fit, the file's sha256 (export/build.py)
# a model version folder's files and their sha256 from the build's report, as `sha256sum -c` reads them
DIGESTS_FILENAME = "SHA256SUMS"
# a checkpoint's text files, as Hugging Face saves them: copied into the artifact (their sha256 in the report)
# and into the generation model's version folder (in its SHA256SUMS), so the tokenizer travels with the model
TOKENIZER_FILENAME = "tokenizer.json"  # the `tokenizers` library's whole tokenizer
# the largest tokenizer.json taken (a build refuses it, a gateway does not parse it): the largest shipped ones are
# tens of MB (Gemma 3's 33 MB); one of 167 MB took a gateway 40 s and 3.6 GB to load
MAX_TOKENIZER_BYTES = 64 << 20
TOKENIZER_CONFIG_FILENAME = "tokenizer_config.json"  # its special tokens, and the chat template of older saves
GENERATION_CONFIG_FILENAME = "generation_config.json"  # the end-of-text ids generation stops at
CHAT_TEMPLATE_FILENAME = "chat_template.jinja"  # the chat template, as transformers 5 saves it
SPECIAL_TOKENS_FILENAME = "special_tokens_map.json"
TEXT_FILES = (
    TOKENIZER_FILENAME,
    TOKENIZER_CONFIG_FILENAME,
    GENERATION_CONFIG_FILENAME,
    CHAT_TEMPLATE_FILENAME,
    SPECIAL_TOKENS_FILENAME,
)


def model_filename(variant: str) -> str:
    """`model.<variant>.onnx`: one file per variant (fp32, fp32-fused, fp16-static, ...)."""
    return f"model.{variant}.onnx"


def sha256(path: str | Path) -> str:
    """The file's SHA-256 as hex."""
    with Path(path).open("rb") as file:
        return hashlib.file_digest(file, "sha256").hexdigest()


PROJECT_ROOT = Path(__file__).resolve().parent.parent  # the checkout (or the installed tree)
DEFAULT_REPOSITORY = PROJECT_ROOT / "model_repository"  # what `python -m serving` serves by default
DEFAULT_ARTIFACTS = PROJECT_ROOT / "build" / "artifacts"  # git-ignored; one folder per preset
# the model trained here on Debian's fortunes (`python -m export train`, export/train.py), shipped as a Hugging
# Face checkpoint folder and served by `make serve` beside the default model
TRAINED_MODEL = PROJECT_ROOT / "models" / "fortunes"
TRAINED_MODEL_NAME = "fortunes"  # its id on the OpenAI-compatible routes and its Triton models' prefix
TRAINED_ARTIFACTS = DEFAULT_ARTIFACTS / TRAINED_MODEL_NAME  # where `python -m serving` builds it
# held-out text beside a trained checkpoint (entries separated by a line of `%`, fortune's format): the build
# scores every form on it (export/quality.py)
HELD_OUT_FILENAME = "held_out.txt"
