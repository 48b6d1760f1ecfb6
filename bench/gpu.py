"""GPU proof: parity on the GPU, decode latency against the HBM floor, the models served on the GPU.

`make gpu-proof` (`python -m bench gpu`) on a CUDA host with PyTorch and onnxruntime-gpu, no Docker, no network:
(a) parity: every GPU variant on ONNX Runtime's CUDA provider against the PyTorch original in fp32 on the same GPU,
    the stateless forms over a left-padded prefill and 128 decode steps, the static form over the pool rung (ragged
    rows, chunked prefill, 128 decode steps); fp16 within its documented tolerance, nothing NaN or Inf;
(b) one decode step's latency against past and batch: the PyTorch original in fp16, the PyTorch static-cache peer
    (gpt-fast style, SDPA), transformers' model of a Llama-shaped one and each fp16 ONNX form, interleaved, against
    the HBM floor of a device-to-device copy measured in the same run;
(c) the models served by the bundled tritonserver on the GPU: the stateful step (gRPC) against the same engine
    in-process, and a no-op Python model's round trip; (e) greedy generation of a Llama-shaped whole model;
(d) `gpu.json`, a PNG per preset, the tables on stdout. Every ONNX Runtime session says where its nodes ran (its
    profiler): a GPU candidate with a compute node on the CPU fails the proof, as does a served model off CUDA.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import json
import platform
import subprocess
import tempfile
import time
import traceback
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import numpy as np

from bench.plot import figure, gridded, save
from bench.results import PLOT_LOCK, counts, planned, table, work_folder
from bench.timing import Budget, Timing, interleaved, measure
from contract import files, names
from contract.config import NO_NORM, ModelConfig, preset
from export import artifacts
from export.progress import Progress

RESULTS = Path(__file__).parent / "results" / "gpu"
CUDA = "CUDAExecutionProvider"
# the forms meant for a GPU; fp32-static is not one (GroupQueryAttention runs fp16/bf16 on CUDA)
GRAPHS = "fp16-static+graphs"  # fp16-static with ONNX Runtime's CUDA graphs: the decode engine's GPU form
BUILT_VARIANTS = ("fp32", "fp32-fused", "fp16-fused", "fp32-trt", "fp16-trt", "fp16-static")
BUILD = (*BUILT_VARIANTS, "fp32-static")  # what a proof builds: fp32-static too, for the served sessions
PARITY_VARIANTS = (*BUILT_VARIANTS, GRAPHS)
LATENCY_VARIANTS = ("fp16-fused", "fp16-trt", "fp16-static", GRAPHS)
TORCH, PEER, TRANSFORMERS = "torch-fp16", "torch-static-fp16", "transformers-fp16"
ENGINE_LOOP = "engine-loop"  # (e): the serving engine's generation loop in this process
# both PyTorch candidates are fp16: they differ by fp16 roundings of the same sums (a few 2^-11)
PEER_BOUND = 5e-3
PASTS = (128, 512, 1024, 2048, 4096, 8192, 16384)
BATCHES = (1, 8, 32)
PRESETS = ("seed", "large", "llama-whole", "seed-bare")
# shapes the proof measures beside the contract's presets: an imported bare module (no norm before
# attention, no residual), whose fp16 forms run the attention node in fp32 between Casts (docs/importing.md)
BENCH_PRESETS = {"seed-bare": dataclasses.replace(preset("seed"), norm=NO_NORM, residual=False)}


class GPUProofError(RuntimeError):
    """The proof cannot run here, or a GPU run fell back to the CPU."""


@dataclasses.dataclass(frozen=True)
class Device:
    """Where a run happens: the proof runs on CUDA; the test suite runs the same code on the CPU."""

    torch: str  # torch device
    provider: str  # ONNX Runtime execution provider
    ort: str  # ONNX Runtime's name for the device's memory

    def synchronize(self) -> None:
        if self.torch == "cuda":
            import torch

            torch.cuda.synchronize()


GPU = Device("cuda", CUDA, "cuda")
CPU = Device("cpu", "CPUExecutionProvider", "cpu")


def bench_config(name: str, longest_past: int = max(PASTS)) -> ModelConfig:
    """The preset, sized for the longest past measured plus the steps that follow it."""
    return dataclasses.replace(BENCH_PRESETS.get(name) or preset(name), max_seq_len=longest_past + 64)


def host() -> dict:
    """What this GPU host is; raises GPUProofError when it cannot run the proof."""
    import onnxruntime as ort
    import torch

    if not torch.cuda.is_available():
        raise GPUProofError("PyTorch sees no CUDA device: the GPU proof needs a CUDA host")
    offered = ort.get_available_providers()
    if CUDA not in offered:
        raise GPUProofError(
            f"onnxruntime {ort.__version__} has no {CUDA} (it offers {offered}): install onnxruntime-gpu"
        )
    properties = torch.cuda.get_device_properties(0)
    return {
        "device": torch.cuda.get_device_name(0),
        "memory_gib": round(properties.total_memory / (1 << 30), 1),
        "multiprocessors": properties.multi_processor_count,
        "driver": _driver_version(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "onnxruntime": ort.__version__,
        "onnxruntime_providers": offered,
        "python": platform.python_version(),
    }


def _driver_version() -> str | None:
    query = ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]
    with contextlib.suppress(OSError):
        return subprocess.run(query, capture_output=True, text=True, check=False).stdout.strip() or None
    return None


def hbm_bandwidth(device: Device, megabytes: int = 2048, repeats: int = 20) -> float:
    """GB/s of a device-to-device copy, counting the bytes read and the bytes written (best of the runs)."""
    import torch

    source = torch.empty(megabytes << 20, dtype=torch.uint8, device=device.torch)
    target = torch.empty_like(source)
    best = float("inf")
    for _ in range(repeats):
        device.synchronize()
        started = time.perf_counter()
        target.copy_(source)
        device.synchronize()
        best = min(best, time.perf_counter() - started)
    return 2 * source.numel() / best / 1e9


def variant_file(directory: Path, name: str) -> Path:
    return directory / files.model_filename(name.removesuffix("+graphs"))


def candidate_session(directory: Path, name: str, device: Device):
    """`+graphs` candidates with CUDA graphs (not profiled: a replay has no per-node events), the others profiled."""
    graphs = name.endswith("+graphs") and device.provider == CUDA
    return device_session(variant_file(directory, name), device, profile=not graphs, cuda_graphs=graphs)


def device_session(path: Path, device: Device, profile: bool = True, cuda_graphs: bool = False):
    """A session on `device`, profiled for `node_placement`; CUDA's TF32 off, so that the fp32 rungs are fp32."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.log_severity_level = 3
    if profile:
        options.enable_profiling = True
        options.profile_file_prefix = str(Path(tempfile.gettempdir()) / f"gpu-proof-{path.stem}")
    # the arena grows by what is asked (not to the next power of two): a B32 P16k run holds GBs per session
    cuda_options = {"device_id": 0, "use_tf32": 0, "arena_extend_strategy": "kSameAsRequested"}
    if cuda_graphs:
        cuda_options["enable_cuda_graph"] = "1"
    providers = [(CUDA, cuda_options)] if device.provider == CUDA else []
    return ort.InferenceSession(str(path), sess_options=options, providers=[*providers, "CPUExecutionProvider"])


def node_placement(session) -> dict:
    """Where the nodes of the runs so far ran (the profile): each provider's count per op, the CPU's node names."""
    profile = Path(session.end_profiling())
    events = json.loads(profile.read_text())
    profile.unlink(missing_ok=True)
    placed: dict[str, Counter] = {}
    on_cpu = set()
    for event in events:
        args = event.get("args", {})
        if event.get("cat") != "Node" or "provider" not in args or not event["name"].endswith("_kernel_time"):
            continue
        placed.setdefault(args["provider"], Counter())[args.get("op_name", "?")] += 1
        if args["provider"] == "CPUExecutionProvider":
            on_cpu.add(event["name"].removesuffix("_kernel_time"))
    return {"providers": {provider: dict(counts) for provider, counts in placed.items()}, "cpu_nodes": sorted(on_cpu)}


def cpu_compute_nodes(path: Path, placement: dict) -> list[str]:
    """CPU nodes that compute floats: a fallback (ONNX Runtime puts integer shape arithmetic there on purpose)."""
    import onnx

    if not placement.get("cpu_nodes"):
        return []
    model = onnx.shape_inference.infer_shapes(onnx.load(str(path)))
    types = {v.name: v.type.tensor_type.elem_type for v in [*model.graph.value_info, *model.graph.output]}
    floats = {onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16}
    nodes = {node.name: node for node in model.graph.node}
    found = []
    for name in placement["cpu_nodes"]:
        node = nodes.get(name)
        if node is None or any(types.get(output) in floats for output in node.output):
            found.append(f"{node.op_type if node else '?'} {name}")
    return found


def parity(directory: Path, device: Device, progress: Progress, decode_steps: int = 128) -> dict:
    """(a): every variant against the PyTorch original in fp32 on `device`, and where its nodes ran."""
    from export.build import POOL, VARIANTS, precision_floor
    from export.parity import POOL_ROWS, Scenario, compare_pool_rung, compare_rung, pool_schedule
    from export.runners import torch_runner
    from serving.engine.kv_pool import KVPool
    from serving.engine.ort import ort_runner

    model = artifacts.load_model(directory)
    cfg = model.cfg
    reference = torch_runner(model, device.torch)
    scenario = Scenario(batch=3, prefill=7, steps=decode_steps, padding=(0, 2, 5))
    results = {}
    for name in PARITY_VARIANTS:
        variant = VARIANTS[name.removesuffix("+graphs")]
        # the fp16 bound is the build's: 2e-3 of the scale, or 8x the precision floor's error where larger
        floor = precision_floor(model, variant)
        with progress.stage(f"parity on {device.torch}: {name}"):
            session = candidate_session(directory, name, device)
            if variant.ladder == POOL:
                pool = KVPool(session, cfg, rows=POOL_ROWS, capacity=cfg.max_seq_len)
                schedule = pool_schedule(cfg.max_seq_len, decode_steps)
                rung = compare_pool_rung(cfg, reference, pool, schedule, variant.tolerance, floor=floor)
            else:
                runner = ort_runner(session)
                rung = compare_rung(cfg, reference, runner, scenario, variant.tolerance, cast=variant.cast, floor=floor)
            placement = node_placement(session) if session.get_session_options().enable_profiling else {}
        results[name] = {
            "passed": rung.passed,
            "finite": all(error.finite for error in rung.tensors.values()),
            "tolerance": dataclasses.asdict(variant.tolerance),
            "worst": {tensor: error.to_dict() for tensor, error in rung.tensors.items()},
            "placement": placement,
            "cpu_compute_ops": cpu_compute_nodes(variant_file(directory, name), placement),
        }
    return results


Step = Callable[[], object]


def torch_step(model, device: Device, batch: int, past: int) -> Step:
    """The PyTorch original in the model's dtype: concat cache, explicit masked softmax (export/model.py)."""
    import torch

    from export.model import KVCache

    cfg, like = model.cfg, next(model.parameters())
    shape = (batch, cfg.n_kv_heads, past, cfg.head_dim)
    cache = [KVCache(like.new_empty(shape).normal_(), like.new_empty(shape).normal_()) for _ in model.layers]
    new_tokens = step_tokens(cfg, batch, like)
    mask = torch.ones(batch, past + 1, dtype=torch.int64, device=like.device)
    # given, not counted from the mask on the host (the original's default for eager callers)
    positions = torch.full((batch, 1), past, dtype=torch.int64, device=like.device) if cfg.positioned else None

    def step():
        with torch.inference_mode():
            model(new_tokens, mask, cache, position_ids=positions)
        device.synchronize()

    return step


def step_tokens(cfg: ModelConfig, batch: int, like):
    """One new token per row on `like`'s device: ids (B, 1) of a whole model, else states in `like`'s dtype."""
    from bench.peers import random_tokens

    tokens = random_tokens(cfg, batch, 1).to(like.device)
    return tokens if cfg.whole else tokens.to(like.dtype)


def peer_step(model, device: Device, batch: int, past: int) -> Step:
    from bench.peers import StaticCacheDecoder

    decoder = StaticCacheDecoder(model, batch, capacity=past + 1)
    new_tokens = step_tokens(model.cfg, batch, next(model.parameters()))

    def step():
        decoder.length = past
        decoder.step(new_tokens)
        device.synchronize()

    return step


def transformers_step(model, hf, device: Device, batch: int, past: int) -> Step:
    """transformers' model (`hf`) as its users run it: eager, its dynamic cache (concatenating), cropped back."""
    import torch
    import transformers

    cfg, like = model.cfg, next(model.parameters())
    cache = transformers.DynamicCache(config=hf.config)
    shape = (batch, cfg.n_kv_heads, past, cfg.head_dim)
    for layer in range(cfg.n_layers):
        cache.update(like.new_empty(shape).normal_(), like.new_empty(shape).normal_(), layer)
    new_tokens = step_tokens(cfg, batch, like)
    positions = torch.full((batch, 1), past, dtype=torch.int64, device=like.device)

    def step():
        with torch.inference_mode():
            hf(input_ids=new_tokens, position_ids=positions, past_key_values=cache, use_cache=True)
        cache.crop(-1)  # the step's key and value off again: the cache holds `past` positions
        device.synchronize()

    return step


def transformers_model(model):
    """transformers' LlamaForCausalLM holding `model`'s weights, on its device in its dtype."""
    import transformers

    from bench.whole_model import hf_config, hf_name

    like = next(model.parameters())
    hf = transformers.LlamaForCausalLM(hf_config(model.cfg)).to(device=like.device, dtype=like.dtype).eval()
    hf.load_state_dict({hf_name(name): tensor for name, tensor in model.state_dict().items()}, strict=True)
    return hf


def check_transformers(model, hf) -> float:
    """`hf`'s logits against the original's over a 9-token prompt of 2 rows, relative to their scale."""
    import torch

    from bench.peers import random_tokens

    ids = random_tokens(model.cfg, 2, 9, torch.Generator().manual_seed(0)).to(next(model.parameters()).device)
    with torch.inference_mode():
        expected = model(ids).output.float()
        actual = hf(input_ids=ids).logits.float()
    return float((actual - expected).abs().max() / expected.abs().max())


def stateless_step(session, device: Device, cfg: ModelConfig, batch: int, past: int) -> Step:
    """A stateless graph as a server keeping caches on the device runs it: the past bound by address, the presents
    left there."""
    import torch

    from serving.engine.ort import session_float_dtype

    dtype = session_float_dtype(session)
    shape = (batch, cfg.n_kv_heads, past, cfg.head_dim)
    torch_dtype = getattr(torch, np.dtype(dtype).name)
    caches = [torch.randn(shape, device=device.torch).to(torch_dtype) for _ in names.past_names(cfg.n_layers)]
    binding = session.io_binding()
    binding.bind_cpu_input(names.model_input(cfg), host_tokens(cfg, batch, dtype)[:, None])
    binding.bind_cpu_input(names.ATTENTION_MASK, np.ones((batch, past + 1), np.int64))
    if cfg.positioned:
        binding.bind_cpu_input(names.POSITION_IDS, np.full((batch, 1), past, np.int64))
    for name, cache in zip(names.past_names(cfg.n_layers), caches, strict=True):
        binding.bind_input(name, device.ort, 0, dtype, list(shape), cache.data_ptr())
    binding.bind_output(names.model_output(cfg), "cpu")
    for name in names.present_names(cfg.n_layers):
        binding.bind_output(name, device.ort, 0)

    def step():
        session.run_with_iobinding(binding)
        return caches  # kept alive with the step

    return step


def host_tokens(cfg: ModelConfig, batch: int, dtype) -> np.ndarray:
    """One new token for each of `batch` rows on the host: ids (B,) int64 of a whole model, else states (B, d_model)."""
    rng = np.random.default_rng(0)
    if cfg.whole:
        return rng.integers(cfg.vocab_size, size=batch, dtype=np.int64)
    return rng.standard_normal((batch, cfg.d_model)).astype(dtype)


def static_step(pool, cfg: ModelConfig, batch: int, past: int) -> Step:
    """A static-cache graph: `batch` rows of the pool at length `past`, each adding a token. One pool per batch size,
    as long as the longest past: a CUDA graph is captured once a window and replayed whatever the lengths."""
    tokens = dict(enumerate(host_tokens(cfg, batch, pool.dtype)[:, None]))

    def step():
        pool.lengths[:batch] = past
        return pool.run(tokens)

    return step


@dataclasses.dataclass(frozen=True)
class Shape:
    batch: int
    past: int

    @property
    def label(self) -> str:
        return f"B{self.batch} P{self.past}"


def decode_floor_ms(cfg: ModelConfig, shape: Shape, gbps: float) -> float:
    """The fp16 cache and weights read once at the HBM bandwidth (an embedding table only as a tied LM head)."""
    gathered = cfg.vocab_size * cfg.d_model if cfg.whole and not cfg.tie_embeddings else 0
    gathered += cfg.max_seq_len * cfg.d_model if cfg.learned_positions else 0
    nbytes = cfg.kv_cache_bytes(shape.batch, shape.past, 2) + (cfg.n_params() - gathered) * 2
    return nbytes / (gbps * 1e9) * 1e3


@dataclasses.dataclass(frozen=True)
class Grid:
    pasts: tuple[int, ...] = PASTS
    batches: tuple[int, ...] = BATCHES

    def shapes(self) -> list[Shape]:
        return [Shape(batch, past) for batch in self.batches for past in self.pasts]


def latency(directory: Path, device: Device, grid: Grid, budget: Budget, passes: int, progress: Progress) -> dict:
    """(b): every candidate at every shape in fp16, interleaved per shape (the order reversed on every pass)."""
    import torch

    from bench.peers import check_peer

    model = artifacts.load_model(directory).to(device.torch).half()
    cfg = model.cfg
    peer_error = check_peer(model, device.torch, torch.float16)
    hf = transformers_model(model) if TRANSFORMERS in candidates(cfg) else None  # one copy of the weights
    transformers_error = check_transformers(model, hf) if hf is not None else None
    sessions = {name: candidate_session(directory, name, device) for name in LATENCY_VARIANTS}
    capacity = max(grid.pasts) + 1
    makers = {
        TORCH: lambda s: torch_step(model, device, s.batch, s.past),
        TRANSFORMERS: lambda s: transformers_step(model, hf, device, s.batch, s.past),
        PEER: lambda s: peer_step(model, device, s.batch, s.past),
        **{name: _session_maker(directory, sessions[name], device, cfg, name, capacity) for name in LATENCY_VARIANTS},
    }
    makers = {name: makers[name] for name in candidates(cfg)}
    rows = []
    for shape in grid.shapes():
        with progress.stage(f"{cfg_label(cfg)} decode {shape.label}"):
            rows.append(_measure_shape(shape, makers, budget, passes))
        gc.collect()
        if device.torch == "cuda":
            torch.cuda.empty_cache()
    placement = {
        name: node_placement(session)
        for name, session in sessions.items()
        if session.get_session_options().enable_profiling
    }
    return {
        "config": cfg.to_dict(),
        "peer_error": peer_error,
        "transformers_error": transformers_error,
        "rows": rows,
        "placement": placement,
        "cpu_compute_ops": {name: cpu_compute_nodes(variant_file(directory, name), p) for name, p in placement.items()},
    }


def candidates(cfg: ModelConfig) -> tuple[str, ...]:
    """What a decode step is timed for, in order (transformers' model only of a Llama-shaped whole model)."""
    from bench.whole_model import llama_shaped

    return (TORCH, *((TRANSFORMERS,) if llama_shaped(cfg) else ()), PEER, *LATENCY_VARIANTS)


def _measure_shape(shape: Shape, makers: dict[str, Callable[[Shape], Step]], budget: Budget, passes: int) -> dict:
    steps = {name: make(shape) for name, make in makers.items()}
    timings = {name: Timing() for name in makers}
    for _, name in interleaved(passes, list(makers)):
        measure(steps[name], budget, into=timings[name])
    measured = {name: timing.to_dict() for name, timing in timings.items()}
    return {"batch": shape.batch, "past": shape.past, "label": shape.label, "candidates": measured}


def _session_maker(
    directory: Path, session, device: Device, cfg: ModelConfig, name: str, capacity: int
) -> Callable[[Shape], Step]:
    if "-static" not in name:
        return lambda s: stateless_step(session, device, cfg, s.batch, s.past)
    from serving.engine.kv_pool import KVPool

    pools: dict[int, KVPool] = {}  # one pool per batch, on a session of its own when graphs are on

    def pool_for(batch: int) -> KVPool:
        if batch not in pools:
            graphs = name.endswith("+graphs") and device.provider == CUDA
            pool_session = session  # the first pool's; a pool after it, a session of its own
            if pools:
                pool_session = device_session(variant_file(directory, name), device, profile=False, cuda_graphs=graphs)
            pools[batch] = KVPool(pool_session, cfg, rows=batch, capacity=capacity)
        return pools[batch]

    return lambda s: static_step(pool_for(s.batch), cfg, s.batch, s.past)


def cfg_label(cfg: ModelConfig) -> str:
    return f"d{cfg.d_model}/h{cfg.n_heads}/kv{cfg.n_kv_heads}/L{cfg.n_layers}"


def served(directory: Path, root: Path, pasts: tuple[int, ...], runs: int, progress: Progress) -> dict:
    """(c): the first preset's model served by the bundled Triton on the GPU: the stateful step over gRPC
    against the same engine in-process at each past, and a no-op Python model's round trip."""
    from bench.serving import NOOP, in_process, session_engine, stateful, write_noop_model
    from bench.stack import triton
    from serving.triton.config import ServingSettings
    from serving.triton.repository import write_repository

    cfg = ModelConfig.load(directory)
    settings = ServingSettings(kv_cache_bytes=cfg.kv_cache_bytes(1, cfg.max_seq_len) * 8)
    repository = write_repository(directory, root / "repository", settings, models=("forward", "sessions"))
    write_noop_model(repository)
    log_path = root / "triton.log"
    with contextlib.ExitStack() as stack:
        with progress.stage("start Triton (the Python models place themselves: the GPU where there is one)"):
            server = stack.enter_context(triton(repository, log_path=log_path, ready_timeout=300))
        runners = runner_lines(log_path)
        noop = stateful(server, "grpc", cfg, 1, runs, (1 << 40) + 999, model=NOOP)
        rows = []
        for k, past in enumerate(pasts):
            with progress.stage(f"served stateful step at past {past}"):
                row = {"past": past, "stateful_grpc": stateful(server, "grpc", cfg, past, runs, (1 << 40) + k)}
                engine = session_engine(repository, "sessions", cfg)
                row["in_process"] = in_process(engine, cfg, past, runs) | {"engine": engine.description}
                del engine
                rows.append(row)
    on_cpu = [line for line in runners if "on CPUExecutionProvider" in line]
    return {"runners": runners, "on_cpu": on_cpu, "noop_grpc": noop, "rows": rows}


def runner_lines(log_path: Path) -> list[str]:
    """What each Python model said at load that it runs on (serving/triton/models/*.py log it)."""
    lines = log_path.read_text(errors="replace").splitlines()
    return [line.split("] ", 1)[-1] for line in lines if ": runner " in line and ".onnx on " in line]


def generation(directory: Path, device: Device, plan: Plan, progress: Progress) -> dict:
    """(e): greedy generation, a `generation_prompt`-token prompt per row then `generation_tokens` tokens, at each
    batch: the serving engine's core over the `sessions` model's engine as the server builds it (on a GPU:
    fp16-static with CUDA graphs; bench/generate.py's in-process candidate) against transformers' model in fp16
    with the same weights, a warm-up then `generation_rounds` rounds in alternating order."""
    from bench.generate import in_process_candidate
    from serving.engine.core import EngineCore
    from serving.triton.engines import core_settings

    model = artifacts.load_model(directory).to(device.torch).half()
    cfg = model.cfg
    most = max(plan.generation_batches)
    engine, settings = generation_engine(directory, cfg, most, plan.generation_prompt + plan.generation_tokens)
    engine_core = EngineCore(engine, core_settings(settings)).start()
    try:
        generators = {
            ENGINE_LOOP: in_process_candidate(engine_core),
            TRANSFORMERS: transformers_generator(model, device),
        }
        rows = generation_rows(generators, cfg, plan, progress)
    finally:
        engine_core.stop()
    return {
        "prompt": plan.generation_prompt,
        "tokens": plan.generation_tokens,
        "engine": engine.description,
        "rows": rows,
    }


def generation_rows(generators: dict[str, Callable], cfg: ModelConfig, plan: Plan, progress: Progress) -> list[dict]:
    """Each batch: every generator on the same prompts, and how long the two greedy sequences agree (both fp16: a
    rounding can part them where two logits are nearly equal)."""
    from bench.whole_model import agreement

    rng = np.random.default_rng(0)
    rows = []
    for batch in plan.generation_batches:
        prompts = rng.integers(cfg.vocab_size, size=(batch, plan.generation_prompt), dtype=np.int64)
        with progress.stage(f"{cfg_label(cfg)} greedy generation, {batch} at once"):
            runs = {name: [] for name in generators}
            for turn, name in interleaved(plan.generation_rounds + 1, list(generators)):  # the first: warm-up
                generated = generators[name](prompts, plan.generation_tokens)
                if turn:
                    runs[name].append(generated)
        rows.append({"batch": batch, "candidates": {name: generation_summary(r) for name, r in runs.items()}})
        rows[-1]["agreement"] = agreement(runs[ENGINE_LOOP][-1].tokens, runs[TRANSFORMERS][-1].tokens)
    return rows


def generation_engine(directory: Path, cfg: ModelConfig, rows: int, positions: int):
    """(engine, settings): the `sessions` model's as the server builds it (a CUDA host: fp16-static with graphs)."""
    from contract.files import model_filename
    from serving.engine import factory
    from serving.engine.placement import CPU as ON_CPU
    from serving.engine.placement import CUDA as ON_CUDA
    from serving.engine.settings import SessionSettings

    graphs = {ON_CPU: directory / model_filename("fp32-static"), ON_CUDA: directory / model_filename("fp16-static")}
    row = cfg.kv_cache_bytes(batch=1, length=cfg.max_seq_len)  # fp32: room for the fp16 rows too
    settings = SessionSettings(kv_cache_bytes=(rows + 1) * row, idle_timeout_seconds=3600.0, max_batch=rows)
    found = {placement: path for placement, path in graphs.items() if path.is_file()}
    return factory.session_engine(found, cfg, settings, "sessions"), settings


def transformers_generator(model, device: Device) -> Callable:
    """Greedy generation by transformers' model, the prompts as one batch, as its `generate` runs: the prompt's
    logits at its last position only, each pick read back to the host (a loop checking stop tokens must)."""
    import torch
    import transformers

    from bench.generate import batched

    hf = transformers_model(model)

    def generate(prompts: np.ndarray, tokens: int):
        ids = torch.from_numpy(prompts).to(device.torch)
        cache = transformers.DynamicCache(config=hf.config)
        with torch.inference_mode():
            started = time.perf_counter()
            logits = hf(input_ids=ids, past_key_values=cache, logits_to_keep=1).logits
            chosen = [logits[:, -1].argmax(-1).cpu()]
            first_ms, steps_ms = (time.perf_counter() - started) * 1e3, []
            for _ in range(tokens - 1):
                t0 = time.perf_counter()
                logits = hf(input_ids=chosen[-1][:, None].to(device.torch), past_key_values=cache).logits
                chosen.append(logits[:, -1].argmax(-1).cpu())
                steps_ms.append((time.perf_counter() - t0) * 1e3)
        return batched(torch.stack(chosen, dim=1).numpy(), first_ms, steps_ms, time.perf_counter() - started)

    return generate


def generation_summary(runs: list) -> dict:
    """A candidate's rounds: median TTFT, the gaps between tokens over every round, tokens/s of the median round."""
    gaps = np.concatenate([run.gaps_ms for run in runs])
    return {
        "ttft_ms": float(np.median([ms for run in runs for ms in run.first_ms])),
        "step_p50_ms": float(np.percentile(gaps, 50)),
        "step_p90_ms": float(np.percentile(gaps, 90)),
        "tokens_per_s": runs[0].tokens.size / float(np.median([run.wall_s for run in runs])),
    }


@dataclasses.dataclass(frozen=True)
class Plan:
    grid: Grid = dataclasses.field(default_factory=Grid)
    budget: Budget = dataclasses.field(default_factory=lambda: Budget(0.25, min_runs=20, warmup=3))
    passes: int = 2
    parity_steps: int = 128
    served_pasts: tuple[int, ...] = (128, 1024, 4096)
    served_runs: int = 60
    bandwidth_mib: int = 2048  # the device-to-device copy that measures the HBM bandwidth, and its runs
    bandwidth_runs: int = 20
    generation_prompt: int = 512  # (e), for a Llama-shaped whole model: prompt and new tokens per row
    generation_tokens: int = 128
    generation_batches: tuple[int, ...] = (1, 16)
    generation_rounds: int = 3
    reuse_build: bool = False  # use a build already in the work folder (see `_build`); the command always builds

    @classmethod
    def quick(cls) -> Plan:
        return cls(budget=Budget(0.05, min_runs=5), passes=1, served_runs=10)


def benchmark(presets: tuple[str, ...], root: Path, device: Device, plan: Plan, progress: Progress, out: Path) -> dict:
    """Every section in turn, the results written after each; one that raises is recorded and the next one runs."""
    from bench.whole_model import llama_shaped

    results: dict = {"host": host() if device == GPU else {"device": "cpu"}, "started": time.strftime("%Y-%m-%d %H:%M")}
    results["errors"], results["presets"] = {}, {}

    def section(name: str, run: Callable[[], object]) -> object:
        try:
            return run()
        except Exception as error:
            results["errors"][name] = f"{type(error).__name__}: {error}\n{traceback.format_exc(limit=8)}"
            progress.note(f"{name} failed: {type(error).__name__}: {error}")
            return None
        finally:
            write(results, out, plots=False)

    def bandwidth() -> float:
        return hbm_bandwidth(device, plan.bandwidth_mib, plan.bandwidth_runs)

    results["hbm_gbps_before"] = section("bandwidth", bandwidth)
    results["served"] = None
    for name in presets:  # the served models are the first preset's: measured right after it
        directory = root / name
        built = section(f"{name} build", lambda name=name, directory=directory: _build(name, directory, plan, progress))
        if built is None:
            continue
        entry = results["presets"][name] = {}
        entry["parity"] = section(f"{name} parity", lambda d=directory: parity(d, device, progress, plan.parity_steps))
        entry["latency"] = section(
            f"{name} latency", lambda d=directory: latency(d, device, plan.grid, plan.budget, plan.passes, progress)
        )
        if llama_shaped(bench_config(name, max(plan.grid.pasts))) and plan.generation_batches:
            entry["generation"] = section(
                f"{name} generation", lambda d=directory: generation(d, device, plan, progress)
            )
        if name == presets[0] and plan.served_pasts:
            results["served"] = section(
                "served", lambda d=directory: served(d, root / "served", plan.served_pasts, plan.served_runs, progress)
            )
    results["hbm_gbps_after"] = section("bandwidth again", bandwidth)
    measured = [g for g in (results["hbm_gbps_before"], results["hbm_gbps_after"]) if g]
    results["hbm_gbps"] = max(measured) if measured else None
    for entry in results["presets"].values():
        if entry.get("latency") and results["hbm_gbps"]:
            add_floors(entry["latency"], results["hbm_gbps"])
    results["problems"] = problems(results)
    write(results, out, plots=False)
    return results


def _build(name: str, directory: Path, plan: Plan, progress: Progress) -> Path:
    """The preset's artifact built in `directory`; with `plan.reuse_build`, one there of this preset's model (seed 0,
    room for the longest past, every variant passed) as it is: the test suite's build."""
    from export.build import build

    wanted = bench_config(name, max(plan.grid.pasts))
    report_file = directory / files.REPORT_FILENAME
    built = report_file.is_file() and all((directory / files.model_filename(v)).is_file() for v in BUILD)
    content = json.loads(report_file.read_text()) if plan.reuse_build and built else {}
    if content.get("passed") and content.get("seed") == 0:
        cfg = ModelConfig.from_dict(content["config"])
        if cfg.max_seq_len >= wanted.max_seq_len and dataclasses.replace(cfg, max_seq_len=wanted.max_seq_len) == wanted:
            progress.note(f"{name}: reusing the artifact in {directory}")
            return directory
    build(wanted, directory, BUILD, progress=progress)
    return directory


def add_floors(latency_entry: dict, gbps: float) -> None:
    cfg = ModelConfig.from_dict(latency_entry["config"])
    for row in latency_entry["rows"]:
        row["floor_ms"] = decode_floor_ms(cfg, Shape(row["batch"], row["past"]), gbps)


def problems(results: dict) -> list[str]:
    """What fails the proof: a section that broke, a parity miss, NaN/Inf, a GPU run on the CPU."""
    found = [f"{name} broke: {error.splitlines()[0]}" for name, error in results["errors"].items()]
    for preset_name, entry in results["presets"].items():
        for variant, outcome in (entry.get("parity") or {}).items():
            if not outcome["passed"] or not outcome["finite"]:
                found.append(f"{preset_name} {variant}: parity failed or not finite")
            if outcome["cpu_compute_ops"]:
                found.append(f"{preset_name} {variant}: {outcome['cpu_compute_ops']} ran on the CPU")
        latency_entry = entry.get("latency") or {}
        for variant, nodes in (latency_entry.get("cpu_compute_ops") or {}).items():
            if nodes:
                found.append(f"{preset_name} {variant} (latency): {nodes} ran on the CPU")
        peer_error = latency_entry.get("peer_error", 0.0)
        if peer_error > PEER_BOUND:
            found.append(f"{preset_name}: the PyTorch static-cache peer is off the original by {peer_error:.1e}")
        transformers_error = latency_entry.get("transformers_error") or 0.0
        if transformers_error > PEER_BOUND:
            found.append(f"{preset_name}: transformers' model is off the original by {transformers_error:.1e}")
    if results.get("served") and results["served"]["on_cpu"]:
        found.append(f"served models on the CPU: {results['served']['on_cpu']}")
    return found


def median(row: dict, name: str) -> float:
    return row["candidates"][name]["median_ms"]


def floored(results: dict) -> dict[str, list[dict]]:
    """Each preset's decode-step rows, where they were measured and given their HBM floor."""
    latencies = {name: entry.get("latency") for name, entry in results["presets"].items()}
    return {name: entry["rows"] for name, entry in latencies.items() if entry and "floor_ms" in entry["rows"][0]}


def latency_table(results: dict) -> str:
    tables = []
    for preset_name, rows in floored(results).items():
        others = [name for name in rows[0]["candidates"] if name != TORCH]
        cells = []
        for row in rows:
            base, floor = median(row, TORCH), row["floor_ms"]
            ratios = [f"{median(row, name):.4f} ({base / median(row, name):.2f}x)" for name in others]
            cells.append([row["label"], f"{base:.4f}", *ratios, f"{floor:.4f}", f"{median(row, GRAPHS) / floor:.2f}"])
        header = ["shape", "torch ms", *(f"{name} (x)" for name in others), "floor ms", "static/floor"]
        tables.append(table(f"decode step, {preset_name} (median)", header, cells))
    note = f"(x) = {TORCH} median / candidate median; floor = fp16 cache + weights read once at the HBM bandwidth"
    return "\n\n".join([*tables, note])


def parity_table(results: dict) -> str:
    rows = []
    for preset_name, entry in results["presets"].items():
        for variant, outcome in (entry.get("parity") or {}).items():
            output = outcome["worst"].get(names.LOGITS) or outcome["worst"][names.OUTPUT]
            placed = (outcome["placement"] or {}).get("providers", {})
            ran = ", ".join(f"{p.replace('ExecutionProvider', '')}: {sum(c.values())}" for p, c in placed.items())
            result = ("pass" if outcome["passed"] else "FAIL") + (" (CPU!)" if outcome["cpu_compute_ops"] else "")
            rows.append([preset_name, variant, f"{output['max_abs']:.2e}", f"{output['max_rel']:.2e}", result, ran])
    header = ["preset", "variant", "output abs", "output rel", "result", "where it ran"]
    return table("parity against the PyTorch original in fp32", header, rows)


def served_table(results: dict) -> str:
    noop = results["served"]["noop_grpc"]["p50_ms"]
    rows = []
    for row in results["served"]["rows"]:
        served_ms, local_ms = row["stateful_grpc"]["p50_ms"], row["in_process"]["p50_ms"]
        ratio, budget = served_ms / local_ms, local_ms + noop + 0.3
        rows.append([row["past"], f"{served_ms:.3f}", f"{local_ms:.3f}", f"{ratio:.2f}", f"{budget:.3f}"])
    heading = f"no-op model with the sessions model's sequence batching, gRPC step p50: {noop:.3f} ms"
    return table(heading, ["past", "served p50 ms", "in-process p50 ms", "ratio", "in-process + no-op + 0.3 ms"], rows)


def generation_table(results: dict) -> str:
    rows, agreed = [], []
    for preset_name, entry in results["presets"].items():
        for row in (entry.get("generation") or {}).get("rows", []):
            for name, c in row["candidates"].items():
                times = [f"{c['ttft_ms']:.2f}", f"{c['step_p50_ms']:.3f}", f"{c['step_p90_ms']:.3f}"]
                rows.append([preset_name, row["batch"], name, *times, f"{c['tokens_per_s']:.0f}"])
            per_row = row["agreement"]["per_row"]
            fewest, middle = min(per_row), int(np.median(per_row))
            agreed.append(
                f"{preset_name} batch {row['batch']}: greedy tokens agree before the first difference: "
                f"{fewest} (fewest), {middle} (median over {len(per_row)} rows)"
            )
    header = ["preset", "batch", "candidate", "TTFT ms", "step p50", "step p90", "tok/s"]
    return "\n".join([table("greedy generation", header, rows), *agreed])


def report(results: dict) -> str:
    parts = []
    if any(entry.get("parity") for entry in results["presets"].values()):
        parts.append(parity_table(results))
    if floored(results):
        parts.append(latency_table(results))
    if any(entry.get("generation") for entry in results["presets"].values()):
        parts.append(generation_table(results))
    if results.get("served"):
        parts.append(served_table(results))
    return "\n\n".join(parts)


def write(results: dict, out: Path, plots: bool = True) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu.json").write_text(json.dumps(results, indent=2) + "\n")
    with PLOT_LOCK:
        return [out / "gpu.json", *(plot(results, out) if plots else [])]


def plot(results: dict, out: Path) -> list[Path]:
    """A PNG per preset: the decode step against past, a panel per batch, with the HBM floor."""
    paths = []
    for preset_name, preset_rows in floored(results).items():
        batches = sorted({row["batch"] for row in preset_rows})
        drawn, axes = figure(len(batches), (5 * len(batches), 4))
        for axis, batch in zip(axes, batches, strict=True):
            rows = [r for r in preset_rows if r["batch"] == batch]
            pasts = [r["past"] for r in rows]
            for name in rows[0]["candidates"]:
                axis.plot(pasts, [median(r, name) for r in rows], marker="o", label=name)
            axis.plot(pasts, [r["floor_ms"] for r in rows], "k:", label="HBM floor (fp16)")
            axis.set(title=f"{preset_name}, batch {batch}", xlabel="past length", ylabel="ms per step")
            axis.set(xscale="log", yscale="log")
            gridded(axis, lines="both")
        drawn.suptitle(f"decode step on {results['host']['device']} ({results['hbm_gbps']:.0f} GB/s copy)")
        paths.append(save(drawn, out / f"gpu_decode_{preset_name}.png"))
    return paths


def add_arguments(parser) -> None:
    parser.add_argument("--presets", default=",".join(PRESETS), help=f"comma-separated (default {','.join(PRESETS)})")
    parser.add_argument("--quick", action="store_true", help="short budgets, one pass")
    parser.add_argument("--out", type=Path, default=RESULTS, help=f"where to write results (default {RESULTS})")
    parser.add_argument("--artifacts", type=Path, help="build artifacts under DIR/<preset> (default: temporary)")
    parser.add_argument("--pasts", help=f"comma-separated past lengths (default {','.join(map(str, PASTS))})")
    parser.add_argument("--batches", help=f"comma-separated batch sizes (default {','.join(map(str, BATCHES))})")
    parser.add_argument("--no-served", action="store_true", help="leave out (c), the models served by Triton")


def run(args) -> int:
    grid = Grid(pasts=counts(args.pasts) or PASTS, batches=counts(args.batches) or BATCHES)
    plan = planned(args, Plan, grid=grid, served_pasts=() if args.no_served else None)
    try:
        host()  # before any work: a host without CUDA stops here with the reason
    except GPUProofError as error:
        print(f"error: {error}")
        return 2
    presets = tuple(name for name in args.presets.split(",") if name)
    with work_folder(args.artifacts, "gpu-proof-") as root:
        results = benchmark(presets, root, GPU, plan, Progress(), args.out)
    written = write(results, args.out)
    print(report(results))
    for problem in results["problems"]:
        print(f"FAILED: {problem}")
    print("wrote " + ", ".join(str(path) for path in written))
    return 1 if results["problems"] else 0
