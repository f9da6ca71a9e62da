"""The workers: a Deployment of `tailserve serve`, the headless Service the front door reads
their addresses from, their PodDisruptionBudget, and the Job that loads the ranker's features.

A worker is ready only when every model is loaded and warm (`/v2/health/ready`), so a new pod
joins the Service's DNS answers, and the front door, warm. Stopping, it first waits
`preStopSleepSeconds` while it leaves those answers, then SIGTERM drains it.
"""

from __future__ import annotations

from kube.common import (
    Obj,
    field_env,
    image,
    labels,
    metadata,
    name,
    redis_url,
    restricted,
)
from kube.values import Values

UID = 10001  # the image's user (deploy/Dockerfile)
COMPONENT = "worker"


def objects(values: Values) -> list[Obj]:
    found = [deployment(values), headless_service(values)]
    if values["disruption"]["workersMinAvailable"]:
        found.append(budget(values))
    if values["examples"]["loadFeatures"]:
        found.append(features_job(values))
    return found


def grace_seconds(worker: Values) -> int:
    """preStop, then the drain, then a margin for the models to close."""
    return int(worker["preStopSleepSeconds"] + worker["drainTimeoutSeconds"] + 5)


def serve_args(values: Values) -> list[str]:
    worker = values["worker"]
    args = [
        "serve",
        "--repository",
        worker["repository"],
        "--host",
        "0.0.0.0",
        "--http-port",
        str(worker["httpPort"]),
        "--grpc-port",
        str(worker["grpcPort"]),
        "--drain-timeout",
        str(worker["drainTimeoutSeconds"]),
        "--worker-id",
        "$(POD_NAME)",
    ]
    url, cluster = redis_url(values)
    if url:
        args += ["--redis-url", url, *(["--redis-cluster"] if cluster else [])]
    return [*args, *(str(arg) for arg in worker["extraArgs"])]


def deployment(values: Values) -> Obj:
    worker = values["worker"]
    pod_security, container_security = restricted(UID)
    ports = [{"name": "http", "containerPort": worker["httpPort"]}]
    if worker["grpcPort"]:
        ports.append({"name": "grpc", "containerPort": worker["grpcPort"]})
    container: Obj = {
        "name": "worker",
        "image": image(values),
        "imagePullPolicy": values["image"]["pullPolicy"],
        "args": serve_args(values),
        "env": [
            field_env("POD_NAME", "metadata.name"),
            {
                "name": "TAILSERVE_ADMIN_TOKEN",
                "valueFrom": {
                    "secretKeyRef": {
                        "name": worker["adminTokenSecret"],
                        "key": "token",
                        "optional": True,
                    }
                },
            },
        ],
        "ports": ports,
        # 200 only when every model is loaded and warm; 503 while draining.
        "readinessProbe": {
            "httpGet": {"path": "/v2/health/ready", "port": "http"},
            "periodSeconds": 2,
            "timeoutSeconds": 1,
            "failureThreshold": 2,
        },
        # The socket listens before the models load, so this holds from the start.
        "livenessProbe": {
            "httpGet": {"path": "/v2/health/live", "port": "http"},
            "periodSeconds": 10,
            "timeoutSeconds": 2,
            "failureThreshold": 3,
        },
        "lifecycle": {
            "preStop": {"exec": {"command": ["sleep", str(worker["preStopSleepSeconds"])]}}
        },
        "resources": worker["resources"],
        "securityContext": container_security,
        "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}],
    }
    pod: Obj = {
        "automountServiceAccountToken": False,
        "terminationGracePeriodSeconds": grace_seconds(worker),
        "securityContext": pod_security,
        "topologySpreadConstraints": [
            {
                "maxSkew": 1,
                "topologyKey": "kubernetes.io/hostname",
                "whenUnsatisfiable": "ScheduleAnyway",
                "labelSelector": {"matchLabels": labels(values, COMPONENT)},
            }
        ],
        "containers": [container],
        "volumes": [{"name": "tmp", "emptyDir": {}}],
    }
    if worker["nodeSelector"]:
        pod["nodeSelector"] = worker["nodeSelector"]
    if worker["tolerations"]:
        pod["tolerations"] = worker["tolerations"]
    spec: Obj = {
        "revisionHistoryLimit": 5,
        "selector": {"matchLabels": labels(values, COMPONENT)},
        # New pods serve (warm) before old ones go: capacity never dips in a rollout.
        "strategy": {
            "type": "RollingUpdate",
            "rollingUpdate": {"maxSurge": "25%", "maxUnavailable": 0},
        },
        "template": {
            "metadata": {
                "labels": labels(values, COMPONENT),
                "annotations": {
                    "prometheus.io/scrape": "true",
                    "prometheus.io/port": str(worker["httpPort"]),
                    "prometheus.io/path": "/metrics",
                },
            },
            "spec": pod,
        },
    }
    # With an autoscaler the replica count is its own: a count here would fight it on apply.
    if not values["autoscaling"]["enabled"]:
        spec = {"replicas": worker["replicas"], **spec}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": metadata(values, name(values, "worker"), COMPONENT),
        "spec": spec,
    }


def headless_service(values: Values) -> Obj:
    """Only ready (warm) workers are in its DNS answers: the front door's membership."""
    worker = values["worker"]
    ports: list[Obj] = [{"name": "http", "port": worker["httpPort"], "targetPort": "http"}]
    if worker["grpcPort"]:
        ports.append(
            {
                "name": "grpc",
                "port": worker["grpcPort"],
                "targetPort": "grpc",
                "appProtocol": "kubernetes.io/h2c",
            }
        )
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": metadata(values, name(values, "workers"), COMPONENT),
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": False,
            "selector": labels(values, COMPONENT),
            "ports": ports,
        },
    }


def budget(values: Values) -> Obj:
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": metadata(values, name(values, "worker"), COMPONENT),
        "spec": {
            "minAvailable": values["disruption"]["workersMinAvailable"],
            "selector": {"matchLabels": labels(values, COMPONENT)},
        },
    }


def features_job(values: Values) -> Obj:
    """`tailserve examples --features-only`: retried until the Redis Cluster is formed."""
    url, cluster = redis_url(values)
    pod_security, container_security = restricted(UID)
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": metadata(values, name(values, "features"), "features"),
        "spec": {
            "backoffLimit": 10,
            # Gone a while after it finished, so that the next apply runs it again (loading
            # the same features is harmless) rather than failing on a changed, immutable Job.
            "ttlSecondsAfterFinished": 600,
            "template": {
                "metadata": {"labels": labels(values, "features")},
                "spec": {
                    "restartPolicy": "OnFailure",
                    "automountServiceAccountToken": False,
                    "securityContext": pod_security,
                    "containers": [
                        {
                            "name": "features",
                            "image": image(values),
                            "imagePullPolicy": values["image"]["pullPolicy"],
                            "args": [
                                "examples",
                                values["worker"]["repository"],
                                "--features-only",
                                "--redis-url",
                                url,
                                *(["--redis-cluster"] if cluster else []),
                            ],
                            "securityContext": container_security,
                            "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}],
                        }
                    ],
                    "volumes": [{"name": "tmp", "emptyDir": {}}],
                },
            },
        },
    }
