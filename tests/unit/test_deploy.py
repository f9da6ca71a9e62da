"""deploy/: the Kubernetes objects rendered from the values, checked offline.

Every object is validated against Kubernetes' own schemas (kubernetes-validate, strict: an
unknown field fails); KEDA's ScaledObject and Prometheus Adapter's rules have no schema there
and are checked by hand. The front door's config is checked by HAProxy, the worker's flags by
tailserve's own parser, and the Redis Cluster's scripts against real redis-server processes.
"""

from __future__ import annotations

import http.server
import os
import shutil
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from tailserve.cli import build_parser
from tailserve.frontdoor.haproxy import find_binary
from tailserve.settings import load_settings

kubernetes_validate = pytest.importorskip("kubernetes_validate")

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
sys.path.insert(0, str(DEPLOY))

import render as render_cli  # noqa: E402
from kube import ValuesError, load, render  # noqa: E402
from kube.frontdoor import AWAIT, CONFIG_DIR, EJECTION, ejection_script, lua_script  # noqa: E402
from kube.redis import CREATE_CLUSTER, UPDATE_NODE_IPS  # noqa: E402

# The schemas every object must pass: the oldest Kubernetes still supported upstream when this
# was written, and a newer one.
VERSIONS = ("1.30.0", "1.33.0")
# Kinds of custom resources: no schema in kubernetes-validate, checked by hand below.
CUSTOM = {("keda.sh/v1alpha1", "ScaledObject")}

Obj = dict[str, Any]


def rendered(*sets: str) -> list[Obj]:
    return render(load(sets=sets))


def one(objects: list[Obj], kind: str, name: str) -> Obj:
    (found,) = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    return found


def validate(objects: list[Obj]) -> None:
    for obj in objects:
        if (obj["apiVersion"], obj["kind"]) in CUSTOM:
            continue
        for version in VERSIONS:
            try:
                kubernetes_validate.validate(obj, version, strict=True)
            except kubernetes_validate.ValidationError as exc:
                where = f"{obj['kind']}/{obj['metadata']['name']} (Kubernetes {version})"
                pytest.fail(f"{where}: {exc.message} at {list(exc.path)}")


def container(deployment: Obj) -> Obj:
    found: Obj
    (found,) = deployment["spec"]["template"]["spec"]["containers"]
    return found


def haproxy_check(config: str, tmp_path: Path) -> None:
    """HAProxy's check of a config, with the ConfigMap's other files where it loads them."""
    (tmp_path / EJECTION).write_text(ejection_script())
    (tmp_path / AWAIT).write_text(lua_script(AWAIT))
    path = tmp_path / "haproxy.cfg"
    path.write_text(config.replace(f"{CONFIG_DIR}/", f"{tmp_path}/"))
    done = subprocess.run(
        [find_binary(), "-c", "-f", str(path)], capture_output=True, text=True, timeout=30
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_every_default_object_passes_the_kubernetes_schemas() -> None:
    objects = rendered()
    kinds = {o["kind"] for o in objects}
    assert {
        "Deployment",
        "Service",
        "StatefulSet",
        "Job",
        "PodDisruptionBudget",
        "HorizontalPodAutoscaler",
        "APIService",
        "ConfigMap",
    } <= kinds
    validate(objects)
    # The CLI prints the same objects as YAML documents that read back the same.
    assert list(yaml.safe_load_all(render_cli.dump(objects))) == objects


def test_strict_validation_refuses_an_unknown_field() -> None:
    worker = one(rendered(), "Deployment", "tailserve-worker")
    container(worker)["readinessProbes"] = container(worker).pop("readinessProbe")
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(worker, VERSIONS[0], strict=True)


def test_workers_are_ready_when_warm_and_drain_before_they_are_killed() -> None:
    objects = rendered("worker.drainTimeoutSeconds=45", "worker.preStopSleepSeconds=7")
    worker = one(objects, "Deployment", "tailserve-worker")
    pod = worker["spec"]["template"]["spec"]
    main = container(worker)
    assert main["readinessProbe"]["httpGet"]["path"] == "/v2/health/ready"
    assert main["livenessProbe"]["httpGet"]["path"] == "/v2/health/live"
    assert main["lifecycle"]["preStop"]["exec"]["command"] == ["sleep", "7"]
    # The grace period counts from the preStop: it must hold the sleep and the whole drain.
    assert pod["terminationGracePeriodSeconds"] > 7 + 45
    assert main["args"][main["args"].index("--drain-timeout") + 1] == "45"
    # A rollout adds warm pods before it takes any away; the autoscaler owns the count.
    assert worker["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
    assert "replicas" not in worker["spec"]
    # The front door's membership: only ready workers are in the headless Service's answers.
    service = one(objects, "Service", "tailserve-workers")
    assert service["spec"]["clusterIP"] == "None"
    assert service["spec"]["publishNotReadyAddresses"] is False
    assert service["spec"]["selector"] == worker["spec"]["selector"]["matchLabels"]
    assert pod["securityContext"]["runAsNonRoot"] is True


def test_the_worker_flags_are_tailserves_own() -> None:
    worker = one(rendered(), "Deployment", "tailserve-worker")
    args = build_parser().parse_args(container(worker)["args"])
    settings = load_settings(
        env={},
        overrides={
            "host": args.host,
            "http_port": args.http_port,
            "grpc_port": args.grpc_port,
            "redis_url": args.redis_url,
            "redis_cluster": args.redis_cluster,
            "drain_timeout_s": args.drain_timeout_s,
            "repository": args.repository,
        },
    )
    assert (settings.host, settings.http_port, settings.grpc_port) == ("0.0.0.0", 8000, 8001)
    assert settings.redis_url == "redis://tailserve-redis:6379" and settings.redis_cluster
    assert settings.drain_timeout_s == 30
    assert settings.repository == "/models"
    env = {e["name"]: e for e in container(worker)["env"]}
    token = env["TAILSERVE_ADMIN_TOKEN"]["valueFrom"]["secretKeyRef"]
    assert token == {"name": "tailserve-admin", "key": "token", "optional": True}


def test_overridden_values_reach_the_objects(tmp_path: Path) -> None:
    values = tmp_path / "prod.yaml"
    values.write_text(
        yaml.safe_dump(
            {
                "namespace": "serving",
                "models": {"churn": 80, "ranker": None},
                "worker": {"resources": {"requests": {"cpu": "2", "memory": "3Gi"}}},
                "autoscaling": {"minReplicas": 3, "maxReplicas": 40, "inFlightPerPod": 12},
                "frontdoor": {"serverSlots": 64, "balance": "affinity"},
                "disruption": {"workersMinAvailable": 2},
            }
        )
    )
    objects = render(load([values], ["frontdoor.maxQueue=20"]))
    validate(objects)
    assert {o["metadata"].get("namespace", "serving") for o in objects} <= {
        "serving",
        "kube-system",  # the adapter's RoleBinding to the API server's authentication reader
    }
    worker = one(objects, "Deployment", "tailserve-worker")
    requests = container(worker)["resources"]["requests"]
    assert requests == {"cpu": "2", "memory": "3Gi"}
    # A free-form map merges key by key: the default memory limit stays.
    assert container(worker)["resources"]["limits"] == {"memory": "2Gi"}
    hpa = one(objects, "HorizontalPodAutoscaler", "tailserve-worker")
    assert hpa["spec"]["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "name": "tailserve-worker",
    }
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (3, 40)
    external = hpa["spec"]["metrics"][0]["external"]
    assert external["metric"]["name"] == "tailserve_in_flight"
    assert external["target"] == {"type": "AverageValue", "averageValue": "12"}
    budget = one(objects, "PodDisruptionBudget", "tailserve-worker")
    assert budget["spec"]["minAvailable"] == 2
    assert budget["spec"]["selector"] == worker["spec"]["selector"]
    config = one(objects, "ConfigMap", "tailserve-frontdoor")["data"]["haproxy.cfg"]
    # Half the SLO to wait in a queue; the removed model has no backend.
    assert "timeout queue 40ms" in config and "backend m.ranker" not in config
    assert "balance hash var(txn.affinity)" in config and "hash-balance-factor 125" in config
    assert "maxconn 16 maxqueue 20" in config and "avg_queue ge 20" in config
    assert "tailserve-workers.serving.svc.cluster.local:8000" in config
    assert "server-template w 1-64 " in config


def test_the_front_door_config_passes_haproxy_with_no_dns(tmp_path: Path) -> None:
    for sets in [(), ("frontdoor.balance=least-loaded", "worker.grpcPort=0", "models={}")]:
        objects = rendered(*sets)
        config = one(objects, "ConfigMap", "tailserve-frontdoor")["data"]["haproxy.cfg"]
        # The workers' addresses come from DNS at run time, never at start or check.
        templates = [line for line in config.splitlines() if "server-template" in line]
        assert templates and all("init-addr none" in line for line in templates)
        assert all("resolvers k8s" in line for line in templates)
        haproxy_check(config, tmp_path)
        door = one(objects, "Deployment", "tailserve-frontdoor")
        assert door["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] > 5 + 30
    assert "frontend grpc" not in config and "backend workers" in config


def test_the_front_door_mirrors_tailserve_up() -> None:
    config = one(rendered(), "ConfigMap", "tailserve-frontdoor")["data"]["haproxy.cfg"]
    lines = [line.strip() for line in config.splitlines()]
    assert "balance random(2)" in lines
    assert "timeout queue 25ms" in lines  # churn: half of 50 ms
    assert "retry-on conn-failure empty-response junk-response 503" in lines
    assert "option redispatch 1" in lines
    assert any("observe layer7 error-limit 10 on-error mark-down" in line for line in lines)
    assert any(
        line.startswith("http-error status 503 content-type application/json") for line in lines
    )
    assert "http-request use-service prometheus-exporter if { path /metrics }" in lines
    # Streams over HTTP/2 to the gRPC port; unary calls over HTTP/1.1 to the HTTP port.
    sections = config.split("\nbackend ")
    (stream,) = [s for s in sections if s.startswith("grpc.stream\n")]
    assert ":8001 proto h2 check port 8000" in stream and "server-template g 1-32 " in stream
    (churn,) = [s for s in sections if s.startswith("g.churn\n")]
    assert "server-template w 1-32 " in churn and ":8000 " in churn and "proto h2" not in churn
    # gRPC by model, with its ejection script from the ConfigMap.
    assert "use_backend g.churn if { var(txn.model) -m str churn } { nbsrv(g.churn) gt 0 }" in lines
    assert f"lua-load {CONFIG_DIR}/{EJECTION}" in lines
    data = one(rendered(), "ConfigMap", "tailserve-frontdoor")["data"]
    assert data[EJECTION] == ejection_script() and "grpc_outcome" in data[EJECTION]


def test_keda_scales_the_workers_on_the_same_signal() -> None:
    objects = rendered("autoscaling.provider=keda", "autoscaling.cpuPercent=0")
    validate(objects)
    assert not [o for o in objects if o["kind"] in ("HorizontalPodAutoscaler", "APIService")]
    scaled = one(objects, "ScaledObject", "tailserve-worker")
    # By hand: KEDA's CRD is not among Kubernetes' schemas.
    assert scaled["apiVersion"] == "keda.sh/v1alpha1"
    assert set(scaled) == {"apiVersion", "kind", "metadata", "spec"}
    spec = scaled["spec"]
    assert spec["scaleTargetRef"]["name"] == "tailserve-worker"
    assert (spec["minReplicaCount"], spec["maxReplicaCount"]) == (2, 16)
    (trigger,) = spec["triggers"]
    assert trigger["type"] == "prometheus" and trigger["metricType"] == "AverageValue"
    assert set(trigger["metadata"]) == {"serverAddress", "query", "threshold"}
    assert trigger["metadata"]["threshold"] == "8"
    assert 'namespace="tailserve",' in trigger["metadata"]["query"]
    behavior = spec["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]
    assert behavior["scaleDown"]["stabilizationWindowSeconds"] == 300


def test_prometheus_adapter_serves_the_metric_the_hpa_reads() -> None:
    objects = rendered()
    rules = yaml.safe_load(
        one(objects, "ConfigMap", "tailserve-prometheus-adapter")["data"]["config.yaml"]
    )
    # By hand: the adapter's config has no schema here.
    (rule,) = rules["externalRules"]
    assert set(rule) == {"seriesQuery", "resources", "name", "metricsQuery"}
    assert rule["name"]["as"] == "tailserve_in_flight"
    assert rule["resources"] == {"overrides": {"namespace": {"resource": "namespace"}}}
    assert "<<.LabelMatchers>>" in rule["metricsQuery"]
    query = rule["metricsQuery"]
    assert query.startswith("sum(") and 'pod=~"tailserve-frontdoor-.+"' in query
    service = one(objects, "APIService", "v1beta1.external.metrics.k8s.io")["spec"]["service"]
    assert service["name"] == "tailserve-prometheus-adapter"
    # Not installed: only the HPA (a cluster's own adapter serves the metric).
    kinds = {o["kind"] for o in rendered("autoscaling.installAdapter=false")}
    assert "HorizontalPodAutoscaler" in kinds and "APIService" not in kinds


def test_without_autoscaling_the_deployment_holds_the_count() -> None:
    objects = rendered("autoscaling.enabled=false", "worker.replicas=3")
    validate(objects)
    worker = one(objects, "Deployment", "tailserve-worker")
    assert worker["spec"]["replicas"] == 3
    assert not [o for o in objects if o["kind"] in ("HorizontalPodAutoscaler", "ScaledObject")]


def test_redis_cluster_is_its_own_and_reachable_only_by_tailserve() -> None:
    objects = rendered("redis.masters=4", "redis.replicasPerMaster=2")
    nodes = one(objects, "StatefulSet", "tailserve-redis")
    assert nodes["spec"]["replicas"] == 12
    assert nodes["spec"]["serviceName"] == "tailserve-redis-headless"
    headless = one(objects, "Service", "tailserve-redis-headless")
    assert headless["spec"]["publishNotReadyAddresses"] is True
    job = one(objects, "Job", "tailserve-redis-create")
    env = {e["name"]: e["value"] for e in container_of_job(job)["env"]}
    assert env["REPLICAS"] == "2" and len(env["NODES"].split()) == 12
    assert env["NODES"].split()[0] == (
        "tailserve-redis-0.tailserve-redis-headless.tailserve.svc.cluster.local"
    )
    policy = one(objects, "NetworkPolicy", "tailserve-redis")
    allowed = policy["spec"]["ingress"][0]["from"][0]["podSelector"]["matchExpressions"][0]
    assert "worker" in allowed["values"] and "frontdoor" not in allowed["values"]
    # Without it, the workers use the Redis named, or none.
    external = rendered("redis.enabled=false", "redis.url=redis://cache:6379", "redis.cluster=true")
    args = container(one(external, "Deployment", "tailserve-worker"))["args"]
    assert args[-3:] == ["--redis-url", "redis://cache:6379", "--redis-cluster"]
    assert not [o for o in external if o["kind"] == "StatefulSet"]
    none = rendered("redis.enabled=false", "examples.loadFeatures=false")
    assert "--redis-url" not in container(one(none, "Deployment", "tailserve-worker"))["args"]


def container_of_job(job: Obj) -> Obj:
    found: Obj
    (found,) = job["spec"]["template"]["spec"]["containers"]
    return found


@pytest.mark.parametrize(
    ("sets", "message"),
    [
        (
            ["autoscaling.minReplicas=5", "autoscaling.maxReplicas=3"],
            "autoscaling.minReplicas (5) is above autoscaling.maxReplicas (3)",
        ),
        (["autoscaling.maxReplicas=40"], "frontdoor.serverSlots (32) must be at least"),
        (["disruption.workersMinAvailable=2"], "disruption.workersMinAvailable (2) must be below"),
        (["autoscaling.maxReplica=3"], "unknown key 'autoscaling.maxReplica'"),
        (["frontdoor.balance=fastest"], "unknown balancing policy 'fastest'"),
        (["models.churn=-1"], "models.churn: the p99 SLO in ms must be positive"),
        (["redis.masters=2"], "redis.masters must be a whole number of at least 3"),
        (["autoscaling.provider=hpa"], "autoscaling.provider must be prometheus-adapter or keda"),
        (["name=Tail_Serve"], "name must be a DNS label"),
        (["worker.drainTimeoutSeconds=soon"], "worker.drainTimeoutSeconds must be a whole"),
    ],
)
def test_a_bad_value_is_refused_naming_it(
    sets: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(ValuesError) as caught:
        render(load(sets=sets))
    assert message in str(caught.value)
    args = [arg for item in sets for arg in ("--set", item)]
    assert render_cli.main(args) == 2
    assert message in capsys.readouterr().err


def test_the_cli_writes_a_file_an_object(tmp_path: Path) -> None:
    assert render_cli.main(["--output-dir", str(tmp_path)]) == 0
    files = sorted(tmp_path.glob("*.yaml"))
    assert len(files) == len(rendered())
    assert files[0].name == "00-namespace-tailserve.yaml"


# The Redis Cluster's scripts, run by sh against real redis-server processes: the cluster is
# formed once, and comes back after every node restarted at a new address.

needs_redis = pytest.mark.skipif(
    not (shutil.which("redis-server") and shutil.which("redis-cli")),
    reason="needs redis-server and redis-cli",
)


@pytest.fixture
def stub_dns(tmp_path: Path) -> Iterator[tuple[Path, dict[str, str]]]:
    """A `getent` first on the PATH that answers from a hosts file the test writes."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    hosts = tmp_path / "hosts"
    hosts.write_text("")
    getent = bin_dir / "getent"
    getent.write_text(f'#!/bin/sh\ngrep " $2$" {hosts} || exit 2\n')
    getent.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "RESOLVE_PAUSE": "0.1"}
    yield hosts, env


def write_hosts(hosts: Path, addresses: dict[str, str]) -> None:
    hosts.write_text("".join(f"{ip} {host}\n" for host, ip in addresses.items()))


def test_update_node_ips_points_each_entry_at_its_name(
    tmp_path: Path, stub_dns: tuple[Path, dict[str, str]]
) -> None:
    hosts, env = stub_dns
    script = tmp_path / "update-node-ips.sh"
    script.write_text(UPDATE_NODE_IPS)
    nodes = tmp_path / "nodes.conf"
    nodes.write_text(
        # Redis 7.0's entry, 7.2's (aux fields after the name), a name that does not resolve.
        "a1 10.0.0.1:6379@16379,r-0.h myself,master - 0 0 1 connected 0-8000\n"
        "b2 10.0.0.2:6379@16379,r-1.h,tls-port=0,shard-id=ff slave a1 0 0 1 connected\n"
        "c3 10.0.0.3:6379@16379,r-2.h master - 0 0 2 connected 8001-16383\n"
        "vars currentEpoch 2 lastVoteEpoch 0\n"
    )
    write_hosts(hosts, {"r-0.h": "10.9.0.1", "r-1.h": "10.9.0.22"})
    done = subprocess.run(
        ["sh", str(script), str(nodes)],
        env={**env, "RESOLVE_TRIES": "2"},
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 0, done.stderr
    assert nodes.read_text().splitlines() == [
        "a1 10.9.0.1:6379@16379,r-0.h myself,master - 0 0 1 connected 0-8000",
        "b2 10.9.0.22:6379@16379,r-1.h,tls-port=0,shard-id=ff slave a1 0 0 1 connected",
        "c3 10.0.0.3:6379@16379,r-2.h master - 0 0 2 connected 8001-16383",
        "vars currentEpoch 2 lastVoteEpoch 0",
    ]
    assert "r-2.h does not resolve" in done.stderr


@needs_redis
def test_the_cluster_forms_once_and_survives_new_addresses(
    tmp_path: Path, stub_dns: tuple[Path, dict[str, str]]
) -> None:
    from support.servers import free_port

    hosts, env = stub_dns
    names = [f"node-{i}.test" for i in range(3)]
    port, bus = free_port(), free_port()
    (tmp_path / "create.sh").write_text(CREATE_CLUSTER)
    (tmp_path / "update.sh").write_text(UPDATE_NODE_IPS)
    env = {**env, "NODES": " ".join(names), "REPLICAS": "0", "REDIS_PORT": str(port)}

    def start(addresses: dict[str, str]) -> list[subprocess.Popen[bytes]]:
        write_hosts(hosts, addresses)
        processes = []
        for host, ip in addresses.items():
            data = tmp_path / host
            data.mkdir(exist_ok=True)
            update = ["sh", str(tmp_path / "update.sh"), str(data / "nodes.conf")]
            subprocess.run(update, env=env, check=True, timeout=30)
            processes.append(
                subprocess.Popen(
                    [
                        "redis-server",
                        "--bind", ip,
                        "--port", str(port),
                        "--cluster-port", str(bus),
                        "--cluster-enabled", "yes",
                        "--cluster-config-file", str(data / "nodes.conf"),
                        "--cluster-node-timeout", "2000",
                        "--cluster-announce-ip", ip,
                        "--cluster-announce-hostname", host,
                        "--dir", str(data),
                        "--save", "",
                        "--appendonly", "no",
                    ],
                    stdout=subprocess.DEVNULL,
                )
            )  # fmt: skip
        return processes

    def ask(ip: str, *command: str) -> str:
        done = subprocess.run(
            ["redis-cli", "-h", ip, "-p", str(port), *command],
            capture_output=True,
            text=True,
            timeout=10,
        )
        return done.stdout

    def settled(addresses: dict[str, str]) -> bool:
        """Every node ok, and connected to every other at its address now (a restarted node
        says ok until its node timeout passes, whether it reaches its peers or not)."""
        wanted = sorted(addresses.values())
        for ip in wanted:
            nodes = [line.split() for line in ask(ip, "cluster", "nodes").splitlines()]
            seen = sorted(fields[1].split(":")[0] for fields in nodes)
            linked = all(f[7] == "connected" and "fail" not in f[2] for f in nodes)
            if seen != wanted or not linked or "cluster_state:ok" not in ask(ip, "cluster", "info"):
                return False
        return True

    def wait_settled(addresses: dict[str, str]) -> None:
        deadline = time.monotonic() + 30
        while not settled(addresses):
            views = [ask(ip, "cluster", "nodes") for ip in addresses.values()]
            assert time.monotonic() < deadline, views
            time.sleep(0.2)

    def stop(processes: list[subprocess.Popen[bytes]]) -> None:
        for process in processes:
            process.terminate()
        for process in processes:
            process.wait(timeout=10)

    first = {host: f"127.0.0.{11 + i}" for i, host in enumerate(names)}
    processes = start(first)
    try:
        create = ["sh", str(tmp_path / "create.sh")]
        done = subprocess.run(create, env=env, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stdout + done.stderr
        wait_settled(first)
        # Once formed, the Job does nothing.
        again = subprocess.run(create, env=env, capture_output=True, text=True, timeout=60)
        assert again.returncode == 0 and "formed already" in again.stdout
    finally:
        stop(processes)
    # Every node comes back at a new address, as pods made again do.
    moved = {host: f"127.0.1.{11 + i}" for i, host in enumerate(names)}
    processes = start(moved)
    try:
        wait_settled(moved)
    finally:
        stop(processes)


# The front door's discovery, run: HAProxy with the rendered config, its DNS answered by a stub
# (as the cluster's DNS answers for the headless Service), in front of two stub workers.


class StubDNS:
    """Answers A queries for one name with ``self.addresses``; nothing else."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.addresses: list[str] = []
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind(("127.0.0.1", 0))
        self.port: int = self.sock.getsockname()[1]
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                query, peer = self.sock.recvfrom(4096)
            except OSError:
                return
            self.sock.sendto(self._answer(query), peer)

    def _answer(self, query: bytes) -> bytes:
        end = 12
        labels = []
        while query[end]:
            labels.append(query[end + 1 : end + 1 + query[end]].decode())
            end += 1 + query[end]
        qtype = struct.unpack("!H", query[end + 1 : end + 3])[0]
        question = query[12 : end + 5]
        found = self.addresses if qtype == 1 and ".".join(labels) == self.name else []
        head = query[:2] + struct.pack("!HHHHH", 0x8180, 1, len(found), 0, 0)
        records = b"".join(
            struct.pack("!HHHIH", 0xC00C, 1, 1, 1, 4) + socket.inet_aton(ip) for ip in found
        )
        return head + question + records

    def close(self) -> None:
        self.sock.close()


class _Echo(http.server.BaseHTTPRequestHandler):
    def _reply(self) -> None:
        self.rfile.read(int(self.headers.get("content-length", 0)))
        body = self.server.server_address[0].encode()  # type: ignore[union-attr]
        self.send_response(200)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST = _reply

    def log_message(self, *args: object) -> None:
        pass


def test_the_front_door_follows_the_workers_dns_answers(tmp_path: Path) -> None:
    from support.servers import free_port, wait_for

    worker_port, http_port, metrics_port = free_port(), free_port(), free_port()
    objects = rendered(
        f"worker.httpPort={worker_port}",
        "worker.grpcPort=0",
        f"frontdoor.httpPort={http_port}",
        f"frontdoor.metricsPort={metrics_port}",
    )
    config = one(objects, "ConfigMap", "tailserve-frontdoor")["data"]["haproxy.cfg"]
    dns = StubDNS("tailserve-workers.tailserve.svc.cluster.local")
    config = config.replace("parse-resolv-conf", f"nameserver stub 127.0.0.1:{dns.port}")
    (tmp_path / "haproxy.cfg").write_text(config.replace(f"{CONFIG_DIR}/", f"{tmp_path}/"))
    (tmp_path / EJECTION).write_text(ejection_script())
    (tmp_path / AWAIT).write_text(lua_script(AWAIT))
    workers = [http.server.ThreadingHTTPServer((ip, worker_port), _Echo) for ip in WORKER_IPS]
    for server in workers:
        threading.Thread(target=server.serve_forever, daemon=True).start()
    proxy = subprocess.Popen(
        [find_binary(), "-db", "-f", str(tmp_path / "haproxy.cfg")],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{http_port}"

    def answered(n: int) -> set[str]:
        seen = set()
        for _ in range(n):
            reply = httpx.post(f"{url}/v2/models/churn/infer", content=b"{}", timeout=5)
            assert reply.status_code == 200, reply.text
            seen.add(reply.text)
        return seen

    try:
        # No worker in the answers yet: not ready, and a request is a JSON 503.
        wait_for(lambda: _get(f"http://127.0.0.1:{metrics_port}/healthz") == 200, 10, "haproxy")
        assert _get(f"{url}/v2/health/ready") == 503
        dns.addresses = list(WORKER_IPS)
        wait_for(lambda: _get(f"{url}/v2/health/ready") == 200, 15, "workers from DNS")
        wait_for(lambda: answered(20) == set(WORKER_IPS), 15, "both workers serving")
        # One leaves the answers (its pod is stopping): it gets no more requests.
        dns.addresses = [WORKER_IPS[0]]
        wait_for(lambda: answered(20) == {WORKER_IPS[0]}, 15, "the other worker left")
    finally:
        proxy.terminate()
        proxy.wait(timeout=10)
        for server in workers:
            server.shutdown()
            server.server_close()
        dns.close()


WORKER_IPS = ("127.0.0.21", "127.0.0.22")


def _get(url: str) -> int:
    try:
        return httpx.get(url, timeout=2).status_code
    except httpx.HTTPError:
        return 0
