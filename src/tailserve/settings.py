"""One settings object, read once at start-up and passed down.

Sources, later ones winning: the defaults below, a YAML file (``--config``), environment
variables ``TAILSERVE_<FIELD>`` (``TAILSERVE_HTTP_PORT=9000``), then command-line flags.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import msgspec
import yaml

from tailserve.errors import ConfigError

ENV_PREFIX = "TAILSERVE_"
# What --log-level takes, for `tailserve serve` and `tailserve up` alike (up passes its own on).
LOG_LEVELS = ("debug", "info", "warning", "error")


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Settings:
    repository: str | None = None
    # Loopback unless asked for another address; beyond it the admin routes need a token
    # (transport/admin_access.py).
    host: str = "127.0.0.1"
    http_port: int = 8000
    grpc_port: int = 8001
    redis_url: str | None = None
    # The Redis URL names one node of a Redis Cluster (keys carry hash tags per model).
    redis_cluster: bool = False
    # The most a result cache lookup waits for Redis before counting it a miss.
    cache_l2_budget_ms: float = 5.0
    # The cache's hot path (MGET, SET pipeline) on a single Redis: "lean" (one pipelined
    # connection, hiredis-packed) or "redis-py" (the standard client, as tutorials use it).
    redis_client: str = "lean"
    # Redis AUTH and TLS, apart from the URL (docs/security.md): the password (better given as
    # TAILSERVE_REDIS_PASSWORD or a file than in a URL on the command line, where `ps` shows
    # it), and for a rediss:// URL the CA that signed the server's certificate and a client
    # certificate and key.
    redis_password: str | None = None
    redis_password_file: str | None = None
    redis_tls_ca_file: str | None = None
    redis_tls_cert_file: str | None = None
    redis_tls_key_file: str | None = None
    # The reply memo (cache/replies.py): encoded replies of L1 hits, reused for a request of
    # the same bytes while L1 still serves the entry they came from. 0: off.
    reply_memo_mb: float = 64.0
    # How this worker signs what it computes (cache lineage); default host:pid.
    worker_id: str | None = None
    # Admin routes (repository load/unload/index) need this bearer token when it is set.
    admin_token: str | None = None
    max_body_bytes: int = 64 * 1024 * 1024
    # An idle kept-alive connection closes after this long; a request whose head is not whole
    # this long after its first byte, or whose body stops coming for this long, gets a 408.
    keep_alive_s: float = 5.0
    read_timeout_s: float = 30.0
    # A request's line and headers must all arrive within this long of its first byte (a
    # slowloris client trickling headers holds a connection no longer than this).
    head_timeout_s: float = 10.0
    # SIGTERM: stop accepting, let requests in flight finish for up to this long, exit 0.
    drain_timeout_s: float = 30.0
    # Strict: a model that failed to load keeps the whole server unready (one the worker is
    # not set up to serve, a feature store with no Redis, did not fail).
    strict_readiness: bool = False
    log_level: str = "info"
    access_log: bool = False
    # Log sampled inference requests to this JSON-lines file, for `tailserve bench` to replay.
    trace_file: str | None = None
    trace_sample: float = 1.0
    # OpenTelemetry traces over OTLP/HTTP to this endpoint (else OTEL_EXPORTER_OTLP_ENDPOINT;
    # neither: no tracing), for this share of the requests that come with no sampled parent.
    otel_endpoint: str | None = None
    otel_sample: float = 0.01
    backlog: int = 2048
    # How long the event loop may hold the GIL while an instance thread waits for it
    # (sys.setswitchinterval; Python's default is 5 ms). A model thread needs the GIL only
    # briefly, to take its batch and hand the results back, but with the loop busy it waited
    # up to the whole interval each time: churn's batch p99 was 6-7 ms for a 0.4 ms p50.
    # 0 keeps the interpreter's own.
    gil_switch_interval_ms: float = 0.5
    # Full garbage collections (which stop the event loop while they walk everything the
    # worker holds, a result cache most of all) run this often from the event loop, not when
    # the interpreter's counters say (every few seconds under load; process/collector.py).
    # 0 leaves them to the interpreter.
    gc_full_interval_s: float = 30.0
    # Jobs this worker runs at once (0: it takes none, though it still accepts them), and how
    # long a job it holds and stops renewing waits before another worker may take it (Redis).
    jobs_concurrency: int = 4
    jobs_visibility_timeout_s: float = 30.0
    # The memory the worker's models may hold together, in MiB (0: no budget, every model
    # loads at start). Under it the least recently used models unload and load again on demand
    # (repository/manager.py); the pinned ones (comma-separated names) never unload.
    model_memory_mb: float = 0.0
    pinned_models: str = ""
    # Which loaded model makes room under the budget: the least recently used, or the least
    # recent traffic (repository/residency.py).
    model_eviction: str = "lru"
    # A test-only fault (the router benchmark's slow replica): this fraction of the inference
    # requests take fault_slow_factor times as long. 0: off.
    fault_slow_fraction: float = 0.0
    fault_slow_factor: float = 20.0

    def replace(self, **changes: Any) -> Settings:
        return dataclasses.replace(self, **changes)

    def pinned(self) -> tuple[str, ...]:
        """The models named in ``pinned_models``."""
        return tuple(name.strip() for name in self.pinned_models.split(",") if name.strip())


FIELDS = {f.name for f in dataclasses.fields(Settings)}


def load_settings(
    *,
    config_file: Path | None = None,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> Settings:
    merged: dict[str, Any] = {}
    if config_file is not None:
        merged.update(_from_file(config_file))
    for key, value in (env or {}).items():
        if key.startswith(ENV_PREFIX):
            name = key[len(ENV_PREFIX) :].lower()
            if name in FIELDS:
                merged[name] = value
    merged.update({k: v for k, v in (overrides or {}).items() if v is not None})
    try:
        settings = msgspec.convert(merged, Settings, strict=False)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"invalid setting: {exc}") from None
    if settings.model_memory_mb < 0:
        raise ConfigError(
            f"invalid setting: model_memory_mb must be at least 0 (0: no budget), not "
            f"{settings.model_memory_mb}"
        )
    if settings.model_eviction not in ("traffic", "lru"):
        raise ConfigError(
            f"invalid setting: model_eviction must be traffic or lru, not "
            f"{settings.model_eviction!r}"
        )
    level = settings.log_level.lower()
    if level not in LOG_LEVELS:
        raise ConfigError(
            f"invalid setting: log_level must be one of {', '.join(LOG_LEVELS)}, "
            f"not {settings.log_level!r}"
        )
    return settings.replace(log_level=level)


def _from_file(path: Path) -> dict[str, Any]:
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"{path}: cannot read settings: {exc}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: settings must be a mapping")
    unknown = sorted(set(raw) - FIELDS)
    if unknown:
        raise ConfigError(f"{path}: unknown setting {unknown[0]!r} (known: {sorted(FIELDS)})")
    return {str(k): v for k, v in raw.items()}
