"""The OpenAPI 3.1 document of the worker, built from the same route table the server uses."""

from __future__ import annotations

from typing import Any

from tailserve.protocols.http.routes import ROUTES, Route
from tailserve.version import __version__

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
        "shape": {"type": "array", "items": {"type": "integer"}},
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
            "version": {"type": "string"},
            "prefix": {"type": "string"},
        },
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
    "413": "Body over the configured limit.",
    "503": "Not ready or overloaded (Retry-After).",
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


def _operation(route: Route) -> dict[str, Any]:
    parameters = [
        {"name": name, "in": "path", "required": True, "schema": {"type": "string"}}
        for name in ("model", "version")
        if "{" + name + "}" in route.template
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
        responses[code] = {
            "description": text,
            "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}},
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
