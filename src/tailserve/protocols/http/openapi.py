"""The OpenAPI 3.1 document of the worker, built from the same route table the server uses."""

from __future__ import annotations

import re
from typing import Any

from tailserve.protocols.http.routes import ROUTES, Route
from tailserve.version import __version__

_MV_NAMES = ("model", "version")
_ERROR = {
    "type": "object",
    "properties": {"error": {"type": "string"}},
    "required": ["error"],
}
_TENSOR = {
    "type": "object",
    "required": ["name", "datatype", "shape"],
    "properties": {
        "name": {"type": "string"},
        "datatype": {
            "type": "string",
            "enum": [
                "BOOL",
                "INT8",
                "INT16",
                "INT32",
                "INT64",
                "UINT8",
                "UINT16",
                "UINT32",
                "UINT64",
                "FP16",
                "FP32",
                "FP64",
                "BYTES",
            ],
        },
        "shape": {"type": "array", "items": {"type": "integer", "minimum": 0}, "maxItems": 32},
        "data": {"description": "Row-major values, flat or nested; absent for binary data."},
        "parameters": {
            "type": "object",
            "description": "binary_data_size: bytes of this tensor after the JSON header.",
        },
    },
}
_SCHEMAS: dict[str, Any] = {
    "Error": _ERROR,
    "Tensor": _TENSOR,
    "InferenceRequest": {
        "type": "object",
        "required": ["inputs"],
        "properties": {
            "id": {"type": "string"},
            "parameters": {
                "type": "object",
                "description": "binary_data_output: answer every output as binary data; "
                "timeout (µs), priority; cache: use | bypass | refresh.",
            },
            "inputs": {"type": "array", "items": {"$ref": "#/components/schemas/Tensor"}},
            "outputs": {
                "type": "array",
                "items": {
                    "type": "object",
                    "required": ["name"],
                    "properties": {
                        "name": {"type": "string"},
                        "parameters": {"type": "object", "description": "binary_data: bool"},
                    },
                },
            },
        },
    },
    "InferenceResponse": {
        "type": "object",
        "properties": {
            "model_name": {"type": "string"},
            "model_version": {"type": "string"},
            "id": {"type": "string"},
            "parameters": {
                "type": "object",
                "description": "How it was served: model_version, queue_us, compute_us, "
                "batch_size, cost_class; cache (l1, l2, stale, coalesced, precomputed, miss, "
                "bypass, refresh) with cache_computed_at and cache_computed_by on a hit; "
                "variant (models with variants).",
            },
            "outputs": {"type": "array", "items": {"$ref": "#/components/schemas/Tensor"}},
        },
    },
    "Records": {
        "type": "object",
        "required": ["instances"],
        "properties": {"instances": {"type": "array", "items": {"type": "object"}}},
    },
    "IndexRequest": {"type": "object", "properties": {"ready": {"type": "boolean"}}},
    "InvalidateRequest": {
        "type": "object",
        "description": "What to drop: a model (and version), or a key prefix (ts:{model}:v1:...).",
        "properties": {
            "model": {"type": "string"},
            "version": {
                "anyOf": [
                    {"type": "string", "pattern": "^[0-9]+$"},
                    {"type": "integer", "minimum": 0},
                ]
            },
            "prefix": {"type": "string", "pattern": "^ts:"},
        },
        "additionalProperties": False,
        "oneOf": [
            {"required": ["model"], "not": {"required": ["prefix"]}},
            {"required": ["prefix"], "not": {"anyOf": [{"required": [n]} for n in _MV_NAMES]}},
        ],
    },
}
_BODIES = {
    "infer": "InferenceRequest",
    "records": "Records",
    "index": "IndexRequest",
    "invalidate": "InvalidateRequest",
}
_STATUS_TEXT = {
    "400": "Bad input; the message names the field or tensor.",
    "401": "Missing or wrong bearer token.",
    "403": "Admin routes of a worker listening beyond loopback with no admin token set.",
    "404": "Unknown model or version.",
    "409": "The job has finished: there is nothing left to cancel.",
    "413": "Body over the configured limit.",
    "429": "Refused now: its deadline cannot be met, or the queue is full (Retry-After).",
    "503": "Not ready or overloaded (Retry-After).",
    "504": "Its deadline passed while it waited.",
}
# The codes only some routes answer.
_ONLY: dict[str, tuple[str, ...]] = {
    "409": ("cancel_job",),
    "429": ("infer", "predict_v1", "submit_job", "submit_job_v1"),
    "504": ("infer", "predict_v1"),
}


def openapi_document() -> dict[str, Any]:
    paths: dict[str, dict[str, Any]] = {}
    for route in ROUTES:
        paths.setdefault(route.template, {})[route.method.lower()] = _operation(route)
    return {
        "openapi": "3.1.0",
        "info": {"title": "tailserve worker", "version": __version__},
        "paths": paths,
        "components": {
            "schemas": _SCHEMAS,
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
    }


# What each path parameter may hold (a path segment is never empty).
_PATH_SCHEMAS: dict[str, dict[str, Any]] = {
    "model": {"type": "string", "minLength": 1},
    "version": {"type": "string", "pattern": "^[0-9]+$"},
    "job": {"type": "string", "pattern": "^[A-Za-z0-9._-]{1,128}$"},
}
# The options an inference request carries in headers (docs/worker.md).
_INFER_HEADERS: tuple[tuple[str, dict[str, Any]], ...] = (
    ("X-Deadline-Ms", {"type": "number", "exclusiveMinimum": 0}),
    ("X-Priority", {"type": "integer"}),
    ("X-Cache-Mode", {"type": "string", "enum": ["use", "bypass", "refresh"]}),
    ("X-Variant", {"type": "string"}),
    ("Inference-Header-Content-Length", {"type": "integer", "minimum": 1}),
)
# As tailserve.jobs names them (a layer above this one; a test keeps the two in step).
JOB_STATES = ("queued", "running", "succeeded", "failed", "cancelled")
MAX_JOBS_LISTED = 1000
_QUERIES: dict[str, tuple[tuple[str, dict[str, Any]], ...]] = {
    "list_jobs": (
        ("model", {"type": "string"}),
        ("status", {"type": "string", "enum": list(JOB_STATES)}),
        ("limit", {"type": "integer", "minimum": 1, "maximum": MAX_JOBS_LISTED}),
    ),
}


def _operation(route: Route) -> dict[str, Any]:
    parameters: list[dict[str, Any]] = [
        {"name": name, "in": "path", "required": True, "schema": _PATH_SCHEMAS[name]}
        for name in re.findall(r"\{(\w+)\}", route.template)
    ]
    if route.body == "infer":
        parameters += [{"name": n, "in": "header", "schema": s} for n, s in _INFER_HEADERS]
    if route.handler.startswith("submit_job"):
        parameters.append({"name": "X-Webhook-Url", "in": "header", "schema": {"type": "string"}})
    parameters += [
        {"name": n, "in": "query", "schema": s} for n, s in _QUERIES.get(route.handler, ())
    ]
    ok_schema = "InferenceResponse" if route.body == "infer" else None
    ok: dict[str, Any] = {"description": "OK"}
    if ok_schema:
        ok["content"] = {
            "application/json": {"schema": {"$ref": f"#/components/schemas/{ok_schema}"}}
        }
    responses: dict[str, Any] = {"200": ok}
    for code, text in _STATUS_TEXT.items():
        if code in ("401", "403") and not route.admin:
            continue
        if code in _ONLY and route.handler not in _ONLY[code]:
            continue
        responses[code] = {
            "description": text,
            "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}},
        }
    if route.handler == "model_ready":  # not ready: 400 with the same document as 200
        ready = {"type": "object", "properties": {"name": {}, "ready": {"type": "boolean"}}}
        responses["400"]["content"]["application/json"]["schema"] = {
            "anyOf": [ready, {"$ref": "#/components/schemas/Error"}]
        }
    operation: dict[str, Any] = {
        "summary": route.summary,
        "operationId": f"{route.handler}_{route.method.lower()}_{len(route.template.split('/'))}",
        "parameters": parameters,
        "responses": responses,
    }
    if route.body is not None:
        schema = {"$ref": f"#/components/schemas/{_BODIES[route.body]}"}
        content: dict[str, Any] = {"application/json": {"schema": schema}}
        if route.body == "infer":
            content["application/octet-stream"] = {
                "schema": {"type": "string", "format": "binary"},
                "description": "A JSON header of Inference-Header-Content-Length bytes, "
                "then the tensors.",
            }
        operation["requestBody"] = {"required": route.body != "index", "content": content}
    if route.admin:
        operation["security"] = [{"bearer": []}]
    return operation
