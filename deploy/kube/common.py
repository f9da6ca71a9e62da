"""What every object shares: names, labels, metadata, and the hardened container basics."""

from __future__ import annotations

from typing import Any

from kube.values import Values

Obj = dict[str, Any]


def labels(values: Values, component: str) -> dict[str, str]:
    """The selector labels of a component (stable: a Deployment's selector cannot change)."""
    return {
        "app.kubernetes.io/name": "tailserve",
        "app.kubernetes.io/instance": values["name"],
        "app.kubernetes.io/component": component,
    }


def metadata(values: Values, name: str, component: str, **extra: Any) -> Obj:
    return {
        "name": name,
        "namespace": values["namespace"],
        "labels": {**labels(values, component), "app.kubernetes.io/managed-by": "deploy-render"},
        **extra,
    }


def name(values: Values, part: str) -> str:
    return f"{values['name']}-{part}"


def fqdn(values: Values, service: str) -> str:
    """A Service's name as the cluster's DNS answers it (HAProxy uses no search list)."""
    return f"{service}.{values['namespace']}.svc.{values['clusterDomain']}"


def field_env(env: str, field: str) -> Obj:
    """An environment variable from the downward API (the pod's own name or address)."""
    return {"name": env, "valueFrom": {"fieldRef": {"fieldPath": field}}}


def restricted(run_as: int) -> tuple[Obj, Obj]:
    """The pod's and the container's security contexts: non-root, nothing to escalate to,
    a read-only root file system (each writes only its volumes)."""
    pod = {
        "runAsNonRoot": True,
        "runAsUser": run_as,
        "runAsGroup": run_as,
        "fsGroup": run_as,
        "seccompProfile": {"type": "RuntimeDefault"},
    }
    container = {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]},
    }
    return pod, container


def redis_url(values: Values) -> tuple[str, bool]:
    """The workers' Redis (URL, whether it is a cluster); ("", False) for none."""
    redis = values["redis"]
    if redis["enabled"]:
        return f"redis://{name(values, 'redis')}:6379", True
    return str(redis["url"]), bool(redis["url"]) and bool(redis["cluster"])


def image(values: Values) -> str:
    return f"{values['image']['repository']}:{values['image']['tag']}"
