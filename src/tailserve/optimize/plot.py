"""The latency-by-batch-size plot of the report (matplotlib, from the ``bench`` extra)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from tailserve.optimize.choose import Result


def latency_plot(results: Sequence[Result], path: Path, title: str) -> str | None:
    """Write the plot; return None, or why it was not written."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        return "matplotlib is not installed (it comes with the 'bench' extra)"
    # A bare Figure, not pyplot: no global state, no display backend to choose.
    figure = Figure(figsize=(7, 4.5))
    axis = figure.subplots()
    for result in results:
        points = sorted(result.variant.latency_ms.items())
        style = "-" if result.kept else "--"
        axis.plot(
            [size for size, _ in points],
            [ms for _, ms in points],
            style,
            marker="o",
            markersize=4,
            label=result.name + ("" if result.kept else " (not kept)"),
        )
    axis.set(
        xscale="log",
        yscale="log",
        xlabel="batch size (rows)",
        ylabel="latency a batch (ms, median)",
        title=title,
    )
    sizes = sorted({size for result in results for size in result.variant.latency_ms})
    axis.set_xticks(sizes, [str(size) for size in sizes])
    axis.grid(True, which="both", linewidth=0.3)
    axis.legend(fontsize=8)
    figure.tight_layout()
    try:
        figure.savefig(path, dpi=110)
    except (OSError, ValueError) as exc:
        return f"it could not be written: {exc}"
    return None
