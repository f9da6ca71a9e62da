"""Writing the measured variants into model.yaml's ``variants`` block, the rest left as it was.

The file is read as plain YAML, the one key set (in its place, or at the end), written back in
its order under its comment header, and checked as a worker would load it before it replaces
the old file. Comments inside the file do not survive (PyYAML does not keep them).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from tailserve.errors import ConfigError
from tailserve.modelconfig import CONFIG_FILE, Metric, Variant, parse_model_config

LATENCY_DIGITS = 4  # significant digits of a latency: more is noise


def variants_block(
    metric: Metric, floor: float | None, choices: Sequence[Variant]
) -> dict[str, Any]:
    block: dict[str, Any] = {"metric": metric}
    if floor is not None:
        block["floor"] = floor
    block["choices"] = [variant_entry(variant) for variant in choices]
    return block


def variant_entry(variant: Variant) -> dict[str, Any]:
    entry: dict[str, Any] = {"name": variant.name}
    if variant.artifact is not None:
        entry["artifact"] = variant.artifact
    if variant.parameters:
        entry["parameters"] = dict(variant.parameters)
    if variant.accuracy is not None:
        entry["accuracy"] = float(variant.accuracy)
    entry["latency_ms"] = {
        int(size): float(f"{ms:.{LATENCY_DIGITS}g}") for size, ms in variant.latency_ms.items()
    }
    if variant.size_bytes is not None:
        entry["size_bytes"] = int(variant.size_bytes)
    return entry


def rewrite(model_dir: Path, block: dict[str, Any]) -> Path:
    """Set ``variants`` in ``model_dir/model.yaml``; return its path."""
    path = model_dir / CONFIG_FILE
    text = path.read_text(encoding="utf-8")
    raw = yaml.safe_load(text)
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: must be a mapping of fields, got {type(raw).__name__}")
    raw["variants"] = block
    parse_model_config({"name": model_dir.name, **raw}, source=f"{path} (as rewritten)")
    body = yaml.safe_dump(raw, sort_keys=False, default_flow_style=None, allow_unicode=True)
    staged = path.with_name(f".{CONFIG_FILE}.tmp")
    staged.write_text(header(text) + body, encoding="utf-8")
    # A worker reloading meanwhile reads the old file or the new one, never half of one.
    os.replace(staged, path)
    return path


def header(text: str) -> str:
    """The comment lines (and blank lines among them) the file starts with."""
    lines: list[str] = []
    for line in text.splitlines(keepends=True):
        if line.strip() and not line.lstrip().startswith("#"):
            break
        lines.append(line)
    kept = "".join(lines).rstrip("\n")
    return f"{kept}\n" if kept.strip() else ""
