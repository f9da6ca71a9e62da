"""The front door on Kubernetes: HAProxy 2.8 with tailserve's own policy, its workers found by
DNS.

The config is `tailserve up`'s (`tailserve.frontdoor.render.render`: the defaults, the model
routing, every backend's balancing, admission, checks and ejection), rendered with no members
and then given what a cluster changes:

- each backend holds `serverSlots` server slots filled from the workers' headless Service's
  DNS answers (`server-template ... resolvers k8s init-addr none`): only ready workers are in
  them, and HAProxy needs no DNS to start or to check the config;
- gRPC's unary backends (``g.<model>``, ``grpc``, ``grpc.cold``, ``grpc.affinity``) fill
  their slots with the workers' HTTP port (a unary call goes over HTTP/1.1,
  `tailserve.protocols.grpc.over_http1`), ``grpc.stream`` with their gRPC port over HTTP/2;
  HAProxy loads the gRPC ejection script (`frontdoor/grpc_ejection.lua`) from the ConfigMap;
- the global section has no master-worker process nor state file (the pod is the unit), and
  its connection limit follows the container's file descriptor limit;
- HAProxy's Prometheus exporter and a /healthz for the kubelet, on the metrics port;
- no admin lane: model load and unload through the front door would reach one worker only, so
  they answer 405 (a new model is a new image, rolled out); cache invalidation reaches every
  worker through Redis, so it passes.
"""

from __future__ import annotations

import hashlib
import importlib.resources

from kube.common import Obj, fqdn, labels, metadata, name, restricted
from kube.values import Values, ValuesError
from tailserve.frontdoor.render import FrontDoorPolicy, Listen
from tailserve.frontdoor.render import render as render_policy

UID = 99  # the haproxy user of the haproxy:2.8 image
COMPONENT = "frontdoor"
CONFIG_DIR = "/usr/local/etc/haproxy"
EJECTION = "grpc_ejection.lua"
AWAIT = "await_server.lua"
RESOLVERS = [
    "resolvers k8s",
    "    parse-resolv-conf",
    "    accepted_payload_size 8192",
    "    resolve_retries 3",
    "    timeout resolve 1s",
    "    timeout retry 1s",
    # A worker that left the DNS answers is out at once (it drains in its preStop); a failed
    # lookup keeps the last good answer a while.
    "    hold valid 10s",
    "    hold obsolete 0s",
    "    hold nx 10s",
    "    hold refused 10s",
    "    hold timeout 10s",
    "    hold other 10s",
    "",
]


def objects(values: Values) -> list[Obj]:
    config = haproxy_config(values)
    return [config_map(values, config), deployment(values, config), service(values), budget(values)]


def policy(values: Values) -> FrontDoorPolicy:
    door = values["frontdoor"]
    try:
        return FrontDoorPolicy(
            balance=door["balance"],
            model_balance=dict(door["modelBalance"]),
            max_conn=door["maxConn"],
            max_queue=door["maxQueue"],
            queue_share=door["queueShare"],
            threads=door["threads"],
        )
    except Exception as exc:  # tailserve's ConfigError, or a TypeError from a wrong type
        raise ValuesError(f"frontdoor: {exc}") from None


def haproxy_config(values: Values) -> str:
    door, worker = values["frontdoor"], values["worker"]
    rules = policy(values)
    listen = Listen(
        host="0.0.0.0",
        port=door["httpPort"],
        grpc_port=door["grpcPort"] if worker["grpcPort"] else 0,
        drain_timeout_s=door["drainTimeoutSeconds"],
        grpc_ejection=f"{CONFIG_DIR}/{EJECTION}",
        await_server=f"{CONFIG_DIR}/{AWAIT}",
    )
    models = {str(m): float(slo) for m, slo in values["models"].items()}
    text = render_policy(listen, [], models, rules)
    workers = fqdn(values, name(values, "workers"))
    slots = door["serverSlots"]
    out: list[str] = []
    for section in _sections(text):
        head = section[0]
        if head == "global":
            section = _global(values, rules, section)
        elif head == "frontend http":
            section = _frontend(section)
        elif head == "backend grpc.stream":
            section = [
                *section,
                f"    server-template g 1-{slots} {workers}:{worker['grpcPort']} proto h2 "
                f"check port {worker['httpPort']} check-proto h1 {_dns()}",
            ]
        elif head.startswith("backend "):
            section = [
                *section,
                f"    server-template w 1-{slots} {workers}:{worker['httpPort']} {_dns()}",
            ]
        out += [*section, ""]
        if head == "defaults":
            out += RESOLVERS
    out += [
        "frontend stats",
        f"    bind 0.0.0.0:{door['metricsPort']}",
        "    http-request use-service prometheus-exporter if { path /metrics }",
        '    http-request return status 200 content-type text/plain string "ok" '
        "if { path /healthz }",
        "    http-request return status 404",
        "",
    ]
    return "\n".join(out)


def _sections(text: str) -> list[list[str]]:
    sections: list[list[str]] = []
    for line in text.splitlines():
        if not line.strip():
            continue
        if line[0].isspace():
            sections[-1].append(line)
        else:
            sections.append([line])
    return sections


def _dns() -> str:
    return "resolvers k8s init-addr none resolve-prefer ipv4"


def _global(values: Values, rules: FrontDoorPolicy, section: list[str]) -> list[str]:
    lua = [line for line in section if line.strip().startswith("lua-load ")]
    return [
        "global",
        f"    nbthread {rules.threads}",
        # No fixed maxconn: HAProxy derives it from the file descriptors the container may
        # open (a fixed one past them stops it at start), up to what maxconn needs.
        f"    fd-hard-limit {2 * rules.max_connections + 1000}",
        f"    hard-stop-after {values['frontdoor']['drainTimeoutSeconds'] * 1000}ms",
        *lua,
    ]


def _frontend(section: list[str]) -> list[str]:
    # Before the routing rules (HAProxy runs http-request rules first, but warns otherwise).
    at = next(i for i, line in enumerate(section) if line.strip().startswith(("acl ", "use_")))
    refusal = [
        "    http-request return status 405 content-type application/json "
        'string "{\\"error\\": \\"on Kubernetes a model is loaded by rolling out an image '
        'that holds it\\"}" if METH_POST { path_reg ^/v2/repository/models/[^/]+/(un)?load$ }',
    ]
    return [*section[:at], *refusal, *section[at:]]


def ejection_script() -> str:
    """The Lua script that ejects a worker failing gRPC calls, as tailserve ships it."""
    return lua_script(EJECTION)


def lua_script(name: str) -> str:
    """One of the front door's Lua scripts, as tailserve ships it."""
    return (importlib.resources.files("tailserve.frontdoor") / name).read_text(encoding="utf-8")


def config_map(values: Values, config: str) -> Obj:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": metadata(values, name(values, "frontdoor"), COMPONENT),
        "data": {"haproxy.cfg": config, EJECTION: ejection_script(), AWAIT: lua_script(AWAIT)},
    }


def grace_seconds(door: Values) -> int:
    return int(door["preStopSleepSeconds"] + door["drainTimeoutSeconds"] + 5)


def deployment(values: Values, config: str) -> Obj:
    door = values["frontdoor"]
    pod_security, container_security = restricted(UID)
    ports = [{"name": "http", "containerPort": door["httpPort"]}]
    if door["grpcPort"] and values["worker"]["grpcPort"]:
        ports.append({"name": "grpc", "containerPort": door["grpcPort"]})
    ports.append({"name": "metrics", "containerPort": door["metricsPort"]})
    health = {"httpGet": {"path": "/healthz", "port": "metrics"}, "timeoutSeconds": 1}
    # Ready as `tailserve up`'s front door is: every backend a request may take has a worker
    # up (HAProxy's own answer on the HTTP port); alive while HAProxy answers at all.
    ready = {"httpGet": {"path": "/v2/health/ready", "port": "http"}, "timeoutSeconds": 1}
    # Out of the Service first, then a soft stop (SIGUSR1: stop listening, finish what is in
    # flight within hard-stop-after), waited for here so that no SIGTERM (a hard stop) cuts it.
    drain = (
        f"sleep {door['preStopSleepSeconds']}; kill -USR1 1; "
        "while kill -0 1 2>/dev/null; do sleep 1; done"
    )
    scripts = ejection_script() + lua_script(AWAIT)
    checksum = hashlib.sha256((config + scripts).encode()).hexdigest()[:16]
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": metadata(values, name(values, "frontdoor"), COMPONENT),
        "spec": {
            "replicas": door["replicas"],
            "revisionHistoryLimit": 5,
            "selector": {"matchLabels": labels(values, COMPONENT)},
            "strategy": {
                "type": "RollingUpdate",
                "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0},
            },
            "template": {
                "metadata": {
                    "labels": labels(values, COMPONENT),
                    "annotations": {
                        # A changed config rolls the pods (HAProxy reads it at start).
                        "tailserve.io/config-sha256": checksum,
                        "prometheus.io/scrape": "true",
                        "prometheus.io/port": str(door["metricsPort"]),
                        "prometheus.io/path": "/metrics",
                    },
                },
                "spec": {
                    "automountServiceAccountToken": False,
                    "terminationGracePeriodSeconds": grace_seconds(door),
                    "securityContext": pod_security,
                    "topologySpreadConstraints": [
                        {
                            "maxSkew": 1,
                            "topologyKey": "kubernetes.io/hostname",
                            "whenUnsatisfiable": "ScheduleAnyway",
                            "labelSelector": {"matchLabels": labels(values, COMPONENT)},
                        }
                    ],
                    "containers": [
                        {
                            "name": "haproxy",
                            "image": door["image"],
                            "command": ["haproxy", "-f", f"{CONFIG_DIR}/haproxy.cfg"],
                            "ports": ports,
                            "readinessProbe": {**ready, "periodSeconds": 2},
                            "livenessProbe": {**health, "periodSeconds": 10, "failureThreshold": 3},
                            "lifecycle": {
                                "preStop": {"exec": {"command": ["/bin/sh", "-c", drain]}}
                            },
                            "resources": door["resources"],
                            "securityContext": container_security,
                            "volumeMounts": [
                                {"name": "config", "mountPath": CONFIG_DIR, "readOnly": True}
                            ],
                        }
                    ],
                    "volumes": [
                        {"name": "config", "configMap": {"name": name(values, "frontdoor")}}
                    ],
                },
            },
        },
    }


def service(values: Values) -> Obj:
    door = values["frontdoor"]
    ports: list[Obj] = [{"name": "http", "port": door["httpPort"], "targetPort": "http"}]
    if door["grpcPort"] and values["worker"]["grpcPort"]:
        ports.append(
            {
                "name": "grpc",
                "port": door["grpcPort"],
                "targetPort": "grpc",
                "appProtocol": "kubernetes.io/h2c",
            }
        )
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": metadata(values, name(values, "frontdoor"), COMPONENT),
        "spec": {
            "type": door["serviceType"],
            "selector": labels(values, COMPONENT),
            "ports": ports,
        },
    }


def budget(values: Values) -> Obj:
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": metadata(values, name(values, "frontdoor"), COMPONENT),
        "spec": {
            "maxUnavailable": 1,
            "selector": {"matchLabels": labels(values, COMPONENT)},
        },
    }
