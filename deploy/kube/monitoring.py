"""The stack's alert rules and Grafana dashboard as ConfigMaps, for the cluster's own
Prometheus and Grafana to pick up.

The files are deploy/prometheus/alerts.yaml and deploy/grafana/tailserve.json, the same that
`tailserve up` users load by hand (docs/observability.md). Each ConfigMap carries the labels
the values give (`monitoring.ruleLabels`, `monitoring.dashboardLabels`): Grafana's dashboard
sidecar, as its Helm chart ships it, loads every ConfigMap labelled `grafana_dashboard: "1"`;
a Prometheus reads the rules file where its deployment mounts the ConfigMap.
"""

from __future__ import annotations

from pathlib import Path

from kube.common import Obj, metadata, name
from kube.values import Values

DEPLOY = Path(__file__).resolve().parent.parent
ALERTS = DEPLOY / "prometheus" / "alerts.yaml"
DASHBOARD = DEPLOY / "grafana" / "tailserve.json"
COMPONENT = "monitoring"


def objects(values: Values) -> list[Obj]:
    monitoring = values["monitoring"]
    found: list[Obj] = []
    if monitoring["alertRules"]:
        found.append(_config_map(values, "alerts", monitoring["ruleLabels"], ALERTS))
    if monitoring["grafanaDashboard"]:
        found.append(_config_map(values, "dashboard", monitoring["dashboardLabels"], DASHBOARD))
    return found


def _config_map(values: Values, part: str, extra: dict[str, str], source: Path) -> Obj:
    meta = metadata(values, name(values, part), COMPONENT)
    meta["labels"].update({str(k): str(v) for k, v in (extra or {}).items()})
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": meta,
        "data": {source.name: source.read_text()},
    }
