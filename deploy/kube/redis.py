"""A Redis Cluster of its own: a StatefulSet of masters x (1 + replicas) nodes, a Job that forms
the cluster once, the Services, a PodDisruptionBudget and a NetworkPolicy.

A pod's address changes when it is made again, and a Redis Cluster node knows its peers by
address (nodes.conf, on the pod's volume). Each node announces a stable host name (its pod's
DNS name under the headless Service), which Redis 7 keeps beside the address in nodes.conf;
before it starts, each node points every entry at its host name's current address
(`update-node-ips.sh`), so the cluster comes back even when every pod was made again at once.
"""

from __future__ import annotations

from kube.common import Obj, field_env, labels, metadata, name, restricted
from kube.values import Values

UID = 999  # the redis user of the redis:7 image
COMPONENT = "redis"
SETUP = "redis-setup"
PORT = 6379
BUS_PORT = 16379

CONFIG = """\
port 6379
cluster-enabled yes
cluster-config-file /data/nodes.conf
cluster-node-timeout 5000
# A cache and job store: a replica that lost its master a while ago may still take over.
cluster-replica-validity-factor 0
cluster-require-full-coverage no
appendonly yes
dir /data
protected-mode no
maxmemory {maxmemory}
maxmemory-policy volatile-lru
"""

# $1: nodes.conf. Each entry's address becomes its host name's current one (getent hosts),
# waiting a while for names that do not resolve yet (their pods are starting too). An entry is
# `id ip:port@bus,hostname[,aux=...] flags ...` (Redis 7.0; 7.2 added the aux fields).
UPDATE_NODE_IPS = r"""#!/bin/sh
set -u
nodes="$1"
[ -f "$nodes" ] || exit 0
for host in $(sed -n 's/^[^ ]* [^ ,]*,\([^ ,]\{1,\}\)[ ,].*/\1/p' "$nodes"); do
  ip=""
  tries=0
  while [ -z "$ip" ] && [ "$tries" -lt "${RESOLVE_TRIES:-30}" ]; do
    ip=$(getent hosts "$host" | awk '{print $1; exit}')
    [ -n "$ip" ] || sleep "${RESOLVE_PAUSE:-2}"
    tries=$((tries + 1))
  done
  if [ -n "$ip" ]; then
    sed -i "s/^\([^ ]*\) [^ :]*:\([0-9]*@[0-9]*,$host[ ,]\)/\1 $ip:\2/" "$nodes"
  else
    echo "update-node-ips: $host does not resolve; its entry keeps its old address" >&2
  fi
done
"""

# Forms the cluster once: waits for every node, does nothing if any already knows a peer.
CREATE_CLUSTER = r"""#!/bin/sh
set -eu
port="${REDIS_PORT:-6379}"
addresses=""
for host in $NODES; do
  while :; do
    ip=$(getent hosts "$host" | awk '{print $1; exit}')
    [ -n "$ip" ] && redis-cli -h "$ip" -p "$port" ping >/dev/null 2>&1 && break
    sleep "${RESOLVE_PAUSE:-2}"
  done
  known=$(redis-cli -h "$ip" -p "$port" cluster info \
    | sed -n 's/^cluster_known_nodes:\([0-9]*\).*/\1/p')
  if [ "${known:-1}" -gt 1 ]; then
    echo "the cluster is formed already ($host knows $known nodes)"
    exit 0
  fi
  addresses="$addresses $ip:$port"
done
redis-cli --cluster create $addresses --cluster-replicas "$REPLICAS" --cluster-yes
"""

START = """\
sh /scripts/update-node-ips.sh /data/nodes.conf
exec redis-server /scripts/redis.conf \\
  --cluster-announce-ip "$POD_IP" \\
  --cluster-announce-hostname "$POD_NAME.$HEADLESS"
"""


def nodes(values: Values) -> int:
    redis = values["redis"]
    return int(redis["masters"] * (1 + redis["replicasPerMaster"]))


def objects(values: Values) -> list[Obj]:
    if not values["redis"]["enabled"]:
        return []
    return [
        config_map(values),
        headless_service(values),
        client_service(values),
        stateful_set(values),
        create_job(values),
        budget(values),
        network_policy(values),
    ]


def headless_name(values: Values) -> str:
    return name(values, "redis-headless")


def host_names(values: Values) -> list[str]:
    domain = f"{headless_name(values)}.{values['namespace']}.svc.{values['clusterDomain']}"
    return [f"{name(values, 'redis')}-{i}.{domain}" for i in range(nodes(values))]


def config_map(values: Values) -> Obj:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": metadata(values, name(values, "redis"), COMPONENT),
        "data": {
            "redis.conf": CONFIG.format(maxmemory=values["redis"]["maxmemory"]),
            "update-node-ips.sh": UPDATE_NODE_IPS,
            "create-cluster.sh": CREATE_CLUSTER,
        },
    }


def _ports() -> list[Obj]:
    return [
        {"name": "client", "port": PORT, "targetPort": "client"},
        {"name": "bus", "port": BUS_PORT, "targetPort": "bus"},
    ]


def headless_service(values: Values) -> Obj:
    """Every node's DNS name, published before it is ready: the nodes find each other by it."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": metadata(values, headless_name(values), COMPONENT),
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": labels(values, COMPONENT),
            "ports": _ports(),
        },
    }


def client_service(values: Values) -> Obj:
    """The clients' first node (any); the cluster's slot map tells them the rest."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": metadata(values, name(values, "redis"), COMPONENT),
        "spec": {
            "selector": labels(values, COMPONENT),
            "ports": [{"name": "client", "port": PORT, "targetPort": "client"}],
        },
    }


def stateful_set(values: Values) -> Obj:
    redis = values["redis"]
    pod_security, container_security = restricted(UID)
    ping = {"exec": {"command": ["redis-cli", "-p", str(PORT), "ping"]}, "timeoutSeconds": 2}
    claim: Obj = {
        "metadata": {"name": "data"},
        "spec": {
            "accessModes": ["ReadWriteOnce"],
            "resources": {"requests": {"storage": redis["storage"]}},
        },
    }
    if redis["storageClassName"]:
        claim["spec"]["storageClassName"] = redis["storageClassName"]
    return {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": metadata(values, name(values, "redis"), COMPONENT),
        "spec": {
            "serviceName": headless_name(values),
            "replicas": nodes(values),
            # All at once: after a restart each node waits for its peers' names.
            "podManagementPolicy": "Parallel",
            "selector": {"matchLabels": labels(values, COMPONENT)},
            "template": {
                "metadata": {"labels": labels(values, COMPONENT)},
                "spec": {
                    "automountServiceAccountToken": False,
                    "terminationGracePeriodSeconds": 30,
                    "securityContext": pod_security,
                    "affinity": {
                        "podAntiAffinity": {
                            "preferredDuringSchedulingIgnoredDuringExecution": [
                                {
                                    "weight": 100,
                                    "podAffinityTerm": {
                                        "topologyKey": "kubernetes.io/hostname",
                                        "labelSelector": {"matchLabels": labels(values, COMPONENT)},
                                    },
                                }
                            ]
                        }
                    },
                    "containers": [
                        {
                            "name": "redis",
                            "image": redis["image"],
                            "command": ["/bin/sh", "-c", START],
                            "env": [
                                field_env("POD_NAME", "metadata.name"),
                                field_env("POD_IP", "status.podIP"),
                                {
                                    "name": "HEADLESS",
                                    "value": f"{headless_name(values)}.{values['namespace']}"
                                    f".svc.{values['clusterDomain']}",
                                },
                            ],
                            "ports": [
                                {"name": "client", "containerPort": PORT},
                                {"name": "bus", "containerPort": BUS_PORT},
                            ],
                            "readinessProbe": {**ping, "periodSeconds": 5},
                            "livenessProbe": {
                                **ping,
                                "periodSeconds": 10,
                                "failureThreshold": 3,
                                "initialDelaySeconds": 30,
                            },
                            "resources": redis["resources"],
                            "securityContext": container_security,
                            "volumeMounts": [
                                {"name": "data", "mountPath": "/data"},
                                {"name": "config", "mountPath": "/scripts"},
                            ],
                        }
                    ],
                    "volumes": [{"name": "config", "configMap": {"name": name(values, "redis")}}],
                },
            },
            "volumeClaimTemplates": [claim],
        },
    }


def create_job(values: Values) -> Obj:
    redis = values["redis"]
    pod_security, container_security = restricted(UID)
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": metadata(values, name(values, "redis-create"), SETUP),
        "spec": {
            "backoffLimit": 6,
            # Gone a while after it finished: the next apply runs it again (a no-op on a formed
            # cluster) rather than failing on a changed, immutable Job.
            "ttlSecondsAfterFinished": 600,
            "template": {
                "metadata": {"labels": labels(values, SETUP)},
                "spec": {
                    "restartPolicy": "OnFailure",
                    "automountServiceAccountToken": False,
                    "securityContext": pod_security,
                    "containers": [
                        {
                            "name": "create",
                            "image": redis["image"],
                            "command": ["/bin/sh", "/scripts/create-cluster.sh"],
                            "env": [
                                {"name": "NODES", "value": " ".join(host_names(values))},
                                {"name": "REPLICAS", "value": str(redis["replicasPerMaster"])},
                            ],
                            "securityContext": container_security,
                            "volumeMounts": [{"name": "config", "mountPath": "/scripts"}],
                        }
                    ],
                    "volumes": [{"name": "config", "configMap": {"name": name(values, "redis")}}],
                },
            },
        },
    }


def budget(values: Values) -> Obj:
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": metadata(values, name(values, "redis"), COMPONENT),
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": labels(values, COMPONENT)}},
    }


def network_policy(values: Values) -> Obj:
    """Only the workers, the setup Jobs and the nodes themselves reach Redis (no password)."""
    clients = {
        "matchLabels": {
            "app.kubernetes.io/name": "tailserve",
            "app.kubernetes.io/instance": values["name"],
        },
        "matchExpressions": [
            {
                "key": "app.kubernetes.io/component",
                "operator": "In",
                "values": ["worker", "features", SETUP, COMPONENT],
            }
        ],
    }
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": metadata(values, name(values, "redis"), COMPONENT),
        "spec": {
            "podSelector": {"matchLabels": labels(values, COMPONENT)},
            "policyTypes": ["Ingress"],
            "ingress": [
                {
                    "from": [{"podSelector": clients}],
                    "ports": [{"port": PORT}, {"port": BUS_PORT}],
                }
            ],
        },
    }
