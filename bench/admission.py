"""Admission: more sessions than the KV budget holds, opened one after another, under two sequence-slot settings.

The sessions model's slots derived from the budget (serving/triton/config.py `candidate_sequences`) and the 1,024 it
had before. Per setting: how many of `--attempts` opens succeed; the first START beyond them (its index, the client
error's type, kind and status, its latency); every open's and refusal's latency; then a sample of the opened sessions
steps the same tokens, against the stateless model's answer. An attempt unanswered within `--timeout` ends the
setting's attempts (each further one would wait as long). And tritonserver's resident memory once ready with the
default 2 GiB budget's slots against 1,024 (what the slots cost Triton), the two of a round started together.

Conditions: the tiny model (max_seq_len 512), a budget of `--rows` fp32 rows, one Triton per setting (the bundled
binary, ONNX Runtime on one thread) on 127.0.0.1, the blocking gRPC client, no retries. Every server of the run
starts at once (one wait) and each setting's opens run while the others sit idle.
"""

from __future__ import annotations

import argparse
import contextlib
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from bench import results as output
from bench import stack
from bench.plot import figure, gridded, save
from bench.serving import start_servers, stop_all
from bench.timing import percentiles
from contract.config import ModelConfig

PRESET = "tiny"
VARIANTS = ("fp32-fused", "fp32-static")  # what forward and sessions serve on the CPU
SLOTS = {"derived": None, "fixed-1024": 1024}  # the sessions model's sequence slots: from the budget, or these
SAMPLE = 50  # opened sessions stepped after the refusals


def repository(source: Path, where: Path, kv_cache_bytes: int, slots: int | None) -> tuple[Path, int]:
    """forward and sessions on a budget of full rows (max_seq_len each, whatever the sessions' length), with `slots`
    sequence slots or (None) those derived from the budget; the repository and its slots."""
    from serving.triton.config import FORWARD, SESSIONS, TRITON_CONFIG_FILENAME, ServingSettings, parse, to_text
    from serving.triton.repository import write_repository

    full_rows = ModelConfig.load(source).max_seq_len
    settings = ServingSettings(threads=1, kv_cache_bytes=kv_cache_bytes, min_row_positions=full_rows)
    written = write_repository(source, where, settings, models=(FORWARD, SESSIONS))
    path = written / SESSIONS / TRITON_CONFIG_FILENAME
    config = parse(path.read_text())
    if slots is not None:
        config.sequence_batching.oldest.max_candidate_sequences = slots
        path.write_text(to_text(config))
    return written, config.sequence_batching.oldest.max_candidate_sequences


@contextlib.contextmanager
def started(repositories: list[Path]) -> Iterator[list]:
    """A Triton on each of `repositories`, started at once, stopped together after the block."""
    servers = start_servers(repositories)
    try:
        yield servers
    finally:
        stop_all(servers)


def rss_mib(server) -> float:
    import psutil

    return psutil.Process(server.process.pid).memory_info().rss / (1 << 20)


def steps_after(client, opened: list) -> dict:
    """A sample of the opened sessions steps the same tokens, each answer against the stateless model's."""
    from client import ClientError

    tokens = np.random.default_rng(5).standard_normal((1, 3, client.metadata("sessions").d_model)).astype(np.float32)
    expected = client.infer(tokens).output
    sample = opened[:: max(1, len(opened) // SAMPLE)][:SAMPLE]
    worst, errors = 0.0, []
    for session in sample:
        try:
            worst = max(worst, float(np.abs(session.step(tokens) - expected).max()))
        except ClientError as error:
            errors.append(f"{type(error).__name__}: {error.message}")
    return {"sessions": len(sample), "answered": len(sample) - len(errors), "max_abs_diff": worst, "errors": errors[:3]}


def run_setting(server, slots: int, attempts: int, timeout: float, ready_rss: float) -> dict:
    """`attempts` opens one after another on `server` (with `slots`; `ready_rss` MiB once ready), ended by the first
    left unanswered in time; then the opened sessions stepped."""
    from client import Client, ClientError, RequestTimeoutError

    client = Client(server.grpc_url, timeout=timeout, retries=0)
    opened, record = [], []
    for index in range(1, attempts + 1):
        session, attempt = client.session(), {"index": index, "outcome": "opened", "kind": None, "status": None}
        started = time.perf_counter()
        try:
            session.open()
            opened.append(session)
        except ClientError as error:
            attempt |= {"outcome": type(error).__name__, "kind": error.kind, "status": error.status}
        record.append(attempt | {"ms": (time.perf_counter() - started) * 1e3})
        if attempt["outcome"] == RequestTimeoutError.__name__:
            break
    after_rss = rss_mib(server)
    steps = steps_after(client, opened)
    for session in opened:
        session.close()
    client.close()
    opens = [attempt["ms"] for attempt in record if attempt["outcome"] == "opened"]
    refused = [attempt["ms"] for attempt in record if attempt["outcome"] == "ServerBusyError"]
    return {
        "slots": slots,
        "attempted": len(record),
        "opened": len(opened),
        "first_beyond": next((attempt for attempt in record if attempt["outcome"] != "opened"), None),
        "open_ms": percentiles(opens) | {"max_ms": max(opens)},
        "refused_ms": percentiles(refused) | {"max_ms": max(refused)} if refused else None,
        "steps_after": steps,
        "tritonserver_rss_mib": {"ready": ready_rss, "after_opens": after_rss},
        "latencies_ms": [round(attempt["ms"], 3) for attempt in record],
        "outcomes": [attempt["outcome"] for attempt in record],
    }


def benchmark(root: Path, rows: int, attempts: int, timeout: float, memory_rounds: int) -> dict:
    from serving.triton.config import ServingSettings

    source = stack.artifact(root, PRESET, VARIANTS)
    cfg = ModelConfig.load(source)
    budget, default_budget = rows * cfg.kv_cache_bytes(1, cfg.max_seq_len), ServingSettings().kv_cache_bytes
    settings = {name: repository(source, root / name, budget, slots) for name, slots in SLOTS.items()}
    memory = {name: repository(source, root / f"memory-{name}", default_budget, slots) for name, slots in SLOTS.items()}
    paths = [where for where, _ in settings.values()]
    memory_paths = [where for where, _ in memory.values()] if memory_rounds else []
    # one wait for every start: both settings' servers and the first memory round's
    with output.during(1) as machine, started(paths + memory_paths) as servers:
        ready = [rss_mib(server) for server in servers]
        rounds = [ready[len(paths) :]]
        for _ in range(memory_rounds - 1):  # the two of a round started together
            with started(memory_paths) as round_servers:
                rounds.append([rss_mib(server) for server in round_servers])
        results = {
            name: run_setting(server, slots, attempts, timeout, ready_rss)
            for (name, (_, slots)), server, ready_rss in zip(settings.items(), servers, ready, strict=False)
        }
    conditions = dict(
        model=PRESET,
        max_seq_len=cfg.max_seq_len,
        kv_cache_bytes=budget,
        budget_rows_fp32=rows,
        attempts=attempts,
        timeout_s=timeout,
    )
    return {
        "conditions": conditions,
        "machine": machine,
        "settings": results,
        "slot_memory": {
            "kv_cache_bytes": default_budget,
            "slots": {name: slots for name, (_, slots) in memory.items()},
            "ready_rss_mib": {name: [sample[k] for sample in rounds if sample] for k, name in enumerate(memory)},
        },
    }


def table(results: dict) -> str:
    conditions, rows = results["conditions"], []
    for name, setting in results["settings"].items():
        first, refused, steps = setting["first_beyond"], setting["refused_ms"], setting["steps_after"]
        rows.append(
            [
                f"{name} ({setting['slots']})",
                setting["opened"],
                f"#{first['index']} {first['outcome']} [{first['kind']}]" if first else "-",
                f"{first['ms'] if first else 0:.1f}",
                "{p50_ms:.2f}/{max_ms:.2f}".format(**setting["open_ms"]),
                "{p50_ms:.2f}/{max_ms:.2f}".format(**refused) if refused else "-",
                f"{steps['answered']}/{steps['sessions']} {steps['max_abs_diff']:.1e}",
            ]
        )
    heading = (
        f"{conditions['attempts']} opens, one after another, on a budget of {conditions['budget_rows_fp32']} rows "
        f"(tiny model, max_seq_len {conditions['max_seq_len']}); client timeout {conditions['timeout_s']:g} s"
    )
    header = ["slots", "opened", "first beyond", "its ms", "open p50/max ms", "refused p50/max ms", "steps after"]
    memory, lines = results["slot_memory"], [output.table(heading, header, rows)]
    for name, values in memory["ready_rss_mib"].items():
        shown = ", ".join(f"{value:.1f}" for value in values)
        lines.append(f"tritonserver once ready with {memory['slots'][name]} slots: {shown} MiB")
    return "\n".join(lines)


def plot(results: dict, path: Path) -> Path:
    drawn, (axis,) = figure(1, (9, 4))
    for name, setting in results["settings"].items():
        attempts = np.arange(1, len(setting["latencies_ms"]) + 1)
        axis.scatter(attempts, setting["latencies_ms"], s=4, label=f"{name} ({setting['slots']} slots)")
    axis.axvline(results["conditions"]["budget_rows_fp32"], color="black", linestyle="--", label="budget")
    axis.set(yscale="log", xlabel="open attempt", ylabel="ms to its answer")
    axis.set_title("Opening more sessions than the KV budget holds")
    gridded(axis)
    return save(drawn, path)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rows", type=int, default=1500, help="the budget in fp32 rows (default 1500)")
    parser.add_argument("--attempts", type=int, default=2000, help="sessions to try to open (default 2000)")
    parser.add_argument("--timeout", type=float, default=5.0, help="the client's deadline per open (default 5 s)")
    parser.add_argument("--memory-rounds", type=int, default=2, help="turns of the slot-memory runs (default 2)")
    output.output_arguments(parser)


def run(args: argparse.Namespace) -> int:
    with output.work_folder(args.work, "bench-admission-") as root:
        results = benchmark(root, args.rows, args.attempts, args.timeout, args.memory_rounds)
    return output.report(results, args.out, "admission", plot, table(results))
