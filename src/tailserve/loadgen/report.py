"""Reports of a bench result: a terminal table, an HTML page with plots, and comparisons.

Everything here reads the JSON result document (`tailserve bench --out`), so a report can be
made again from a saved run, and runs from different days or servers can be compared:

    {"name", "workload", "overall": {...}, "classes": {name: {...}}, "generator": {...},
     "timeline": [{"t", "sent", "completed", "errors", "p50_ms", "p99_ms"}],
     "cdf": [[percentile, ms], ...], "steps": [{"offered_rps", "achieved_rps", "p99_ms", ...}],
     "capacity": {"slo_p99_ms", "rps"} | null}

where each stats object holds offered_rps, achieved_rps, p50_ms, p90_ms, p99_ms, p999_ms,
max_ms, count and errors.
"""

from __future__ import annotations

import base64
import html
import io
from collections.abc import Sequence
from pathlib import Path
from typing import Any

STAT_COLUMNS = ("offered_rps", "achieved_rps", "p50_ms", "p90_ms", "p99_ms", "p999_ms", "max_ms")


def table(result: dict[str, Any]) -> str:
    """The result as a terminal table: overall, then each request class."""
    rows = [("overall", result["overall"])]
    rows += [(name, stats) for name, stats in result.get("classes", {}).items()]
    head = f"{'class':<14}" + "".join(f"{c:>13}" for c in STAT_COLUMNS) + f"{'errors':>9}"
    lines = [head, "-" * len(head)]
    for name, stats in rows:
        cells = "".join(f"{_num(stats.get(c)):>13}" for c in STAT_COLUMNS)
        lines.append(f"{name:<14}{cells}{stats.get('errors', 0):>9}")
    generator = result.get("generator", {})
    if generator.get("behind"):
        lines.append(
            f"WARNING: the generator fell behind its schedule (max lag "
            f"{generator.get('lag_max_ms', 0):.1f} ms): its figures understate the load"
        )
    capacity = result.get("capacity")
    if capacity:
        lines.append(
            f"SLO capacity (p99 <= {capacity['slo_p99_ms']:g} ms, no errors): "
            f"{_num(capacity.get('rps'))} req/s"
        )
    return "\n".join(lines)


def steps_table(steps: Sequence[dict[str, Any]]) -> str:
    head = (
        f"{'offered':>10}{'achieved':>10}{'p50 ms':>10}{'p99 ms':>10}{'p99.9 ms':>10}{'errors':>8}"
    )
    lines = [head]
    for step in steps:
        lines.append(
            f"{_num(step['offered_rps']):>10}{_num(step['achieved_rps']):>10}"
            f"{_num(step['p50_ms']):>10}{_num(step['p99_ms']):>10}"
            f"{_num(step.get('p999_ms')):>10}{step.get('errors', 0):>8}"
        )
    return "\n".join(lines)


def compare_table(results: Sequence[dict[str, Any]]) -> str:
    """Side by side, with each run's ratio to the first (higher is better for throughput)."""
    names = [r.get("name", f"run {i}") for i, r in enumerate(results)]
    width = max(14, *(len(n) + 2 for n in names))
    lines = [f"{'metric':<14}" + "".join(f"{n:>{width}}" for n in names)]
    metrics = [*STAT_COLUMNS, "errors"]
    if any(r.get("capacity") for r in results):
        metrics.append("capacity_rps")
    for metric in metrics:
        cells = []
        for result in results:
            value = _metric(result, metric)
            reference = _metric(results[0], metric) if metric != "errors" else None
            ratio = ""
            if result is not results[0] and value is not None and reference:
                ratio = f" ({value / reference:.2f}x)"
            cells.append(f"{_num(value) + ratio:>{width}}")
        lines.append(f"{metric:<14}" + "".join(cells))
    return "\n".join(lines)


def _metric(result: dict[str, Any], metric: str) -> float | None:
    if metric == "capacity_rps":
        capacity = result.get("capacity") or {}
        value = capacity.get("rps")
        return None if value is None else float(value)
    value = result["overall"].get(metric)
    if value is None:
        return None
    return int(value) if metric == "errors" else float(value)


def _num(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, int):
        return f"{value:,}"
    return f"{value:.2f}" if abs(value) < 100 else f"{value:,.0f}"


# --- plots and HTML ---------------------------------------------------------------------


def plots(results: Sequence[dict[str, Any]]) -> dict[str, bytes]:
    """PNG images: percentiles against offered load, the latency CDF, and the run over time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    images: dict[str, bytes] = {}

    colours = [f"C{i % 10}" for i in range(len(results))]
    figure, axis = plt.subplots(figsize=(7, 4))
    for result, colour in zip(results, colours, strict=True):
        # A capacity search visits rates out of order: plot them as a curve.
        steps = sorted(result.get("steps") or [result["overall"]], key=lambda s: s["offered_rps"])
        offered = [s["offered_rps"] for s in steps]
        for key, style in (("p50_ms", ":"), ("p99_ms", "-"), ("p999_ms", "--")):
            axis.plot(
                offered,
                [s.get(key) for s in steps],
                style,
                marker="o",
                color=colour,
                markersize=3,
                label=f"{result.get('name', '')} {key[:-3]}",
            )
    slo = results[0].get("workload", {}).get("slo", {}).get("p99_ms")
    if slo:
        axis.axhline(slo, color="grey", linewidth=0.8)
    axis.set(
        xlabel="offered load (req/s)",
        ylabel="latency (ms)",
        yscale="log",
        title="Latency percentiles against offered load",
    )
    axis.legend(fontsize=7)
    images["latency_vs_load.png"] = _png(figure)

    figure, axis = plt.subplots(figsize=(7, 4))
    for result, colour in zip(results, colours, strict=True):
        cdf = result.get("cdf") or []
        if cdf:
            percentiles, latency = zip(*cdf, strict=True)
            # x: the "nines" of the percentile, so the tail gets the room it deserves
            nines = [1.0 / max(1e-6, 1.0 - p / 100.0) for p in percentiles]
            axis.plot(nines, latency, color=colour, label=result.get("name", ""))
    axis.set(
        xscale="log",
        xlabel="percentile",
        ylabel="latency (ms)",
        title="Latency by percentile (CDF)",
    )
    ticks = [1, 2, 10, 100, 1000, 10000]
    axis.set_xticks(ticks, ["0", "50", "90", "99", "99.9", "99.99"])
    axis.legend(fontsize=7)
    images["latency_cdf.png"] = _png(figure)

    figure, (top, bottom) = plt.subplots(2, 1, figsize=(7, 5), sharex=True)
    for result, colour in zip(results, colours, strict=True):
        timeline = result.get("timeline") or []
        t = [point["t"] for point in timeline]
        name = result.get("name", "")
        top.plot(t, [p.get("p99_ms") for p in timeline], color=colour, label=f"{name} p99")
        top.plot(t, [p.get("p50_ms") for p in timeline], ":", color=colour, label=f"{name} p50")
        bottom.plot(
            t, [p.get("completed") for p in timeline], color=colour, label=f"{name} completed/s"
        )
        bottom.plot(t, [p.get("sent") for p in timeline], ":", color=colour, label=f"{name} sent/s")
    top.set(ylabel="latency (ms)", title="Latency and throughput over time")
    bottom.set(xlabel="seconds", ylabel="req/s")
    top.legend(fontsize=7)
    bottom.legend(fontsize=7)
    images["over_time.png"] = _png(figure)
    plt.close("all")
    return images


def _png(figure: Any) -> bytes:
    buffer = io.BytesIO()
    figure.tight_layout()
    figure.savefig(buffer, format="png", dpi=100)
    return buffer.getvalue()


def write_html(results: Sequence[dict[str, Any]], path: Path) -> Path:
    """One self-contained page (plots inline as PNG) and the PNG files beside it."""
    images = plots(results)
    path.parent.mkdir(parents=True, exist_ok=True)
    for name, data in images.items():
        (path.parent / f"{path.stem}-{name}").write_bytes(data)
    title = " vs ".join(r.get("name", "run") for r in results)
    text = compare_table(results) if len(results) > 1 else table(results[0])
    parts = [
        "<!doctype html><html><head><meta charset='utf-8'>",
        f"<title>tailserve bench: {html.escape(title)}</title>",
        "<style>body{font-family:sans-serif;margin:2em}pre{background:#f5f5f5;padding:1em}"
        "img{max-width:100%;display:block;margin:1em 0}</style></head><body>",
        f"<h1>tailserve bench: {html.escape(title)}</h1>",
        f"<pre>{html.escape(text)}</pre>",
    ]
    for result in results:
        if result.get("steps"):
            parts.append(f"<h2>{html.escape(result.get('name', ''))}: steps</h2>")
            parts.append(f"<pre>{html.escape(steps_table(result['steps']))}</pre>")
    for name, data in images.items():
        encoded = base64.b64encode(data).decode()
        parts.append(f"<img alt='{name}' src='data:image/png;base64,{encoded}'>")
    parts.append("</body></html>")
    path.write_text("\n".join(parts), encoding="utf-8")
    return path
