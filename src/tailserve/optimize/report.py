"""What the command found, as ``report.json``, ``report.md`` and the table it prints."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

from tailserve.modelconfig import Metric
from tailserve.optimize.candidates import BASELINE, Skipped
from tailserve.optimize.choose import Result, speedups

PLOT = "latency.png"


@dataclass(frozen=True, slots=True, kw_only=True)
class Outcome:
    model: str
    version: int
    runtime: str
    metric: Metric
    metric_note: str  # what the figure compares, against what
    held_out: str
    held_out_rows: int
    labels: bool
    calibration: str | None  # None: nothing was calibrated
    batch_sizes: list[int]
    repeat: int
    timing_note: str
    results: list[Result]  # in order of preference
    skipped: list[Skipped]
    config: str  # what became of model.yaml
    plot: str | None = None  # the image's file name, when there is one
    plot_note: str = ""
    warnings: list[str] = field(default_factory=list)

    @property
    def baseline(self) -> Result:
        return next(result for result in self.results if result.name == BASELINE)


def as_json(outcome: Outcome) -> str:
    baseline = outcome.baseline
    largest = max(outcome.batch_sizes)
    variants = []
    for result in outcome.results:
        variant = result.variant
        ms = variant.latency_ms.get(largest)
        variants.append(
            {
                "name": variant.name,
                "artifact": variant.artifact,
                "parameters": variant.parameters,
                "made": result.made,
                "kept": result.kept,
                "note": result.note,
                "accuracy": _finite(variant.accuracy),
                "latency_ms": {str(size): ms for size, ms in variant.latency_ms.items()},
                "speedup": {str(size): x for size, x in speedups(result, baseline).items()},
                "rows_per_s": largest / ms * 1000.0 if ms else None,
                "size_bytes": variant.size_bytes,
            }
        )
    document: dict[str, Any] = {
        "model": outcome.model,
        "version": outcome.version,
        "runtime": outcome.runtime,
        "metric": outcome.metric,
        "metric_note": outcome.metric_note,
        "held_out": {
            "source": outcome.held_out,
            "rows": outcome.held_out_rows,
            "labels": outcome.labels,
        },
        "calibration": outcome.calibration,
        "batch_sizes": outcome.batch_sizes,
        "repeat": outcome.repeat,
        "timing": outcome.timing_note,
        "variants": variants,
        "skipped": [{"name": s.name, "reason": s.reason} for s in outcome.skipped],
        "plot": outcome.plot,
        "plot_note": outcome.plot_note,
        "config": outcome.config,
        "warnings": outcome.warnings,
    }
    return json.dumps(document, indent=2, allow_nan=False) + "\n"


def as_markdown(outcome: Outcome) -> str:
    baseline = outcome.baseline
    sizes = outcome.batch_sizes
    largest = max(sizes)
    metric = outcome.metric
    lines = [
        f"# tailserve optimize: {outcome.model}, version {outcome.version}",
        "",
        f"- Accuracy: **{metric}**, {outcome.metric_note}, on {outcome.held_out_rows:,} held-out "
        f"rows ({outcome.held_out}).",
        f"- Latency: {outcome.timing_note}.",
    ]
    if outcome.calibration is not None:
        lines.append(f"- Calibration (int8-static): {outcome.calibration}.")
    lines += [f"- model.yaml: {outcome.config}.", ""]
    lines += [f"> {warning}" for warning in outcome.warnings]
    if outcome.warnings:
        lines.append("")
    lines += [
        "## Variants",
        "",
        "In model.yaml's order of preference (the most accurate first); *kept*: in its "
        "`variants` block.",
        "",
        f"| variant | kept | file | size | {metric} | rows/s at {largest} | "
        f"speed-up at {largest} |",
        "| --- | --- | --- | ---: | ---: | ---: | ---: |",
    ]
    for result in outcome.results:
        variant = result.variant
        ms = variant.latency_ms.get(largest)
        speedup = speedups(result, baseline).get(largest)
        lines.append(
            f"| {variant.name} | {'yes' if result.kept else 'no'} | "
            f"{variant.artifact or _settings(result)} | {human_bytes(variant.size_bytes)} | "
            f"{_accuracy(variant.accuracy)} | {_rate(largest, ms)} | {_times(speedup)} |"
        )
    lines += [
        "",
        "## Latency",
        "",
        "Milliseconds a batch by batch size (in brackets: the speed-up over fp32).",
        "",
        "| variant | " + " | ".join(str(size) for size in sizes) + " |",
        "| --- |" + " ---: |" * len(sizes),
    ]
    for result in outcome.results:
        ratios = speedups(result, baseline)
        cells = []
        for size in sizes:
            ms = result.variant.latency_ms.get(size)
            ratio = "" if result.name == BASELINE else f" ({_times(ratios.get(size))})"
            cells.append(f"{_ms(ms)}{ratio}")
        lines.append(f"| {result.name} | " + " | ".join(cells) + " |")
    lines.append("")
    if outcome.plot is not None:
        lines += [f"![latency by batch size, log-log]({outcome.plot})", ""]
    else:
        lines += [f"*The plot was skipped: {outcome.plot_note}.*", ""]
    lines += ["## How each was made", ""]
    lines += [f"- **{result.name}**: {result.note}" for result in outcome.results]
    if outcome.skipped:
        lines += ["", "## Skipped", ""]
        lines += [f"- **{skipped.name}**: {skipped.reason}" for skipped in outcome.skipped]
    return "\n".join(lines) + "\n"


def summary(outcome: Outcome) -> str:
    """The short table the command prints."""
    sizes = outcome.batch_sizes
    header = ["variant", "kept", outcome.metric, *(f"ms@{size}" for size in sizes), "size"]
    rows = [header]
    for result in outcome.results:
        variant = result.variant
        rows.append(
            [
                variant.name,
                "yes" if result.kept else "no",
                _accuracy(variant.accuracy),
                *(_ms(variant.latency_ms.get(size)) for size in sizes),
                human_bytes(variant.size_bytes),
            ]
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = [
        "  ".join(
            cell.ljust(width) if i == 0 else cell.rjust(width)
            for i, (cell, width) in enumerate(zip(row, widths, strict=True))
        ).rstrip()
        for row in rows
    ]
    lines += [f"skipped {skipped.name}: {skipped.reason}" for skipped in outcome.skipped]
    return "\n".join(lines)


def human_bytes(size: int | None) -> str:
    if size is None:
        return "-"
    value = float(size)
    for unit in ("B", "KiB", "MiB"):
        if value < 1024 or unit == "MiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def _settings(result: Result) -> str:
    parameters = result.variant.parameters
    if not parameters:
        return "(the model's own)"
    return ", ".join(f"{key}: {value}" for key, value in parameters.items())


def _accuracy(value: float | None) -> str:
    return "-" if value is None else f"{value:.6f}"


def _ms(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.3f}" if value < 10 else f"{value:.1f}"


def _rate(rows: int, ms: float | None) -> str:
    return "-" if not ms else f"{rows / ms * 1000.0:,.0f}"


def _times(ratio: float | None) -> str:
    return "-" if ratio is None else f"{ratio:.2f}x"


def _finite(value: float | None) -> float | None:
    # JSON has no NaN or infinity (an output of another shape has an infinite error).
    return value if value is not None and math.isfinite(value) else None
