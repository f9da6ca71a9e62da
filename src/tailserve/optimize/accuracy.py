"""How close a variant's outputs are to the full model's: AUC, accuracy, largest error.

AUC and accuracy read one score a row (the model's first output) as a probability, decided at
0.5. Against labels they score the variant itself; without labels the full model's decisions
stand in for them, so the figures say how well the variant keeps the full model's answers.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from tailserve.errors import ConfigError
from tailserve.modelconfig import Metric

Array = np.ndarray[Any, Any]

THRESHOLD = 0.5
METRICS: tuple[Metric, ...] = ("auc", "accuracy", "max_abs_error")


def auc(scores: Array, labels: Array) -> float:
    """Area under the ROC curve: the chance that a positive outranks a negative, a tie counting
    half (Mann-Whitney U from average ranks). NaN when only one class is present."""
    scores = np.asarray(scores, dtype=np.float64).ravel()
    positive = np.asarray(labels).ravel().astype(bool)
    n_pos = int(positive.sum())
    n_neg = positive.size - n_pos
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    order = np.argsort(scores, kind="mergesort")
    ordered = scores[order]
    ranks = np.empty(scores.size, dtype=np.float64)
    # Each run of equal scores shares the mean of the ranks it spans (1-based).
    starts = np.flatnonzero(np.r_[True, ordered[1:] != ordered[:-1]])
    ends = np.r_[starts[1:], ordered.size]
    mean_ranks = (starts + ends + 1) / 2.0
    ranks[order] = np.repeat(mean_ranks, ends - starts)
    u = ranks[positive].sum() - n_pos * (n_pos + 1) / 2.0
    return float(u / (n_pos * n_neg))


def accuracy(scores: Array, labels: Array) -> float:
    """The share of rows whose decision (score >= 0.5) equals the label."""
    decisions = np.asarray(scores, dtype=np.float64).ravel() >= THRESHOLD
    truth = np.asarray(labels).ravel().astype(bool)
    return float(np.mean(decisions == truth)) if truth.size else float("nan")


def max_abs_error(outputs: dict[str, Array], reference: dict[str, Array]) -> float:
    """The largest absolute difference from the full model's outputs, over every output."""
    worst = 0.0
    for name, expected in reference.items():
        got = np.asarray(outputs[name], dtype=np.float64)
        want = np.asarray(expected, dtype=np.float64)
        if got.shape != want.shape:
            return float("inf")
        if want.size:
            worst = max(worst, float(np.max(np.abs(got - want))))
    return worst


def decisions(scores: Array) -> Array:
    return (np.asarray(scores, dtype=np.float64).ravel() >= THRESHOLD).astype(np.int64)


def default_metric(scores: Array | None, truth: Array | None) -> Metric:
    """``auc`` for one probability-like score a row whose decisions (or labels) hold both
    classes; else ``max_abs_error``."""
    if scores is None or scores.size == 0:
        return "max_abs_error"
    values = np.asarray(scores, dtype=np.float64)
    if not np.all(np.isfinite(values)) or values.min() < 0.0 or values.max() > 1.0:
        return "max_abs_error"
    classes = decisions(values) if truth is None else np.asarray(truth).ravel()
    return "auc" if np.unique(classes).size == 2 else "max_abs_error"


def measure(
    metric: Metric,
    outputs: dict[str, Array],
    reference: dict[str, Array],
    score_name: str,
    labels: Array | None,
) -> float:
    """The variant's figure by ``metric``: its outputs against the labels, or else against the
    full model's outputs (``reference``)."""
    if metric == "max_abs_error":
        return max_abs_error(outputs, reference)
    scores = outputs[score_name]
    truth = labels if labels is not None else decisions(reference[score_name])
    return auc(scores, truth) if metric == "auc" else accuracy(scores, truth)


def check_scores(metric: Metric, scores: Array, rows: int, name: str) -> None:
    """AUC and accuracy need one score a row."""
    if metric != "max_abs_error" and scores.size != rows:
        raise ConfigError(
            f"--metric {metric} needs one score a row, but output {name!r} gives "
            f"{scores.size} values for {rows} rows (use --metric max_abs_error)"
        )


def higher_is_better(metric: Metric) -> bool:
    return metric != "max_abs_error"
