"""Redis AUTH and TLS against real redis-servers (one with ``--requirepass``, one serving TLS
only and asking clients for a certificate), used by a real worker for its L2 cache and its
job store (the feature store connects through the same `Worker._redis_client`); and no secret
in the logs of that run, nor in the argv `tailserve up` gives its workers."""

from __future__ import annotations

import argparse
import logging
import shutil
import socket
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import redis

from support.models import doubler_config, write_model
from support.servers import free_port, run_worker, stop_redis, wait_for
from tailserve.assembly.up import worker_args
from tailserve.settings import Settings

PASSWORD = "redis-pass-5ecret"
TOKEN = "admin-token-5ecret"
ONE = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 1], "data": [1.0]}]}


@dataclass
class Redis:
    port: int
    files: dict[str, Path]


def _answers(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False


def _redis(port: int, workdir: Path, *extra: str) -> subprocess.Popen[bytes]:
    binary = shutil.which("redis-server")
    assert binary is not None, "the Redis tests need redis-server on PATH"
    command = [binary, "--bind", "127.0.0.1", "--save", "", "--dir", str(workdir), *extra]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_for(lambda: process.poll() is not None or _answers(port), what="redis-server")
    assert process.poll() is None, f"redis-server exited with {process.returncode}"
    return process


@pytest.fixture(scope="module")
def with_password(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Redis]:
    workdir = tmp_path_factory.mktemp("redis-auth")
    port = free_port()
    process = _redis(port, workdir, "--port", str(port), "--requirepass", PASSWORD)
    try:
        yield Redis(port, {})
    finally:
        stop_redis(process)


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True)


@pytest.fixture(scope="module")
def with_tls(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Redis]:
    """redis-server on TLS only, with a CA of the test's own that signed its certificate and
    the client's; it refuses a client without one (tls-auth-clients)."""
    d = tmp_path_factory.mktemp("redis-tls")
    files = {name: d / f"{name}.pem" for name in ("ca", "ca_key", "server", "server_key")}
    files |= {"client": d / "client.pem", "client_key": d / "client_key.pem"}
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=t-ca",
             "-keyout", str(files["ca_key"]), "-out", str(files["ca"]))  # fmt: skip
    for who in ("server", "client"):
        csr = d / f"{who}.csr"
        _openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={who}",
                 "-keyout", str(files[f"{who}_key"]), "-out", str(csr))  # fmt: skip
        ext = d / f"{who}.ext"
        ext.write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n", encoding="utf-8")
        _openssl("x509", "-req", "-in", str(csr), "-CA", str(files["ca"]), "-CAkey",
                 str(files["ca_key"]), "-CAcreateserial", "-days", "1", "-extfile", str(ext),
                 "-out", str(files[who]))  # fmt: skip
    port = free_port()
    process = _redis(
        port, d, "--port", "0", "--tls-port", str(port),
        "--tls-cert-file", str(files["server"]), "--tls-key-file", str(files["server_key"]),
        "--tls-ca-cert-file", str(files["ca"]), "--tls-auth-clients", "yes",
    )  # fmt: skip
    try:
        yield Redis(port, files)
    finally:
        stop_redis(process)


@pytest.fixture(scope="module")
def repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    repo = tmp_path_factory.mktemp("repo")
    write_model(repo, "m", doubler_config(cache={"enabled": True}))
    return repo


def _serves_from_redis(url: str, client: redis.Redis) -> None:
    """Two inferences (the first's result reaches L2) and a job, all through Redis."""
    client.flushall()
    assert httpx.post(f"{url}/v2/models/m/infer", json=ONE).status_code == 200
    wait_for(lambda: client.dbsize() > 0, timeout=10, what="the result in the L2 cache")
    reply = httpx.post(f"{url}/v2/models/m/jobs", json=ONE)
    assert reply.status_code == 202, reply.text
    job = httpx.get(f"{url}{reply.headers['location']}")

    def done() -> bool:
        nonlocal job
        job = httpx.get(f"{url}{reply.headers['location']}")
        return job.json()["status"] in ("succeeded", "failed")

    wait_for(done, timeout=20, what="the job to finish")
    assert job.json()["status"] == "succeeded", job.text
    job_id = job.json()["id"]
    assert client.exists(f"{{tailserve:jobs}}:job:{job_id}")  # kept in this Redis


def test_redis_auth_with_the_password_from_a_file_and_no_secret_in_the_logs(
    with_password: Redis, repository: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with pytest.raises(redis.AuthenticationError):
        redis.Redis(port=with_password.port).ping()  # the server really wants the password
    secret = tmp_path / "redis.password"
    secret.write_text(PASSWORD + "\n", encoding="utf-8")
    caplog.set_level(logging.DEBUG)
    settings = Settings(
        repository=str(repository),
        redis_url=f"redis://127.0.0.1:{with_password.port}/0",
        redis_password_file=str(secret),
        admin_token=TOKEN,
        access_log=True,
    )
    client = redis.Redis(port=with_password.port, password=PASSWORD)
    with run_worker(settings) as running:
        _serves_from_redis(running.url, client)
        bad = httpx.post(
            f"{running.url}/v2/repository/index", headers={"Authorization": "Bearer wrong-5ecret"}
        )
        assert bad.status_code == 401 and "5ecret" not in bad.text
        good = httpx.post(
            f"{running.url}/v2/repository/index", headers={"Authorization": f"Bearer {TOKEN}"}
        )
        assert good.status_code == 200
    logged = "\n".join(r.getMessage() for r in caplog.records if r.name.startswith("tailserve"))
    assert "POST /v2/repository/index" in logged  # the access log was on
    for secret_text in (PASSWORD, TOKEN, "wrong-5ecret", "Bearer"):
        assert secret_text not in logged


def test_redis_auth_with_the_password_in_the_url(with_password: Redis, repository: Path) -> None:
    settings = Settings(
        repository=str(repository),
        redis_url=f"redis://:{PASSWORD}@127.0.0.1:{with_password.port}",
        redis_client="redis-py",
    )
    with run_worker(settings) as running:
        _serves_from_redis(running.url, redis.Redis(port=with_password.port, password=PASSWORD))


def test_redis_over_tls_with_a_client_certificate(with_tls: Redis, repository: Path) -> None:
    files = with_tls.files
    client = redis.Redis(
        port=with_tls.port,
        ssl=True,
        ssl_ca_certs=str(files["ca"]),
        ssl_certfile=str(files["client"]),
        ssl_keyfile=str(files["client_key"]),
    )
    settings = Settings(
        repository=str(repository),
        redis_url=f"rediss://127.0.0.1:{with_tls.port}",
        redis_tls_ca_file=str(files["ca"]),
        redis_tls_cert_file=str(files["client"]),
        redis_tls_key_file=str(files["client_key"]),
    )
    with run_worker(settings) as running:
        _serves_from_redis(running.url, client)


def test_up_gives_its_workers_the_redis_password_by_the_environment_not_argv() -> None:
    args = argparse.Namespace(
        redis_url=f"redis://:{PASSWORD}@cache:6379/0",
        redis_cluster=False,
        redis_password_file="/run/secrets/redis",
        redis_tls_ca_file=None,
        redis_tls_cert_file=None,
        redis_tls_key_file=None,
        jobs_concurrency=None,
        jobs_visibility_timeout_s=None,
        model_memory_mb=None,
        pinned_models=None,
        model_eviction=None,
        otel_endpoint=None,
        otel_sample=None,
    )
    argv = worker_args(args)
    assert PASSWORD not in " ".join(argv)
    assert argv[:2] == ["--redis-url", "redis://cache:6379/0"]
    assert argv[2:] == ["--redis-password-file", "/run/secrets/redis"]
