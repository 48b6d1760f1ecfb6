"""Fixtures shared by every test tier (artifact directories built once per test session) and the tiers:

- `served`: talks to a real Triton (the shared `triton` fixture, or servers the module starts itself);
- `slow`: takes tens of seconds on its own (the README run, benchmarks, the fault suite, anything
  that builds a whole artifact);
- `gpu`: needs a CUDA GPU (skipped here with the reason);
- `unit`: everything else: no server, `pytest -m unit` in about 3 minutes on 2 cores.

A module that starts its own servers says so with `pytestmark = pytest.mark.served`; tests that use
the `triton` or `artifact_dir` fixture are marked here; `unit` is what is left.

The builds the session's later tests need are made ahead in the background (tests/fixtures/prebuilds.py):
`artifact_dir`, `trained_artifact` and the test modules that define `prebuild_jobs` read what it built.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from contract.config import ModelConfig, preset

# the real Triton fixtures (`triton`, `triton_repository`, `triton_artifact`) for every tier
pytest_plugins = [
    "tests.fixtures.triton",
    "tests.fixtures.redis",
    "tests.fixtures.browser",
    "tests.fixtures.prebuilds",
    "tests.fixtures.fortunes",
]

# Configs the tests build; `unseen` has sizes no preset uses (odd head_dim, 3 kv heads, 3 layers).
TEST_CONFIGS = {
    "tiny": preset("tiny"),
    "gqa": preset("gqa"),
    "unseen": ModelConfig(d_model=96, n_heads=6, n_kv_heads=2, n_layers=3, max_seq_len=1024),
    # the modern block, every part at once: RMSNorm, q/k norms, a head_dim of its own (query width 128
    # from 64), RoPE with Llama 3's scaling (its original context small enough to bite), a sliding
    # window in every other layer
    "rotary": ModelConfig(
        d_model=64,
        n_heads=4,
        n_kv_heads=2,
        n_layers=2,
        head_dim=32,
        bias=False,
        norm="rmsnorm",
        qk_norm="rmsnorm",
        rope_theta=1e4,
        rope_scaling="llama3",
        rope_scaling_factor=8.0,
        rope_original_max_position=64,
        sliding_window=24,
        sliding_window_pattern=2,
        max_seq_len=512,
    ),
    # partial, interleaved rotation (GPT-J's pairing, Phi's partial width) with linear scaling
    "rotary-partial": ModelConfig(
        d_model=128,
        n_heads=4,
        n_kv_heads=4,
        n_layers=1,
        rope_theta=500.0,
        rotary_dim=16,
        rope_pairing="interleaved",
        rope_scaling="linear",
        rope_scaling_factor=2.0,
        max_seq_len=512,
    ),
    # whole decoders (token ids in, logits out): Llama's block (RMSNorm, RoPE, GQA, a gated SiLU MLP, its
    # own head) and GPT-2's (LayerNorm with biases, learned positions, a dense tanh-GELU MLP, a tied head)
    "whole": ModelConfig(
        d_model=64,
        n_heads=4,
        n_kv_heads=2,
        n_layers=2,
        bias=False,
        norm="rmsnorm",
        rope_theta=1e4,
        max_seq_len=64,  # short: each static form's pool rung decodes until its rows are full
        vocab_size=320,  # a byte-level BPE tokenizer's (tests/fixtures/text.py): its artifact carries one
        mlp="gated",
        mlp_width=96,
    ),
    "whole-gpt2": ModelConfig(
        d_model=64,
        n_heads=4,
        n_kv_heads=4,
        n_layers=2,
        max_seq_len=64,
        vocab_size=256,
        mlp="dense",
        mlp_width=128,
        mlp_activation="gelu_tanh",
        mlp_bias=True,
        learned_positions=True,
        tie_embeddings=True,
    ),
}


@pytest.fixture(scope="session", autouse=True)
def background_stops():
    """The servers stopped beside the next tests (tests/fixtures/stops.py) have all ended, each cleanly."""
    from tests.fixtures import stops

    yield
    problems = stops.finish()
    assert not problems, "\n".join(problems)


@pytest.fixture(scope="session")
def artifact_dir(tmp_path_factory, prebuilds):
    """`artifact_dir(name)` -> an artifact directory built from TEST_CONFIGS[name] once per session,
    with the variants tests/fixtures/builds.py's `artifact_build(name)` names (made ahead in the background
    where the session's tests need it later: tests/fixtures/prebuilds.py)."""
    from tests.fixtures.prebuilds import artifact_key

    built: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in built:
            built[name] = prebuilds.wait(artifact_key(name)) or build_here(name)
        return built[name]

    def build_here(name: str) -> Path:
        out = tmp_path_factory.mktemp(artifact_key(name))
        build_test_artifact(name, out)
        return out

    return get


def build_test_artifact(name: str, out: Path) -> None:
    """TEST_CONFIGS[name] built into `out` with its variants (its tokenizer, where it has one, saved beside)."""
    from export.build import build
    from export.progress import Progress
    from tests.fixtures.builds import artifact_build

    text = artifact_text_files(name, out.with_name(f"{out.name}-text"))
    build(TEST_CONFIGS[name], out, artifact_build(name), progress=Progress(enabled=False), text_files=text)


# The trained model's forms the tests build: the served CPU forms and the quantized caches, whose held-out cost
# the quality ladder bounds (export/quality.py). Its fp16 and INT8-weight forms cost 9.6 s and 10 s of parity
# here; their ladder is proven on a stand-in (tests/export/test_quality.py) and measured in docs/trained-model.md.
TRAINED_VARIANTS = ("fp32-fused", "fp32-static", "fp32-static-int8kv", "fp32-static-int4kv")


@pytest.fixture(scope="session")
def trained_artifact(tmp_path_factory, prebuilds) -> Path:
    """The model trained here (models/fortunes: export/train.py) imported and built as `make serve` builds it
    (serving/triton/cli.py `export_trained`), once per session with TRAINED_VARIANTS, its held-out text scored
    through each (the report's `quality`); the artifact's folder (made ahead in the background where the
    session's tests need it later: tests/fixtures/prebuilds.py)."""
    from tests.fixtures.prebuilds import TRAINED_KEY

    prebuilt = prebuilds.wait(TRAINED_KEY)
    if prebuilt is not None:
        return prebuilt
    out = tmp_path_factory.mktemp("artifact-trained")
    build_trained_artifact(out, tmp_path_factory.mktemp("repository-trained"))
    return out


def build_trained_artifact(out: Path, repository: Path) -> None:
    from serving.triton.cli import export_trained, has_trained

    report = export_trained(repository, out, variants=TRAINED_VARIANTS)
    assert report["passed"] and has_trained(repository), report


def artifact_text_files(name: str, folder: Path) -> tuple[Path, ...]:
    """The `whole` artifact's tokenizer files (a checkpoint's, as transformers saves them, into `folder`): its
    served model takes text too (the OpenAI-compatible routes); the others serve token ids only."""
    if name != "whole":
        return ()
    from contract.files import TEXT_FILES
    from tests.fixtures.text import save_tokenizer

    folder.mkdir(exist_ok=True)
    save_tokenizer(folder, TEST_CONFIGS[name].vocab_size, template="chatml")
    return tuple(folder / file for file in TEXT_FILES if (folder / file).is_file())


TIERS = ("served", "slow", "gpu")


def pytest_collection_modifyitems(config, items) -> None:
    items[:] = trained_model_later(items)
    for item in items:
        if "triton" in item.fixturenames:
            item.add_marker(pytest.mark.served)
        if "artifact_dir" in item.fixturenames:  # a full build with its parity ladder: 10 to 30 s a config
            item.add_marker(pytest.mark.slow)
        if not any(item.get_closest_marker(tier) for tier in TIERS):
            item.add_marker(pytest.mark.unit)


def trained_model_later(items: list) -> list:
    """The export tests of the trained model after the rest of the session's tests, their modules whole: its build
    (tests/fixtures/prebuilds.py: the training and four forms, in the background at the lowest priority) is ready by
    then, where in their place test_train waited 30 s for it (measured on 2 cores). The later folders' tests that
    take it come after minutes of the suite's idle CPU."""
    later_modules = {
        item.module for item in items if "trained_artifact" in item.fixturenames and "/export/" in str(item.path)
    }
    return sorted(items, key=lambda item: item.module in later_modules)  # stable: each part keeps its order
