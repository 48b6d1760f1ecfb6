"""The serving benchmark's bookkeeping, without a server: bytes on the wire, the targets (engine
comparison, memory bounds), the table; and `python -m bench serving --quick` end to end against real Tritons
(its JSON, plot and table; timings are not asserted: this is a smoke test)."""

import json
import subprocess
import sys

import pytest

from bench import serving
from contract.config import preset

# its run is `python -m bench serving` in a process of its own: it builds its artifact (an export), which must not
# meet the torch of the runs in this process (tests/bench/conftest.py)
TORCH_FREE_RUNS = ("serving",)


def bench_jobs(root, artifact_dir) -> dict:
    """Run by tests/bench/conftest.py with the other benchmarks' smoke runs."""
    args = ["serving", "--quick", "--threads", "1", "--out", str(root / "results"), "--work", str(root / "work")]
    command = [sys.executable, "-m", "bench", *args]
    return {"serving": lambda: subprocess.run(command, capture_output=True, text=True, timeout=540, check=False)}


@pytest.mark.served
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_quick_serving_benchmark_times_every_mode_and_engine_and_says_each_target(bench_runs):
    run = bench_runs["serving"]
    done = run.result()
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    out = run.root / "results"
    results = json.loads((out / "serving.json").read_text())
    assert (out / "serving.png").read_bytes().startswith(b"\x89PNG")
    for row in results["latency"]:
        assert set(row["modes"]) == set(serving.MODES), row["past"]
        assert all(0 < mode["p50_ms"] <= mode["p99_ms"] for mode in row["modes"].values())
    engines = {entry["engine"] for entry in results["throughput"] if "error" not in entry}
    assert engines == set(serving.THROUGHPUT_MODELS) and set(results["memory"]) == engines
    assert all(entry["steps_per_s"] > 0 for entry in results["throughput"] if "error" not in entry)
    assert {"served_static_step", "static_wins_everywhere"} <= set(results["targets"])
    assert "decode step latency" in done.stdout and "targets:" in done.stdout


MIB = 1 << 20


def test_a_stateful_step_sends_the_same_bytes_at_any_past_a_stateless_one_ships_the_cache():
    cfg = preset("tiny")
    short, long = serving.wire_bytes(cfg, 16), serving.wire_bytes(cfg, 256)
    for key in ("stateful_request_grpc", "stateful_request_http", "stateful_response_tensors"):
        assert short[key] == long[key]
    cache_growth = cfg.kv_cache_bytes(1, 256) - cfg.kv_cache_bytes(1, 16)
    assert long["stateless_request_grpc"] - short["stateless_request_grpc"] >= cache_growth
    assert long["stateless_request_http"] - short["stateless_request_http"] >= cache_growth


def row(past: int, **p50: float) -> dict:
    modes = {mode: {"p50_ms": 1.0, "p99_ms": 1.0, "runs": 3} for mode in serving.MODES}
    for mode, value in p50.items():
        modes[mode.replace("_", "/")] = {"p50_ms": value, "p99_ms": value, "runs": 3}
    return {"past": past, "modes": modes, "bytes": serving.wire_bytes(preset("tiny"), past)}


def rate(engine: str, sessions: int, steps_per_s: float, run: int = 1, peak_mib: int = 200) -> dict:
    return {
        "engine": engine,
        "sessions": sessions,
        "past": 1024,
        "run": run,
        "steps_per_s": steps_per_s,
        "peak_own_bytes": peak_mib * MIB,
        "peak_shared_bytes": 400 * MIB,
    }


def memory(*own_mib: int) -> list[dict]:
    return [{"own_bytes": m * MIB, "shared_bytes": 300 * MIB} for m in own_mib]


def results(after_runs_mib: tuple[int, ...], static_16: float = 1800.0) -> dict:
    latency = [
        row(128, **{"in-process/static": 0.4, "in-process/concat": 0.5, "stateful/grpc": 1.2, "noop/grpc": 0.6}),
        row(4096, **{"in-process/static": 2.5, "in-process/concat": 2.0, "stateful/grpc": 3.2, "noop/grpc": 0.6}),
    ]
    for r in latency:
        r["modes"]["stateful/grpc/concat"] = {"p50_ms": 5.0, "p99_ms": 5.0, "runs": 3}
    throughput = [rate("static", 1, 500.0), rate("static", 16, static_16), rate("concat", 1, 450.0)]
    throughput += [rate("concat", 16, 700.0), rate("static", 16, 1750.0, run=2), rate("static", 1, 350.0, run=2)]
    throughput += [rate("noop", 1, 1000.0), rate("noop", 16, 2500.0)]
    stubs = {
        "static": {"engine": "static", "before": memory(120)[0], "after": memory(*after_runs_mib)},
        "concat": {"engine": "concat", "before": memory(110)[0], "after": memory(300, 600)},
    }
    sizes = {"pool_bytes": 100 * MIB, "weight_bytes": MIB}
    return {"latency": latency, "throughput": throughput, "memory": stubs, **sizes}


def test_the_targets_measure_what_they_say():
    measured = serving.targets(results((150, 155)))
    served = measured["served_static_step"]
    assert served["past"] == 4096 and abs(served["budget_ms"] - (2.5 + 0.6 + 0.3)) < 1e-9 and served["met"]
    scaling = measured["throughput_16_sessions"]
    assert scaling["ratio"] == 3.6 and scaling["met"]  # the first run's
    assert scaling["ratio_each_run"] == [3.6, 5.0] and scaling["noop_ratio_each_run"] == [2.5]
    assert measured["static_stub_memory_bounded"]["met"]  # peak 200 MiB <= 100 + 1 + 300
    assert measured["static_stub_shared_memory"]["peak_bytes"] == 400 * MIB  # reported, not bounded
    no_growth = measured["static_stub_memory_no_growth"]
    assert no_growth["growth_bytes"] == 5 * MIB and no_growth["met"]
    assert measured["static_wins_everywhere"] == {"losses": ["in-process/static at past 4096"], "met": False}


def test_memory_that_grows_from_run_to_run_or_passes_the_pool_misses():
    grown = serving.targets(results((150, 260)))
    assert not grown["static_stub_memory_no_growth"]["met"]
    slow = serving.targets(results((150, 150), static_16=1000.0))
    assert not slow["throughput_16_sessions"]["met"]


def test_table_and_targets_text():
    data = results((150, 155))
    data["targets"] = serving.targets(data)
    text = serving.table(data) + "\n" + serving.targets_text(data["targets"])
    assert "4096" in text and "static  past 1024  1: 500 [350], 16: 1800 [1750]" in text
    assert "noop    past 1024  1: 1000, 16: 2500" in text
    assert "(each run: 3.6x, 5.0x; the no-op model, Triton's ceiling here: 2.5x)" in text
    assert "static stub own MiB: before 120, peak 200, after each run 150, 155" in text
    assert "static stub Triton shared memory MiB: before 300, peak 400, after each run 300, 300" in text
    assert "MISSED (loses: in-process/static at past 4096)" in text
