"""KServe v1 records for tabular models: ``{"instances": [{field: value}, ...]}``.

Each record is one row; each declared input is one field. The rows become one column tensor per
input with the model's declared datatype, so the same validation and batching apply as for v2.
"""

from __future__ import annotations

from typing import Any

import orjson

from tailserve.engine.messages import InferRequest, InferResponse
from tailserve.errors import InvalidInput, shown
from tailserve.modelconfig import ModelConfig
from tailserve.tensors import Tensor, from_json, to_json_data


def decode_records(model: str, config: ModelConfig, body: bytes) -> InferRequest:
    try:
        document = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise InvalidInput(f"request body is not valid JSON: {exc}") from None
    if not isinstance(document, dict) or "instances" not in document:
        raise InvalidInput('request body must be an object with an "instances" list')
    instances = document["instances"]
    if not isinstance(instances, list) or not instances:
        raise InvalidInput('"instances" must be a non-empty list of records')
    names = [spec.name for spec in config.inputs]
    known = set(names)
    columns: dict[str, list[Any]] = {name: [] for name in names}
    for index, record in enumerate(instances):
        if not isinstance(record, dict):
            raise InvalidInput(f"instances[{index}] must be an object of field values")
        for name in names:
            try:
                columns[name].append(record[name])
            except KeyError:
                raise InvalidInput(f"instances[{index}]: missing field {name!r}") from None
        if len(record) != len(names):
            extra = sorted(set(record) - known)
            raise InvalidInput(f"instances[{index}]: unknown field {shown(extra[0])}")
    rows = len(instances)
    inputs = []
    for spec in config.inputs:
        shape = [rows, *spec.shape] if config.batched else list(spec.shape)
        if any(d == -1 for d in shape):
            raise InvalidInput(f"input {spec.name!r} has a variable shape: use the v2 protocol")
        data = from_json(spec.name, spec.datatype, shape, columns[spec.name])
        inputs.append(Tensor(spec.name, spec.datatype, data))
    return InferRequest(model=model, inputs=inputs)


def encode_predictions(response: InferResponse) -> bytes:
    """One prediction per row: a scalar for a one-value output, else a list, else a record."""
    per_output = [_rows(tensor) for tensor in response.outputs]
    if len(per_output) == 1:
        predictions = per_output[0]
    else:
        names = [tensor.name for tensor in response.outputs]
        predictions = [dict(zip(names, row, strict=True)) for row in zip(*per_output, strict=True)]
    return orjson.dumps({"predictions": predictions}, option=orjson.OPT_SERIALIZE_NUMPY)


def _rows(tensor: Tensor) -> list[Any]:
    data = tensor.data
    rows = len(data) if data.ndim else 1
    flat: Any = to_json_data(data)
    values = flat.tolist() if hasattr(flat, "tolist") else flat
    width = len(values) // rows if rows else 0
    if width == 1:
        return list(values)
    return [values[i * width : (i + 1) * width] for i in range(rows)]
