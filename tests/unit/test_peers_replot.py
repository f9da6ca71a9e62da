"""benchmarks/peers.py's --replot: the table and plot again from runs' peers.json, a target
measured again in a later run taking the place of its earlier figures."""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture
def peers(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import peers as module

    return module


def _figures(capacity: float, **more: Any) -> dict[str, Any]:
    return {
        "capacity_rps": capacity,
        "p50_ms": 1.0,
        "p99_ms": 2.0,
        "p999_ms": 3.0,
        "cpu_us": 500.0,
        "resident_bytes": 100 * 2**20,
        "cold_start_s": 1.5,
        **more,
    }


def test_a_later_run_replaces_a_targets_figures_in_the_earlier_order(
    peers: ModuleType, tmp_path: Path
) -> None:
    first, second = tmp_path / "first.json", tmp_path / "second.json"
    overload = {"goodput_2x": 0.5, "goodput_3x": 0.25, "after_2x_errors": 0, "after_3x_errors": 2}
    first.write_text(
        json.dumps(
            {
                "a": _figures(100, **overload),
                "b": _figures(200, **overload),
                "c": _figures(300, **overload),
            }
        )
    )
    second.write_text(json.dumps({"b": _figures(250, **overload)}))
    table = peers.replot([first, second], tmp_path / "peers.png")
    rows = [line for line in table.splitlines() if line.startswith("| ") and "---" not in line]
    assert [row.split(" | ")[0] for row in rows[1:]] == ["| a", "| b", "| c"]
    assert "| 250 |" in rows[2] and "| 200 |" not in table
    assert "goodput" in rows[0] and "0.50 / 0.25" in rows[1] and "0 / 2" in rows[1]
    assert (tmp_path / "peers.png").stat().st_size > 0


def test_a_quick_run_has_no_overload_columns(peers: ModuleType, tmp_path: Path) -> None:
    only = tmp_path / "quick.json"
    only.write_text(json.dumps({"a": _figures(100)}))
    table = peers.replot([only], tmp_path / "peers.png")
    assert "goodput" not in table and "| 100 |" in table
