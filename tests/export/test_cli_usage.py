"""What a new user meets before any build: the usage without a command, --help and a mistyped flag
answered without importing torch, a checkpoint folder as --weights, a Hugging Face checkpoint where an
artifact or one of our configs is expected, and which variants a build makes by default."""

import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import save_file

from contract import files
from contract.config import ModelConfig
from export import __main__ as cli
from export import artifacts, build, choices
from export.importers import WeightsError, import_weights
from export.model import AttentionModel
from serving.engine import placement

# main() in a fresh interpreter, then which heavy modules it imported
LOADED = """
import sys
from export import __main__ as cli
try:
    code = cli.main(sys.argv[1:])
except SystemExit as done:
    code = done.code
print(sorted(m for m in ("torch", "onnx", "onnxruntime", "numpy") if m in sys.modules))
sys.exit(code)
"""


def run_cli(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", LOADED, *argv], capture_output=True, text=True, timeout=120, check=False
    )


def test_no_command_prints_the_usage_and_builds_nothing():
    done = run_cli()
    assert done.returncode == 2
    assert done.stderr.splitlines() == [
        "usage: python -m export [-h] {build,inspect,train} ...",
        "python -m export: error: give a command: build, inspect or train (--help says more)",
    ]
    assert done.stdout.strip() == "[]"  # nothing heavy was even imported


@pytest.mark.parametrize("argv", [["--help"], ["build", "--help"], ["inspect", "--help"], ["train", "--help"]])
def test_help_answers_without_importing_torch(argv):
    done = run_cli(*argv)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"usage: python -m export {argv[0] if len(argv) > 1 else ''}".rstrip())
    assert done.stdout.strip().splitlines()[-1] == "[]"


def test_a_mistyped_flag_prints_the_commands_usage_without_importing_torch(tmp_path):
    done = run_cli("build", "--preset", "tiny", "--out", str(tmp_path / "out"), "--varaints", "fp32")
    assert done.returncode == 2
    assert done.stderr.startswith("usage: python -m export build ")
    assert done.stderr.splitlines()[-1] == "python -m export build: error: unrecognized arguments: --varaints fp32"
    assert done.stdout.strip() == "[]" and not (tmp_path / "out").exists()


def test_an_unknown_variant_is_named_with_the_choices():
    done = run_cli("build", "--out", "x", "--variants", "cpu,fp8")
    assert done.returncode == 2
    assert "error: argument --variants: unknown variant(s) ['fp8']; choose from ['fp32', " in done.stderr
    assert "or a set: cpu, cuda, tensorrt, all" in done.stderr


# --- which variants a build makes -------------------------------------------------------------------


def test_a_build_makes_what_this_machine_serves_and_says_how_to_build_the_rest():
    assert choices.variants_for(placement.host_kind()) == build.DEFAULT_VARIANTS
    if build.HOST == choices.CPU:  # this machine's ONNX Runtime has no CUDA device
        assert build.DEFAULT_VARIANTS == ("fp32", "fp32-fused", "fp32-fused-inspect", "fp32-static")
        assert build.default_note() == (
            "built for this machine (cpu): fp32, fp32-fused, fp32-fused-inspect, fp32-static; build the rest "
            "with --variants fp16-fused,fp16-static,fp32-static-int8kv,fp32-static-int4kv,fp32-fused-int8w,"
            "fp32-static-int8w,fp32-fused-int4w,fp32-static-int4w,fp32-trt,fp16-trt (or --variants all)"
        )


def test_each_host_serves_what_the_one_before_it_does_and_every_variant_stays_buildable_by_name():
    cpu, cuda, tensorrt = (set(choices.variants_for(host)) for host in choices.HOSTS)
    assert cpu < cuda < tensorrt < set(build.VARIANTS)
    assert cuda - cpu == {"fp16-fused", "fp16-static"} and tensorrt - cuda == {"fp32-trt", "fp16-trt"}
    assert set(build.VARIANTS) - tensorrt == {
        "fp32-static-int8kv",
        "fp32-static-int4kv",
        "fp32-fused-int8w",
        "fp32-static-int8w",
        "fp32-fused-int4w",
        "fp32-static-int4w",
    }
    assert choices.parse_variants("cpu, fp32-static-int8kv,cpu") == ("cpu", "fp32-static-int8kv")
    assert choices.expand(("fp32-static-int8kv", "cpu")) == (*choices.variants_for(choices.CPU), "fp32-static-int8kv")


def test_a_set_skips_what_the_config_cannot_have_and_a_name_fails(tmp_path):
    odd = ModelConfig(d_model=36, n_heads=3, n_kv_heads=3, n_layers=1, max_seq_len=64)  # head_dim 12: no static form
    with pytest.raises(build.BuildError, match="fp32-static"):
        build.build(odd, tmp_path / "named", ("fp32-static",), progress=build.Progress(enabled=False))
    report = build.build(odd, tmp_path / "set", ("fp32", "cpu"), progress=build.Progress(enabled=False))
    assert report["passed"] and list(report["variants"]) == list(choices.variants_for(choices.CPU))
    assert report["variants"]["fp32-static"]["file"] is None and report["variants"]["fp32-static"]["skipped"]


# --- a checkpoint folder as --weights ---------------------------------------------------------------

CFG = ModelConfig(d_model=48, n_heads=6, n_kv_heads=2, n_layers=2, max_seq_len=300, norm_eps=1e-6)


def equal_weights(imported, model) -> bool:
    return all(torch.equal(imported.model.state_dict()[k], v) for k, v in model.state_dict().items())


def test_a_checkpoint_folder_is_read_through_its_one_safetensors_file(tmp_path):
    model = AttentionModel(CFG, seed=9)
    artifacts.save_artifact(model, tmp_path)  # config.json and weights.safetensors
    imported = import_weights(tmp_path, "native")
    assert imported.model.cfg == CFG and equal_weights(imported, model)
    assert imported.weights["file"] == str(tmp_path / files.WEIGHTS_FILENAME)


def test_a_sharded_checkpoint_folder_is_read_through_its_index(tmp_path):
    model = AttentionModel(CFG, seed=3)
    model.cfg.save(tmp_path)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    shards = {"model-00001-of-00002.safetensors": {}, "model-00002-of-00002.safetensors": {}}
    for key, tensor in state.items():
        shards[sorted(shards)[key.startswith("layers.1.")]][key] = tensor
    for name, tensors in shards.items():
        save_file(tensors, str(tmp_path / name))
    weight_map = {key: name for name, tensors in shards.items() for key in tensors}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    imported = import_weights(tmp_path, "native")
    assert equal_weights(imported, model) and sorted(imported.weights["shards"]) == sorted(shards)
    assert imported.weights["file"] == str(tmp_path / "model.safetensors.index.json")


def test_a_folder_without_one_checkpoint_names_what_it_holds(tmp_path, capsys):
    for name in ("a.safetensors", "b.safetensors"):
        save_file({"x": torch.zeros(2)}, str(tmp_path / name))
    with pytest.raises(WeightsError) as raised:
        import_weights(tmp_path, "native")
    assert str(raised.value) == (
        f"{tmp_path}: a folder without one checkpoint to read: expected model.safetensors.index.json or "
        "model.safetensors, one *.safetensors.index.json or one *.safetensors; it holds "
        "['a.safetensors', 'b.safetensors']; give --weights the file"
    )
    assert cli.main(["build", "--weights", str(tmp_path), "--layout", "native", "--out", str(tmp_path / "o")]) == 2
    assert capsys.readouterr().err.startswith(f"error: {tmp_path}: a folder without one checkpoint")


# --- a Hugging Face checkpoint where an artifact or a config of ours is expected -------------------


@pytest.fixture
def hf_folder(tmp_path):
    folder = tmp_path / "TinyLlama"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64, "vocab_size": 100}))
    return folder


def test_a_hugging_face_checkpoint_given_as_an_artifact_says_what_it_is(hf_folder, tmp_path, capsys):
    assert cli.main(["inspect", str(hf_folder), "--out", str(tmp_path / "maps.png")]) == 2
    assert capsys.readouterr().err == (
        f"error: {hf_folder} is a Hugging Face checkpoint (model_type 'llama'), not an artifact; build an "
        f"artifact from it: python -m export build --weights {hf_folder} --layout hf --out DIR\n"
    )


@pytest.mark.parametrize("given", ["folder", "its config.json"])
def test_a_hugging_face_checkpoint_given_as_our_config_says_what_it_is(hf_folder, tmp_path, capsys, given):
    config = hf_folder if given == "folder" else hf_folder / "config.json"
    assert cli.main(["build", "--config", str(config), "--out", str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err == (
        f"error: {config} is a Hugging Face checkpoint (model_type 'llama'), not a config of ours "
        f"(contract/config.py); build an artifact from it: python -m export build --weights {hf_folder} "
        "--layout hf --out DIR\n"
    )
    assert not (tmp_path / "out").exists()
