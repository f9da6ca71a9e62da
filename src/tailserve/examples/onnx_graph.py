"""Small ONNX helpers: build a hand-written graph, expose one probability column of an
exported one as its only output."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

# Slice takes its bounds as inputs from opset 10 on.
_MIN_OPSET = 10


def probability_column(
    model: onnx.ModelProto, *, source: str, column: int, output: str
) -> onnx.ModelProto:
    """Make ``output`` = ``source[:, column:column+1]`` (float, [N, 1]) the graph's only output."""
    graph = model.graph
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)
    if opset < _MIN_OPSET:
        raise ValueError(f"the graph's opset {opset} is older than {_MIN_OPSET}")
    if source not in {o.name for o in graph.output}:
        raise ValueError(f"the graph has no output {source!r}")
    bounds = {"starts": column, "ends": column + 1, "axes": 1}
    names = []
    for key, value in bounds.items():
        name = f"{output}_{key}"
        graph.initializer.append(numpy_helper.from_array(np.array([value], np.int64), name))
        names.append(name)
    graph.node.append(helper.make_node("Slice", [source, *names], [output], name=f"{output}_slice"))
    del graph.output[:]
    graph.output.append(helper.make_tensor_value_info(output, TensorProto.FLOAT, [None, 1]))
    prune(graph)
    onnx.checker.check_model(model)
    return model


def prune(graph: onnx.GraphProto) -> None:
    """Drop the nodes and initializers no graph output depends on (the label branch).

    Names used only inside subgraphs (If, Loop) are not followed; exported pipelines have none.
    """
    needed = {o.name for o in graph.output}
    keep = []
    for node in reversed(graph.node):
        if needed.intersection(node.output):
            keep.append(node)
            needed.update(name for name in node.input if name)
    kept_inits = [init for init in graph.initializer if init.name in needed]
    del graph.node[:]
    graph.node.extend(reversed(keep))
    del graph.initializer[:]
    graph.initializer.extend(kept_inits)


def build_model(
    name: str,
    nodes: Sequence[onnx.NodeProto],
    inputs: Sequence[tuple[str, int, list[Any]]],
    output: str,
    constants: Mapping[str, np.ndarray[Any, Any]],
) -> bytes:
    """A checked, serialised model of ``nodes``: inputs as (name, element type, shape), one
    float output of shape [N, 1], the constants as initializers (opset 17, IR 8)."""
    model = helper.make_model(
        helper.make_graph(
            list(nodes),
            name,
            [helper.make_tensor_value_info(n, kind, shape) for n, kind, shape in inputs],
            [helper.make_tensor_value_info(output, TensorProto.FLOAT, [None, 1])],
            [numpy_helper.from_array(value, key) for key, value in constants.items()],
        ),
        opset_imports=[helper.make_opsetid("", 17)],
        producer_name="tailserve-examples",
    )
    model.ir_version = 8
    onnx.checker.check_model(model)
    content: bytes = model.SerializeToString()
    return content
