"""Autoscaling the workers on requests in flight per worker.

The signal is the front door's: HAProxy's per-worker requests in service plus those queued
(`haproxy_server_current_sessions`, `haproxy_server_current_queue`,
`haproxy_backend_current_queue`), summed over the front door's pods. An `AverageValue` target
divides it by the workers' count, so the workers wanted are ceil(in flight / target). The worker
exports no in-flight gauge of its own.

Two ways to the HorizontalPodAutoscaler: Prometheus Adapter serving it as the external metric
`tailserve_in_flight` (deployed here unless the cluster has one), or KEDA's ScaledObject with a
Prometheus trigger (KEDA installed in the cluster), which makes the HPA itself.
"""

from __future__ import annotations

from kube.common import Obj, labels, metadata, name
from kube.values import Values

METRIC = "tailserve_in_flight"
COMPONENT = "autoscaler"
ADAPTER_PORT = 6443
_SERIES = "|".join(
    f"haproxy_{level}_current_{what}"
    for level, what in (("server", "sessions"), ("server", "queue"), ("backend", "queue"))
)
# The front door's worker backends: one a model, the default one, gRPC.
_PROXIES = r"m\\..+|workers|grpc"


def objects(values: Values) -> list[Obj]:
    scaling = values["autoscaling"]
    if not scaling["enabled"]:
        return []
    if scaling["provider"] == "keda":
        return [scaled_object(values)]
    found = [hpa(values)]
    if scaling["installAdapter"]:
        found += adapter(values)
    return found


def query(values: Values, matchers: str) -> str:
    """PromQL: requests in flight or queued at the front door, over its pods."""
    pods = f'pod=~"{name(values, "frontdoor")}-.+"'
    return f'sum({{__name__=~"{_SERIES}",{matchers}{pods},proxy=~"{_PROXIES}"}})'


def _target(values: Values) -> Obj:
    return {"apiVersion": "apps/v1", "kind": "Deployment", "name": name(values, "worker")}


def behavior(values: Values) -> Obj:
    """Up at once (doubling, or 4 pods, each 15 s); down slowly, one pod a minute."""
    return {
        "scaleUp": {
            "stabilizationWindowSeconds": 0,
            "selectPolicy": "Max",
            "policies": [
                {"type": "Percent", "value": 100, "periodSeconds": 15},
                {"type": "Pods", "value": 4, "periodSeconds": 15},
            ],
        },
        "scaleDown": {
            "stabilizationWindowSeconds": values["autoscaling"]["scaleDownStabilizationSeconds"],
            "selectPolicy": "Max",
            "policies": [{"type": "Pods", "value": 1, "periodSeconds": 60}],
        },
    }


def hpa(values: Values) -> Obj:
    scaling = values["autoscaling"]
    metrics: list[Obj] = [
        {
            "type": "External",
            "external": {
                "metric": {"name": METRIC},
                "target": {
                    "type": "AverageValue",
                    "averageValue": str(scaling["inFlightPerPod"]),
                },
            },
        }
    ]
    if scaling["cpuPercent"]:
        metrics.append(
            {
                "type": "Resource",
                "resource": {
                    "name": "cpu",
                    "target": {"type": "Utilization", "averageUtilization": scaling["cpuPercent"]},
                },
            }
        )
    return {
        "apiVersion": "autoscaling/v2",
        "kind": "HorizontalPodAutoscaler",
        "metadata": metadata(values, name(values, "worker"), "worker"),
        "spec": {
            "scaleTargetRef": _target(values),
            "minReplicas": scaling["minReplicas"],
            "maxReplicas": scaling["maxReplicas"],
            "metrics": metrics,
            "behavior": behavior(values),
        },
    }


def scaled_object(values: Values) -> Obj:
    scaling = values["autoscaling"]
    triggers: list[Obj] = [
        {
            "type": "prometheus",
            "metricType": "AverageValue",
            "metadata": {
                "serverAddress": scaling["prometheusUrl"],
                "query": query(values, f'namespace="{values["namespace"]}",'),
                "threshold": str(scaling["inFlightPerPod"]),
            },
        }
    ]
    if scaling["cpuPercent"]:
        triggers.append(
            {
                "type": "cpu",
                "metricType": "Utilization",
                "metadata": {"value": str(scaling["cpuPercent"])},
            }
        )
    return {
        "apiVersion": "keda.sh/v1alpha1",
        "kind": "ScaledObject",
        "metadata": metadata(values, name(values, "worker"), "worker"),
        "spec": {
            "scaleTargetRef": _target(values),
            "minReplicaCount": scaling["minReplicas"],
            "maxReplicaCount": scaling["maxReplicas"],
            "pollingInterval": 5,
            "advanced": {"horizontalPodAutoscalerConfig": {"behavior": behavior(values)}},
            "triggers": triggers,
        },
    }


def adapter_rules(values: Values) -> str:
    """Prometheus Adapter's config: the one external metric, per namespace (found by one of
    its series, computed over all three)."""
    return (
        "externalRules:\n"
        '  - seriesQuery: \'haproxy_server_current_sessions{namespace!="",pod!=""}\'\n'
        "    resources:\n"
        "      overrides:\n"
        "        namespace: {resource: namespace}\n"
        "    name:\n"
        '      matches: "^haproxy_server_current_sessions$"\n'
        f'      as: "{METRIC}"\n'
        f"    metricsQuery: '{query(values, '<<.LabelMatchers>>,')}'\n"
    )


def adapter(values: Values) -> list[Obj]:
    """Prometheus Adapter serving external.metrics.k8s.io (its own upstream manifests, cut to
    the external metrics API)."""
    adapter_name = name(values, "prometheus-adapter")
    namespace = values["namespace"]
    meta = metadata(values, adapter_name, COMPONENT)
    cluster_meta = {k: v for k, v in meta.items() if k != "namespace"}
    account = [{"kind": "ServiceAccount", "name": adapter_name, "namespace": namespace}]
    scaling = values["autoscaling"]
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": meta},
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": meta,
            "data": {"config.yaml": adapter_rules(values)},
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRole",
            "metadata": {**cluster_meta, "name": f"{adapter_name}-resource-reader"},
            "rules": [
                {
                    "apiGroups": [""],
                    "resources": ["namespaces", "pods", "services", "configmaps"],
                    "verbs": ["get", "list", "watch"],
                }
            ],
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRoleBinding",
            "metadata": {**cluster_meta, "name": f"{adapter_name}-resource-reader"},
            "roleRef": {
                "apiGroup": "rbac.authorization.k8s.io",
                "kind": "ClusterRole",
                "name": f"{adapter_name}-resource-reader",
            },
            "subjects": account,
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRoleBinding",
            "metadata": {**cluster_meta, "name": f"{adapter_name}-auth-delegator"},
            "roleRef": {
                "apiGroup": "rbac.authorization.k8s.io",
                "kind": "ClusterRole",
                "name": "system:auth-delegator",
            },
            "subjects": account,
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "RoleBinding",
            "metadata": {**meta, "name": f"{adapter_name}-auth-reader", "namespace": "kube-system"},
            "roleRef": {
                "apiGroup": "rbac.authorization.k8s.io",
                "kind": "Role",
                "name": "extension-apiserver-authentication-reader",
            },
            "subjects": account,
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRole",
            "metadata": {**cluster_meta, "name": f"{adapter_name}-external-metrics-reader"},
            "rules": [
                {
                    "apiGroups": ["external.metrics.k8s.io"],
                    "resources": ["*"],
                    "verbs": ["get", "list", "watch"],
                }
            ],
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRoleBinding",
            "metadata": {**cluster_meta, "name": f"{adapter_name}-hpa-external-metrics"},
            "roleRef": {
                "apiGroup": "rbac.authorization.k8s.io",
                "kind": "ClusterRole",
                "name": f"{adapter_name}-external-metrics-reader",
            },
            "subjects": [
                {
                    "kind": "ServiceAccount",
                    "name": "horizontal-pod-autoscaler",
                    "namespace": "kube-system",
                }
            ],
        },
        {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": meta,
            "spec": {
                "replicas": 1,
                "selector": {"matchLabels": labels(values, COMPONENT)},
                "template": {
                    "metadata": {"labels": labels(values, COMPONENT)},
                    "spec": {
                        "serviceAccountName": adapter_name,
                        "securityContext": {
                            "runAsNonRoot": True,
                            "runAsUser": 65534,
                            "seccompProfile": {"type": "RuntimeDefault"},
                        },
                        "containers": [
                            {
                                "name": "prometheus-adapter",
                                "image": scaling["adapterImage"],
                                "args": [
                                    f"--secure-port={ADAPTER_PORT}",
                                    "--cert-dir=/var/run/serving-cert",
                                    "--config=/etc/adapter/config.yaml",
                                    f"--prometheus-url={scaling['prometheusUrl']}",
                                    "--metrics-relist-interval=1m",
                                ],
                                "ports": [{"name": "https", "containerPort": ADAPTER_PORT}],
                                "readinessProbe": {
                                    "httpGet": {
                                        "path": "/readyz",
                                        "port": "https",
                                        "scheme": "HTTPS",
                                    },
                                    "periodSeconds": 5,
                                },
                                "livenessProbe": {
                                    "httpGet": {
                                        "path": "/livez",
                                        "port": "https",
                                        "scheme": "HTTPS",
                                    },
                                    "periodSeconds": 10,
                                },
                                "resources": {
                                    "requests": {"cpu": "100m", "memory": "128Mi"},
                                    "limits": {"memory": "256Mi"},
                                },
                                "securityContext": {
                                    "allowPrivilegeEscalation": False,
                                    "readOnlyRootFilesystem": True,
                                    "capabilities": {"drop": ["ALL"]},
                                },
                                "volumeMounts": [
                                    {"name": "config", "mountPath": "/etc/adapter"},
                                    {"name": "serving-cert", "mountPath": "/var/run/serving-cert"},
                                    {"name": "tmp", "mountPath": "/tmp"},
                                ],
                            }
                        ],
                        "volumes": [
                            {"name": "config", "configMap": {"name": adapter_name}},
                            {"name": "serving-cert", "emptyDir": {}},
                            {"name": "tmp", "emptyDir": {}},
                        ],
                    },
                },
            },
        },
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": meta,
            "spec": {
                "selector": labels(values, COMPONENT),
                "ports": [{"name": "https", "port": 443, "targetPort": "https"}],
            },
        },
        {
            "apiVersion": "apiregistration.k8s.io/v1",
            "kind": "APIService",
            "metadata": {**cluster_meta, "name": "v1beta1.external.metrics.k8s.io"},
            "spec": {
                "service": {"name": adapter_name, "namespace": namespace, "port": 443},
                "group": "external.metrics.k8s.io",
                "version": "v1beta1",
                # The adapter's certificate is its own, made at start.
                "insecureSkipTLSVerify": True,
                "groupPriorityMinimum": 100,
                "versionPriority": 100,
            },
        },
    ]
