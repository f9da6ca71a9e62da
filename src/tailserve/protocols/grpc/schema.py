"""The Open Inference Protocol's gRPC messages (package ``inference``), built at import.

The messages are described here in Python, field by field, and turned into classes by
protobuf's own runtime: no generated code to keep in step with the installed protobuf, and a
private descriptor pool, so a process that also loads a client's copy of the same package
(``tritonclient.grpc`` registers one in the default pool) has no clash. Names and field
numbers are the protocol's: clients written against its ``.proto`` read these bytes as theirs.
Only what the worker serves is described: health, metadata and inference (unary and
streaming).
"""

from __future__ import annotations

from typing import Any

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

PACKAGE = "inference"
SERVICE = f"{PACKAGE}.GRPCInferenceService"

_F = descriptor_pb2.FieldDescriptorProto
_STRING, _BOOL, _BYTES, _MESSAGE = _F.TYPE_STRING, _F.TYPE_BOOL, _F.TYPE_BYTES, _F.TYPE_MESSAGE
_INT32, _INT64, _UINT32, _UINT64 = _F.TYPE_INT32, _F.TYPE_INT64, _F.TYPE_UINT32, _F.TYPE_UINT64
_FLOAT, _DOUBLE = _F.TYPE_FLOAT, _F.TYPE_DOUBLE

# (name, number, type, repeated, message type or None, oneof index or None)
Field = tuple[str, int, int, bool, str | None, int | None]


def _f(
    name: str,
    number: int,
    kind: int,
    *,
    repeated: bool = False,
    message: str | None = None,
    oneof: int | None = None,
) -> Field:
    return (name, number, kind, repeated, message, oneof)


def _parameters(number: int, owner: str) -> Field:
    """A ``map<string, InferParameter>`` field: a repeated entry message nested in its owner."""
    return _f("parameters", number, _MESSAGE, repeated=True, message=f"{owner}.ParametersEntry")


def _message(
    proto: Any,
    name: str,
    fields: list[Field],
    *,
    oneofs: tuple[str, ...] = (),
    map_entry: bool = False,
    nested: tuple[tuple[str, list[Field]], ...] = (),
) -> None:
    message = proto.add()
    message.name = name
    if map_entry:
        message.options.map_entry = True
    for oneof in oneofs:
        message.oneof_decl.add().name = oneof
    for field_name, number, kind, repeated, type_name, oneof_index in fields:
        field = message.field.add()
        field.name, field.number, field.type = field_name, number, kind
        field.label = _F.LABEL_REPEATED if repeated else _F.LABEL_OPTIONAL
        if type_name is not None:
            field.type_name = f".{PACKAGE}.{type_name}"
        if oneof_index is not None:
            field.oneof_index = oneof_index
    for nested_name, nested_fields in nested:
        _message(message.nested_type, nested_name, nested_fields)
    if any(f[0] == "parameters" for f in fields):  # its map's entry type lives inside it
        _message(message.nested_type, "ParametersEntry", _ENTRY, map_entry=True)


_ENTRY = [_f("key", 1, _STRING), _f("value", 2, _MESSAGE, message="InferParameter")]


def _file() -> descriptor_pb2.FileDescriptorProto:
    proto = descriptor_pb2.FileDescriptorProto(
        name="tailserve/oip_v2.proto", package=PACKAGE, syntax="proto3"
    )
    _health_messages(proto.message_type)
    _metadata_messages(proto.message_type)
    _infer_messages(proto.message_type)
    return proto


def _health_messages(m: Any) -> None:
    for empty in ("ServerLiveRequest", "ServerReadyRequest", "ServerMetadataRequest"):
        _message(m, empty, [])
    _message(m, "ServerLiveResponse", [_f("live", 1, _BOOL)])
    _message(m, "ServerReadyResponse", [_f("ready", 1, _BOOL)])
    named = [_f("name", 1, _STRING), _f("version", 2, _STRING)]
    _message(m, "ModelReadyRequest", named)
    _message(m, "ModelReadyResponse", [_f("ready", 1, _BOOL)])


def _metadata_messages(m: Any) -> None:
    _message(
        m,
        "ServerMetadataResponse",
        [
            _f("name", 1, _STRING),
            _f("version", 2, _STRING),
            _f("extensions", 3, _STRING, repeated=True),
        ],
    )
    _message(m, "ModelMetadataRequest", [_f("name", 1, _STRING), _f("version", 2, _STRING)])
    tensor_metadata = [
        _f("name", 1, _STRING),
        _f("datatype", 2, _STRING),
        _f("shape", 3, _INT64, repeated=True),
    ]
    _message(
        m,
        "ModelMetadataResponse",
        [
            _f("name", 1, _STRING),
            _f("versions", 2, _STRING, repeated=True),
            _f("platform", 3, _STRING),
            _f(
                "inputs", 4, _MESSAGE, repeated=True, message="ModelMetadataResponse.TensorMetadata"
            ),
            _f(
                "outputs",
                5,
                _MESSAGE,
                repeated=True,
                message="ModelMetadataResponse.TensorMetadata",
            ),
        ],
        nested=(("TensorMetadata", tensor_metadata),),
    )


def _infer_messages(m: Any) -> None:
    _message(
        m,
        "InferParameter",
        [
            _f("bool_param", 1, _BOOL, oneof=0),
            _f("int64_param", 2, _INT64, oneof=0),
            _f("string_param", 3, _STRING, oneof=0),
            _f("double_param", 4, _DOUBLE, oneof=0),
            _f("uint64_param", 5, _UINT64, oneof=0),
        ],
        oneofs=("parameter_choice",),
    )
    _message(
        m,
        "InferTensorContents",
        [
            _f("bool_contents", 1, _BOOL, repeated=True),
            _f("int_contents", 2, _INT32, repeated=True),
            _f("int64_contents", 3, _INT64, repeated=True),
            _f("uint_contents", 4, _UINT32, repeated=True),
            _f("uint64_contents", 5, _UINT64, repeated=True),
            _f("fp32_contents", 6, _FLOAT, repeated=True),
            _f("fp64_contents", 7, _DOUBLE, repeated=True),
            _f("bytes_contents", 8, _BYTES, repeated=True),
        ],
    )

    def tensor(owner: str) -> list[Field]:
        return [
            _f("name", 1, _STRING),
            _f("datatype", 2, _STRING),
            _f("shape", 3, _INT64, repeated=True),
            _parameters(4, owner),
            _f("contents", 5, _MESSAGE, message="InferTensorContents"),
        ]

    request_input = "ModelInferRequest.InferInputTensor"
    request_output = "ModelInferRequest.InferRequestedOutputTensor"
    _message(
        m,
        "ModelInferRequest",
        [
            _f("model_name", 1, _STRING),
            _f("model_version", 2, _STRING),
            _f("id", 3, _STRING),
            _parameters(4, "ModelInferRequest"),
            _f("inputs", 5, _MESSAGE, repeated=True, message=request_input),
            _f("outputs", 6, _MESSAGE, repeated=True, message=request_output),
            _f("raw_input_contents", 7, _BYTES, repeated=True),
        ],
        nested=(
            ("InferInputTensor", tensor(request_input)),
            (
                "InferRequestedOutputTensor",
                [_f("name", 1, _STRING), _parameters(2, request_output)],
            ),
        ),
    )
    response_output = "ModelInferResponse.InferOutputTensor"
    _message(
        m,
        "ModelInferResponse",
        [
            _f("model_name", 1, _STRING),
            _f("model_version", 2, _STRING),
            _f("id", 3, _STRING),
            _parameters(4, "ModelInferResponse"),
            _f("outputs", 5, _MESSAGE, repeated=True, message=response_output),
            _f("raw_output_contents", 6, _BYTES, repeated=True),
        ],
        nested=(("InferOutputTensor", tensor(response_output)),),
    )
    _message(
        m,
        "ModelStreamInferResponse",
        [
            _f("error_message", 1, _STRING),
            _f("infer_response", 2, _MESSAGE, message="ModelInferResponse"),
        ],
    )


_pool = descriptor_pool.DescriptorPool()
_pool.Add(_file())


def message(name: str) -> Any:
    """The class of message ``name`` (``inference.<name>``)."""
    return message_factory.GetMessageClass(_pool.FindMessageTypeByName(f"{PACKAGE}.{name}"))


ServerLiveRequest = message("ServerLiveRequest")
ServerLiveResponse = message("ServerLiveResponse")
ServerReadyRequest = message("ServerReadyRequest")
ServerReadyResponse = message("ServerReadyResponse")
ModelReadyRequest = message("ModelReadyRequest")
ModelReadyResponse = message("ModelReadyResponse")
ServerMetadataRequest = message("ServerMetadataRequest")
ServerMetadataResponse = message("ServerMetadataResponse")
ModelMetadataRequest = message("ModelMetadataRequest")
ModelMetadataResponse = message("ModelMetadataResponse")
ModelInferRequest = message("ModelInferRequest")
ModelInferResponse = message("ModelInferResponse")
ModelStreamInferResponse = message("ModelStreamInferResponse")
InferParameter = message("InferParameter")
