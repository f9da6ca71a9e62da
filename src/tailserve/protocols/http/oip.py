"""Open Inference Protocol v2 bodies over HTTP: JSON, and the binary tensor extension.

With the extension, the body is a JSON header of ``Inference-Header-Content-Length`` bytes
followed by the raw data of every tensor whose parameters carry ``binary_data_size``, in order.
Outputs go back binary when the request asks (``binary_data`` on a requested output, or
``binary_data_output`` on the request, which is what tritonclient sends when it names none).
"""

from __future__ import annotations

from typing import Any

import msgspec
import orjson

from tailserve.engine.messages import InferRequest, InferResponse, RequestedOutput
from tailserve.errors import InvalidInput, field_message, shown
from tailserve.tensors import Tensor, from_binary, from_json, to_binary, to_json_data


class _Input(msgspec.Struct):
    name: str
    shape: list[int]
    datatype: str
    data: Any = None
    parameters: dict[str, Any] | None = None


class Output(msgspec.Struct):
    name: str
    parameters: dict[str, Any] | None = None


class _Request(msgspec.Struct):
    inputs: list[_Input]
    id: str | None = None
    outputs: list[Output] | None = None
    parameters: dict[str, Any] | None = None


_decoder = msgspec.json.Decoder(_Request)
_ORJSON_OPTIONS = orjson.OPT_SERIALIZE_NUMPY


def decode_request(
    model: str, version: str | None, body: bytes, header_length: int | None
) -> InferRequest:
    if header_length is None:
        header, binary = body, memoryview(b"")
    else:
        if not 0 < header_length <= len(body):
            raise InvalidInput(
                f"Inference-Header-Content-Length {header_length} does not fit a body of "
                f"{len(body)} bytes"
            )
        header, binary = body[:header_length], memoryview(body)[header_length:]
    raw = read_header(header)
    inputs = []
    offset = 0
    for item in raw.inputs:
        parameters = item.parameters or {}
        size = parameters.get("binary_data_size")
        if size is None:
            data = from_json(item.name, item.datatype, item.shape, item.data)
        else:
            if not isinstance(size, int) or isinstance(size, bool):
                raise InvalidInput(
                    f"tensor {item.name!r}: binary_data_size must be a whole number of bytes, "
                    f"not {shown(size)}"
                )
            if size < 0 or offset + size > len(binary):
                raise InvalidInput(
                    f"tensor {item.name!r}: binary_data_size {size} runs past the binary data "
                    f"({len(binary) - offset} bytes left)"
                )
            data = from_binary(item.name, item.datatype, item.shape, binary[offset : offset + size])
            offset += size
        inputs.append(Tensor(item.name, item.datatype, data, parameters))
    if offset != len(binary):
        raise InvalidInput(
            f"{len(binary) - offset} bytes of binary data follow the header that no input claims"
        )
    return request_of(model, version, raw, inputs)


def read_header(header: bytes) -> Any:
    """A JSON body, or a binary request's header, read as a request (its inputs' data as
    sent)."""
    try:
        return _decoder.decode(header)
    except msgspec.ValidationError as exc:
        raise InvalidInput(f"invalid inference request: {field_message(str(exc))}") from None
    except msgspec.DecodeError as exc:
        raise InvalidInput(f"request body is not valid JSON: {exc}") from None
    except RecursionError:
        raise InvalidInput("request body is not valid JSON: nested too deeply") from None
    except UnicodeDecodeError as exc:
        raise InvalidInput(f"request body is not valid JSON: not valid UTF-8 ({exc})") from None


def request_of(model: str, version: str | None, raw: Any, inputs: list[Tensor]) -> InferRequest:
    """The request of a decoded body (its ``id``, ``outputs`` and ``parameters``, as `_Request`
    has them) and its input tensors; its flags checked."""
    _check_flag("parameter 'binary_data_output'", (raw.parameters or {}).get("binary_data_output"))
    outputs = None
    if raw.outputs is not None:
        outputs = [RequestedOutput(o.name, o.parameters or {}) for o in raw.outputs]
        for output in outputs:
            flag = output.parameters.get("binary_data")
            _check_flag(f"output {output.name!r}: parameter 'binary_data'", flag)
    return InferRequest(
        model=model,
        inputs=inputs,
        version=version,
        id=raw.id,
        outputs=outputs,
        parameters=raw.parameters or {},
    )


def _check_flag(what: str, value: Any) -> None:
    # A flag is true or false: "false" (a string) would otherwise be taken as true.
    if value is not None and not isinstance(value, bool):
        raise InvalidInput(f"{what} must be true or false, not {shown(value)}")


def encode_response(
    request: InferRequest, response: InferResponse
) -> tuple[bytes, list[tuple[bytes, bytes]]]:
    """The body and content headers of an infer response, binary where the request asked."""
    binary_default = bool(request.parameters.get("binary_data_output", False))
    outputs: list[dict[str, Any]] = []
    chunks: list[bytes] = []
    for tensor in response.outputs:
        entry: dict[str, Any] = {
            "name": tensor.name,
            "datatype": tensor.datatype,
            "shape": tensor.shape,
        }
        if tensor.parameters.get("binary_data", binary_default):
            raw = to_binary(tensor.data)
            chunks.append(raw)
            entry["parameters"] = {"binary_data_size": len(raw)}
        else:
            entry["data"] = to_json_data(tensor.data)
        outputs.append(entry)
    document: dict[str, Any] = {
        "model_name": response.model,
        "model_version": response.version,
        "outputs": outputs,
        "parameters": response.parameters,
    }
    if response.id is not None:
        document["id"] = response.id
    header = orjson.dumps(document, option=_ORJSON_OPTIONS)
    if not chunks:
        return header, [(b"content-type", b"application/json")]
    return b"".join([header, *chunks]), [
        (b"content-type", b"application/octet-stream"),
        (b"inference-header-content-length", str(len(header)).encode()),
    ]
