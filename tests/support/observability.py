"""The Grafana dashboard and the Prometheus rules in deploy/, read for the tests: each
expression, and the series and labels it uses (walked with promql_parser)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import promql_parser
import yaml

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
DASHBOARD = DEPLOY / "grafana" / "tailserve.json"
ALERTS = DEPLOY / "prometheus" / "alerts.yaml"


def dashboard() -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return loaded


def alerts() -> dict[str, Any]:
    loaded: dict[str, Any] = yaml.safe_load(ALERTS.read_text())
    return loaded


def expressions() -> list[str]:
    """Every PromQL expression of the dashboard's panels and of the alert rules."""
    found = [t["expr"] for panel in dashboard()["panels"] for t in panel["targets"]]
    return found + [rule["expr"] for group in alerts()["groups"] for rule in group["rules"]]


def series(expr: str) -> dict[str, set[str]]:
    """The series an expression selects, each with the labels it filters, groups or matches
    by (``le`` aside: a histogram's buckets have it)."""
    out: dict[str, set[str]] = {}
    _walk(promql_parser.parse(expr), set(), out)
    return out


def _walk(node: Any, labels: set[str], out: dict[str, set[str]]) -> None:
    if isinstance(node, promql_parser.VectorSelector):
        used = labels | {m.name for m in node.matchers.matchers}
        out.setdefault(node.name, set()).update(used - {"le", "__name__"})
    elif isinstance(node, promql_parser.MatrixSelector):
        _walk(node.vector_selector, labels, out)
    elif isinstance(node, promql_parser.AggregateExpr):
        grouped = set(node.modifier.labels) if node.modifier is not None else set()
        _walk(node.expr, labels | grouped, out)
    elif isinstance(node, promql_parser.BinaryExpr):
        matching = node.modifier.matching if node.modifier is not None else None
        on = set(matching.labels) if matching is not None else set()
        _walk(node.lhs, labels | on, out)
        _walk(node.rhs, labels | on, out)
    elif isinstance(node, promql_parser.Call):
        for arg in node.args:
            _walk(arg, labels, out)
    elif isinstance(node, promql_parser.ParenExpr | promql_parser.UnaryExpr):
        _walk(node.expr, labels, out)
