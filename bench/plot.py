"""The decode plot: latency of one decode step against past length, per preset and batch size."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path


def decode_plot(results: dict, path: Path) -> Path:
    panels = [
        (preset, batch, [r for r in entry["rows"] if r["phase"] == "decode" and r["batch"] == batch])
        for preset, entry in results["presets"].items()
        for batch in sorted({r["batch"] for r in entry["rows"] if r["phase"] == "decode"})
    ]
    drawn, axes = figure(len(panels), (5 * len(panels), 4))
    for axis, (preset, batch, rows) in zip(axes, panels, strict=True):
        _panel(axis, rows, f"{preset}, batch {batch}")
    drawn.suptitle(f"decode step latency (median; {results['bandwidth']['gbps']:.0f} GB/s memory bandwidth)")
    return save(drawn, path)


def save(figure, path: Path) -> Path:
    """Laid out, written as a PNG, and closed (matplotlib keeps every open figure)."""
    import matplotlib.pyplot as plt

    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return path


def gridded(*axes, lines: str = "y", which: str = "both") -> None:
    """Each axis gridded (`lines`: "y", "x" or "both"; `which`: major, minor or both ticks) and its legend drawn
    small: every bench's panels read the same way."""
    for axis in axes:
        axis.grid(True, axis=lines, which=which, alpha=0.3)
        axis.legend(fontsize=8)


def _panel(axis, rows: list[dict], title: str) -> None:
    pasts = [r["past"] for r in rows]
    for name in rows[0]["candidates"]:
        axis.plot(pasts, [r["candidates"][name]["median_ms"] for r in rows], marker="o", label=name)
    for kind, style in (("fp32", "--"), ("fp16", ":")):
        axis.plot(pasts, [r["floor_ms"][kind] for r in rows], "k" + style, label=f"{kind} bandwidth floor")
    axis.set(title=title, xlabel="past length (tokens)", ylabel="ms per step", xscale="log", yscale="log")
    axis.set_xticks(pasts, [str(p) for p in pasts])
    axis.minorticks_off()
    axis.grid(True, which="both", alpha=0.3)
    axis.legend(fontsize=7)


def figure(panels: int = 1, size: tuple[float, float] = (7, 4.5)):
    """A figure of `panels` axes side by side (files only: no display on our machines); (figure, [axes])."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    drawn, axes = plt.subplots(1, panels, figsize=size, squeeze=False)
    return drawn, list(axes[0])


def grouped_bars(axis, groups: Sequence[str], series: dict[str, Sequence[float]], **labels) -> list[float]:
    """A bar per series in each group, side by side, the groups named under them; `labels`: the axis's
    (ylabel, title, yscale); the bars' x positions of the first series' (to mark more on them)."""
    width = 0.8 / max(len(series), 1)
    for k, (name, values) in enumerate(series.items()):
        axis.bar([g + k * width for g in range(len(groups))], values, width, label=name)
    axis.set_xticks([g + width * (len(series) - 1) / 2 for g in range(len(groups))], groups)
    axis.set(**labels)
    return [float(g) for g in range(len(groups))]
