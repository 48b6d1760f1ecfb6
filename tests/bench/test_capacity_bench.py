"""`python -m bench capacity` end to end, bounded: the tiny model at a max_seq_len of 2,048 with a
16 MiB budget, one round, 3 served steps a session through a real Triton per cache; it writes its
JSON, its plot and its table, and what it counted follows from the bytes (timings are not asserted:
this is a smoke test)."""

import json
import subprocess
import sys

import pytest

from contract.config import preset
from serving.engine.settings import MIN_ROW_POSITIONS

pytestmark = [pytest.mark.served, pytest.mark.slow, pytest.mark.timeout(600)]

MAX_SEQ_LEN, BUDGET_MIB, TOKENS = 2048, 16, 300
# its run is `python -m bench capacity` in a process of its own: no torch in this process (conftest.py)
TORCH_FREE_RUNS = ("capacity",)


def bench_jobs(root, artifact_dir) -> dict:
    """Run by tests/bench/conftest.py with the other benchmarks' smoke runs. This one builds its artifact
    (an export and three parity ladders: the longest run), so it runs as `python -m bench` in a process of
    its own: its Python does not wait on the others' for the interpreter lock."""
    args = ["capacity", "--preset", "tiny", "--max-seq-len", str(MAX_SEQ_LEN), "--budget-mib", str(BUDGET_MIB)]
    args += ["--session-tokens", str(TOKENS), "--pasts", "256,512", "--batch-past", "300", "--rounds", "1"]
    args += ["--seconds", "0.05", "--served-steps", "3", "--threads", "1"]  # one thread: see test_sessions_bench
    args += ["--out", str(root / "results"), "--work", str(root / "work")]
    command = [sys.executable, "-m", "bench", *args]
    return {"capacity": lambda: subprocess.run(command, capture_output=True, text=True, timeout=540, check=False)}


def test_the_capacity_benchmark_counts_sessions_by_cache_and_row_size(bench_runs):
    run = bench_runs["capacity"]
    done = run.result()
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    out = run.root / "results"
    results = json.loads((out / "capacity.json").read_text())
    assert (out / "capacity.png").read_bytes().startswith(b"\x89PNG")
    cfg, budget = preset("tiny"), BUDGET_MIB << 20
    row_of_300 = 2 * MIN_ROW_POSITIONS  # 300 positions take a row of 512 of the sizes 256, 512, 1024, 2048
    for cache, bits in (("fp32", 32), ("int8", 8), ("int4", 4)):
        per_position = cfg.kv_cache_bytes(1, 1, 1) * bits // 8
        full, sized = (results["admission"][f"{cache}, {rows} rows"] for rows in ("full", "sized"))
        assert full["sessions"] == budget // (per_position * MAX_SEQ_LEN), (cache, full)
        assert sized["sessions"] == budget // (per_position * row_of_300), (cache, sized)
        assert sized["allocated_bytes"] <= budget and "budget is full" in sized["refusal"]
    assert results["admission"]["int8, sized rows"]["vs_fp32_full"] == 4 * MAX_SEQ_LEN / row_of_300
    for past in ("256", "512"):
        assert set(results["decode"]["pasts"][past]["timings"]) == {"fp32", "int8", "int4", "torch"}
    # one pool of one stride: the 16 decode in one graph run, whatever their lengths
    assert {name: entry["decode_runs_per_step"] for name, entry in results["batch"].items()} == {
        "fp32, one size": 1,
        "int8, one size": 1,
        "int4, one size": 1,
        "fp32, four sizes": 1,
    }
    served = results["served"]  # 16 sessions through a real Triton per cache
    assert set(served) == {"fp32", "int8", "int4"} and all(entry["steps_per_s"] > 0 for entry in served.values())
    assert served["fp32"]["vs_fp32"] == 1.0
    assert "sessions of 300 positions in 16 MiB" in done.stdout
