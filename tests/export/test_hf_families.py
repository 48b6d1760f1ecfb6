"""The checkpoints people have: a Llama (sharded, Llama 3's rotary scaling), a Mistral (a sliding
window), a Qwen2 (q/k/v biases), a Qwen3 (q/k norms, its own head_dim) and a Phi-3 (packed qkv_proj,
partial rotary), each made by transformers from a small config with random weights (no download),
saved as `save_pretrained` saves them (embeddings, MLPs and the LM head included), imported through
`python -m export build --weights ... --layout hf`, and proven against transformers' own attention
classes: at import (report.json's source_check), through ONNX Runtime (the fused graph over a causal
prefill and decode steps, fp32 within 1e-5, fp16 within its bound; a left-padded batch equal to each
row alone) and through a real Triton (a session and stateless calls)."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
import transformers  # a dev dependency (make install): the source modules, built from configs

from client import Client
from contract import files, names
from export.__main__ import main as export_main
from export.hf_source import family_classes, forward, source_layer, windows
from serving.engine.ort import ort_runner, ort_session
from serving.host.launcher import start_triton
from serving.triton import config as triton_config
from serving.triton.config import MHA, MHA_SESSION, TRITON_CONFIG_FILENAME, ServingSettings
from serving.triton.repository import write_repository

COMMON = {
    "num_hidden_layers": 2,
    "intermediate_size": 64,
    "vocab_size": 32,
    "max_position_embeddings": 128,
    "rms_norm_eps": 1e-5,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "tie_word_embeddings": False,
}
LLAMA3 = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}
FAMILIES = {
    "llama": lambda: transformers.LlamaConfig(
        hidden_size=64, num_attention_heads=4, num_key_value_heads=2, rope_parameters=LLAMA3, **COMMON
    ),
    "mistral": lambda: transformers.MistralConfig(
        hidden_size=64, num_attention_heads=4, num_key_value_heads=2, sliding_window=8, **COMMON
    ),
    "qwen2": lambda: transformers.Qwen2Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, **COMMON),
    "qwen3": lambda: transformers.Qwen3Config(
        hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=32, **COMMON
    ),
    "phi3": lambda: transformers.Phi3Config(
        hidden_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
        **COMMON,
    ),
}
PREFILL, STEPS = 7, 32
SETTINGS = ServingSettings(threads=1, kv_cache_bytes=4 << 20, max_batch_size=4)


class Checkpoint:
    """A family's checkpoint on disk, its artifact, and its own attention layers to compare with."""

    def __init__(self, family: str, work) -> None:
        self.family = family
        config = FAMILIES[family]()
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
        with torch.no_grad():  # norms and biases away from their initial ones and zeros
            for parameter in model.parameters():
                if parameter.dim() == 1:
                    parameter.add_(0.1 * torch.randn_like(parameter))
        self.dir, self.artifact = work / "checkpoint", work / "artifact"
        model.save_pretrained(self.dir, max_shard_size="100KB" if family == "llama" else "50MB")  # llama: sharded
        index = self.dir / "model.safetensors.index.json"
        self.weights = index if index.is_file() else self.dir / "model.safetensors"
        (work / "serving.json").write_text(json.dumps({"max_seq_len": 128}))
        argv = ["build", "--weights", str(self.weights), "--layout", "hf", "--config", str(work / "serving.json")]
        assert export_main([*argv, "--out", str(self.artifact), "--variants", "fp32-fused,fp16-fused,fp32-static"]) == 0
        self.config = transformers.AutoConfig.from_pretrained(str(self.dir))
        self.config._attn_implementation = "eager"
        state = {k: v.float() for k, v in model.state_dict().items()}
        classes = family_classes(self.config.model_type)
        self.layers = [
            source_layer(
                classes,
                self.config,
                i,
                state,
                f"model.layers.{i}.self_attn.",
                f"model.layers.{i}.input_layernorm.weight",
            )
            for i in range(self.config.num_hidden_layers)
        ]
        self.rotary = classes["RotaryEmbedding"](self.config)

    def source(self, hidden: np.ndarray) -> np.ndarray:
        """transformers' layers over whole rows (positions from 0), as the checkpoint computes them."""
        with torch.no_grad():
            return forward(self.layers, self.rotary, torch.from_numpy(hidden), windows(self.config)).numpy()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """family -> its Checkpoint, each made once for the module when first asked for."""
    made: dict[str, Checkpoint] = {}

    def get(family: str) -> Checkpoint:
        if family not in made:
            made[family] = Checkpoint(family, tmp_path_factory.mktemp(f"hf-{family}"))
        return made[family]

    return get


@pytest.fixture(scope="module", params=list(FAMILIES))
def checkpoint(request, checkpoints):
    return checkpoints(request.param)


def served_name(model: str, family: str) -> str:
    return f"{model}-{family}"


@pytest.fixture(scope="module")
def served(checkpoints, tmp_path_factory):
    """One real Triton for the module, serving every family's `mha` and `mha_session` as its
    repository has them, each pair under the family's name (`mha-llama`, `mha_session-llama`): the
    config's name is the folder's; the rest is what `write_repository` wrote (Triton starts and stops
    in seconds: once, not per family)."""
    work = tmp_path_factory.mktemp("hf-served")
    repository = work / "repository"
    for family in FAMILIES:
        own = write_repository(checkpoints(family).artifact, work / family, SETTINGS, models=(MHA, MHA_SESSION))
        for model in (MHA, MHA_SESSION):
            target = shutil.copytree(own / model, repository / served_name(model, family))
            config = triton_config.parse((target / TRITON_CONFIG_FILENAME).read_text())
            config.name = target.name
            (target / TRITON_CONFIG_FILENAME).write_text(triton_config.to_text(config))
    with start_triton(repository, log_path=work / "triton.log") as server:
        yield server


def tokens(width: int, count: int, seed: int, batch: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((batch, count, width)).astype(np.float32)


def test_the_import_was_proven_at_build_and_the_rest_of_the_checkpoint_listed(checkpoint):
    report = json.loads((checkpoint.artifact / files.REPORT_FILENAME).read_text())
    check = report["source_check"]
    assert check["checked"] and check["passed"] and check["max_abs"] <= 1e-5, check
    assert type(checkpoint.layers[0].attention).__name__ in check["module"]
    left_out = report["weights"]["left_out"]
    assert {"model.embed_tokens", "lm_head", "model.norm", "model.layers.{i}.mlp"} <= set(left_out), left_out


def test_the_graphs_equal_the_checkpoints_attention_over_a_prefill_and_decode_steps(checkpoint):
    width = checkpoint.config.hidden_size
    hidden = tokens(width, PREFILL + STEPS, seed=1, batch=2)
    expected = checkpoint.source(hidden)
    scale = float(np.abs(expected).max())
    for variant, dtype, bound in (("fp32-fused", np.float32, 1e-5), ("fp16-fused", np.float16, 2e-3 * scale)):
        run = ort_runner(ort_session(checkpoint.artifact / files.model_filename(variant)))
        result = run({names.HIDDEN_STATES: hidden[:, :PREFILL].astype(dtype)})
        outputs, past = [result[names.OUTPUT]], result
        for t in range(PREFILL, PREFILL + STEPS):
            feeds = {names.HIDDEN_STATES: hidden[:, t : t + 1].astype(dtype)}
            feeds |= {n.replace("present", "past_key_values"): v for n, v in past.items() if n.startswith("present.")}
            past = run(feeds)
            outputs.append(past[names.OUTPUT])
        error = float(np.abs(np.concatenate(outputs, axis=1).astype(np.float64) - expected).max())
        family = checkpoint.config.model_type
        print(f"{family} {variant}: max abs error against transformers {error:.2e} (output scale {scale:.2f})")
        assert error <= bound


def test_a_left_padded_batch_equals_each_row_alone(checkpoint):
    """Positions counted from the mask as Hugging Face does: a padded row's tokens start at position 0."""
    width = checkpoint.config.hidden_size
    hidden = tokens(width, 9, seed=2, batch=2)
    mask = np.array([[0, 0, 0] + [1] * 6, [1] * 9])
    run = ort_runner(ort_session(checkpoint.artifact / files.model_filename("fp32-fused")))
    output = run({names.HIDDEN_STATES: hidden, names.ATTENTION_MASK: mask})[names.OUTPUT]
    np.testing.assert_allclose(output[0, 3:], checkpoint.source(hidden[:1, 3:])[0], atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(output[1], checkpoint.source(hidden[1:])[0], atol=1e-5, rtol=1e-5)


@pytest.mark.served
def test_served_a_session_and_stateless_calls_equal_the_checkpoints_attention(checkpoint, served):
    width = checkpoint.config.hidden_size
    hidden = tokens(width, PREFILL + STEPS, seed=3)
    expected = checkpoint.source(hidden)
    family = checkpoint.family
    models = {"model": served_name(MHA, family), "session_model": served_name(MHA_SESSION, family)}
    with Client(served.grpc_url, **models) as client:
        with client.session() as session:
            outputs = [session.step(hidden[:, :PREFILL])]
            outputs += [session.step(hidden[:, t : t + 1]) for t in range(PREFILL, PREFILL + STEPS)]
        np.testing.assert_allclose(np.concatenate(outputs, axis=1), expected, atol=1e-5, rtol=1e-5)
        first = client.infer(hidden[:, :PREFILL])
        rest = client.infer(hidden[:, PREFILL:], past=first.present)  # positions counted after the past
        np.testing.assert_allclose(np.concatenate([first.output, rest.output], axis=1), expected, atol=1e-5, rtol=1e-5)
