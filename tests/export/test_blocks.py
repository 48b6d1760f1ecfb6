"""The block's parts (norm x residual): every variant builds, fuses and passes the parity ladder for each,
and the Triton repository filled from it fits its graphs."""

import json
from pathlib import Path

import pytest

from contract import files, names
from contract.config import ModelConfig
from export.build import build
from export.progress import Progress
from serving.triton import repository
from serving.triton.config import FORWARD, FORWARD_ONNX, SESSIONS
from tests.fixtures.builds import FULL_BUILD, FULL_VARIANTS
from tests.fixtures.configs import assert_fits, graph_io, loaded_onnx, model_filename_of, read_config
from tests.fixtures.prebuilds import folder_job

pytestmark = pytest.mark.slow  # a whole build with its parity ladder per block

# the default block (pre-norm residual) is built by every other test (tests/conftest.py TEST_CONFIGS)
BLOCKS = {
    "norm-only": {"norm": "layernorm", "residual": False},
    "residual-only": {"norm": "none", "residual": True},
    "bare": {"norm": "none", "residual": False, "bias": False},
}


def block_config(block: str) -> ModelConfig:
    return ModelConfig(d_model=32, n_heads=4, n_kv_heads=2, n_layers=2, max_seq_len=64, **BLOCKS[block])


def build_block(block: str, out: Path) -> None:
    build(block_config(block), out, FULL_BUILD, progress=Progress(enabled=False))


def block_key(block: str) -> str:
    return f"block-{block}"


def prebuild_jobs(item) -> dict:
    """The block this test reads, built ahead in the background (tests/fixtures/prebuilds.py)."""
    block = getattr(getattr(item, "callspec", None), "params", {}).get("built")
    return {block_key(block): folder_job(block_key(block), build_block, block)} if block in BLOCKS else {}


@pytest.fixture(scope="module", params=list(BLOCKS))
def built(request, tmp_path_factory, prebuilds):
    """(the block's config, its artifact, the build's report as written)."""
    out = prebuilds.wait(block_key(request.param))
    if out is None:
        out = tmp_path_factory.mktemp(block_key(request.param))
        build_block(request.param, out)
    return block_config(request.param), out, json.loads((out / files.REPORT_FILENAME).read_text())


def test_every_variant_builds_fuses_and_passes(built):
    cfg, _, report = built
    assert report["passed"] and report["config"] == cfg.to_dict()
    for name in FULL_VARIANTS:
        entry = report["variants"][name]
        assert entry["passed"] and entry["file"] == files.model_filename(name), (name, entry["problems"])
        assert entry["fused_attention_ops"] == (0 if name == "fp32" else cfg.n_layers), name
        has_norm = "LayerNormalization" in entry["op_histogram"]
        assert has_norm == (cfg.norm == "layernorm"), (name, entry["op_histogram"])


def test_the_repository_fits_every_block(built, tmp_path):
    _, out, _ = built
    repo = repository.write_repository(out, tmp_path / "repo")
    assert repository.is_complete(repo)
    map_names = names.attention_map_names(ModelConfig.load(out).n_layers)
    for model in (FORWARD, FORWARD_ONNX):
        config = read_config(repo, model)
        maps = [t for t in config.output if t.name in map_names]  # the inspection graph's, when asked
        served = [t for t in [*config.input, *config.output] if t not in maps]
        assert_fits(served, graph_io(loaded_onnx(repo, config)), batch_axis_added=False)
        if maps:
            inspection = graph_io(repo / model / repository.VERSION / model_filename_of(config))
            assert_fits([*config.input, *config.output], inspection, batch_axis_added=False)
    session = read_config(repo, SESSIONS)  # the static engine: new tokens in, lengths instead of the mask
    graph = graph_io(loaded_onnx(repo, session))
    # held_length and a snapshot's blob are the model's, not the graph's; the maps the inspection graph's
    model_only = (names.HELD_LENGTH, names.SNAPSHOT)
    graph_outputs = [t for t in session.output if t.name not in (*model_only, *map_names)]
    assert_fits([session.input[0], *graph_outputs], graph, batch_axis_added=True)
