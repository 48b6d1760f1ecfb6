"""PyTorch eager (the original) against each ONNX variant on ONNX Runtime CPU: prefill and decode, `model.json`
and `model_decode.png` (decode latency against past length). A whole model's preset (`llama-whole`: token ids
in, logits out) generates greedily instead, against transformers and onnxruntime-genai: bench/whole_model.py.

Candidates: the PyTorch original (concat cache), gpt-fast's static cache in PyTorch (bench/peers.py), the
stateless ONNX variants (the past in, a new present out: the cache read and written again every step),
`fp32-static` (serving/engine/kv_pool.py's KVPool: the cache read once, the new token written in place) and the
Q/K/V-merged graph. Each uses `--threads` threads and runs alone; ONNX Runtime runs through IOBinding (inputs
bound in place, outputs left in its memory), as PyTorch returns its tensors without a copy. A decode step is
timed at a fixed past (the static forms rewind their length). The decode floor: (KV-cache bytes + weight bytes)
/ the measured bandwidth; a stateless step must also write the present, a second pass over the cache.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from bench import results as output
from bench import whole_model
from bench.plot import decode_plot
from bench.results import goal
from bench.timing import SETTLE_S, Budget, Timing, copy_bandwidth, interleaved, measure
from bench.whole_model import BenchError
from contract import files, names
from contract.config import ModelConfig, preset
from export import artifacts
from export.progress import Progress
from serving.engine.tensorrt import axis_sizes, random_inputs

VARIANTS = ("fp32", "fp32-fused", "fp16-fused", "fp32-static")
PLAIN, FUSED, FP16, STATIC = VARIANTS
QKV = "fp32-fused+qkv"  # not shipped: measured here to decide whether fusing Q/K/V pays
TORCH, TORCH_STATIC = "torch", "torch-static"
CANDIDATES = (TORCH, TORCH_STATIC, *VARIANTS, QKV)
WITHOUT_ROTARY = "-without-rotary"  # a rotary preset's twin, to measure what the rotation costs a step


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
    if quick:
        return [Shape("prefill", 1, 128, 0), Shape("decode", 1, 1, 128), Shape("decode", 1, 1, 1024)]
    prefill = [Shape("prefill", batch, new, 0) for batch in (1, 4) for new in (128, 512, 2048)]
    return prefill + [Shape("decode", batch, 1, past) for batch in (1, 8) for past in (128, 1024, 4096)]


@dataclasses.dataclass(frozen=True)
class Plan:
    """How long each phase is timed, in all over its passes: the candidates one at a time (a prefill arena holds
    GBs), their order reversed every pass."""

    budgets: dict[str, Budget]
    passes: dict[str, int]
    settle_s: float = SETTLE_S  # the pause after each candidate (its threads go to sleep)
    bandwidth_mib: int = 256  # the copy that measures the memory bandwidth, and its runs
    bandwidth_runs: int = 10

    @classmethod
    def make(cls, quick: bool) -> Plan:
        if quick:  # a smoke run: every candidate and shape, timed briefly
            budget = Budget(0.02, min_runs=3)
            passes = {"prefill": 1, "decode": 1}
            return cls({"prefill": budget, "decode": budget}, passes, settle_s=0.02, bandwidth_mib=64, bandwidth_runs=3)
        # a big prefill (seconds per call) runs once per pass after its warm-up, so twice in all
        return cls(
            {"prefill": Budget(1.5, min_runs=4, slow_runs=1), "decode": Budget(1.0, min_runs=12)},
            {"prefill": 2, "decode": 4},
        )


Step = Callable[[], object]
Prepare = Callable[[Shape], Step]


def candidate(name: str, directory: Path, paths: dict[str, Path], threads: int) -> Prepare:
    if name in (TORCH, TORCH_STATIC):
        import torch

        torch.set_num_threads(threads)
        model = artifacts.load_model(directory)
        return static_cache_steps(model) if name == TORCH_STATIC else module_steps(model)
    if name == STATIC:
        return pool_steps(paths[name], threads)
    return ort_steps(paths[name], threads, np.float16 if name == FP16 else np.float32)


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


def static_cache_steps(model) -> Prepare:
    """gpt-fast's static cache in eager PyTorch: decode only (its prefill is the original's)."""
    import torch

    from bench.peers import StaticCacheDecoder

    def prepare(shape: Shape) -> Step:
        if shape.phase != "decode":
            return module_steps(model)(shape)
        decoder = StaticCacheDecoder(model, shape.batch, capacity=shape.past + 1)
        hidden = torch.randn(shape.batch, 1, model.cfg.d_model, generator=torch.Generator().manual_seed(0))

        def step():
            decoder.length = shape.past
            return decoder.step(hidden)

        return step

    return prepare


def ort_steps(path: Path, threads: int, dtype: type) -> Prepare:
    from serving.engine.ort import ort_session

    session = ort_session(path, threads=threads)
    cfg = ModelConfig.load(path.parent)

    def prepare(shape: Shape) -> Step:
        binding = session.io_binding()
        for name, array in stateless_inputs(cfg, shape, dtype).items():
            binding.bind_cpu_input(name, array)
        for output_name in session.get_outputs():
            binding.bind_output(output_name.name, "cpu")
        return lambda: session.run_with_iobinding(binding)

    return prepare


def pool_steps(path: Path, threads: int) -> Prepare:
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


def prepare_artifacts(cfg: ModelConfig, directory: Path, progress: Progress) -> dict[str, Path]:
    """The variants (reused where built of `cfg` and passed) and the Q/K/V merge, where it applies: not where q
    and k are normalized per head or rotated first (the 4D form), the merge needing projections that feed the 3D
    Attention op directly."""
    from export.build import build

    paths = {v: directory / files.model_filename(v) for v in (*VARIANTS, QKV)}
    report = directory / files.REPORT_FILENAME
    built = json.loads(report.read_text()) if report.is_file() else {}
    if not (built.get("passed") and built.get("config") == cfg.to_dict() and all(paths[v].is_file() for v in VARIANTS)):
        build(cfg, directory, VARIANTS, progress=progress)
        paths[QKV].unlink(missing_ok=True)  # made from the old build
    if cfg.rotary or cfg.qk_norm != "none":
        del paths[QKV]
    elif not paths[QKV].is_file():
        with progress.stage(f"{QKV}: fuse and check against {FUSED}"):
            _make_qkv(cfg, paths)
    return paths


def _make_qkv(cfg: ModelConfig, paths: dict[str, Path]) -> None:
    import onnx

    from export.fusion import fused_proto
    from export.onnx_export import save_onnx
    from export.parity import TOLERANCES, Scenario, compare_rung
    from serving.engine.ort import ort_runner, ort_session

    proto, counts = fused_proto(onnx.load(str(paths[PLAIN])), fuse_qkv=True)
    save_onnx(proto, paths[QKV])
    if counts.qkv != cfg.n_layers:
        raise BenchError(f"{QKV}: merged {counts.qkv} projection groups for {cfg.n_layers} layers")
    fused, qkv = (ort_runner(ort_session(paths[n])) for n in (FUSED, QKV))
    result = compare_rung(cfg, fused, qkv, Scenario(steps=4), TOLERANCES[FUSED])
    if not result.passed:
        raise BenchError(f"{QKV} differs from {FUSED}: {result.to_dict()['tensors']}")


def measured(paths: dict[str, Path]) -> tuple[str, ...]:
    """The candidates a preset has (the Q/K/V merge only where it applies)."""
    return tuple(name for name in CANDIDATES if name != QKV or QKV in paths)


def measure_preset(
    directory: Path, paths: dict[str, Path], grid: list[Shape], plan: Plan, threads: int, progress: Progress
) -> dict[tuple[str, Shape], Timing]:
    """Every candidate at every shape; one candidate alive at a time (a prefill arena is GBs)."""
    cfg = ModelConfig.load(directory)
    label = f"d{cfg.d_model}/h{cfg.n_heads}/kv{cfg.n_kv_heads}/L{cfg.n_layers}"
    timings: dict[tuple[str, Shape], Timing] = {}
    for phase in ("prefill", "decode"):
        budget, passes = plan.budgets[phase], plan.passes[phase]
        budget = dataclasses.replace(budget, seconds=budget.seconds / passes, min_runs=-(-budget.min_runs // passes))
        for turn, name in interleaved(passes, measured(paths)):
            with progress.stage(f"{label} {phase} {name} (pass {turn + 1}/{passes})"):
                prepare = candidate(name, directory, paths, threads)
                for shape in [shape for shape in grid if shape.phase == phase]:
                    progress.update(shape.label)
                    measure(prepare(shape), budget, into=timings.setdefault((name, shape), Timing()))
                del prepare
                gc.collect()
                time.sleep(plan.settle_s)
    return timings


def decode_floor_ms(cfg: ModelConfig, shape: Shape, itemsize: int, gbps: float) -> float:
    """Streaming the past keys/values and every weight once at the measured bandwidth."""
    nbytes = cfg.kv_cache_bytes(shape.batch, shape.past, itemsize) + cfg.n_params() * itemsize
    return nbytes / (gbps * 1e9) * 1e3


def preset_results(cfg: ModelConfig, grid: list[Shape], timings: dict, gbps: float, paths: dict[str, Path]) -> dict:
    rows = []
    for shape in grid:
        row = {**dataclasses.asdict(shape), "label": shape.label}
        row["candidates"] = {name: timings[(name, shape)].to_dict() for name in measured(paths)}
        if shape.phase == "decode":
            row["floor_ms"] = {
                kind: decode_floor_ms(cfg, shape, size, gbps) for kind, size in (("fp32", 4), ("fp16", 2))
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
        if twin is not None:
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
    seed = results["presets"].get("seed", {"rows": []})
    decode = next((row for row in seed["rows"] if row["label"] == "decode B1 P4096"), None)
    if decode:
        floor, fused, static = decode["floor_ms"]["fp32"], median(decode, FUSED), median(decode, STATIC)
        where = "seed_decode_B1_P4096"
        out[f"{where}_fused_vs_torch"] = goal(median(decode, TORCH) / fused, least=2, kind="speedup")
        out[f"{where}_fused_vs_floor"] = goal(fused / floor, most=4)
        out[f"{where}_static_vs_floor"] = goal(static / floor, most=1.2)
        out[f"{where}_static_vs_fused"] = goal(fused / static, least=1.3, kind="speedup")
    rows = [(name, row) for name, entry in results["presets"].items() for row in entry["rows"]]
    if rows:
        worst, where = max((median(row, FUSED) / median(row, PLAIN), f"{name} {row['label']}") for name, row in rows)
        out["fused_vs_fp32_worst"] = goal(worst, most=1.10, where=where, target="<= 1.10")
    for name, entry in results["presets"].items():
        out[f"{name}_fp16_file_vs_fused"] = goal(entry["file_bytes"][FP16] / entry["file_bytes"][FUSED], most=0.55)
    return out


def table(results: dict) -> str:
    header = ["preset", "shape", "torch ms", *(f"{name} ms (x)" for name in CANDIDATES[1:])]
    rows = []
    for preset_name, entry in results["presets"].items():
        for row in entry["rows"]:
            torch_ms, floor, fused = median(row, TORCH), row.get("floor_ms", {}).get("fp32"), median(row, FUSED)
            cells = [
                f"{median(row, n):.3f} ({torch_ms / median(row, n):.2f}x)" if n in row["candidates"] else "-"
                for n in CANDIDATES[1:]
            ]
            floors = [f"{floor:.3f}", f"{fused / floor:.2f}", f"{median(row, STATIC) / floor:.2f}"] if floor else []
            rows.append(
                [preset_name, row["label"], f"{torch_ms:.3f}", *cells, f"{fused / median(row, PLAIN):.2f}", *floors]
            )
    heading = "median ms; (x) = PyTorch eager median / candidate median; fused/fp32 and */floor use medians"
    lines = [output.table(heading, [*header, "fused/fp32", "floor ms", "fused/floor", "static/floor"], rows)]
    lines.append(f"memory bandwidth {results['bandwidth']['gbps']:.1f} GB/s (copy, read + write bytes)")
    lines.append("targets:")
    for name, entry in results["targets"].items():
        value = entry.get("speedup", entry.get("ratio"))
        where = f" at {entry['where']}" if "where" in entry else ""
        lines.append(
            f"  {name}: {value:.2f} (target {entry['target']}){where} -> {'met' if entry['met'] else 'MISSED'}"
        )
    for name, rotation_rows in results["rotation_costs"].items():
        for label, ratios in rotation_rows.items():
            cells = ", ".join(f"{c} {ratio:.2f}x" for c, ratio in ratios.items())
            lines.append(f"rotation cost, {name} {label}: {cells} (with / without rotary embeddings)")
    return "\n".join(lines)


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
    where = output.RESULTS
    parser.add_argument("--out", type=Path, default=where, help=f"where to write results (default {where})")
    parser.add_argument(
        "--artifacts", type=Path, help="build (or reuse) artifacts under DIR/<preset>; default: temporary"
    )
    parser.add_argument(
        "--config", type=Path, help="a model config JSON besides the presets, measured under its file's stem"
    )
    whole_model.add_arguments(parser)


def parse_shapes(text: str) -> list[Shape]:
    """`decode:B:P` and `prefill:B:T`, comma-separated (e.g. "decode:1:4096,prefill:1:512")."""
    grid = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        phase, _, sizes = item.partition(":")
        batch, _, length = sizes.partition(":")
        if phase not in ("decode", "prefill") or not (batch.isdigit() and length.isdigit()):
            raise argparse.ArgumentTypeError(f"a shape is decode:BATCH:PAST or prefill:BATCH:TOKENS, got {item!r}")
        decode = phase == "decode"
        grid.append(Shape(phase, int(batch), 1 if decode else int(length), int(length) if decode else 0))
    return grid


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
    whole = {name: configs.pop(name) for name in list(configs) if configs[name].whole}
    if whole:
        with output.work_folder(args.artifacts, "bench-whole-") as root:
            whole_model.run(whole, args, root)
    if not configs:
        return 0
    configs |= {f"{name}{WITHOUT_ROTARY}": without_rotary(cfg) for name, cfg in configs.items() if cfg.rotary}
    with output.work_folder(args.artifacts, "bench-artifacts-") as root:
        results = benchmark(configs, root, args.quick, args.threads, args.shapes)
    return output.report(results, args.out, "model", decode_plot, table(results), png="model_decode")


def benchmark(
    configs: dict[str, ModelConfig], root: Path, quick: bool, threads: int, grid: list[Shape] | None = None
) -> dict:
    """`grid` (default: the standard shapes, fewer when `quick`) for every preset."""
    started, grid, plan, progress = time.perf_counter(), grid or shapes(quick), Plan.make(quick), Progress()
    with output.during(threads, "torch", "onnxruntime") as machine:
        with progress.stage("memory bandwidth"):
            bandwidth = {"before": copy_bandwidth(threads, plan.bandwidth_mib, plan.bandwidth_runs)}
        presets = {}
        for name, cfg in configs.items():
            paths = prepare_artifacts(cfg, root / name, progress)
            timings = measure_preset(root / name, paths, grid, plan, threads, progress)
            presets[name] = (cfg, paths, timings)
        with progress.stage("memory bandwidth, again"):  # the machine may drift during the run
            bandwidth["after"] = copy_bandwidth(threads, plan.bandwidth_mib, plan.bandwidth_runs)
    bandwidth["gbps"] = max(bandwidth["before"]["gbps"], bandwidth["after"]["gbps"])  # the best seen
    results = {
        "machine": machine,
        "bandwidth": bandwidth,
        "quick": quick,
        "presets": {
            name: preset_results(cfg, grid, timings, bandwidth["gbps"], paths)
            for name, (cfg, paths, timings) in presets.items()
        },
        "seconds": round(time.perf_counter() - started, 1),
    }
    results["targets"] = targets(results)
    results["rotation_costs"] = rotation_costs(results)
    return results
