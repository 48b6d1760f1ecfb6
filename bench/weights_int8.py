"""INT8 weights: `fp32-fused-int8w` against PyTorch's own dynamic quantization, prefill and decode.

Candidates, one model (the preset's weights, seed 0) on the same inputs: `torch`, the PyTorch original in fp32
(every error is taken against it); `torch-int8`, the peer, `quantize_dynamic(original, {nn.Linear}, qint8)`:
weights int8 with one scale per tensor, activations uint8 with a 7-bit range (`reduce_range` in its x86 kernel;
torch 2.13 still has it, deprecated for torchao's `quantize_`); `fp32-fused` and `fp32-fused-int8w` on ONNX
Runtime's CPU provider through IOBinding as bench/model.py drives them, the int8w graph past its parity rung.
Shapes: a prefill of `--prefill` tokens onto an empty past, one decode token onto each of `--pasts`, batch 1,
stateless. Each candidate alone on `--threads` threads, rounds interleaved; medians and p90s over every round.
`--threads 1` is steady on a shared machine: PyTorch's OpenMP pool over every core stalls when other work takes
one (a 512-token prefill of the seed model measured 8x slower on 2 threads than on 1). Errors: the largest
absolute difference from the original's output and that over its largest magnitude. Sizes: the ONNX files, the
original's `weights.safetensors`, the peer's state dict as `torch.save` writes it.
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import numpy as np

from bench import results as output
from bench import stack
from bench.model import Shape, module_steps, stateless_inputs
from bench.plot import figure, gridded, grouped_bars, save
from bench.timing import SETTLE_S, Budget, Timing, interleaved, measure
from contract import files, names
from contract.config import ModelConfig

TORCH, TORCH_INT8, FUSED, INT8W = "torch", "torch-int8", "fp32-fused", "fp32-fused-int8w"
CANDIDATES = (TORCH, TORCH_INT8, FUSED, INT8W)


class BenchError(RuntimeError):
    """The int8w graph failed its parity rung."""


@dataclasses.dataclass
class Candidate:
    step: Callable[[Shape], Callable[[], object]]  # the call timed at a shape
    forward: Callable[[dict[str, np.ndarray]], dict[str, np.ndarray]]  # its outputs, for the errors


def prepare(root: Path, preset_name: str, threads: int) -> tuple[ModelConfig, dict[str, Candidate], dict]:
    """Every candidate, the files' sizes and the int8w graph's rung; the int8w graph is made from the preset's
    fp32-fused graph (its artifact built in `root` where missing)."""
    import onnx
    import torch
    from torch import nn

    from export import artifacts
    from export.build import VARIANTS, check_variant
    from export.progress import Progress
    from export.runners import torch_runner
    from export.weights_int8 import quantize_projections

    torch.set_num_threads(threads)
    directory = stack.artifact(root, preset_name, [FUSED])
    model = artifacts.load_model(directory)
    paths = {name: directory / files.model_filename(name) for name in (FUSED, INT8W)}
    quantize_projections(onnx.load(str(paths[FUSED])), model.cfg, paths[INT8W])
    rung = check_variant(model, paths[INT8W], VARIANTS[INT8W], Progress(enabled=False))
    if not rung["passed"]:
        raise BenchError(f"{INT8W} failed its rung: {rung['problems']}")
    with warnings.catch_warnings():  # torch.ao.quantization's deprecation notices
        warnings.simplefilter("ignore")
        peer = torch.ao.quantization.quantize_dynamic(model, {nn.Linear}, dtype=torch.qint8)
    state = io.BytesIO()
    torch.save(peer.state_dict(), state)
    modules = {TORCH: model, TORCH_INT8: peer}
    candidates = {name: Candidate(module_steps(module), torch_runner(module)) for name, module in modules.items()}
    candidates |= {name: ort_candidate(path, model.cfg, threads) for name, path in paths.items()}
    sizes = {TORCH: (directory / files.WEIGHTS_FILENAME).stat().st_size, TORCH_INT8: state.getbuffer().nbytes}
    sizes |= {name: path.stat().st_size for name, path in paths.items()}
    return model.cfg, candidates, {"file_bytes": sizes, "parity": {"passed": True, "worst": rung["worst"]}}


def ort_candidate(path: Path, cfg: ModelConfig, threads: int) -> Candidate:
    """A graph on ONNX Runtime's CPU provider, timed through IOBinding (inputs bound in place, outputs left in its
    memory) as bench/model.py times it."""
    from serving.engine.ort import ort_runner, ort_session

    session = ort_session(path, threads=threads)

    def step(shape: Shape) -> Callable[[], object]:
        binding = session.io_binding()
        for name, array in stateless_inputs(cfg, shape, np.float32).items():
            binding.bind_cpu_input(name, array)
        for output_name in session.get_outputs():
            binding.bind_output(output_name.name, "cpu")
        return lambda: session.run_with_iobinding(binding)

    return Candidate(step, ort_runner(session))


def errors(cfg: ModelConfig, candidates: dict[str, Candidate], shape: Shape) -> dict[str, dict]:
    """Each candidate's output against the fp32 original's, on the inputs it is timed with."""
    inputs = stateless_inputs(cfg, shape, np.float32)
    expected = candidates[TORCH].forward(inputs)[names.OUTPUT].astype(np.float64)
    scale = float(np.abs(expected).max())
    found = {}
    for name, candidate in candidates.items():
        max_abs = float(np.abs(candidate.forward(inputs)[names.OUTPUT] - expected).max())
        found[name] = {"max_abs": max_abs, "max_rel": max_abs / scale}
    return found


def row(shape: Shape, measured: dict[tuple[str, Shape], Timing], errors_at: dict) -> dict:
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


def benchmark(root: Path, preset_name: str, grid: list[Shape], rounds: int, seconds: float, threads: int) -> dict:
    started = time.perf_counter()
    with output.during(threads, "torch", "onnxruntime") as machine:
        cfg, candidates, facts = prepare(root, preset_name, threads)
        steps = {(name, shape): candidates[name].step(shape) for name in CANDIDATES for shape in grid}
        measured = {key: Timing() for key in steps}
        for _, name in interleaved(rounds, CANDIDATES):
            for shape in grid:
                measure(steps[(name, shape)], Budget(seconds, min_runs=3), into=measured[(name, shape)])
            time.sleep(SETTLE_S)
        rows = [row(shape, measured, errors(cfg, candidates, shape)) for shape in grid]
    sizes = facts["file_bytes"]
    return {
        "preset": preset_name,
        "config": cfg.to_dict(),
        "machine": machine,
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


def table(results: dict) -> str:
    machine = results["machine"]
    heading = (
        f"int8 weights, {results['preset']} on the CPU ({machine['cores']} cores, {machine['threads']} threads), "
        f"{results['rounds']} interleaved rounds: median ms (error: max abs, relative to the output's scale)"
    )
    rows = []
    for entry in results["shapes"]:
        cells = [
            f"{entry['candidates'][name]['median_ms']:.3f} ({entry['errors'][name]['max_abs']:.1e}, "
            f"{entry['errors'][name]['max_rel']:.1e})"
            for name in CANDIDATES
        ]
        ratios = entry["ratios"]
        rows.append(
            [entry["label"], *cells, f"{ratios['int8w_vs_fp32_fused']:.2f}x", f"{ratios['int8w_vs_torch_int8']:.2f}x"]
        )
    sizes = results["file_bytes"]
    return "\n".join(
        [
            output.table(heading, ["shape", *CANDIDATES, "vs fused", "vs torch-int8"], rows),
            "file bytes: " + ", ".join(f"{name} {sizes[name] / 1e6:.2f} MB" for name in CANDIDATES),
            "vs fused, vs torch-int8: how many times faster fp32-fused-int8w is (medians)",
        ]
    )


def plot(results: dict, path: Path) -> Path:
    rows = results["shapes"]
    drawn, (axis,) = figure(1, (8, 4.5))
    series = {name: [entry["candidates"][name]["median_ms"] for entry in rows] for name in CANDIDATES}
    title = f"int8 weights, {results['preset']} (CPU, {results['machine']['threads']} threads)"
    grouped_bars(axis, [entry["label"] for entry in rows], series, yscale="log", ylabel="median ms", title=title)
    gridded(axis)
    return save(drawn, path)


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
    grid = [Shape("prefill", 1, args.prefill, 0)] + [Shape("decode", 1, 1, past) for past in output.counts(args.pasts)]
    with output.work_folder(args.work, "bench-weights-int8-") as root:
        results = benchmark(root, args.preset, grid, args.rounds, args.seconds, args.threads)
    return output.report(results, args.out, "weights_int8", plot, table(results))
