"""The names `python -m export` offers, without importing torch or ONNX: the variants and which of
them each kind of host serves, and the weight layouts. `--help` and a mistyped flag answer from
here in a fraction of a second; export/build.py and export/importers.py check that their tables
hold exactly these names.
"""

from __future__ import annotations

import argparse

from contract import names
from contract.deployment import CPU, CUDA, HOST_KINDS, TENSORRT

FP32_FUSED, FP16_FUSED = "fp32-fused", "fp16-fused"
INSPECT = names.INSPECTION_VARIANT
INT8_CACHE, INT4_CACHE = "fp32-static-int8kv", "fp32-static-int4kv"
INT8_WEIGHTS, STATIC_INT8_WEIGHTS = "fp32-fused-int8w", "fp32-static-int8w"
INT4_WEIGHTS, STATIC_INT4_WEIGHTS = "fp32-fused-int4w", "fp32-static-int4w"
VARIANT_NAMES = (
    "fp32",
    FP32_FUSED,
    FP16_FUSED,
    INSPECT,
    "fp32-static",
    "fp16-static",
    INT8_CACHE,
    INT4_CACHE,
    INT8_WEIGHTS,
    STATIC_INT8_WEIGHTS,
    INT4_WEIGHTS,
    STATIC_INT4_WEIGHTS,
    "fp32-trt",
    "fp16-trt",
)
INSPECTED_VARIANTS = (FP32_FUSED, FP16_FUSED)  # the fused graphs: one Attention node per layer

# What a host of each kind serves (serving/triton/repository.py, PYTHON_FILES): the CPU runs `forward` on
# fp32-fused, `sessions` on fp32-static (fp32-fused with the concat engine), `forward_onnx` on fp32 and
# the attention maps on the inspection graph; CUDA adds the fp16 forms, TensorRT its own. The
# quantized caches and weights are built when asked for: a deployment asks for one by its kv_dtype
# (`python -m serving ensure --kv-dtype int8` adds fp32-static-int8kv), and INT8 weights by its
# weights_dtype (`--weights-dtype int8` adds fp32-fused-int8w and fp32-static-int8w; int4 their 4-bit forms).
SERVED = {
    CPU: ("fp32", FP32_FUSED, INSPECT, "fp32-static"),
    CUDA: (FP16_FUSED, "fp16-static"),
    TENSORRT: ("fp32-trt", "fp16-trt"),
}
HOSTS = HOST_KINDS  # each serves its own variants and those of the kinds before it
ALL = "all"
VARIANT_SETS = {
    **{
        host: tuple(v for v in VARIANT_NAMES if any(v in SERVED[kind] for kind in HOSTS[: i + 1]))
        for i, host in enumerate(HOSTS)
    },
    ALL: VARIANT_NAMES,
}

LAYOUT_NAMES = ("seeds", "torch-mha", "hf", "native")  # export/importers.py, LAYOUTS


def variants_for(host: str) -> tuple[str, ...]:
    """The variants a host of this kind serves, in build order."""
    return VARIANT_SETS[host]


def expand(items: tuple[str, ...]) -> tuple[str, ...]:
    """Variant names and sets -> the variants, in build order, each once."""
    chosen = {name for item in items for name in VARIANT_SETS.get(item, (item,))}
    return tuple(v for v in VARIANT_NAMES if v in chosen)


def parse_variants(text: str) -> tuple[str, ...]:
    """An argparse `type`: comma-separated variant names and sets (cpu, cuda, tensorrt, all), as given
    (a set's variants that a config cannot have are skipped; a name's fail the build)."""
    items = tuple(dict.fromkeys(part.strip() for part in text.split(",") if part.strip()))
    unknown = [item for item in items if item not in VARIANT_NAMES and item not in VARIANT_SETS]
    if unknown:
        raise argparse.ArgumentTypeError(
            f"unknown variant(s) {unknown}; choose from {list(VARIANT_NAMES)} or a set: {', '.join(VARIANT_SETS)}"
        )
    if not items:
        raise argparse.ArgumentTypeError("no variant named")
    return items
