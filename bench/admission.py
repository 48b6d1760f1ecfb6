"""Admission: more sessions than the KV budget holds, opened one after another, on sessions with
its sequence slots derived from the budget and with the 1,024 it had before.

Writes `admission.json` and `admission.png` and prints a table.

- per slot setting (`derived`: serving/triton/config.py `candidate_sequences`; `fixed-1024`: the
  count sessions had whatever its budget): how many of `--attempts` opens succeed, the first
  START beyond what opened (its index, the client's error type, kind and status, its latency), the
  latency of every open and of every refusal; an attempt that gets no answer within `--timeout`
  ends that setting's attempts (each further one would wait as long);
- the sessions opened before: a sample of them steps the same tokens afterwards; how many answer,
  and the largest difference from the stateless model's answer for those tokens (no past);
- tritonserver's resident memory once ready, per slot setting, and for the slots the default 2 GiB
  budget gets on the same model against 1,024 (what the slots cost Triton), the two servers of a
  round started together.

Conditions: the tiny model (max_seq_len 512) with a budget of `--rows` fp32 rows on the CPU, one
Triton per slot setting from the bundled binary on 127.0.0.1, ONNX Runtime on one thread; the
blocking gRPC client on the same machine, no retries. Both settings' servers and the first memory
round's start at once (one wait for every start) and stop together at the end: each setting's opens
run while the other servers sit idle. Bounded by `--attempts` and `--timeout`.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from pathlib import Path

import numpy as np

from bench import results as output
from bench.plot import save
from bench.serving import start_servers, stop_all
from bench.timing import percentiles
from contract import files
from contract.config import ModelConfig, preset

PRESET = "tiny"
VARIANTS = ("fp32-fused", "fp32-static")  # what forward and sessions serve on the CPU
DERIVED, FIXED = "derived", "fixed-1024"
FIXED_SLOTS = 1024
SAMPLE = 50  # opened sessions stepped after the refusals
SETTINGS = {DERIVED: None, FIXED: FIXED_SLOTS}  # the slot setting: derived (None) or given


def artifact(root: Path) -> Path:
    """The tiny model's artifact (reused when it is there)."""
    from export.build import build

    directory = root / "artifact"
    if not all((directory / files.model_filename(v)).is_file() for v in VARIANTS):
        build(preset(PRESET), directory, VARIANTS)
    return directory


def repository(source: Path, where: Path, kv_cache_bytes: int, slots: int | None) -> Path:
    """forward and sessions for the budget; `slots` overrides the derived sequence slots."""
    from contract.config import ModelConfig
    from serving.triton.config import FORWARD, SESSIONS, TRITON_CONFIG_FILENAME, ServingSettings, parse, to_text
    from serving.triton.repository import write_repository

    # full rows: the budget is `rows` sessions of max_seq_len, whatever their length (not sized to them)
    cfg = ModelConfig.load(source)
    settings = ServingSettings(threads=1, kv_cache_bytes=kv_cache_bytes, min_row_positions=cfg.max_seq_len)
    written = write_repository(source, where, settings, models=(FORWARD, SESSIONS))
    if slots is not None:
        path = written / SESSIONS / TRITON_CONFIG_FILENAME
        config = parse(path.read_text())
        config.sequence_batching.oldest.max_candidate_sequences = slots
        path.write_text(to_text(config))
    return written


def slots_of(repository_dir: Path) -> int:
    from serving.triton.config import SESSIONS, TRITON_CONFIG_FILENAME, parse

    config = parse((repository_dir / SESSIONS / TRITON_CONFIG_FILENAME).read_text())
    return config.sequence_batching.oldest.max_candidate_sequences


def rss_mib(server) -> float:
    import psutil

    return psutil.Process(server.process.pid).memory_info().rss / (1 << 20)


@dataclasses.dataclass
class Attempt:
    index: int  # 1-based
    ms: float
    outcome: str  # "opened" or the client error's type
    kind: str | None = None
    status: str | None = None


def attempt_opens(client, attempts: int) -> tuple[list, list[Attempt]]:
    """Open sessions one after another; stop early at the first one that got no answer in time."""
    from client import ClientError, RequestTimeoutError

    opened, record = [], []
    for index in range(1, attempts + 1):
        session = client.session()
        started = time.perf_counter()
        try:
            session.open()
            outcome, kind, status = "opened", None, None
            opened.append(session)
        except ClientError as error:
            outcome, kind, status = type(error).__name__, error.kind, error.status
        record.append(Attempt(index, (time.perf_counter() - started) * 1e3, outcome, kind, status))
        if outcome == RequestTimeoutError.__name__:
            break
    return opened, record


def steps_after(client, opened: list, d_model: int) -> dict:
    """A sample of the opened sessions steps the same tokens: each against the stateless answer."""
    from client import ClientError

    tokens = np.random.default_rng(5).standard_normal((1, 3, d_model)).astype(np.float32)
    expected = client.infer(tokens).output
    sample = opened[:: max(1, len(opened) // SAMPLE)][:SAMPLE]
    answered, worst, errors = 0, 0.0, []
    for session in sample:
        try:
            worst = max(worst, float(np.abs(session.step(tokens) - expected).max()))
            answered += 1
        except ClientError as error:
            errors.append(f"{type(error).__name__}: {error.message}")
    return {"sessions": len(sample), "answered": answered, "max_abs_diff": worst, "errors": errors[:3]}


def run_setting(server, repository_dir: Path, attempts: int, timeout: float, ready_rss: float) -> dict:
    """The opens on `server` (started on `repository_dir`; `ready_rss` its memory once ready)."""
    from client import Client

    client = Client(server.grpc_url, timeout=timeout, retries=0)
    opened, record = attempt_opens(client, attempts)
    after_rss = rss_mib(server)
    steps = steps_after(client, opened, client.metadata("sessions").d_model)
    for session in opened:
        session.close()
    client.close()
    first = next((a for a in record if a.outcome != "opened"), None)
    refused = [a.ms for a in record if a.outcome == "ServerBusyError"]
    return {
        "slots": slots_of(repository_dir),
        "attempted": len(record),
        "opened": len(opened),
        "first_beyond": dataclasses.asdict(first) if first else None,
        "open_ms": percentiles([a.ms for a in record if a.outcome == "opened"])
        | {"max_ms": max(a.ms for a in record if a.outcome == "opened")},
        "refused_ms": percentiles(refused) | {"max_ms": max(refused)} if refused else None,
        "steps_after": steps,
        "tritonserver_rss_mib": {"ready": ready_rss, "after_opens": after_rss},
        "latencies_ms": [round(a.ms, 3) for a in record],
        "outcomes": [a.outcome for a in record],
    }


def memory_repositories(source: Path, root: Path) -> dict[str, Path]:
    """The default budget with its derived slots and with 1,024."""
    from serving.triton.config import ServingSettings

    budget = ServingSettings().kv_cache_bytes
    return {
        DERIVED: repository(source, root / "memory-derived", budget, None),
        FIXED: repository(source, root / "memory-fixed", budget, FIXED_SLOTS),
    }


def slot_memory(repositories: dict[str, Path], rounds: int, first: list | None = None) -> dict:
    """tritonserver's resident memory once ready with the default budget's derived slots and with
    1,024, `rounds` times: the two servers of a round start together (each process's own memory);
    `first`: the first round's servers, started already (stopped by the caller)."""
    from serving.triton.config import ServingSettings

    samples: dict[str, list[float]] = {name: [] for name in repositories}
    for turn in range(rounds):
        servers = first if turn == 0 and first else start_servers(list(repositories.values()))
        try:
            for name, server in zip(repositories, servers, strict=True):
                samples[name].append(rss_mib(server))
        finally:
            if servers is not first:
                stop_all(servers)
    return {
        "kv_cache_bytes": ServingSettings().kv_cache_bytes,
        "slots": {name: slots_of(where) for name, where in repositories.items()},
        "ready_rss_mib": samples,
    }


def benchmark(root: Path, rows: int, attempts: int, timeout: float, memory_rounds: int) -> dict:
    source = artifact(root)
    cfg = ModelConfig.load(source)
    budget = rows * cfg.kv_cache_bytes(1, cfg.max_seq_len)  # `rows` rows of the CPU's fp32 pool
    settings = {name: repository(source, root / name, budget, slots) for name, slots in SETTINGS.items()}
    memory = memory_repositories(source, root)
    # one wait for every start: both slot settings' servers and the first memory round's, up at once
    # (each memory sample is taken once it is ready, each setting's opens run with the others idle)
    servers = start_servers([*settings.values(), *(memory.values() if memory_rounds else ())])
    try:
        setting_servers = dict(zip(settings, servers, strict=False))
        ready = {name: rss_mib(server) for name, server in setting_servers.items()}
        memory_results = slot_memory(memory, memory_rounds, first=servers[len(settings) :])
        results = {
            name: run_setting(server, settings[name], attempts, timeout, ready[name])
            for name, server in setting_servers.items()
        }
    finally:
        stop_all(servers)
    return {
        "conditions": {
            "model": PRESET,
            "max_seq_len": cfg.max_seq_len,
            "kv_cache_bytes": budget,
            "budget_rows_fp32": rows,
            "attempts": attempts,
            "timeout_s": timeout,
        },
        "settings": results,
        "slot_memory": memory_results,
    }


def table(results: dict) -> str:
    c = results["conditions"]
    lines = [
        f"{c['attempts']} opens, one after another, on a budget of {c['budget_rows_fp32']} rows "
        f"(tiny model, max_seq_len {c['max_seq_len']}); client timeout {c['timeout_s']:g} s",
        f"{'slots':<18} {'opened':>7} {'first beyond':>34} {'its ms':>9} {'open p50/max ms':>16} "
        f"{'refused p50/max ms':>19} {'steps after':>18}",
    ]
    for name, r in results["settings"].items():
        first = r["first_beyond"]
        what = f"#{first['index']} {first['outcome']} [{first['kind']}]" if first else "-"
        refused = f"{r['refused_ms']['p50_ms']:.2f}/{r['refused_ms']['max_ms']:.2f}" if r["refused_ms"] else "-"
        steps = r["steps_after"]
        lines.append(
            f"{name + ' (' + str(r['slots']) + ')':<18} {r['opened']:>7} {what:>34} "
            f"{first['ms'] if first else 0:>9.1f} {r['open_ms']['p50_ms']:>7.2f}/{r['open_ms']['max_ms']:<8.2f} "
            f"{refused:>19} {steps['answered']}/{steps['sessions']} {steps['max_abs_diff']:.1e}"
        )
    memory = results["slot_memory"]
    for name, values in memory["ready_rss_mib"].items():
        shown = ", ".join(f"{v:.1f}" for v in values)
        lines.append(f"tritonserver once ready with {memory['slots'][name]} slots: {shown} MiB")
    return "\n".join(lines)


def plot(results: dict, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(9, 4))
    for name, r in results["settings"].items():
        index = np.arange(1, len(r["latencies_ms"]) + 1)
        axis.scatter(index, r["latencies_ms"], s=4, label=f"{name} ({r['slots']} slots)")
    axis.axvline(results["conditions"]["budget_rows_fp32"], color="black", linestyle="--", label="budget")
    axis.set_yscale("log")
    axis.set_xlabel("open attempt")
    axis.set_ylabel("ms to its answer")
    axis.set_title("Opening more sessions than the KV budget holds")
    axis.legend()
    return save(figure, path)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rows", type=int, default=1500, help="the budget in fp32 rows (default 1500)")
    parser.add_argument("--attempts", type=int, default=2000, help="sessions to try to open (default 2000)")
    parser.add_argument("--timeout", type=float, default=5.0, help="the client's deadline per open (default 5 s)")
    parser.add_argument("--memory-rounds", type=int, default=2, help="turns of the slot-memory runs (default 2)")
    output.output_arguments(parser)


def run(args: argparse.Namespace) -> int:
    with output.work_folder(args.work, "bench-admission-") as root:
        results = benchmark(root, args.rows, args.attempts, args.timeout, args.memory_rounds)
    wrote = output.write(results, args.out, "admission", plot)
    print(table(results))
    print(wrote)
    return 0
