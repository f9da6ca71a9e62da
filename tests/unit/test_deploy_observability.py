"""deploy/grafana/tailserve.json and deploy/prometheus/alerts.yaml: they load, every
expression parses, and the rule file has Prometheus's shape (the series they use are checked
against a real stack's /metrics in tests/integration/test_stack_metrics.py)."""

from __future__ import annotations

import re

import promql_parser
import pytest
from test_deploy import DEPLOY, one, rendered, validate

from support.observability import alerts, dashboard, expressions, series

ALERTS_WANTED = {
    "TailserveP99OverSLO",
    "TailserveRefusalRate",
    "TailserveL2BreakerOpen",
    "TailserveWorkerRestarts",
}


@pytest.mark.parametrize("expr", expressions())
def test_every_expression_parses(expr: str) -> None:
    promql_parser.parse(expr)
    assert series(expr), f"{expr!r} selects no series"
    assert all(name.startswith("tailserve_") for name in series(expr))


def test_the_rule_file_has_prometheus_shape() -> None:
    document = alerts()
    assert set(document) == {"groups"}
    names = set()
    for group in document["groups"]:
        assert set(group) <= {"name", "interval", "rules"} and group["name"]
        for rule in group["rules"]:
            assert set(rule) == {"alert", "expr", "for", "labels", "annotations"}, rule
            assert re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", rule["alert"])
            assert re.fullmatch(r"\d+[smh]", rule["for"]), rule["for"]
            assert rule["labels"]["severity"] in {"page", "warn"}
            assert rule["annotations"]["summary"] and rule["annotations"]["description"]
            names.add(rule["alert"])
    assert names == ALERTS_WANTED


def test_the_p99_alert_compares_each_model_with_its_own_slo() -> None:
    rules = [r for g in alerts()["groups"] for r in g["rules"]]
    (rule,) = [r for r in rules if r["alert"] == "TailserveP99OverSLO"]
    used = series(rule["expr"])
    assert used["tailserve_model_slo_seconds"] == {"model"}
    assert "model" in used["tailserve_request_duration_seconds_bucket"]


def test_the_dashboard_has_a_panel_for_each_thing_to_watch() -> None:
    board = dashboard()
    assert board["uid"] == "tailserve" and board["title"] == "tailserve"
    used = {
        name for panel in board["panels"] for t in panel["targets"] for name in series(t["expr"])
    }
    for wanted in (
        "tailserve_request_duration_seconds_bucket",
        "tailserve_model_slo_seconds",
        "tailserve_requests_total",
        "tailserve_rejected_requests_total",
        "tailserve_cache_lookups_total",
        "tailserve_batch_size_rows_sum",
        "tailserve_batch_efficiency_ratio_sum",
        "tailserve_compute_debt_seconds_sum",
        "tailserve_queue_duration_seconds_bucket",
        "tailserve_workers",
        "tailserve_worker_restarts_total",
        "tailserve_router_hedges_total",
        "tailserve_variant_requests_total",
        "tailserve_jobs_finished_total",
        "tailserve_model_memory_bytes",
    ):
        assert wanted in used, wanted
    ids = [panel["id"] for panel in board["panels"]]
    assert len(ids) == len(set(ids))
    for panel in board["panels"]:
        assert [t["refId"] for t in panel["targets"]] == [
            chr(65 + i) for i in range(len(panel["targets"]))
        ]


def test_the_alert_rules_and_the_dashboard_ship_as_config_maps() -> None:
    objects = rendered("monitoring.ruleLabels.release=prom")
    alerts = one(objects, "ConfigMap", "tailserve-alerts")
    assert alerts["data"] == {"alerts.yaml": (DEPLOY / "prometheus" / "alerts.yaml").read_text()}
    assert alerts["metadata"]["labels"]["release"] == "prom"
    board = one(objects, "ConfigMap", "tailserve-dashboard")
    assert board["data"] == {"tailserve.json": (DEPLOY / "grafana" / "tailserve.json").read_text()}
    assert board["metadata"]["labels"]["grafana_dashboard"] == "1"
    validate([alerts, board])
    off = rendered("monitoring.alertRules=false", "monitoring.grafanaDashboard=false")
    assert not [
        o for o in off if o["metadata"]["labels"].get("app.kubernetes.io/component") == "monitoring"
    ]
