"""`python -m export build` end to end, on a config no preset uses."""

import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest
from onnx import numpy_helper

from contract import files, names
from contract.config import ModelConfig
from export import __main__ as cli
from export import build
from export.onnx_export import plain_graph, save_onnx
from serving.engine.ort import ort_runner, ort_session
from tests import reference
from tests.conftest import TEST_CONFIGS
from tests.fixtures.prebuilds import Job

ROOT = Path(__file__).resolve().parents[2]

UNSEEN = TEST_CONFIGS["unseen"]  # 96 wide, 6 heads, 2 kv heads, 3 layers


CLI_BUILD_KEY = "cli-build"
OUTCOME = "outcome.json"  # the command's exit code and output, kept beside its `--out`


def run_cli_build(directory: Path) -> None:
    """`python -m export build --config ... --out directory/out --variants fp32` in a process of its own."""
    config_path = directory / "my_config.json"
    config_path.write_text(json.dumps(UNSEEN.to_dict()))
    command = [sys.executable, "-m", "export", "build", "--config", str(config_path), "--out", str(directory / "out")]
    proc = subprocess.run([*command, "--variants", "fp32"], check=False, capture_output=True, text=True, timeout=300)
    outcome = {"args": proc.args, "returncode": proc.returncode, "stdout": proc.stdout, "stderr": proc.stderr}
    (directory / OUTCOME).write_text(json.dumps(outcome))


def prebuild_jobs(item) -> dict:
    """The command's run, made ahead in the background (tests/fixtures/prebuilds.py)."""
    return {CLI_BUILD_KEY: cli_build_job} if "cli_build" in item.fixturenames else {}


def cli_build_job(mktemp) -> Job:
    directory = mktemp("cli")
    return Job(run_cli_build, (directory,), directory)


@pytest.fixture(scope="module")
def cli_build(tmp_path_factory, prebuilds):
    """(the finished command, its `--out`)."""
    directory = prebuilds.wait(CLI_BUILD_KEY)
    if directory is None:
        directory = tmp_path_factory.mktemp("cli")
        run_cli_build(directory)
    return subprocess.CompletedProcess(**json.loads((directory / OUTCOME).read_text())), directory / "out"


@pytest.mark.slow  # a whole build
def test_build_writes_the_artifact_and_prints_a_table(cli_build):
    proc, out = cli_build
    assert proc.returncode == 0, proc.stderr
    assert {p.name for p in out.iterdir()} == {"config.json", "weights.safetensors", "model.fp32.onnx", "report.json"}
    assert ModelConfig.load(out) == UNSEEN
    assert "fp32" in proc.stdout and "pass" in proc.stdout
    assert "fp32: export ... done" in proc.stderr and "fp32: parity ... done" in proc.stderr  # progress
    report = json.loads((out / files.REPORT_FILENAME).read_text())  # each kept file's digest, for the repository
    assert report["variants"]["fp32"]["sha256"] == files.sha256(out / "model.fp32.onnx")


@pytest.mark.slow  # a whole build
def test_report_gives_every_outputs_error_and_where_it_is(cli_build):
    _, out = cli_build
    report = json.loads((out / "report.json").read_text())
    entry = report["variants"]["fp32"]
    assert report["passed"] and entry["passed"] and entry["file"] == "model.fp32.onnx"
    assert entry["file_bytes"] == (out / "model.fp32.onnx").stat().st_size
    assert entry["op_histogram"]["MatMul"] >= 6 * UNSEEN.n_layers
    assert set(entry["worst"]) == set(names.output_names(UNSEEN))
    for name, error in entry["worst"].items():
        assert 0 <= error["max_abs"] <= 1e-5, name
        assert error["max_rel"] >= 0 and len(error["index"]) in (3, 4) and error["scenario"] in build.SCENARIOS
    steps = entry["parity"]["empty_past"]["output_error_per_step"]
    assert len(steps) == build.SCENARIOS["empty_past"].steps + 1


@pytest.mark.slow  # a whole build
def test_the_exported_graph_matches_an_independent_implementation(cli_build):
    """Left-padded prefill then 16 decode steps, each fed the presents ONNX Runtime returned."""
    _, out = cli_build
    weights = reference.load_weights(out / "weights.safetensors")
    run = ort_runner(ort_session(out / "model.fp32.onnx"))
    rng = np.random.default_rng(11)
    B, prefill = 3, 6
    mask = np.ones((B, prefill), dtype=np.int64)
    mask[1, :2] = 0
    mask[2, :5] = 0
    hidden = rng.standard_normal((B, prefill, UNSEEN.d_model)).astype(np.float32)
    past, worst = None, 0.0
    for _ in range(17):
        feeds = {names.HIDDEN_STATES: hidden, names.ATTENTION_MASK: mask}
        if past:
            feeds.update(
                {
                    names.past_name(i, kind): past[i][j]
                    for i in range(UNSEEN.n_layers)
                    for j, kind in enumerate(names.KV_KINDS)
                }
            )
        outputs = run(feeds)
        expected, presents = reference.forward(UNSEEN, weights, hidden, mask, past)
        real = reference.real_rows(mask, hidden.shape[1])
        worst = max(worst, float(np.abs(outputs[names.OUTPUT][real] - expected[real]).max()))
        for i, (key, value) in enumerate(presents):
            for kind, theirs in zip(names.KV_KINDS, (key, value), strict=True):
                ours = outputs[names.present_name(i, kind)]
                real_keys = mask == 1
                np.testing.assert_allclose(
                    ours.transpose(0, 2, 1, 3)[real_keys], theirs.transpose(0, 2, 1, 3)[real_keys], atol=1e-4
                )
        past = [
            (outputs[names.present_name(i, names.KEY)], outputs[names.present_name(i, names.VALUE)])
            for i in range(UNSEEN.n_layers)
        ]
        hidden = rng.standard_normal((B, 1, UNSEEN.d_model)).astype(np.float32)
        mask = np.concatenate([mask, np.ones((B, 1), dtype=np.int64)], axis=1)
    assert worst <= 1e-4
    print(f"unseen config, fp32 ONNX vs the independent implementation over 17 steps: max abs error {worst:.2e}")


@pytest.mark.slow  # a whole build
def test_preset_build_in_process(tmp_path, capsys):
    assert cli.main(["build", "--preset", "tiny", "--out", str(tmp_path), "--variants", "fp32"]) == 0
    assert "pass" in capsys.readouterr().out
    assert (tmp_path / "model.fp32.onnx").is_file()


def test_an_invalid_config_exits_2_naming_the_field(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"d_model": 100, "n_heads": 8}))
    assert cli.main(["build", "--config", str(bad), "--out", str(tmp_path / "out")]) == 2
    assert "n_heads (8) must divide d_model (100)" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


@pytest.mark.slow  # a whole build
def test_a_variant_that_fails_parity_fails_the_command_and_is_not_kept(tmp_path, capsys, monkeypatch):
    def export_with_a_wrong_weight(model, path):
        proto = plain_graph(model)  # the model's own export (one per process: export/onnx_export.py)
        bias = next(t for t in proto.graph.initializer if t.name == "model.layers.0.attn.W_v.bias")
        wrong = numpy_helper.to_array(bias).copy()
        wrong[0] += 1e-3  # a small slip somewhere in the graph
        bias.CopyFrom(numpy_helper.from_array(wrong, bias.name))
        return save_onnx(proto, path)

    wrong = build.Variant("fp32", export_with_a_wrong_weight, build.TOLERANCES["fp32"])
    monkeypatch.setitem(build.VARIANTS, "fp32", wrong)
    assert cli.main(["build", "--preset", "tiny", "--out", str(tmp_path), "--variants", "fp32"]) == 1
    captured = capsys.readouterr()
    assert "FAIL" in captured.out and "parity failed" in captured.err
    assert not (tmp_path / "model.fp32.onnx").exists()
    assert not list(tmp_path.parent.glob(f".{tmp_path.name}.*.partial"))  # the staging folder beside it is gone
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["passed"] is False and report["variants"]["fp32"]["file"] is None
    assert report["variants"]["fp32"]["worst"]["present.0.value"]["max_abs"] > 1e-5


# --- a file system that refuses the build -----------------------------------------------------------


def tree(directory: Path) -> dict[str, str]:
    """Each file under `directory` (names relative to it) and its sha256: what a failure must not change."""
    return {str(p.relative_to(directory)): files.sha256(p) for p in sorted(directory.rglob("*")) if p.is_file()}


def build_command(out: Path) -> list[str]:
    return [sys.executable, "-m", "export", "build", "--preset", "tiny", "--variants", "fp32", "--out", str(out)]


def test_an_out_path_inside_a_file_is_one_clear_error_and_nothing_is_made(tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("a file where a folder would go")
    before = tree(tmp_path)
    assert cli.main(["build", "--preset", "tiny", "--out", str(tmp_path / "notes.txt" / "out")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == (
        f"error: cannot write {tmp_path / 'notes.txt' / 'out'}: Not a directory (ENOTDIR): {tmp_path / 'notes.txt'}; "
        "nothing was changed there"
    )
    assert tree(tmp_path) == before and sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]


@pytest.mark.slow  # a build
def test_a_full_disk_leaves_the_earlier_build_as_it_was_and_says_so_in_one_line(tmp_path):
    """RLIMIT_FSIZE in the child (honest as root too, unlike chmod): the config fits, the weights do
    not, as when a disk fills up mid-build (the staging folder holds a file by then); a rebuild over
    an earlier artifact and a first build, run side by side."""
    earlier = tmp_path / "earlier"
    assert cli.main(["build", "--preset", "tiny", "--out", str(earlier), "--variants", "fp32"]) == 0
    limit = 4096
    assert (earlier / files.MODEL_CONFIG_FILENAME).stat().st_size < limit  # the staging folder gets a file
    assert (earlier / files.WEIGHTS_FILENAME).stat().st_size > limit  # the weights are what hits the limit
    before = tree(tmp_path)

    # util-linux's prlimit sets the file size limit and execs the build (no preexec_fn: no Python in a forked child
    # of this process's threads); Python ignores SIGXFSZ, so its writes past the limit get EFBIG
    small_disk = ["prlimit", f"--fsize={limit}", "--"]
    outs = (earlier, tmp_path / "first")
    procs = [
        subprocess.Popen([*small_disk, *build_command(out)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for out in outs
    ]
    try:
        for out, proc in zip(outs, procs, strict=True):
            _, stderr = proc.communicate(timeout=300)
            assert proc.returncode == 1, stderr
            assert "Traceback" not in stderr, stderr
            assert stderr.strip().splitlines()[-1] == (
                f"error: cannot write {out}: File too large (EFBIG); nothing was changed there"
            )
    finally:
        for proc in procs:
            proc.kill()  # a no-op for one that has exited
            proc.wait()
    assert tree(tmp_path) == before  # the earlier build byte for byte, no first/, no staging folder
    assert sorted(p.name for p in tmp_path.iterdir()) == ["earlier"]


# The command with everything imported first, then (as root, who writes through any mode) as `nobody`,
# so that a read-only folder is read-only to it
AS_NOBODY = """
import os, sys
from export import __main__ as cli
import export.build, export.report  # what the command imports when it runs
if os.geteuid() == 0:
    os.setegid(65534)
    os.seteuid(65534)
sys.exit(cli.main(sys.argv[1:]))
"""


def test_a_read_only_out_directory_fails_before_building_and_stays_as_it_was():
    place = Path(tempfile.mkdtemp(prefix="read-only-"))  # under /tmp: a folder `nobody` may enter
    try:
        place.chmod(0o755)
        out = place / "out"
        out.mkdir()
        (out / "kept.txt").write_text("already here")
        out.chmod(0o555)
        before = tree(place)
        command = [sys.executable, "-c", AS_NOBODY, "build", "--preset", "tiny", "--out", str(out)]
        done = subprocess.run(command, capture_output=True, text=True, timeout=120, check=False, cwd=ROOT)
        assert done.returncode == 1, done.stdout + done.stderr
        err = done.stderr.strip().splitlines()
        assert err[-1] == f"error: cannot write {out}: Permission denied (EACCES): {out}; nothing was changed there"
        assert tree(place) == before and sorted(p.name for p in place.iterdir()) == ["out"]
    finally:
        (place / "out").chmod(0o755)
        shutil.rmtree(place)
