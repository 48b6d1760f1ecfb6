"""PyTorch eager (the original) against each ONNX variant on ONNX Runtime CPU: prefill and decode.

Writes `model.json` (every latency, the measured memory bandwidth, the decode floors, the targets)
and `model_decode.png` (decode latency against past length) and prints a table of ratios. A whole
model's preset (`llama-whole`: token ids in, logits out) generates greedily instead, against
transformers and onnxruntime-genai: bench/whole_model.py.

Candidates: the PyTorch original (concat cache), the PyTorch static-cache peer (gpt-fast's
`index_copy_` into a preallocated buffer, SDPA; `bench/peers.py`), the stateless ONNX variants
(the past in, a new present out: the cache is read and written again every step), `fp32-static`
(a KV pool, serving/engine/kv_pool.py: the cache read once and the new token written in place) and the
Q/K/V-merged candidate. Conditions: each candidate uses `--threads` threads (PyTorch's intra-op
pool, ONNX Runtime's intra-op pool) and runs alone; ONNX Runtime is driven through IOBinding (inputs
bound in place, outputs left in ONNX Runtime's memory), as PyTorch returns its tensors without a
copy. A decode step is timed at a fixed past length (the same inputs every call; the static forms
rewind their length). The decode floor is the time to stream the KV cache and the weights once at
the measured bandwidth: (KV-cache bytes + weight bytes) / bandwidth; a stateless step must also
write the present, a second pass over the cache.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from bench import results as output
from bench import whole_model
from bench.plot import decode_plot
from bench.results import goal, machine
from bench.timing import SETTLE_S, Budget, Timing, copy_bandwidth, interleaved, measure
from contract import files, names
from contract.config import ModelConfig, preset
from export import artifacts
from export.progress import Progress
from serving.engine.tensorrt import axis_sizes, random_inputs

RESULTS = Path(__file__).parent / "results"
VARIANTS = ("fp32", "fp32-fused", "fp16-fused", "fp32-static")
QKV = "fp32-fused+qkv"  # not shipped: measured here to decide whether fusing Q/K/V pays
TORCH, TORCH_STATIC = "torch", "torch-static"
CANDIDATES = (TORCH, TORCH_STATIC, *VARIANTS, QKV)
FUSED, PLAIN, FP16, STATIC = "fp32-fused", "fp32", "fp16-fused", "fp32-static"


class BenchError(RuntimeError):
    """The benchmark cannot run as asked (an artifact failed, a candidate disagrees)."""


@dataclasses.dataclass(frozen=True)
class Shape:
    phase: str  # "prefill" (new tokens onto an empty past) or "decode" (one token onto a past)
    batch: int
    new: int
    past: int

    @property
    def label(self) -> str:
        return f"{self.phase} B{self.batch} " + (f"T{self.new}" if self.phase == "prefill" else f"P{self.past}")


def shapes(quick: bool) -> list[Shape]:
    batches, lengths = {"prefill": (1, 4), "decode": (1, 8)}, {"prefill": (128, 512, 2048), "decode": (128, 1024, 4096)}
    if quick:
        batches, lengths = {"prefill": (1,), "decode": (1,)}, {"prefill": (128,), "decode": (128, 1024)}
    grid = [Shape("prefill", b, t, 0) for b in batches["prefill"] for t in lengths["prefill"]]
    return grid + [Shape("decode", b, 1, p) for b in batches["decode"] for p in lengths["decode"]]


@dataclasses.dataclass(frozen=True)
class Plan:
    """How long each phase is timed, in total over its passes. The candidates run one at a time (a
    prefill arena holds GBs), in several passes with their order reversed every pass, so that drift
    or other work on the machine falls on every candidate alike."""

    budgets: dict[str, Budget]
    passes: dict[str, int]
    settle_s: float = SETTLE_S  # the pause after each candidate (its threads go to sleep)
    bandwidth_mib: int = 256  # the copy that measures the memory bandwidth, and its runs
    bandwidth_runs: int = 10

    @classmethod
    def make(cls, quick: bool) -> Plan:
        if quick:  # a smoke run: every candidate and shape, timed briefly
            budgets = {"prefill": Budget(0.02, min_runs=3), "decode": Budget(0.02, min_runs=3)}
            return cls(budgets, {"prefill": 1, "decode": 1}, settle_s=0.02, bandwidth_mib=64, bandwidth_runs=3)
        # small shapes run until the seconds are spent; a big prefill (seconds per call) runs once
        # per pass after its warm-up, so twice in all
        prefill, decode = Budget(1.5, min_runs=4, slow_runs=1), Budget(1.0, min_runs=12)
        return cls({"prefill": prefill, "decode": decode}, {"prefill": 2, "decode": 4})


# --- candidates: each opens once per preset and prepares a zero-argument step per shape -----------

Step = Callable[[], object]
Prepare = Callable[[Shape], Step]


def torch_candidate(directory: Path, threads: int) -> Prepare:
    import torch

    torch.set_num_threads(threads)
    return module_steps(artifacts.load_model(directory))


def module_steps(model) -> Prepare:
    """A module of the AttentionModel's signature (the original, or a quantized copy) called eagerly."""
    import torch

    from export.model import KVCache

    def prepare(shape: Shape) -> Step:
        inputs = stateless_inputs(model.cfg, shape, np.float32)
        tensors = {name: torch.from_numpy(array) for name, array in inputs.items()}
        past = [
            KVCache(tensors[names.past_name(i, names.KEY)], tensors[names.past_name(i, names.VALUE)])
            for i in range(model.cfg.n_layers)
        ]

        positions = tensors.get(names.POSITION_IDS)  # a rotary model's, given as a caller would

        def step():
            with torch.inference_mode():
                return model(tensors[names.HIDDEN_STATES], tensors[names.ATTENTION_MASK], past, position_ids=positions)

        return step

    return prepare


def torch_static_candidate(directory: Path, threads: int) -> Prepare:
    """gpt-fast's static cache in eager PyTorch: decode only (its prefill is the original's)."""
    import torch

    from bench.peers import StaticCacheDecoder

    torch.set_num_threads(threads)
    model = artifacts.load_model(directory)

    def prepare(shape: Shape) -> Step:
        if shape.phase != "decode":
            return torch_candidate(directory, threads)(shape)
        decoder = StaticCacheDecoder(model, shape.batch, capacity=shape.past + 1)
        hidden = torch.randn(shape.batch, 1, model.cfg.d_model, generator=torch.Generator().manual_seed(0))

        def step():
            decoder.length = shape.past
            return decoder.step(hidden)

        return step

    return prepare


def ort_candidate(path: Path, threads: int, dtype: type) -> Prepare:
    from serving.engine.ort import ort_session

    session = ort_session(path, threads=threads)
    outputs = [o.name for o in session.get_outputs()]
    cfg = ModelConfig.load(path.parent)

    def prepare(shape: Shape) -> Step:
        binding = session.io_binding()
        for name, array in stateless_inputs(cfg, shape, dtype).items():
            binding.bind_cpu_input(name, array)
        for name in outputs:
            binding.bind_output(name, "cpu")
        return lambda: session.run_with_iobinding(binding)

    return prepare


def static_candidate(path: Path, threads: int) -> Prepare:
    """A KV pool of `batch` rows: decode appends one token per row at `past` (rewound every call),
    prefill puts `new` tokens into each empty row (one graph run per row, as the engine runs it)."""
    from serving.engine.kv_pool import KVPool
    from serving.engine.ort import ort_session

    session = ort_session(path, threads=threads)
    cfg = ModelConfig.load(path.parent)

    def prepare(shape: Shape) -> Step:
        pool = KVPool(session, cfg, rows=shape.batch, capacity=shape.past + shape.new)
        rng = np.random.default_rng(0)
        if shape.past:  # real keys and values in the rows: untouched pages would all read one zero page
            pool.run({r: rng.standard_normal((shape.past, cfg.d_model)).astype(np.float32) for r in range(shape.batch)})
        steps = {r: rng.standard_normal((shape.new, cfg.d_model)).astype(np.float32) for r in range(shape.batch)}

        def step():
            pool.lengths[:] = shape.past
            return pool.run(steps)

        return step

    return prepare


def stateless_inputs(cfg: ModelConfig, shape: Shape, dtype: type) -> dict[str, np.ndarray]:
    return random_inputs(cfg, axis_sizes(shape.batch, shape.new, shape.past), dtype)


def candidate(name: str, directory: Path, paths: dict[str, Path], threads: int) -> Prepare:
    if name == TORCH:
        return torch_candidate(directory, threads)
    if name == TORCH_STATIC:
        return torch_static_candidate(directory, threads)
    if name == STATIC:
        return static_candidate(paths[name], threads)
    return ort_candidate(paths[name], threads, np.float16 if name == FP16 else np.float32)


# --- artifacts ---------------------------------------------------------------------------------


def prepare_artifacts(cfg: ModelConfig, directory: Path, progress: Progress) -> dict[str, Path]:
    """Build (or reuse) the artifact directory and the Q/K/V-fused candidate; return every file."""
    from export.build import build

    paths = {v: directory / files.model_filename(v) for v in (*VARIANTS, QKV)}
    if not _reusable(cfg, directory, [paths[v] for v in VARIANTS]):
        build(cfg, directory, VARIANTS, progress=progress)
        paths[QKV].unlink(missing_ok=True)  # made from the old build
    if not qkv_applies(cfg):
        del paths[QKV]
    elif not paths[QKV].is_file():
        with progress.stage(f"{QKV}: fuse and check against {FUSED}"):
            _make_qkv(directory, paths)
    return paths


def qkv_applies(cfg: ModelConfig) -> bool:
    """The Q/K/V merge takes projections that feed the 3D Attention op directly: not where q and k are
    normalized per head or rotated first (the 4D form)."""
    return not cfg.rotary and cfg.qk_norm == "none"


def measured(paths: dict[str, Path]) -> tuple[str, ...]:
    """The candidates a preset has (the Q/K/V merge only where it applies)."""
    return tuple(name for name in CANDIDATES if name != QKV or QKV in paths)


def _reusable(cfg: ModelConfig, directory: Path, graphs: list[Path]) -> bool:
    report = directory / files.REPORT_FILENAME
    if not report.is_file() or not all(p.is_file() for p in graphs):
        return False
    content = json.loads(report.read_text())
    return bool(content.get("passed")) and content.get("config") == cfg.to_dict()


def _make_qkv(directory: Path, paths: dict[str, Path]) -> None:
    import onnx

    from export.fusion import fused_proto
    from export.onnx_export import save_onnx
    from export.parity import TOLERANCES, Scenario, compare_rung
    from serving.engine.ort import ort_runner, ort_session

    proto, counts = fused_proto(onnx.load(str(paths[PLAIN])), fuse_qkv=True)
    save_onnx(proto, paths[QKV])
    cfg = ModelConfig.load(directory)
    if counts.qkv != cfg.n_layers:
        raise BenchError(f"{QKV}: merged {counts.qkv} projection groups for {cfg.n_layers} layers")
    fused, qkv = (ort_runner(ort_session(paths[n])) for n in (FUSED, QKV))
    result = compare_rung(cfg, fused, qkv, Scenario(steps=4), TOLERANCES[FUSED])
    if not result.passed:
        raise BenchError(f"{QKV} differs from {FUSED}: {result.to_dict()['tensors']}")


# --- measuring ---------------------------------------------------------------------------------


def measure_preset(
    directory: Path, paths: dict[str, Path], grid: list[Shape], plan: Plan, threads: int, progress: Progress
) -> dict[tuple[str, Shape], Timing]:
    """Every candidate at every shape; one candidate alive at a time (a prefill arena is GBs)."""
    cfg = ModelConfig.load(directory)
    timings: dict[tuple[str, Shape], Timing] = {}
    for phase in ("prefill", "decode"):
        phase_shapes = [s for s in grid if s.phase == phase]
        budget, passes = plan.budgets[phase], plan.passes[phase]
        budget = dataclasses.replace(budget, seconds=budget.seconds / passes, min_runs=-(-budget.min_runs // passes))
        for turn, name in interleaved(passes, measured(paths)):
            with progress.stage(f"{cfg_label(cfg)} {phase} {name} (pass {turn + 1}/{passes})"):
                prepare = candidate(name, directory, paths, threads)
                for shape in phase_shapes:
                    progress.update(shape.label)
                    measure(prepare(shape), budget, into=timings.setdefault((name, shape), Timing()))
                del prepare
                gc.collect()
                time.sleep(plan.settle_s)
    return timings


def cfg_label(cfg: ModelConfig) -> str:
    return f"d{cfg.d_model}/h{cfg.n_heads}/kv{cfg.n_kv_heads}/L{cfg.n_layers}"


def decode_floor_ms(cfg: ModelConfig, shape: Shape, itemsize: int, gbps: float) -> float:
    """Streaming the past keys/values and every weight once at the measured bandwidth."""
    nbytes = cfg.kv_cache_bytes(shape.batch, shape.past, itemsize) + cfg.n_params() * itemsize
    return nbytes / (gbps * 1e9) * 1e3


# --- results -----------------------------------------------------------------------------------


def preset_results(cfg: ModelConfig, grid: list[Shape], timings: dict, gbps: float, paths: dict[str, Path]) -> dict:
    rows = []
    for shape in grid:
        row = {**dataclasses.asdict(shape), "label": shape.label}
        row["candidates"] = {name: timings[(name, shape)].to_dict() for name in measured(paths)}
        if shape.phase == "decode":
            row["floor_ms"] = {
                "fp32": decode_floor_ms(cfg, shape, 4, gbps),
                "fp16": decode_floor_ms(cfg, shape, 2, gbps),
            }
        rows.append(row)
    sizes = {name: path.stat().st_size for name, path in paths.items()}
    return {"config": cfg.to_dict(), "file_bytes": sizes, "rows": rows}


def median(row: dict, name: str) -> float:
    return row["candidates"][name]["median_ms"]


def rotation_costs(results: dict) -> dict:
    """Per rotary preset and decode shape: its step time over its twin's without rotary embeddings, for
    the PyTorch original and each served form (1.0 = the rotation is free)."""
    costs: dict = {}
    for name, entry in results["presets"].items():
        twin = results["presets"].get(f"{name}{WITHOUT_ROTARY}")
        if twin is None:
            continue
        twin_rows = {row["label"]: row for row in twin["rows"]}
        costs[name] = {
            row["label"]: {c: median(row, c) / median(twin_rows[row["label"]], c) for c in (TORCH, FUSED, STATIC)}
            for row in entry["rows"]
            if row["phase"] == "decode"
        }
    return costs


def targets(results: dict) -> dict:
    """The issue's targets, measured (reported, never asserted)."""
    out: dict = {}
    seed = results["presets"].get("seed")
    if seed:
        decode = next((r for r in seed["rows"] if r["label"] == "decode B1 P4096"), None)
        if decode:
            speedup = median(decode, TORCH) / median(decode, FUSED)
            floor_ratio = median(decode, FUSED) / decode["floor_ms"]["fp32"]
            out["seed_decode_B1_P4096_fused_vs_torch"] = goal(speedup, least=2, kind="speedup")
            out["seed_decode_B1_P4096_fused_vs_floor"] = goal(floor_ratio, most=4)
            static_floor = median(decode, STATIC) / decode["floor_ms"]["fp32"]
            static_speedup = median(decode, FUSED) / median(decode, STATIC)
            out["seed_decode_B1_P4096_static_vs_floor"] = goal(static_floor, most=1.2)
            out["seed_decode_B1_P4096_static_vs_fused"] = goal(static_speedup, least=1.3, kind="speedup")
    worst = max(
        (
            (median(r, FUSED) / median(r, PLAIN), f"{p} {r['label']}")
            for p, e in results["presets"].items()
            for r in e["rows"]
        ),
        default=None,
    )
    if worst:
        out["fused_vs_fp32_worst"] = goal(worst[0], most=1.10, where=worst[1], target="<= 1.10")
    for name, entry in results["presets"].items():
        ratio = entry["file_bytes"][FP16] / entry["file_bytes"][FUSED]
        out[f"{name}_fp16_file_vs_fused"] = goal(ratio, most=0.55)
    return out


def table(results: dict) -> str:
    header = (
        f"{'preset':<22} {'shape':<18} {'torch ms':>9} "
        + " ".join(f"{n + ' ms (x)':>22}" for n in CANDIDATES[1:])
        + f" {'fused/fp32':>10} {'floor ms':>9} {'fused/floor':>11} {'static/floor':>12}"
    )
    lines = [header, "-" * len(header)]
    for preset_name, entry in results["presets"].items():
        for row in entry["rows"]:
            torch_ms = median(row, TORCH)
            cells = " ".join(
                f"{median(row, n):>12.3f} ({torch_ms / median(row, n):>5.2f}x)  "
                if n in row["candidates"]
                else f"{'-':>22}"
                for n in CANDIDATES[1:]
            )
            floor = row.get("floor_ms", {}).get("fp32")
            if floor:
                tail = f"{floor:>9.3f} {median(row, FUSED) / floor:>11.2f} {median(row, STATIC) / floor:>12.2f}"
            else:
                tail = f"{'':>9} {'':>11} {'':>12}"
            ratio = median(row, FUSED) / median(row, PLAIN)
            lines.append(f"{preset_name:<22} {row['label']:<18} {torch_ms:>9.3f} {cells}{ratio:>10.2f} {tail}")
    lines.append("(x) = PyTorch eager median / candidate median; fused/fp32 and */floor use medians")
    return "\n".join(lines)


def targets_text(measured: dict) -> str:
    lines = ["targets:"]
    for name, entry in measured.items():
        value = next(v for k, v in entry.items() if k in ("speedup", "ratio"))
        where = f" at {entry['where']}" if "where" in entry else ""
        lines.append(
            f"  {name}: {value:.2f} (target {entry['target']}){where} -> {'met' if entry['met'] else 'MISSED'}"
        )
    return "\n".join(lines)


# --- command -----------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--presets",
        help="comma-separated preset names (default: seed,large, none with --config); a rotary preset (llama) is "
        "measured beside its twin without rotary embeddings, for the rotation's cost per step; a whole model's "
        "(llama-whole) generates greedily against transformers and onnxruntime-genai (bench/whole_model.py)",
    )
    parser.add_argument("--quick", action="store_true", help="a few small shapes with short budgets")
    parser.add_argument(
        "--shapes",
        type=parse_shapes,
        help="only these shapes, e.g. decode:1:4096,prefill:1:512 (default: prefill B1/B4 at T 128/512/2048, "
        "decode B1/B8 at P 128/1024/4096)",
    )
    output.threads_argument(parser, "threads per candidate")
    parser.add_argument("--out", type=Path, default=RESULTS, help=f"where to write results (default {RESULTS})")
    parser.add_argument(
        "--artifacts", type=Path, help="build (or reuse) artifacts under DIR/<preset>; default: temporary"
    )
    parser.add_argument(
        "--config", type=Path, help="a model config JSON besides the presets, measured under its file's stem"
    )
    whole_model.add_arguments(parser)


WITHOUT_ROTARY = "-without-rotary"  # a rotary preset's twin, to measure what the rotation costs a step


def without_rotary(cfg: ModelConfig) -> ModelConfig:
    """The same model with q and k not rotated (every rotary field at its default)."""
    defaults = {f.name: f.default for f in dataclasses.fields(ModelConfig) if f.name.startswith(("rope_", "rotary_"))}
    return dataclasses.replace(cfg, **defaults)


def run(args: argparse.Namespace) -> int:
    try:
        chosen = args.presets if args.presets is not None else ("" if args.config else "seed,large")
        configs = {name: preset(name) for name in chosen.split(",") if name}
    except ValueError as error:
        print(f"error: {error}")
        return 2
    if args.config:
        configs[args.config.stem] = ModelConfig.load(args.config)
    # a whole model (token ids in, logits out) generates greedily against transformers and onnxruntime-genai
    whole = {name: configs.pop(name) for name in list(configs) if configs[name].whole}
    if whole:
        with tempfile.TemporaryDirectory(prefix="bench-whole-") as scratch:
            whole_model.run(whole, args, args.artifacts or Path(scratch))
    if not configs:
        return 0
    configs |= {f"{name}{WITHOUT_ROTARY}": without_rotary(cfg) for name, cfg in configs.items() if cfg.rotary}
    progress = Progress()
    with tempfile.TemporaryDirectory(prefix="bench-artifacts-") as scratch:
        root = args.artifacts or Path(scratch)
        results = benchmark(configs, root, args.quick, args.threads, progress, args.shapes)
    lines = [
        table(results),
        f"memory bandwidth {results['bandwidth']['gbps']:.1f} GB/s (copy, read + write bytes)",
        targets_text(results["targets"]),
    ]
    for name, rows in results["rotation_costs"].items():
        for label, ratios in rows.items():
            cells = ", ".join(f"{c} {ratio:.2f}x" for c, ratio in ratios.items())
            lines.append(f"rotation cost, {name} {label}: {cells} (with / without rotary embeddings)")
    return output.report(results, args.out, "model", decode_plot, "\n".join(lines), png="model_decode")


def parse_shapes(text: str) -> list[Shape]:
    """`decode:B:P` and `prefill:B:T`, comma-separated (e.g. "decode:1:4096,prefill:1:512")."""
    grid = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        try:
            phase, batch, length = item.split(":")
            if phase not in ("decode", "prefill"):
                raise ValueError
            b, n = int(batch), int(length)
        except ValueError:
            wanted = "decode:BATCH:PAST or prefill:BATCH:TOKENS"
            raise argparse.ArgumentTypeError(f"a shape is {wanted}, got {item!r}") from None
        grid.append(Shape(phase, b, 1, n) if phase == "decode" else Shape(phase, b, n, 0))
    return grid


def benchmark(
    configs: dict[str, ModelConfig],
    root: Path,
    quick: bool,
    threads: int,
    progress: Progress,
    grid: list[Shape] | None = None,
) -> dict:
    """`grid` (default: the standard shapes, fewer when `quick`) for every preset."""
    started, load_before = time.perf_counter(), os.getloadavg()[0]
    grid, plan = grid or shapes(quick), Plan.make(quick)
    with progress.stage("memory bandwidth"):
        before = copy_bandwidth(threads, plan.bandwidth_mib, plan.bandwidth_runs)
    measured = {}
    for name, cfg in configs.items():
        paths = prepare_artifacts(cfg, root / name, progress)
        measured[name] = (cfg, paths, measure_preset(root / name, paths, grid, plan, threads, progress))
    with progress.stage("memory bandwidth, again"):  # the machine may drift during the run
        after = copy_bandwidth(threads, plan.bandwidth_mib, plan.bandwidth_runs)
    bandwidth = {"before": before, "after": after, "gbps": max(before["gbps"], after["gbps"])}  # the best seen
    presets_out = {
        name: preset_results(cfg, grid, timings, bandwidth["gbps"], paths)
        for name, (cfg, paths, timings) in measured.items()
    }
    results = {
        # other work on the machine during the run shows as a load average above ~0.5 before it
        "machine": {
            **machine(threads, "torch", "onnxruntime"),
            "load_average_1min": {"before": load_before, "after": os.getloadavg()[0]},
        },
        "bandwidth": bandwidth,
        "quick": quick,
        "presets": presets_out,
        "seconds": round(time.perf_counter() - started, 1),
    }
    results["targets"] = targets(results)
    results["rotation_costs"] = rotation_costs(results)
    return results
