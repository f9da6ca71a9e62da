"""ONNX Runtime's I/O binding path (the GPU's), run here with the CPU provider: the same answers
as ``session.run``; string inputs, which ORT cannot bind, keep ``session.run``. And its CPU
arena: off unless asked for, the same answers either way."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from tailserve.errors import ModelLoadError
from tailserve.modelconfig import parse_model_config
from tailserve.runtimes import Runtime, RuntimeContext, create_runtime
from tailserve.runtimes.onnx import OnnxRuntime


def two_output_graph(path: Path) -> None:
    """scaled = x @ W + k (k cast to float); total = the row sums of x."""
    weights = helper.make_tensor(
        "W", TensorProto.FLOAT, [3, 2], np.arange(6, dtype=np.float32).tolist()
    )
    nodes = [
        helper.make_node("MatMul", ["x", "W"], ["xw"]),
        helper.make_node("Cast", ["k"], ["kf"], to=TensorProto.FLOAT),
        helper.make_node("Add", ["xw", "kf"], ["scaled"]),
        helper.make_node("ReduceSum", ["x", "axis"], ["total"], keepdims=1),
    ]
    axis = helper.make_tensor("axis", TensorProto.INT64, [1], [1])
    graph = helper.make_graph(
        nodes,
        "binding",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, 3]),
            helper.make_tensor_value_info("k", TensorProto.INT64, [None, 1]),
        ],
        [
            helper.make_tensor_value_info("scaled", TensorProto.FLOAT, [None, 2]),
            helper.make_tensor_value_info("total", TensorProto.FLOAT, [None, 1]),
        ],
        initializer=[weights, axis],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(path))


def runtime(tmp_path: Path, *, graph: str = "numbers", **parameters: Any) -> Runtime:
    version_dir = tmp_path / "1"
    version_dir.mkdir(parents=True, exist_ok=True)
    if graph == "numbers":
        two_output_graph(version_dir / "model.onnx")
        inputs = [
            {"name": "x", "datatype": "FP32", "shape": [3]},
            {"name": "k", "datatype": "INT64", "shape": [1]},
        ]
        outputs = [
            {"name": "total", "datatype": "FP32", "shape": [1]},
            {"name": "scaled", "datatype": "FP32", "shape": [2]},
        ]
    else:
        identity = helper.make_node("Identity", ["s"], ["same"])
        strings = helper.make_graph(
            [identity],
            "strings",
            [helper.make_tensor_value_info("s", TensorProto.STRING, [None, 1])],
            [helper.make_tensor_value_info("same", TensorProto.STRING, [None, 1])],
        )
        model = helper.make_model(strings, opset_imports=[helper.make_opsetid("", 17)])
        model.ir_version = 8
        onnx.save(model, str(version_dir / "model.onnx"))
        inputs = [{"name": "s", "datatype": "BYTES", "shape": [1]}]
        outputs = [{"name": "same", "datatype": "BYTES", "shape": [1]}]
    raw = {"name": "m", "runtime": "onnx", "max_batch_size": 64, "inputs": inputs}
    raw.update(outputs=outputs, parameters=parameters)
    config = parse_model_config(raw, source="test")
    loaded = create_runtime(RuntimeContext(config=config, version=1, version_dir=version_dir))
    loaded.load()
    return loaded


def batch(rows: int, seed: int = 0) -> dict[str, np.ndarray[Any, Any]]:
    rng = np.random.default_rng(seed)
    return {
        "x": rng.normal(size=(rows, 3)).astype(np.float32),
        "k": rng.integers(0, 10, size=(rows, 1)),
    }


@pytest.mark.parametrize("rows", [1, 7, 64])
def test_bound_runs_give_what_session_run_gives(tmp_path: Path, rows: int) -> None:
    plain = runtime(tmp_path / "plain", io_binding=False)
    bound = runtime(tmp_path / "bound", io_binding=True)
    for seed in range(3):  # the binding is reused from batch to batch
        inputs = batch(rows, seed)
        want, got = plain.predict(inputs), bound.predict(inputs)
        assert list(got) == ["total", "scaled"]
        for name in want:
            assert got[name].dtype == want[name].dtype and got[name].shape == want[name].shape
            np.testing.assert_array_equal(got[name], want[name])
    expected = batch(rows, 2)["x"] @ np.arange(6, dtype=np.float32).reshape(3, 2)
    np.testing.assert_allclose(got["scaled"], expected + batch(rows, 2)["k"], rtol=1e-5)


def test_auto_binds_only_on_a_gpu_and_gives_the_same_answers(tmp_path: Path) -> None:
    inputs = batch(5)
    auto = runtime(tmp_path / "auto").predict(inputs)
    bound = runtime(tmp_path / "bound", io_binding=True).predict(inputs)
    np.testing.assert_array_equal(auto["scaled"], bound["scaled"])


def test_string_inputs_keep_session_run(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        strings = runtime(tmp_path, graph="strings", io_binding=True)
    assert "input 's' is a string tensor: no I/O binding" in caplog.text
    words = np.array([["annual"], ["monthly"]], dtype=object)
    assert strings.predict({"s": words})["same"].tolist() == [["annual"], ["monthly"]]


def test_an_unknown_io_binding_setting_is_a_load_error(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match=r"parameters\.io_binding': 'yes' is not auto"):
        runtime(tmp_path, io_binding="yes")


def test_the_cpu_arena_is_off_unless_asked_for_and_answers_do_not_change(tmp_path: Path) -> None:
    auto = runtime(tmp_path / "auto")
    kept = runtime(tmp_path / "kept", memory_arena=True)
    assert isinstance(auto, OnnxRuntime) and isinstance(kept, OnnxRuntime)
    assert (auto.memory_arena, kept.memory_arena) == (False, True)
    for rows in (1, 64, 3):
        inputs = batch(rows, rows)
        want = kept.predict(inputs)["scaled"]
        np.testing.assert_array_equal(auto.predict(inputs)["scaled"], want)


def test_an_unknown_memory_arena_setting_is_a_load_error(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match=r"parameters\.memory_arena': 'on' is not auto"):
        runtime(tmp_path, memory_arena="on")
