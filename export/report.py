"""Reading a build report: the short table the CLI prints."""

from __future__ import annotations

from contract import names


def summary_table(report: dict) -> str:
    columns = ("variant", "size MB", "fused", "output abs", "output rel", "present abs", "result")
    header = "{:<12} {:>8} {:>5}  {:>10} {:>10}  {:>11}  {}".format(*columns)
    lines = [header, "-" * len(header)]
    for name, entry in report["variants"].items():
        if "skipped" in entry:
            lines.append(f"{name:<12} {'-':>8} {'-':>5}  {'-':>10} {'-':>10}  {'-':>11}  " + _skipped(entry))
            continue
        worst = entry["worst"]
        present_abs = max((e["max_abs"] for n, e in worst.items() if n != names.OUTPUT), default=0.0)
        result = "pass" if entry["passed"] else "FAIL: " + "; ".join(entry["problems"])
        output = worst[names.OUTPUT]
        lines.append(
            f"{name:<12} {entry['file_bytes'] / 1e6:>8.2f} {entry['fused_attention_ops']:>5}  "
            f"{output['max_abs']:>10.2e} {output['max_rel']:>10.2e}  {present_abs:>11.2e}  {result}"
        )
    return "\n".join(lines)


def _skipped(entry: dict) -> str:
    return ("FAIL: " if not entry["passed"] else "not built: ") + entry["skipped"]
