"""Which models take the hedging lane: the front door sends a model's requests through the
Python router (`tailserve route`, which hedges them) only when they are slow enough for a hedge
to pay for the extra hop (about 0.1 ms a request against a request of hundreds).

A model is slow when its cost model predicts more than the threshold for one row in every one
of its cost classes: the front door routes by model (it reads no body), so a model whose cheap
classes are fast stays on the direct path, where its fast requests belong. Models named
explicitly take the lane whatever their cost.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

# Seed 002's threshold: below it the hop costs more than a hedge saves.
DEFAULT_THRESHOLD_MS = 200.0


def predicted_ms(stats: Mapping[str, Any]) -> float | None:
    """The least time one row costs over the model's cost classes, from its stats document
    (``GET /v2/models/{m}/stats``); None while it has no cost model."""
    least = None
    for entry in stats.get("model_stats", []):
        for model in entry.get("batching", {}).get("cost_model", {}).values():
            one = model.get("predicted_ms", {}).get("1")
            if one is not None and model.get("observations", 0) > 0:
                least = one if least is None else min(least, one)
    return least


def slow_models(
    predictions: Mapping[str, float | None], threshold_ms: float, named: Iterable[str] = ()
) -> frozenset[str]:
    """The models whose one-row prediction is over ``threshold_ms`` (0: none), and ``named``."""
    slow = set(named)
    if threshold_ms > 0:
        slow.update(m for m, ms in predictions.items() if ms is not None and ms > threshold_ms)
    return frozenset(slow)
