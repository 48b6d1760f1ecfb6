"""Reading a build report: the short table the CLI prints, and where the weights came from; a build
that prints its table (`build_and_report`, what the export and serving commands run)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from contract import names
from contract.config import ModelConfig
from contract.files import REPORT_FILENAME

# When rounding to fp16 alone moves a model's output by more than this share of its scale (5x the
# 2e-3 our init's weights stay within), its attention is too sharp for fp16 to be accurate, whatever
# the graph: the table says so under the variant.
SHARP_FOR_FP16 = 1e-2
ORIGINAL = "PyTorch original (fp32)"  # the quality table's reference row


def summary_table(report: dict) -> str:
    output = "logits" if report.get("config", {}).get("vocab_size") else "output"  # a whole model's are logits
    columns = ("variant", "size MB", "fused", f"{output} abs", f"{output} rel", "present abs", "result")
    width = max([12, *map(len, report["variants"])])  # the quantized caches' names are longer
    header = f"{{:<{width}}} {{:>8}} {{:>5}}  {{:>10}} {{:>10}}  {{:>11}}  {{}}".format(*columns)
    lines = [header, "-" * len(header)]
    for name, entry in report["variants"].items():
        if "skipped" in entry:
            lines.append(f"{name:<{width}} {'-':>8} {'-':>5}  {'-':>10} {'-':>10}  {'-':>11}  " + _skipped(entry))
            continue
        worst = entry["worst"]
        present_abs = max((e["max_abs"] for n, e in worst.items() if n != output_name(worst)), default=0.0)
        result = "pass" if entry["passed"] else "FAIL: " + "; ".join(entry["problems"])
        output = worst[output_name(worst)]
        lines.append(
            f"{name:<{width}} {entry['file_bytes'] / 1e6:>8.2f} {entry['fused_attention_ops']:>5}  "
            f"{output['max_abs']:>10.2e} {output['max_rel']:>10.2e}  {present_abs:>11.2e}  {result}"
        )
    notes = _precision_notes(report) + _cache_notes(report) + _maps_notes(report) + _int8_notes(report)
    return "\n".join(lines + notes + _quality_table(report.get("quality")))


def _quality_table(quality: dict | None) -> list[str]:
    """The quality ladder (export/quality.py): held-out bits/byte per form, what each costs against the
    original, its bound."""
    if quality is None:
        return []
    if "skipped" in quality:
        return [f"quality: not scored ({quality['skipped']})"]
    held = quality["held_out"]
    lines = [
        "",
        f"quality on {held['file']}: {held['ids']:,} ids, {held['bytes']:,} bytes ({held['entries']} of "
        f"{held['of_entries']} entries), windows of {quality['window']} ids fed {quality['chunk']} at a time",
    ]
    width = max([len(ORIGINAL), *map(len, quality["variants"])])
    header = f"{{:<{width}}} {{:>9}} {{:>10}} {{:>10}} {{:>7}}  {{}}".format(
        "form", "bits/byte", "perplexity", "vs PyTorch", "bound", "result"
    )
    lines += [header, "-" * len(header)]
    original = quality["original"]
    lines.append(f"{ORIGINAL:<{width}} {original['bits_per_byte']:>9.4f} {original['perplexity']:>10.2f}")
    for name, entry in quality["variants"].items():
        result = "pass" if entry["passed"] else "FAIL: beyond its bound"
        lines.append(
            f"{name:<{width}} {entry['bits_per_byte']:>9.4f} {entry['perplexity']:>10.2f} {entry['relative']:>+10.4%} "
            f"{entry['bound']:>7.2%}  {result}"
        )
    return lines


def output_name(worst: dict) -> str:
    """The model's output among a variant's worst errors: `output`, or a whole model's `logits`."""
    return names.LOGITS if names.LOGITS in worst else names.OUTPUT


def _output_error(entry: dict) -> dict:
    worst = entry.get("worst", {})
    return worst.get(output_name(worst), {})


def _maps_notes(report: dict) -> list[str]:
    """A variant that also returns the attention maps: their worst error (not in the table's columns)."""
    return [
        f"note: {name}: attention maps within {entry['attention_maps']['max_abs']:.2e} of the original's weights "
        "(real queries)"
        for name, entry in report["variants"].items()
        if "attention_maps" in entry
    ]


def _cache_notes(report: dict) -> list[str]:
    """What each quantized cache is and where its scales came from: its errors are that quantization's."""
    notes = []
    for name, entry in report["variants"].items():
        cache = entry.get("kv_cache")
        if cache:
            source = cache["calibration"]
            if "file" in source:
                origin = f"{source['file']} (sha256 {source['sha256'][:12]}...)"
            else:
                what = "token ids" if len(source["generated"]["shape"]) == 2 else "hidden states"
                origin = f"generated {what} (seed {source['generated']['seed']})"
            floor = _output_error(entry).get("floor_rel") or 0.0
            notes.append(
                f"note: {name}: {cache['bits']}-bit cache ({cache['cache_dtype']}), {cache['layout'].lower()} "
                f"scales calibrated on {origin}; its codes alone move the output by {floor:.2e} of its scale"
            )
    return notes


def _precision_notes(report: dict) -> list[str]:
    notes = []
    for name, entry in report["variants"].items():
        floor = _output_error(entry).get("floor_rel")
        # a quantized cache's floor is what its codes cost, not fp16's rounding (_cache_notes says so)
        # nor is int8 weights' (their floor is the int8 scheme's)
        if floor is not None and floor > SHARP_FOR_FP16 and "kv_cache" not in entry and name.startswith("fp16"):
            notes.append(
                f"note: {name}: rounding to fp16 alone moves this model's output by {floor:.2e} of its scale "
                "(its attention logits are large); where that matters, serve an fp32 variant"
            )
    return notes


def _int8_notes(report: dict) -> list[str]:
    """One line for the int8 weights' path (the same for every int8w variant of a build)."""
    chosen = next((entry["int8_weights"] for entry in report["variants"].values() if "int8_weights" in entry), None)
    if chosen is None:
        return []
    reduce_range = "on" if chosen["reduce_range"] else "off"
    return [f"int8 weights: {chosen['bits']}-bit (reduce_range {reduce_range}): {chosen['why']}"]


def _skipped(entry: dict) -> str:
    return ("FAIL: " if not entry["passed"] else "not built: ") + entry["skipped"]


def origin_summary(report: dict) -> str:
    """Where an imported model's weights came from and how it compared with the module they came from."""
    weights, check = report["weights"], report["source_check"]
    lines = [f"weights: {weights['file']} (layout {weights['layout']}, sha256 {weights['sha256'][:12]}...)"]
    if weights.get("left_out"):  # a whole checkpoint: what this model does not serve, by key group
        groups = ", ".join(f"{group} ({count})" for group, count in weights["left_out"].items())
        lines.append(f"left out (not attention): {groups}")
    if check["checked"]:
        result = "pass" if check["passed"] else "FAIL"
        lines.append(f"checked against {check['module']}: max abs error {check['max_abs']:.2e} ({result})")
    else:
        lines.append(f"not checked against its source module: {check['reason']}")
    if report.get("text_files"):
        lines.append(f"text files (the tokenizer travels with the model): {', '.join(sorted(report['text_files']))}")
    elif weights.get("whole"):
        lines.append("no tokenizer.json beside the weights: the model serves token ids, not text")
    return "\n".join(lines)


def build_and_report(
    cfg: ModelConfig,
    out: Path,
    variants: tuple[str, ...] | None = None,
    seed: int = 0,
    calibration=None,
    int4_head_bits: int | None = None,
) -> dict:
    """Build `cfg` into `out` and print the variants' table; raises BuildError (after printing the
    table) when a variant failed. `calibration`: the quantized caches' (export/kv_quant.py); `int4_head_bits`:
    as `build_model`'s."""
    from export.build import build

    return printing(
        lambda: build(cfg, out, variants, seed=seed, calibration=calibration, int4_head_bits=int4_head_bits), out
    )


def printing(run: Callable[[], dict], out: Path) -> dict:
    """Run a build and print its table, also when it fails (from the report it left)."""
    from export.build import BuildError

    try:
        report = run()
    except BuildError:
        print(summary_table(json.loads((out / REPORT_FILENAME).read_text())))
        raise
    print(summary_table(report))
    return report
