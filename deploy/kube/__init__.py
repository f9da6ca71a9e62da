"""tailserve's Kubernetes objects, rendered from the values (deploy/values.yaml)."""

from __future__ import annotations

from kube import autoscaling, frontdoor, monitoring, redis, workers
from kube.common import Obj
from kube.values import Values, ValuesError, load

__all__ = ["Obj", "Values", "ValuesError", "load", "render"]


def render(values: Values) -> list[Obj]:
    """Every object, in an order `kubectl apply` can take them in one go."""
    found: list[Obj] = []
    if values["createNamespace"]:
        namespace = {"name": values["namespace"], "labels": {"app.kubernetes.io/name": "tailserve"}}
        found.append({"apiVersion": "v1", "kind": "Namespace", "metadata": namespace})
    found += redis.objects(values)
    found += workers.objects(values)
    found += frontdoor.objects(values)
    found += autoscaling.objects(values)
    found += monitoring.objects(values)
    return found
