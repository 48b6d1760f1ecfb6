"""INT8 weights: `fp32-fused-int8w` against PyTorch's own dynamic quantization, prefill and decode.

Writes `weights_int8.json` and `weights_int8.png` and prints a table.

Candidates, one model (the preset's weights, seed 0) and the same inputs:

- `torch`: the PyTorch original, fp32, eager (the reference every error is taken against);
- `torch-int8`: the peer, `torch.ao.quantization.quantize_dynamic(original, {nn.Linear}, dtype=torch.qint8)`.
  Its default qconfig: weights int8 with one scale per tensor; activations uint8 per tensor with a
  7-bit range (`reduce_range=True` in DynamicQuantizedLinear's x86 kernel). torch 2.13 still has it
  there, deprecated (torchao's `quantize_` is named as its successor);
- `fp32-fused` and `fp32-fused-int8w` (export/weights_int8.py) on ONNX Runtime's CPU provider, driven
  through IOBinding as `bench/model.py` drives them (inputs bound in place, outputs left in ONNX
  Runtime's memory). The int8w graph climbs its parity rung (`check_variant`) before it is timed.

Shapes: a prefill of `--prefill` tokens onto an empty past, and one decode token onto pasts of
`--pasts` positions, batch 1 (stateless: the past in, a new present out, the same inputs every call).
Conditions: every candidate on `--threads` threads (PyTorch's intra-op pool, ONNX Runtime's), one at a
time; `--rounds` rounds, the candidates' order reversed every round so that drift or other work on the
machine falls on every candidate alike; medians and 90th percentiles over all rounds. On a shared
machine PyTorch's OpenMP pool over every core stalls when other work takes a core (a 512-token
prefill of the seed model measured 8x slower on 2 threads than on 1 so): `--threads 1` is steady.
Errors: each candidate's output at each shape against the original's, the largest absolute
difference and that relative to the original output's largest magnitude. Sizes: the ONNX files, the original's
`weights.safetensors`, and the peer's state dict as `torch.save` writes it.
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import os
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import numpy as np

from bench import results as output
from bench.model import Shape, module_steps, stateless_inputs
from bench.plot import gridded, save
from bench.timing import SETTLE_S, Budget, Timing, interleaved, measure
from contract import files, names
from contract.config import ModelConfig, preset

TORCH, TORCH_INT8, FUSED, INT8W = "torch", "torch-int8", "fp32-fused", "fp32-fused-int8w"
CANDIDATES = (TORCH, TORCH_INT8, FUSED, INT8W)
ONNX_CANDIDATES = (FUSED, INT8W)


class BenchError(RuntimeError):
    """The benchmark cannot run as asked (the int8w graph failed its rung)."""


Step = Callable[[], object]


@dataclasses.dataclass
class Candidate:
    step: Callable[[Shape], Step]  # a zero-argument call timed at a shape
    forward: Callable[[dict[str, np.ndarray]], dict[str, np.ndarray]]  # the outputs, for the errors


def shapes(prefill: int, pasts: list[int]) -> list[Shape]:
    return [Shape("prefill", 1, prefill, 0)] + [Shape("decode", 1, 1, past) for past in pasts]


# --- candidates ----------------------------------------------------------------------------------


def torch_candidate(model) -> Candidate:
    """A PyTorch module of the AttentionModel's signature (the original or its quantized copy)."""
    from export.runners import torch_runner

    return Candidate(module_steps(model), torch_runner(model))


def torch_int8(model):
    """The peer: PyTorch's dynamic quantization of every nn.Linear (a copy; the original is kept)."""
    import torch
    from torch import nn

    with warnings.catch_warnings():  # torch.ao.quantization's deprecation notices, at every call
        warnings.simplefilter("ignore")
        return torch.ao.quantization.quantize_dynamic(model, {nn.Linear}, dtype=torch.qint8)


def ort_candidate(path: Path, cfg: ModelConfig, threads: int) -> Candidate:
    from serving.engine.ort import ort_runner, ort_session

    session = ort_session(path, threads=threads)
    outputs = [o.name for o in session.get_outputs()]

    def step(shape: Shape) -> Step:
        binding = session.io_binding()
        for name, array in stateless_inputs(cfg, shape, np.float32).items():
            binding.bind_cpu_input(name, array)
        for name in outputs:
            binding.bind_output(name, "cpu")
        return lambda: session.run_with_iobinding(binding)

    return Candidate(step, ort_runner(session))


def prepare(root: Path, preset_name: str, threads: int) -> tuple[ModelConfig, dict[str, Candidate], dict]:
    """The artifact folder (config, weights, both graphs), the int8w graph's rung, every candidate.
    A build of the preset already in the folder (`python -m export` of seed 0, passed) gives its
    `fp32-fused` graph: the int8w graph is made from it without exporting the model again."""
    import onnx
    import torch

    from export import artifacts
    from export.build import VARIANTS, check_variant
    from export.fusion import make_fp32_fused
    from export.model import AttentionModel
    from export.progress import Progress
    from export.weights_int8 import quantize_projections

    torch.set_num_threads(threads)
    cfg = preset(preset_name)
    model = AttentionModel(cfg, seed=0).eval()
    directory = root / preset_name
    paths = {FUSED: directory / files.model_filename(FUSED), INT8W: directory / files.model_filename(INT8W)}
    if not _built(directory, cfg, paths[FUSED]):
        artifacts.save_artifact(model, directory)
        make_fp32_fused(model, paths[FUSED])
    quantize_projections(onnx.load(str(paths[FUSED])), cfg, paths[INT8W])
    entry = check_variant(model, paths[INT8W], VARIANTS[INT8W], Progress(enabled=False))
    if not entry["passed"]:
        raise BenchError(f"{INT8W} failed its rung: {entry['problems']}")
    peer = torch_int8(model)
    candidates = {TORCH: torch_candidate(model), TORCH_INT8: torch_candidate(peer)}
    candidates |= {name: ort_candidate(paths[name], cfg, threads) for name in ONNX_CANDIDATES}
    sizes = {TORCH: (directory / files.WEIGHTS_FILENAME).stat().st_size, TORCH_INT8: _state_bytes(peer)}
    sizes |= {name: paths[name].stat().st_size for name in ONNX_CANDIDATES}
    parity = {"passed": entry["passed"], "worst": entry["worst"]}
    return cfg, candidates, {"file_bytes": sizes, "parity": parity}


def _built(directory: Path, cfg: ModelConfig, fused: Path) -> bool:
    """Whether `directory` holds a passed build of `cfg` with seed 0's weights and its fp32-fused graph."""
    import json

    report = directory / files.REPORT_FILENAME
    if not report.is_file() or not fused.is_file() or not (directory / files.WEIGHTS_FILENAME).is_file():
        return False
    content = json.loads(report.read_text())
    return bool(content.get("passed")) and content.get("seed") == 0 and content.get("config") == cfg.to_dict()


def _state_bytes(module) -> int:
    import torch

    buffer = io.BytesIO()
    torch.save(module.state_dict(), buffer)
    return buffer.getbuffer().nbytes


# --- measuring -----------------------------------------------------------------------------------


def errors(cfg: ModelConfig, candidates: dict[str, Candidate], shape: Shape) -> dict[str, dict]:
    """Each candidate's output against the fp32 original's, on the inputs it is timed with."""
    inputs = stateless_inputs(cfg, shape, np.float32)
    expected = candidates[TORCH].forward(inputs)[names.OUTPUT].astype(np.float64)
    scale = float(np.abs(expected).max())
    out = {}
    for name, candidate in candidates.items():
        max_abs = float(np.abs(candidate.forward(inputs)[names.OUTPUT] - expected).max())
        out[name] = {"max_abs": max_abs, "max_rel": max_abs / scale}
    return out


def timings(candidates: dict[str, Candidate], grid: list[Shape], rounds: int, seconds: float) -> dict:
    steps = {(name, shape): candidate.step(shape) for name, candidate in candidates.items() for shape in grid}
    measured = {key: Timing() for key in steps}
    for _, name in interleaved(rounds, CANDIDATES):
        for shape in grid:
            measure(steps[(name, shape)], Budget(seconds, min_runs=3), into=measured[(name, shape)])
        time.sleep(SETTLE_S)  # the last candidate's spinning threads go to sleep
    return measured


def benchmark(root: Path, preset_name: str, grid: list[Shape], rounds: int, seconds: float, threads: int) -> dict:
    started, load_before = time.perf_counter(), os.getloadavg()[0]
    cfg, candidates, facts = prepare(root, preset_name, threads)
    measured = timings(candidates, grid, rounds, seconds)
    rows = [_row(shape, measured, errors(cfg, candidates, shape)) for shape in grid]
    sizes = facts["file_bytes"]
    return {
        "preset": preset_name,
        "config": cfg.to_dict(),
        "machine": {
            **output.machine(threads, "torch", "onnxruntime"),
            "load_average_1min": {"before": load_before, "after": os.getloadavg()[0]},
        },
        "rounds": rounds,
        "seconds_per_round": seconds,
        "candidates": list(CANDIDATES),
        "shapes": rows,
        "file_bytes": sizes,
        "file_ratios": {
            "int8w_over_fp32_fused": sizes[INT8W] / sizes[FUSED],
            "int8w_over_torch_int8": sizes[INT8W] / sizes[TORCH_INT8],
        },
        "parity": facts["parity"],
        "seconds": round(time.perf_counter() - started, 1),
    }


def _row(shape: Shape, measured: dict, errors_at: dict) -> dict:
    medians = {name: measured[(name, shape)].median_ms for name in CANDIDATES}
    return {
        **dataclasses.asdict(shape),
        "label": shape.label,
        "candidates": {name: measured[(name, shape)].to_dict() for name in CANDIDATES},
        "errors": errors_at,
        # speedups: how many times faster the first is than the second (medians)
        "ratios": {
            "int8w_vs_fp32_fused": medians[FUSED] / medians[INT8W],
            "int8w_vs_torch_int8": medians[TORCH_INT8] / medians[INT8W],
            "torch_int8_vs_torch": medians[TORCH] / medians[TORCH_INT8],
        },
    }


# --- results -------------------------------------------------------------------------------------


def table(results: dict) -> str:
    machine = results["machine"]
    lines = [
        f"int8 weights, {results['preset']} on the CPU ({machine['cores']} cores, {machine['threads']} threads), "
        f"{results['rounds']} interleaved rounds: median ms (error: max abs, relative to the output's scale)",
        f"{'shape':<18}" + "".join(f"{name:>30}" for name in CANDIDATES) + f"{'vs fused':>10}{'vs torch-int8':>15}",
    ]
    for row in results["shapes"]:
        cells = "".join(
            f"{row['candidates'][n]['median_ms']:>9.3f} ({row['errors'][n]['max_abs']:.1e}, "
            f"{row['errors'][n]['max_rel']:.1e})"
            for n in CANDIDATES
        )
        ratios = row["ratios"]
        lines.append(
            f"{row['label']:<18}{cells}{ratios['int8w_vs_fp32_fused']:>9.2f}x{ratios['int8w_vs_torch_int8']:>14.2f}x"
        )
    sizes = results["file_bytes"]
    lines.append("file bytes: " + ", ".join(f"{name} {sizes[name] / 1e6:.2f} MB" for name in CANDIDATES))
    lines.append("vs fused, vs torch-int8: how many times faster fp32-fused-int8w is (medians)")
    return "\n".join(lines)


def plot(results: dict, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")  # files only
    import matplotlib.pyplot as plt

    rows = results["shapes"]
    figure, axis = plt.subplots(figsize=(8, 4.5))
    width = 0.8 / len(CANDIDATES)
    for i, name in enumerate(CANDIDATES):
        positions = [j + (i - (len(CANDIDATES) - 1) / 2) * width for j in range(len(rows))]
        axis.bar(positions, [row["candidates"][name]["median_ms"] for row in rows], width, label=name)
    axis.set_xticks(range(len(rows)), [row["label"] for row in rows])
    axis.set(yscale="log", ylabel="median ms")
    axis.set_title(f"int8 weights, {results['preset']} (CPU, {results['machine']['threads']} threads)")
    gridded(axis)
    return save(figure, path)


# --- command -------------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prefill", type=int, default=512, help="prefill tokens, batch 1 (default: %(default)s)")
    parser.add_argument(
        "--pasts", default="512,1024", help="decode past lengths, comma-separated (default: %(default)s)"
    )
    output.rounds_argument(parser, 4)
    parser.add_argument(
        "--seconds", type=float, default=0.1, help="per candidate and shape, per round (default: %(default)s)"
    )
    output.threads_argument(parser, "threads per candidate")
    output.output_arguments(parser, served_preset=True)


def run(args: argparse.Namespace) -> int:
    grid = shapes(args.prefill, [int(text) for text in args.pasts.split(",") if text])
    with output.work_folder(args.work, "bench-weights-int8-") as root:
        results = benchmark(root, args.preset, grid, args.rounds, args.seconds, args.threads)
    return output.report(results, args.out, "weights_int8", plot, table(results))
