"""Request bodies for a workload, built before the timed run so generation costs nothing then.

Each field gets a generator: named in the workload (``{int: [1, 120]}``, ``{uniform: [0, 1]}``,
``{normal: [mu, sigma]}``, ``{lognormal: [mu, sigma]}``, ``{choice: [a, b], weights: [3, 1]}``,
``{constant: v}``, ``{zipf: [size, s]}`` for ids 0..size-1 with 0 the most popular, optional
``clip: [lo, hi]``), or else derived from the model's configuration (its ranges and allowed
values), so any tailserve model can be driven without writing one.

A model that fills inputs from the feature store (``features:`` in its configuration) is sent
the entity ids instead: one for a ``shape: [1]`` entity (e.g. ``user_id``), one a row for a
``shape: [-1]`` one (e.g. the candidate ``item_ids``).

A *key* names one request's inputs. ``unique`` gives every request its own key; ``uniform`` and
``zipf`` draw keys from ``size`` of them, so repeated inputs (cache hits) come as often as they
would with that popularity.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import orjson

from tailserve.errors import ConfigError
from tailserve.loadgen.workload import Workload
from tailserve.tensors import numpy_dtype, to_binary

Generator = Callable[[np.random.Generator, int], np.ndarray[Any, Any]]


@dataclass(frozen=True, slots=True)
class Field:
    name: str
    datatype: str
    row_shape: tuple[int, ...]  # -1: a variable dimension, its length drawn per request
    draw: Generator
    length: Generator | None = None
    # One value a request whatever its rows (a feature-store entity of shape [1]).
    per_request: bool = False

    def shape(self, length: int) -> tuple[int, ...]:
        return tuple(length if d == -1 else d for d in self.row_shape)


@dataclass(frozen=True, slots=True)
class Prepared:
    """One request ready to send: its class, key, path, body and extra headers."""

    cls: int
    key: int
    body: bytes
    headers: tuple[tuple[str, str], ...]
    path: str


def fields_for(model_config: dict[str, Any], overrides: dict[str, dict[str, Any]]) -> list[Field]:
    """Fields from the model's configuration (``GET /v2/models/{m}/config``) and overrides."""
    fields = []
    known = set()
    for spec, per_request in _request_inputs(model_config):
        name = spec["name"]
        known.add(name)
        rule = dict(overrides.get(name) or _auto_rule(spec))
        length_rule = rule.pop("length", None)
        length = None
        if length_rule is not None:
            if -1 not in spec["shape"]:
                raise ConfigError(f"workload field {name!r}: 'length' needs a variable dimension")
            length = _generator(f"{name}.length", {"datatype": "INT64"}, length_rule)
        # A variable dimension with no length rule: 8 long.
        row_shape = tuple(d if d > 0 or length is not None else 8 for d in spec["shape"])
        draw = _generator(name, spec, rule)
        fields.append(Field(name, spec["datatype"], row_shape, draw, length, per_request))
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise ConfigError(f"workload field {unknown[0]!r} is not an input of the model")
    return fields


def _request_inputs(model_config: dict[str, Any]) -> list[tuple[dict[str, Any], bool]]:
    """The tensors a request sends, and whether each is one a request: the model's inputs,
    with those the feature store fills replaced by the ids they are looked up by."""
    features = model_config.get("features") or {}
    by_input = {item["input"]: item for item in features.get("inputs") or []}
    tensors = []
    for spec in model_config["inputs"]:
        looked_up = by_input.get(spec["name"])
        if looked_up is None:
            tensors.append((spec, False))
            continue
        datatype = looked_up.get("datatype", "INT64")
        per_request = list(looked_up.get("shape", [1])) == [1]
        tensors.append(
            ({"name": looked_up["key"], "datatype": datatype, "shape": [1]}, per_request)
        )
    return tensors


def _auto_rule(spec: dict[str, Any]) -> dict[str, Any]:
    if spec.get("values"):
        return {"choice": list(spec["values"])}
    kind = numpy_dtype(spec["datatype"]).kind
    low, high = spec.get("range") or ((0, 100) if kind in "iu" else (0.0, 1.0))
    if kind in "iu":
        return {"int": [int(np.ceil(low)), int(np.floor(high))]}
    if kind == "b":
        return {"choice": [True, False]}
    if kind == "O":
        return {"choice": ["sample"]}
    return {"uniform": [float(low), float(high)]}


def _generator(name: str, spec: dict[str, Any], rule: dict[str, Any]) -> Generator:
    dtype = numpy_dtype(spec["datatype"])
    clip = rule.get("clip")

    def finish(values: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
        if clip is not None:
            values = np.clip(values, clip[0], clip[1])
        if dtype.kind in "iu":
            # (a choice of numbers comes as an object array, which rint cannot round)
            values = np.rint(values.astype(np.float64))
        return values.astype(dtype) if dtype.kind != "O" else values

    if "int" in rule:
        lo, hi = rule["int"]
        return lambda rng, n: finish(rng.integers(lo, hi + 1, size=n))
    if "uniform" in rule:
        lo, hi = rule["uniform"]
        return lambda rng, n: finish(rng.uniform(lo, hi, size=n))
    if "normal" in rule:
        mu, sigma = rule["normal"]
        return lambda rng, n: finish(rng.normal(mu, sigma, size=n))
    if "lognormal" in rule:
        mu, sigma = rule["lognormal"]
        return lambda rng, n: finish(rng.lognormal(mu, sigma, size=n))
    if "choice" in rule:
        options = np.array(rule["choice"], dtype=object)
        weights = rule.get("weights")
        p = None if weights is None else np.asarray(weights, dtype=float) / sum(weights)
        return lambda rng, n: finish(options[rng.choice(len(options), size=n, p=p)])
    if "constant" in rule:
        value = rule["constant"]
        return lambda rng, n: finish(np.full(n, value, dtype=object))
    if "zipf" in rule:
        size, s = rule["zipf"]
        cumulative = np.cumsum(np.arange(1, int(size) + 1, dtype=float) ** -float(s))
        cumulative /= cumulative[-1]
        return lambda rng, n: finish(
            np.minimum(np.searchsorted(cumulative, rng.random(n), side="right"), int(size) - 1)
        )
    raise ConfigError(f"workload field {name!r}: unknown generator {sorted(rule)}")


def draw_keys(workload: Workload, count: int, rng: np.random.Generator) -> np.ndarray[Any, Any]:
    keys = workload.keys
    if keys.space == "unique":
        # Keys of their own per seed: the steps of a search never repeat each other's inputs.
        base = 0 if workload.input_seed in (None, workload.seed) else (workload.seed & 0xFFFF) << 32
        return np.arange(count, dtype=np.int64) + base
    if keys.space == "uniform":
        return rng.integers(0, keys.size, size=count)
    ranks = np.arange(1, keys.size + 1, dtype=float)
    weights = ranks ** (-keys.s)
    return rng.choice(keys.size, size=count, p=weights / weights.sum())


def prepare(workload: Workload, fields: Sequence[Field], count: int) -> list[Prepared]:
    """``count`` requests in send order: classes by weight, keys by the key space."""
    rng = np.random.default_rng(workload.seed)
    weights = np.array([c.weight for c in workload.classes], dtype=float)
    classes = rng.choice(len(weights), size=count, p=weights / weights.sum())
    keys = draw_keys(workload, count, rng)
    headers = _option_headers(workload)
    encoded: dict[tuple[int, int], tuple[bytes, int | None]] = {}
    input_seed = workload.input_seed if workload.input_seed is not None else workload.seed
    for cls_index, cls in enumerate(workload.classes):
        wanted = sorted({int(k) for k, c in zip(keys, classes, strict=True) if c == cls_index})
        if not wanted:
            continue
        # A key's rows depend on the key alone (its chunk of one vectorised draw per field):
        # the same key gives the same inputs in every run and step, different keys different.
        slots = {
            f.name: _Slots(f, [input_seed, cls_index, i], wanted, cls.rows)
            for i, f in enumerate(fields)
        }
        for key in wanted:
            rows = {f.name: slots[f.name].take(key) for f in fields}
            encoded[(cls_index, key)] = _encode(workload, fields, rows, cls.rows)
    plan = []
    path = request_path(workload)
    for cls_index, key in zip(classes.tolist(), keys.tolist(), strict=True):
        body, header_length = encoded[(cls_index, key)]
        extra = headers
        if header_length is not None:
            extra = (*headers, ("Inference-Header-Content-Length", str(header_length)))
        plan.append(Prepared(cls_index, key, body, extra, path))
    return plan


_CHUNK_BITS = 12  # keys are drawn in chunks of 4,096


class _Slots:
    """One field's values for the wanted keys of a class: drawn a chunk of keys at a time,
    each chunk from its own seed, so a key's values do not depend on which others are wanted."""

    def __init__(self, field: Field, seed: list[int], keys: Sequence[int], rows: int) -> None:
        self.field = field
        self.rows = rows = 1 if field.per_request else rows
        self._chunks: dict[int, tuple[Any, Any, Any]] = {}
        size = 1 << _CHUNK_BITS
        fixed = int(np.prod([d for d in field.row_shape if d != -1]))
        for chunk in sorted({key >> _CHUNK_BITS for key in keys}):
            rng = np.random.default_rng([*seed, chunk])
            if field.length is None:
                lengths = np.ones(size, dtype=np.int64)
            else:
                lengths = np.maximum(1, field.length(rng, size).astype(np.int64))
            offsets = np.concatenate([[0], np.cumsum(rows * fixed * lengths)])
            self._chunks[chunk] = (lengths, offsets, field.draw(rng, int(offsets[-1])))

    def take(self, key: int) -> Any:
        lengths, offsets, values = self._chunks[key >> _CHUNK_BITS]
        slot = key & ((1 << _CHUNK_BITS) - 1)
        start, end = int(offsets[slot]), int(offsets[slot + 1])
        return values[start:end].reshape(self.rows, *self.field.shape(int(lengths[slot])))


def _option_headers(workload: Workload) -> tuple[tuple[str, str], ...]:
    options = workload.options
    binary = workload.protocol == "v2-binary"
    headers = {"Content-Type": "application/octet-stream" if binary else "application/json"}
    headers.update(options.headers)
    if options.deadline_ms is not None:
        headers["X-Deadline-Ms"] = f"{options.deadline_ms:g}"
    if workload.protocol == "v1-records":
        if options.priority is not None:
            headers["X-Priority"] = str(options.priority)
        if options.cache is not None:
            headers["X-Cache-Mode"] = options.cache
    return tuple(headers.items())


def _parameters(workload: Workload) -> dict[str, Any]:
    options = workload.options
    parameters: dict[str, Any] = {}
    if options.priority is not None:
        parameters["priority"] = options.priority
    if options.cache is not None:
        parameters["cache"] = options.cache
    return parameters


def _encode(
    workload: Workload, fields: Sequence[Field], rows: dict[str, Any], count: int
) -> tuple[bytes, int | None]:
    """The body, and the length of its JSON header when binary tensors follow it."""
    if workload.protocol == "v1-records":
        columns = {name: values.reshape(count, -1).tolist() for name, values in rows.items()}
        instances = [
            {name: (col[i][0] if len(col[i]) == 1 else col[i]) for name, col in columns.items()}
            for i in range(count)
        ]
        return orjson.dumps({"instances": instances}), None
    parameters = _parameters(workload)
    if workload.over_grpc:
        return _grpc_body(workload, fields, rows, parameters), None
    if workload.protocol == "v2-json":
        inputs = [
            {
                "name": f.name,
                "datatype": f.datatype,
                "shape": list(rows[f.name].shape),
                "data": rows[f.name].reshape(-1).tolist(),
            }
            for f in fields
        ]
        document: dict[str, Any] = {"inputs": inputs}
        if parameters:
            document["parameters"] = parameters
        return orjson.dumps(document), None
    raws = [to_binary(rows[f.name]) for f in fields]
    inputs = [
        {
            "name": f.name,
            "datatype": f.datatype,
            "shape": list(rows[f.name].shape),
            "parameters": {"binary_data_size": len(raw)},
        }
        for f, raw in zip(fields, raws, strict=True)
    ]
    header: dict[str, Any] = {
        "inputs": inputs,
        **({"parameters": parameters} if parameters else {}),
    }
    head = orjson.dumps(header)
    return b"".join([head, *raws]), len(head)


def _grpc_body(
    workload: Workload, fields: Sequence[Field], rows: dict[str, Any], parameters: dict[str, Any]
) -> bytes:
    """A serialized ``ModelInferRequest``, the inputs raw as the binary extension has them."""
    from tailserve.protocols.grpc import schema
    from tailserve.protocols.grpc.common import set_parameter

    message = schema.ModelInferRequest(
        model_name=workload.model, model_version=workload.version or ""
    )
    for f in fields:
        values = rows[f.name]
        message.inputs.add(name=f.name, datatype=f.datatype, shape=list(values.shape))
        message.raw_input_contents.append(to_binary(values))
    deadline_ms = workload.options.deadline_ms
    if workload.protocol == "grpc-stream" and deadline_ms is not None:
        # A stream's requests have no gRPC deadline of their own: Triton's ``timeout`` (µs).
        parameters = {**parameters, "timeout": round(deadline_ms * 1000)}
    for key, value in parameters.items():
        set_parameter(message.parameters[key], value)
    data: bytes = message.SerializeToString()
    return data


def request_path(workload: Workload) -> str:
    if workload.protocol == "v1-records":
        return f"/v1/models/{workload.model}:predict"
    if workload.version is not None:
        return f"/v2/models/{workload.model}/versions/{workload.version}/infer"
    return f"/v2/models/{workload.model}/infer"
