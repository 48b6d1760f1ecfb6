"""The serving benchmark's bookkeeping, without a server: bytes on the wire, targets, the table.
(The benchmark itself runs against a real Triton: `python -m bench serving`.)"""

from bench import serving
from export.config import preset


def test_a_stateful_step_sends_the_same_bytes_at_any_past_a_stateless_one_ships_the_cache():
    cfg = preset("tiny")
    short, long = serving.wire_bytes(cfg, 16), serving.wire_bytes(cfg, 256)
    for key in ("stateful_request_grpc", "stateful_request_http", "stateful_response_tensors"):
        assert short[key] == long[key]
    cache_growth = cfg.kv_cache_bytes(1, 256) - cfg.kv_cache_bytes(1, 16)
    assert long["stateless_request_grpc"] - short["stateless_request_grpc"] >= cache_growth
    assert long["stateless_request_http"] - short["stateless_request_http"] >= cache_growth


def row(past: int, stateless_ms: float, stateful_ms: float, in_process_ms: float) -> dict:
    modes = {mode: {"p50_ms": stateful_ms, "p99_ms": stateful_ms, "runs": 3} for mode in serving.MODES}
    modes["in-process"] = {"p50_ms": in_process_ms, "p99_ms": in_process_ms, "runs": 3}
    for protocol in ("grpc", "http"):
        modes[f"stateless/{protocol}"] = {"p50_ms": stateless_ms, "p99_ms": stateless_ms, "runs": 3}
    return {"past": past, "modes": modes, "bytes": serving.wire_bytes(preset("tiny"), past)}


def test_targets_and_table():
    results = {
        "latency": [row(128, 2.0, 1.2, 0.5), row(4096, 90.0, 3.0, 2.5)],
        "throughput": [{"sessions": 1, "steps_per_s": 500.0}, {"sessions": 16, "steps_per_s": 1200.0}],
    }
    targets = serving.targets(results)
    assert targets["stateful_vs_stateless_grpc"]["speedup"] == 30.0 and targets["stateful_vs_stateless_grpc"]["met"]
    assert targets["stateful_request_bytes"]["met"]
    assert targets["throughput_scaling"]["ratio"] == 2.4 and not targets["throughput_scaling"]["met"]
    assert abs(targets["triton_grpc_added_ms"]["stateful_ms"] - 0.7) < 1e-9 and targets["triton_grpc_added_ms"]["met"]
    text = serving.table(results) + "\n" + serving.targets_text(targets)
    assert "4096" in text and "MISSED" in text and "16: 1200" in text
