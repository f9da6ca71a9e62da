"""The HTTP route table: one list that both the dispatcher and the OpenAPI document read."""

from __future__ import annotations

import re
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class Route:
    method: str
    template: str
    handler: str
    summary: str
    # Requests on this route are counted in the request metrics under this protocol label.
    protocol: str | None = None
    admin: bool = False
    body: str | None = None  # what the request body holds, for the OpenAPI document
    pattern: re.Pattern[str] = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        # "/v2/models/{model}/infer" splits into literals and names, alternately.
        parts = re.split(r"\{(\w+)\}", self.template)
        regex = "".join(
            re.escape(part) if i % 2 == 0 else f"(?P<{part}>[^/]+?)" for i, part in enumerate(parts)
        )
        object.__setattr__(self, "pattern", re.compile(f"^{regex}$"))

    @property
    def static(self) -> bool:
        return "{" not in self.template


_M = "/v2/models/{model}"
_MV = "/v2/models/{model}/versions/{version}"

ROUTES: tuple[Route, ...] = (
    Route("GET", "/v2/health/live", "live", "Liveness: the process answers."),
    Route("GET", "/v2/health/ready", "ready", "Readiness: every model has finished loading."),
    Route("GET", "/v2", "server_metadata", "Server name, version and protocol extensions."),
    Route(
        "POST",
        f"{_M}/infer",
        "infer",
        "Run inference (JSON or binary tensors).",
        "v2",
        body="infer",
    ),
    Route("POST", f"{_MV}/infer", "infer", "Run inference on one version.", "v2", body="infer"),
    Route("GET", _M, "model_metadata", "Model metadata: inputs, outputs, versions."),
    Route("GET", _MV, "model_metadata", "Metadata of one version."),
    Route("GET", f"{_M}/ready", "model_ready", "Model readiness (200 ready, 400 not)."),
    Route("GET", f"{_MV}/ready", "model_ready", "Readiness of one version."),
    Route("GET", "/v2/models/stats", "model_stats", "Statistics of every model."),
    Route("GET", f"{_M}/stats", "model_stats", "Statistics: counts, times, batching, costs."),
    Route("GET", f"{_MV}/stats", "model_stats", "Statistics of one version."),
    Route("GET", f"{_M}/config", "model_config", "The model's configuration (model.yaml)."),
    Route("GET", f"{_MV}/config", "model_config", "Configuration of one version."),
    Route(
        "POST",
        "/v2/repository/index",
        "repository_index",
        "Models in the repository and their state.",
        admin=True,
        body="index",
    ),
    Route(
        "POST",
        "/v2/repository/models/{model}/load",
        "load_model",
        "Load or reload a model from the repository.",
        admin=True,
    ),
    Route(
        "POST",
        "/v2/repository/models/{model}/unload",
        "unload_model",
        "Unload a model (requests in flight finish).",
        admin=True,
    ),
    Route(
        "POST",
        "/v2/cache/invalidate",
        "invalidate",
        "Drop cached results by model, version or key prefix, on every worker.",
        admin=True,
        body="invalidate",
    ),
    Route(
        "POST",
        "/v1/models/{model}:predict",
        "predict_v1",
        "KServe v1 records: {instances: [...]}.",
        "v1",
        body="records",
    ),
    Route("GET", "/v1/models/{model}", "model_status_v1", "KServe v1 model status."),
    Route(
        "POST",
        f"{_M}/jobs",
        "submit_job",
        "Submit a job: the inference runs later; 202, its id and a Location.",
        "jobs",
        body="infer",
    ),
    Route(
        "POST", f"{_MV}/jobs", "submit_job", "Submit a job to one version.", "jobs", body="infer"
    ),
    Route(
        "POST",
        "/v1/models/{model}/jobs",
        "submit_job_v1",
        "Submit a job of KServe v1 records: {instances: [...]}.",
        "jobs",
        body="records",
    ),
    Route("GET", "/v2/jobs", "list_jobs", "List jobs: ?model=&status=&limit= (newest first)."),
    Route("GET", "/v2/jobs/{job}", "get_job", "A job's status, timings, and result or error."),
    Route("DELETE", "/v2/jobs/{job}", "cancel_job", "Cancel a job that has not finished."),
    Route("GET", "/metrics", "metrics", "Prometheus metrics."),
    Route("GET", "/openapi.json", "openapi", "This document."),
)


class Router:
    def __init__(self, routes: tuple[Route, ...] = ROUTES) -> None:
        self._static = {(r.method, r.template): r for r in routes if r.static}
        self._dynamic = [r for r in routes if not r.static]
        self._paths = {r.template for r in routes if r.static}
        # Paths with parameters matched before (a model's infer path, over and over): the
        # route and its parameters, up to _SEEN entries (a client could send endless paths).
        self._seen: dict[tuple[str, str], tuple[Route, dict[str, str]]] = {}

    @property
    def remembered(self) -> int:
        """Paths with parameters matched and kept for next time (no more than _SEEN)."""
        return len(self._seen)

    def match(self, method: str, path: str) -> tuple[Route | None, dict[str, str], bool]:
        """The route, its path parameters (the caller's to read, not to change), and whether
        the path exists under another method."""
        route = self._static.get((method, path))
        if route is not None:
            return route, {}, True
        seen = self._seen.get((method, path))
        if seen is not None:
            return seen[0], seen[1], True
        path_known = path in self._paths
        for route in self._dynamic:
            found = route.pattern.match(path)
            if found is not None:
                if route.method == method:
                    params = found.groupdict()
                    if len(self._seen) < _SEEN:
                        self._seen[(method, path)] = (route, params)
                    return route, params, True
                path_known = True
        return None, {}, path_known

    def allowed(self, path: str) -> str:
        """The methods ``path`` answers, for the Allow header of a 405 (RFC 9110 15.5.6)."""
        matching = [r for r in self._static.values() if r.template == path]
        matching += [r for r in self._dynamic if r.pattern.match(path)]
        # Those of the most specific template: /v1/models/m:predict is the predict route's
        # path (it matches /v1/models/{model} too, with the model named "m:predict").
        best = max((_literal_length(r) for r in matching), default=0)
        return ", ".join(sorted({r.method for r in matching if _literal_length(r) == best}))


def _literal_length(route: Route) -> int:
    return len(re.sub(r"\{\w+\}", "", route.template))


_SEEN = 4096
