"""`build`: an artifact directory with every variant that passed the parity ladder, and its report.

Every file is written into a staging directory beside the target, put in place when the build ends
(also when a variant failed: the report says why); a variant's file is kept only when it passed the
parity ladder against the PyTorch original (docs/design.md, "Artifacts and variants"), and its
sha256 goes into the report.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx

from contract import files, names
from contract.config import NO_MLP, RMSNORM, ModelConfig
from export import artifacts, choices, forms, graph_stats, kv_quant, quality, targets, weights_int4, weights_int8
from export.fp16 import make_fp16_fused
from export.fusion import make_fp32_fused
from export.inspect_form import make_inspection_graph
from export.model import AttentionModel
from export.onnx_export import export_onnx
from export.parity import (
    POOL_ROWS,
    TOLERANCES,
    RungResult,
    Scenario,
    Tolerance,
    compare_pool_rung,
    compare_rung,
    pool_schedule,
)
from export.progress import Progress
from export.runners import one_thread, quantized_cache_runner, rounded_runner, torch_runner
from serving.engine import placement
from serving.engine.kv_pool import KVPool
from serving.engine.ort import Forward, ort_runner, ort_session


class BuildError(RuntimeError):
    """The build could not produce an acceptable artifact."""


STATELESS, POOL = "stateless", "pool"  # the ladder a variant climbs (export/parity.py)
INSPECT = names.INSPECTION_VARIANT


@dataclasses.dataclass(frozen=True)
class Variant:
    name: str
    # (the PyTorch original, the path to write[, its cache's quantization when kv_bits]) -> the path
    make: Callable[..., Path]
    tolerance: Tolerance
    float_dtype: type = np.float32
    fused: bool = False  # must hold one fused attention op per layer
    ladder: str = STATELESS
    # the engine the graph is for, checked by `targets.problems` (None: ONNX Runtime CPU, no extra check)
    target: str | None = None
    # why a config cannot have this variant (None: it can); such a variant is skipped by default
    unsupported: Callable[[ModelConfig], str | None] = lambda cfg: None
    kv_bits: int = 0  # a static cache quantized to this many bits (8, 4), its scales calibrated by the build
    # what a tolerance's floor is measured against: (the original, the graph's float dtype) -> a runner
    precision_floor: Callable[..., Forward] = rounded_runner
    # the graph also returns each layer's attention weights (`attention.{i}`), compared with the
    # original's on the stateless scenarios (export/parity.py, `compare_rung`'s `maps`)
    maps: bool = False
    # ONNX Runtime's fp32 forms: each residual Add that feeds an RMSNorm and goes on is folded into it
    # (SkipSimplifiedLayerNormalization, export/norm_rotary_fusion.py), counted by `fusion_shortfalls`
    skip_norms: bool = False
    head_bits: int | None = None  # 4-bit weights: a whole model's head in this many bits (`with_int4_head`)

    def cast(self, array: np.ndarray) -> np.ndarray:
        return array.astype(self.float_dtype)


def _make_fp32(model: AttentionModel, path: Path) -> Path:
    return export_onnx(model, path)


# what a static-cache form of a variant takes beside its fused form's (the quantized weights' static forms)
STATIC_FORM = {"ladder": POOL, "target": targets.STATIC, "unsupported": forms.static_problem, "skip_norms": True}
VARIANTS: dict[str, Variant] = {
    "fp32": Variant("fp32", _make_fp32, TOLERANCES["fp32"], target=targets.ONNX_BACKEND),
    "fp32-fused": Variant("fp32-fused", make_fp32_fused, TOLERANCES["fp32-fused"], fused=True, skip_norms=True),
    "fp16-fused": Variant("fp16-fused", make_fp16_fused, TOLERANCES["fp16-fused"], np.float16, fused=True),
    # what `forward` and `sessions` answer the attention maps from (export/inspect_form.py): fp32-fused
    # with every Attention op's probabilities as outputs; its outputs and presents are fp32-fused's
    INSPECT: Variant(INSPECT, make_inspection_graph, TOLERANCES["fp32-fused"], fused=True, maps=True),
    "fp32-static": Variant(
        "fp32-static",
        forms.make_fp32_static,
        TOLERANCES["fp32-static"],
        fused=True,
        ladder=POOL,
        target=targets.STATIC,
        unsupported=forms.static_problem,
        skip_norms=True,
    ),
    "fp16-static": Variant(
        "fp16-static",
        forms.make_fp16_static,
        TOLERANCES["fp16-static"],
        np.float16,
        fused=True,
        ladder=POOL,
        target=targets.STATIC_CUDA,
        unsupported=forms.static_problem,
    ),
    **{
        name: Variant(
            name,
            forms.make_fp32_static_quantized,
            TOLERANCES[name],
            fused=True,
            ladder=POOL,
            target=targets.STATIC,
            unsupported=forms.static_problem,
            kv_bits=bits,
            skip_norms=True,
        )
        for name, bits in (("fp32-static-int8kv", 8), ("fp32-static-int4kv", 4))
    },
    **{
        name: Variant(name, make, tolerance, fused=True, precision_floor=floor, **({"skip_norms": True} | static))
        for fused_make, static_make, tolerance, floor, fused_name, static_name in (
            (
                weights_int8.make_fp32_fused_int8w,
                weights_int8.make_fp32_static_int8w,
                weights_int8.INT8_WEIGHTS_TOLERANCE,
                weights_int8.int8_weights_floor,
                weights_int8.NAME,
                weights_int8.STATIC_NAME,
            ),
            (
                weights_int4.make_fp32_fused_int4w,
                weights_int4.make_fp32_static_int4w,
                weights_int4.INT4_WEIGHTS_TOLERANCE,
                weights_int4.int4_weights_floor,
                weights_int4.NAME,
                weights_int4.STATIC_NAME,
            ),
        )
        for name, make, static in (
            (fused_name, fused_make, {}),
            (static_name, static_make, STATIC_FORM),
        )
    },
    "fp32-trt": Variant("fp32-trt", forms.make_fp32_trt, TOLERANCES["fp32-trt"], fused=True, target=targets.TENSORRT),
    "fp16-trt": Variant(
        "fp16-trt", forms.make_fp16_trt, TOLERANCES["fp16-trt"], np.float16, fused=True, target=targets.TENSORRT
    ),
}
assert tuple(VARIANTS) == choices.VARIANT_NAMES, "export/choices.py names the variants the CLI offers"


# What a build makes unless told: the variants this machine serves. The others cost time it would not
# use (on 2 CPU cores fp16-static's pool rung alone took longer than the whole CPU set: fp16 math is
# emulated there) and are built by name or set (`--variants cuda`), or by default on such a host.
HOST = placement.host_kind()
DEFAULT_VARIANTS = choices.variants_for(HOST)

# The ladder each stateless variant climbs: a left-padded prefill from an empty past then decode
# steps, and a prefill onto an existing cache (batch 3, rows padded by 0, 2 and 5 tokens). The
# static variants climb the pool rung (`parity.pool_schedule`): 256 decode steps over ragged rows.
SCENARIOS = {
    "empty_past": Scenario(batch=3, prefill=7, steps=16, padding=(0, 2, 5)),
    "with_past": Scenario(batch=3, prefill=5, steps=4, padding=(0, 1, 3), past=33, seed=1),
}
POOL_SCENARIO = "pool"


def _climb(
    model: AttentionModel,
    path: Path,
    variant: Variant,
    progress: Progress,
    quantization: kv_quant.CacheQuantization | None = None,
) -> dict[str, RungResult]:
    reference = attention_maps_runner(model) if variant.maps else torch_runner(model)
    floor = precision_floor(model, variant)
    if quantization is not None:
        floor = quantized_cache_runner(model, quantization)
    if variant.ladder == POOL:
        schedule = pool_schedule(model.cfg.max_seq_len)
        pool = KVPool(ort_session(path, threads=1), model.cfg, rows=POOL_ROWS, capacity=model.cfg.max_seq_len)
        total = len(schedule)
        return {
            POOL_SCENARIO: compare_pool_rung(
                model.cfg,
                reference,
                pool,
                schedule,
                variant.tolerance,
                on_step=lambda step: progress.update(f"parity {POOL_SCENARIO} step {step + 1}/{total}"),
                floor=floor,
                dequantize=quantization.dequantize if quantization else None,
            )
        }
    candidate = ort_runner(ort_session(path, threads=1))
    results: dict[str, RungResult] = {}
    for name, scenario in SCENARIOS.items():
        total = scenario.steps + 1
        results[name] = compare_rung(
            model.cfg,
            reference,
            candidate,
            scenario,
            variant.tolerance,
            cast=variant.cast,
            on_step=lambda step, name=name, total=total: progress.update(f"parity {name} step {step + 1}/{total}"),
            floor=floor,
            maps=variant.maps,
        )
    return results


def precision_floor(model: AttentionModel, variant: Variant) -> Forward | None:
    """The runner a reduced-precision variant's bound is relative to (export/parity.py), None for the others."""
    return variant.precision_floor(model, variant.float_dtype) if variant.tolerance.floor else None


def attention_maps_runner(model: AttentionModel) -> Forward:
    """The PyTorch original as a runner (`runners.torch_runner`'s outputs) that also answers each
    layer's attention weights as `attention.{i}`, as the inspection graph names them."""
    import torch

    from export.model import KVCache

    n_layers = model.cfg.n_layers

    @torch.no_grad()
    def run(inputs):
        tensor = {name: torch.from_numpy(np.array(array)) for name, array in inputs.items()}  # writable copies
        past = None
        if names.past_name(0, names.KEY) in tensor:
            past = [
                KVCache(tensor[names.past_name(i, names.KEY)], tensor[names.past_name(i, names.VALUE)])
                for i in range(n_layers)
            ]
        new_tokens, mask = tensor[names.model_input(model.cfg)], tensor.get(names.ATTENTION_MASK)
        result = model(new_tokens, mask, past, return_attention=True, position_ids=tensor.get(names.POSITION_IDS))
        arrays = {names.model_output(model.cfg): result.output.numpy()}
        for i, cache in enumerate(result.present):
            arrays[names.present_name(i, names.KEY)] = cache.key.numpy()
            arrays[names.present_name(i, names.VALUE)] = cache.value.numpy()
        for name, weights in zip(names.attention_map_names(n_layers), result.attention_weights, strict=True):
            arrays[name] = weights.numpy()
        return arrays

    return run


def check_variant(
    model: AttentionModel,
    path: Path,
    variant: Variant,
    progress: Progress,
    quantization: kv_quant.CacheQuantization | None = None,
) -> dict:
    """Climb the ladder with the ONNX file at `path` (its cache quantized as `quantization` says, for a
    variant with kv_bits) and check its fit; return its report entry. The ladder runs PyTorch and ONNX
    Runtime on one thread each (`one_thread`): a row and a token at a time, a second thread costs more
    than it saves (on a busy 2-core machine, measured: a static variant's pool rung twice as fast)."""
    model_proto = onnx.load(str(path), load_external_data=False)
    with one_thread():
        results = _climb(model, path, variant, progress, quantization)
    fused = graph_stats.fused_attention_count(model_proto)
    problems = [f"parity failed in scenario '{n}'" for n, r in results.items() if not r.passed]
    if variant.fused:
        problems += fusion_shortfalls(
            model.cfg, model_proto, rotations_inside=variant.ladder == POOL, skip_norms=variant.skip_norms
        )
    if variant.target:
        problems += [
            f"does not fit {variant.target}: {p}" for p in targets.problems(variant.target, model_proto, model.cfg)
        ]
    return {
        "file": path.name,
        "file_bytes": path.stat().st_size,
        "opset": graph_stats.opset_of(model_proto),
        "op_histogram": graph_stats.op_histogram(model_proto),
        "fused_attention_ops": fused,
        "fused_ops": {
            op: graph_stats.op_count(model_proto, op) for op in (graph_stats.ROTARY_OP, graph_stats.RMS_NORM_OP)
        }
        | {graph_stats.SKIP_RMS_NORM_OP: graph_stats.op_count(model_proto, *graph_stats.SKIP_RMS_NORM)},
        "target": variant.target,
        "tolerance": dataclasses.asdict(variant.tolerance),
        "parity": {name: result.to_dict() for name, result in results.items()},
        "worst": _worst(results),
        **({"attention_maps": _worst_map(results)} if variant.maps else {}),
        "passed": not problems,
        "problems": problems,
    }


def fusion_shortfalls(
    cfg: ModelConfig, model_proto: onnx.ModelProto, rotations_inside: bool = False, skip_norms: bool = False
) -> list[str]:
    """What a "fused" graph lacks: one fused attention op per layer, and for the modern block one
    RMSNormalization per RMSNorm (the block's, q's, k's; a whole model's MLP norms and final norm) and one
    RotaryEmbedding per rotation of q and k, unless the attention op rotates them itself
    (`rotations_inside`: the static form's GQA). With `skip_norms`, at least every block norm but the first
    (which reads the graph's input) holds its residual Add: a SkipSimplifiedLayerNormalization, counted as a norm
    too."""
    wanted = {"fused attention": (graph_stats.fused_attention_count(model_proto), cfg.n_layers)}
    # per layer the block's norm (and a whole model's MLP norm) and q's and k's; a whole model's final norm once
    block_norms = 1 + (cfg.mlp != NO_MLP)
    norms = (cfg.norm == RMSNORM) * block_norms + 2 * (cfg.qk_norm == RMSNORM)
    final = int(cfg.whole and cfg.norm == RMSNORM)
    skipped = graph_stats.op_count(model_proto, *graph_stats.SKIP_RMS_NORM)
    wanted[graph_stats.RMS_NORM_OP] = (
        graph_stats.op_count(model_proto, graph_stats.RMS_NORM_OP) + skipped,
        norms * cfg.n_layers + final,
    )
    if skip_norms and cfg.norm == RMSNORM and cfg.residual:
        wanted[graph_stats.SKIP_RMS_NORM_OP] = (skipped, block_norms * cfg.n_layers - 1)
    if cfg.rotary and not rotations_inside:
        wanted[graph_stats.ROTARY_OP] = (graph_stats.op_count(model_proto, graph_stats.ROTARY_OP), 2 * cfg.n_layers)
    return [
        f"{have} {op} ops for {cfg.n_layers} layers (expected {need})"
        for op, (have, need) in wanted.items()
        if have < need
    ]


def _worst(results: dict[str, RungResult], maps: bool = False) -> dict[str, dict]:
    """Per tensor, the largest absolute error over all scenarios, with where it is: the outputs and
    presents, or with `maps` the attention maps (`attention.{i}`)."""
    worst: dict[str, dict] = {}
    for scenario, result in results.items():
        for name, error in result.tensors.items():
            if _is_map(name) != maps:
                continue
            if name not in worst or error.max_abs > worst[name]["max_abs"]:
                worst[name] = {**error.to_dict(), "scenario": scenario}
    return worst


def _is_map(name: str) -> bool:
    return name.startswith(names.attention_map_name(0).rpartition(".")[0] + ".")


def _worst_map(results: dict[str, RungResult]) -> dict:
    """The attention maps' largest absolute error over all layers and scenarios, and per layer."""
    per_layer = _worst(results, maps=True)
    largest = max(per_layer.values(), key=lambda error: error["max_abs"])
    return {"max_abs": largest["max_abs"], "passed": all(e["passed"] for e in per_layer.values()), "layers": per_layer}


def build(
    cfg: ModelConfig,
    out: str | Path,
    variants: tuple[str, ...] | None = None,
    seed: int = 0,
    progress: Progress | None = None,
    calibration: kv_quant.CalibrationData | None = None,
    text_files: tuple[Path, ...] = (),
    int4_head_bits: int | None = None,
) -> dict:
    """`build_model` for the weights `seed` initializes."""
    model = AttentionModel(cfg, seed=seed).eval()
    return build_model(
        model,
        out,
        variants,
        progress,
        origin={"seed": seed},
        calibration=calibration,
        text_files=text_files,
        int4_head_bits=int4_head_bits,
    )


def build_model(
    model: AttentionModel,
    out: str | Path,
    variants: tuple[str, ...] | None = None,
    progress: Progress | None = None,
    origin: dict | None = None,
    calibration: kv_quant.CalibrationData | None = None,
    text_files: tuple[Path, ...] = (),
    held_out: Path | None = None,
    int4_head_bits: int | None = None,
) -> dict:
    """Write config, weights, every passing variant and `report.json` to `out`; return the report.

    `origin` says where the weights came from (a seed, or an imported file and its check against the
    module it came from) and goes into the report; the quantized caches' scales are calibrated on
    `calibration` (default: the hidden states `kv_quant.generated` makes). `variants`: names and sets
    (export/choices.py); None builds what this machine serves (DEFAULT_VARIANTS), and says so. `text_files`:
    the checkpoint's tokenizer files (files.TEXT_FILES), copied beside the graphs, their sha256 in the report. A
    variant of a set that the config cannot have is reported as skipped, with the reason; one asked
    for by name fails the build. `held_out`: a held-out text (fortune's format) that a whole model with a
    tokenizer among its text files is scored on through the original and every passing variant
    (`quality_ladder`, export/quality.py); a variant beyond its quality bound fails like a parity failure.
    `int4_head_bits`: a whole model's head in the 4-bit weights' variants in this many bits instead (8:
    onnxruntime-genai's `last_matmul:int8`), their floor too, said in their report entries (`weights`).
    Raises BuildError (after writing the report) when any variant fails. Everything is written into a
    directory beside `out` and put in place at the end (`artifacts.staged`): an error (OSError: a full disk,
    a directory that cannot be written) leaves `out` as it was.
    """
    progress = progress or Progress()
    if variants is None:
        progress.note(default_note())
    given = variants or (HOST,)
    unknown = [v for v in given if v not in VARIANTS and v not in choices.VARIANT_SETS]
    if unknown:
        raise ValueError(f"unknown variant(s) {unknown}; choose from {list(VARIANTS)} or {list(choices.VARIANT_SETS)}")
    asked = {v for v in given if v in VARIANTS}  # by name: one the config cannot have fails the build
    variants = choices.expand(given)
    problem = int4_head_problem(model.cfg, variants, int4_head_bits)
    if problem:
        raise ValueError(problem)
    out = Path(out)
    if held_out is not None:  # an unreadable held-out text fails now, not after every variant was built
        try:
            quality.read_entries(held_out)
        except quality.QualityError as error:
            raise BuildError(str(error)) from error
    owned = [files.model_filename(name) for name in variants] + [*files.TEXT_FILES, files.HELD_OUT_FILENAME]
    with artifacts.staged(out, owned=owned) as staging:
        copied = _copy_text_files(text_files, staging)
        origin = {**(origin or {}), **({"text_files": copied} if copied else {})}
        chosen = {name: with_int4_head(VARIANTS[name], int4_head_bits) for name in variants}
        report = _build_into(
            model, staging, chosen, asked, progress, origin, shown=out, calibration=calibration, held_out=held_out
        )
    if not report["passed"]:
        failed = {n: e["problems"] for n, e in report["variants"].items() if not e["passed"]}
        raise BuildError(f"variant(s) failed: {failed}; see {out / files.REPORT_FILENAME}")
    return report


def _copy_text_files(text_files: tuple[Path, ...], out: Path) -> dict[str, str]:
    """Each text file copied into `out`: its name -> sha256 (what the repository checks them against)."""
    copied = {}
    for path in text_files:
        shutil.copyfile(path, out / path.name)
        copied[path.name] = files.sha256(out / path.name)
    return copied


def default_note() -> str:
    """What a build without --variants makes, and how to build the rest."""
    rest = [name for name in VARIANTS if name not in DEFAULT_VARIANTS]
    line = f"built for this machine ({HOST}): {', '.join(DEFAULT_VARIANTS)}"
    return line + (f"; build the rest with --variants {','.join(rest)} (or --variants all)" if rest else "")


def int4_head_problem(cfg: ModelConfig, variants: tuple[str, ...], head_bits: int | None) -> str | None:
    """Why a head in `head_bits` changes nothing in a build of `variants` (names, expanded) of `cfg`: a model
    without a head, or no 4-bit weights' variant among them; None where it applies (or none is asked for)."""
    if head_bits is None:
        return None
    if not cfg.whole:
        return f"a head in {head_bits} bits was asked for, but this model has no head (no vocab_size)"
    if not {weights_int4.NAME, weights_int4.STATIC_NAME} & set(variants):
        return (
            f"a head in {head_bits} bits was asked for, but no 4-bit weights' variant is built; "
            f"add {weights_int4.STATIC_NAME} to the variants"
        )
    return None


def with_int4_head(variant: Variant, head_bits: int | None) -> Variant:
    """`variant`, or for the 4-bit weights' variants with `head_bits`, the same with the head in that many bits:
    its graph and its floor."""
    if head_bits is None or variant.name not in (weights_int4.NAME, weights_int4.STATIC_NAME):
        return variant
    return dataclasses.replace(
        variant,
        head_bits=head_bits,
        make=functools.partial(variant.make, head_bits=head_bits),
        precision_floor=functools.partial(variant.precision_floor, head_bits=head_bits),
    )


def _build_into(
    model: AttentionModel,
    out: Path,
    variants: dict[str, Variant],
    asked: set[str],
    progress: Progress,
    origin: dict | None,
    shown: Path,
    calibration: kv_quant.CalibrationData | None = None,
    held_out: Path | None = None,
) -> dict:
    """Every file of the build into `out`; `shown` is the directory the user asked for."""
    with progress.stage(f"config and weights -> {shown}"):
        artifacts.save_artifact(model, out)
    report = {"config": model.cfg.to_dict(), **(origin or {}), "variants": {}}
    calibrated: kv_quant.Calibration | None = None  # the original's keys and values, once a build
    for name, variant in variants.items():
        reason = variant.unsupported(model.cfg)
        if reason is None and variant.kv_bits:
            if calibrated is None:
                with progress.stage("calibration of the quantized caches"):
                    calibrated = kv_quant.calibrate(model, calibration or kv_quant.generated(model.cfg))
            report["variants"][name] = _build_variant(model, out, variant, progress, calibrated)
        elif reason is None:
            report["variants"][name] = _build_variant(model, out, variant, progress)
        else:
            report["variants"][name] = _not_built(reason, failed=name in asked)
    if held_out is not None:
        report["quality"] = quality_ladder(model, out, report["variants"], held_out, progress)
    report["passed"] = all(entry["passed"] for entry in report["variants"].values())
    (out / files.REPORT_FILENAME).write_text(json.dumps(report, indent=2) + "\n")
    return report


def _not_built(reason: str, failed: bool) -> dict:
    return {"file": None, "skipped": reason, "passed": not failed, "problems": [reason] if failed else []}


def _build_variant(
    model: AttentionModel,
    out: Path,
    variant: Variant,
    progress: Progress,
    calibrated: kv_quant.Calibration | None = None,
) -> dict:
    """The variant's file in `out` (a staging directory) if it passes, with its sha256 in the entry
    (the repository records it and the served models check it before loading), else no file. A
    quantized cache's scales come from `calibrated`, and its entry says how (`kv_cache`)."""
    path = out / files.model_filename(variant.name)
    started = time.perf_counter()
    quantization = calibrated.quantization(variant.kv_bits) if variant.kv_bits else None
    with progress.stage(f"{variant.name}: export"):
        variant.make(model, path, *([quantization] if quantization else []))
    with progress.stage(f"{variant.name}: parity"):
        entry = check_variant(model, path, variant, progress, quantization)
    if quantization:  # the layouts' errors on the calibration data: why the default layout is the default
        entry["kv_cache"] = quantization.to_report() | {"calibration_errors": calibrated.errors(variant.kv_bits)}
    if variant.precision_floor is weights_int8.int8_weights_floor:  # which int8 path this CPU chose, and why
        entry["int8_weights"] = weights_int8.int8_weights_report()
    if variant.name in (weights_int4.NAME, weights_int4.STATIC_NAME):
        head = {"head_bits": variant.head_bits or weights_int4.BITS} if model.cfg.whole else {}
        entry["weights"] = {"bits": weights_int4.BITS} | head
    entry["build_seconds"] = round(time.perf_counter() - started, 2)
    if entry["passed"]:
        entry["file"], entry["sha256"] = path.name, files.sha256(path)
    else:
        path.unlink()
        entry["file"] = None
    return entry


# --- the quality ladder: held-out bits per byte through every passing variant (export/quality.py) --------


def quality_ladder(
    model: AttentionModel, out: Path, entries: dict[str, dict], held_out: Path, progress: Progress
) -> dict:
    """The report's `quality`: the held-out text's bits/byte through the original and each passing variant in
    `out`, each judged against its bound; a variant beyond it fails (its entry's problems say why, its file
    is removed). Skipped, with the reason, for a model that is not whole or has no tokenizer."""
    if not model.cfg.whole or not (out / files.TOKENIZER_FILENAME).is_file():
        reason = "not a whole model" if not model.cfg.whole else f"no {files.TOKENIZER_FILENAME} among its text files"
        progress.note(f"quality: {held_out} not scored: {reason}")
        return {"skipped": reason}
    shutil.copyfile(held_out, out / files.HELD_OUT_FILENAME)
    ids = quality.held_out_for(out, out / files.HELD_OUT_FILENAME)
    cfg = model.cfg
    section = {
        "held_out": {"file": files.HELD_OUT_FILENAME, "sha256": files.sha256(held_out), **ids.to_report()},
        "window": cfg.max_seq_len,
        "chunk": quality.DEFAULT_CHUNK,
    }
    with one_thread():
        with progress.stage(f"quality: the PyTorch original on {len(ids.ids):,} held-out ids ({ids.bytes:,} bytes)"):
            original = quality.score(quality.runner_logits(torch_runner(model), cfg), ids, cfg.max_seq_len, progress)
        section["original"] = original.to_report()
        section["variants"] = {}
        for name, entry in entries.items():
            if entry.get("file") is None:
                continue
            with progress.stage(f"quality: {name}"):
                reader = quality.form_logits(out / entry["file"], cfg, pool=VARIANTS[name].ladder == POOL)
                judged = quality.judged(name, quality.score(reader, ids, cfg.max_seq_len, progress), original)
            section["variants"][name] = judged
            if not judged["passed"]:
                _fail(out, entry, quality.problem(name, judged, original.bits_per_byte))
    return section


def _fail(out: Path, entry: dict, problem: str) -> None:
    """A built variant failed after its parity passed: its file removed, the entry says why."""
    (out / entry["file"]).unlink()
    entry.update(file=None, passed=False, problems=[*entry["problems"], problem])
    entry.pop("sha256", None)
