"""Each runtime against a tiny artifact in tmp_path: predictions, describe(), load errors."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path
from typing import Any

import joblib
import lightgbm
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from sklearn.compose import ColumnTransformer
from sklearn.linear_model import LogisticRegression
from sklearn.pipeline import Pipeline
from sklearn.preprocessing import OneHotEncoder

from tailserve.errors import InvalidInput, ModelExecutionError, ModelLoadError
from tailserve.modelconfig import parse_model_config
from tailserve.runtimes import Runtime, RuntimeContext, create_runtime
from tailserve.runtimes import onnx as onnx_runtime


def make_runtime(
    version_dir: Path,
    runtime: str,
    inputs: list[dict[str, Any]],
    outputs: list[dict[str, Any]],
    **extra: Any,
) -> Runtime:
    raw = {"name": "m", "runtime": runtime, "max_batch_size": 8, "inputs": inputs}
    raw.update(outputs=outputs, **extra)
    config = parse_model_config(raw, source="test")
    version_dir.mkdir(parents=True, exist_ok=True)
    return create_runtime(RuntimeContext(config=config, version=3, version_dir=version_dir))


def tensor(name: str, datatype: str = "FP32", shape: list[int] | None = None, **more: Any) -> Any:
    return {"name": name, "datatype": datatype, "shape": shape or [1], **more}


def strings(*items: str | bytes) -> np.ndarray[Any, Any]:
    array = np.empty(len(items), dtype=object)
    array[:] = items
    return array.reshape(-1, 1)


# --- ONNX -----------------------------------------------------------------------------------


def save_graph(
    path: Path, nodes: list[Any], inputs: list[Any], outputs: list[Any], **kw: Any
) -> None:
    graph = helper.make_graph(nodes, "g", inputs, outputs, initializer=kw.get("inits", []))
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("ai.onnx.ml", 2)]
    model = helper.make_model(graph, opset_imports=opsets)
    model.ir_version = 8
    onnx.checker.check_model(model)
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(path))


def doubler_graph(path: Path, input_type: int = TensorProto.FLOAT) -> None:
    """y = float(x) * 2, with x of ``input_type``."""
    two = numpy_helper.from_array(np.array(2.0, np.float32), "two")
    nodes = [
        helper.make_node("Cast", ["x"], ["xf"], to=TensorProto.FLOAT),
        helper.make_node("Mul", ["xf", "two"], ["y"]),
    ]
    x = helper.make_tensor_value_info("x", input_type, ["batch", 1])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, 1])
    save_graph(path / "model.onnx", nodes, [x], [y], inits=[two])


def test_onnx_predicts_and_describes_the_graph(tmp_path: Path) -> None:
    doubler_graph(tmp_path)
    runtime = make_runtime(tmp_path, "onnx", [tensor("x")], [tensor("y")])
    runtime.load()
    x = np.array([[1.5], [-2.0], [0.0]], dtype=np.float32)
    y = runtime.predict({"x": x})["y"]
    assert y.dtype == np.float32
    np.testing.assert_array_equal(y, x * 2)
    signature = runtime.describe()
    assert [(s.name, s.datatype, s.shape) for s in signature.inputs] == [("x", "FP32", (-1, 1))]
    assert [(s.name, s.datatype, s.shape) for s in signature.outputs] == [("y", "FP32", (-1, 1))]
    runtime.unload()


def test_onnx_casts_integers_to_the_width_the_graph_wants(tmp_path: Path) -> None:
    doubler_graph(tmp_path, TensorProto.INT32)
    runtime = make_runtime(tmp_path, "onnx", [tensor("x", "INT64")], [tensor("y")])
    runtime.load()
    y = runtime.predict({"x": np.array([[3], [-4]], dtype=np.int64)})["y"]
    np.testing.assert_array_equal(y, [[6.0], [-8.0]])
    with pytest.raises(InvalidInput, match=r"'x'.*INT32"):
        runtime.predict({"x": np.array([[2**40]], dtype=np.int64)})


def test_onnx_refuses_a_datatype_the_graph_cannot_take(tmp_path: Path) -> None:
    doubler_graph(tmp_path, TensorProto.INT32)
    runtime = make_runtime(tmp_path, "onnx", [tensor("x", "FP32")], [tensor("y")])
    with pytest.raises(ModelLoadError, match=r"input 'x' is FP32 in model\.yaml but the graph"):
        runtime.load()


def test_onnx_string_inputs_accept_bytes_and_str(tmp_path: Path) -> None:
    encoder = helper.make_node(
        "LabelEncoder",
        ["colour"],
        ["code"],
        domain="ai.onnx.ml",
        keys_strings=["red", "green", "blue"],
        values_int64s=[0, 1, 2],
        default_int64=-1,
    )
    colour = helper.make_tensor_value_info("colour", TensorProto.STRING, [None, 1])
    code = helper.make_tensor_value_info("code", TensorProto.INT64, [None, 1])
    save_graph(tmp_path / "model.onnx", [encoder], [colour], [code])
    runtime = make_runtime(tmp_path, "onnx", [tensor("colour", "BYTES")], [tensor("code", "INT64")])
    runtime.load()
    assert runtime.describe().inputs[0].datatype == "BYTES"
    out = runtime.predict({"colour": strings(b"blue", "red", b"green", "pink")})["code"]
    np.testing.assert_array_equal(out, [[2], [0], [1], [-1]])
    with pytest.raises(InvalidInput, match=r"'colour'.*UTF-8"):
        runtime.predict({"colour": strings(b"\xff")})


def test_onnx_load_errors_name_model_version_and_file(tmp_path: Path) -> None:
    runtime = make_runtime(tmp_path, "onnx", [tensor("x")], [tensor("y")])
    with pytest.raises(ModelLoadError, match=r"model 'm' version 3: .*model\.onnx not found"):
        runtime.load()
    (tmp_path / "model.onnx").write_bytes(b"not a graph")
    with pytest.raises(ModelLoadError, match=r"model 'm' version 3: cannot load .*model\.onnx"):
        runtime.load()


def test_onnx_refuses_an_output_the_graph_lacks(tmp_path: Path) -> None:
    doubler_graph(tmp_path)
    runtime = make_runtime(tmp_path, "onnx", [tensor("x")], [tensor("z")])
    with pytest.raises(ModelLoadError, match=r"no output 'z' \(it has \['y'\]\)"):
        runtime.load()


def test_onnx_providers_skip_absent_ones_and_end_with_cpu(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    available = ["CUDAExecutionProvider", "CPUExecutionProvider"]
    monkeypatch.setattr(onnx_runtime.ort, "get_available_providers", lambda: available)
    chosen = onnx_runtime.choose_providers(["cpu", "tensorrt", "cuda"], "model 'm'")
    assert chosen == ["CUDAExecutionProvider", "CPUExecutionProvider"]
    assert "TensorrtExecutionProvider is not available" in caplog.text
    assert onnx_runtime.choose_providers([], "m") == ["CPUExecutionProvider"]
    with pytest.raises(ModelLoadError, match="unknown provider 'tpu'"):
        onnx_runtime.choose_providers(["tpu"], "m")


# --- LightGBM -------------------------------------------------------------------------------

COLOURS = ["red", "green", "blue"]


def lightgbm_booster(path: Path) -> tuple[lightgbm.Booster, np.ndarray[Any, Any]]:
    """A small binary booster on columns (x0, x1, colour index); returns it and its data."""
    rng = np.random.default_rng(0)
    matrix = np.column_stack([rng.normal(size=(400, 2)), rng.integers(0, 3, 400)])
    labels = ((matrix[:, 0] + (matrix[:, 2] == 2)) > 0.5).astype(int)
    params = {"objective": "binary", "num_threads": 1, "verbose": -1, "min_data_in_leaf": 5}
    dataset = lightgbm.Dataset(matrix, labels, categorical_feature=[2])
    booster = lightgbm.train(params, dataset, num_boost_round=5)
    path.mkdir(parents=True, exist_ok=True)
    booster.save_model(str(path / "model.txt"))
    return booster, matrix


LGBM_INPUTS = [
    tensor("x", "FP32", [2]),
    tensor("colour", "BYTES", values=COLOURS),
]


def test_lightgbm_builds_the_matrix_in_input_order(tmp_path: Path) -> None:
    booster, matrix = lightgbm_booster(tmp_path)
    runtime = make_runtime(tmp_path, "lightgbm", LGBM_INPUTS, [tensor("p")])
    runtime.load()
    rows = matrix[:6]
    names = strings(*(COLOURS[int(i)] for i in rows[:, 2]))
    names[0, 0] = names[0, 0].encode()  # binary requests carry bytes
    out = runtime.predict({"x": rows[:, :2].astype(np.float32), "colour": names})["p"]
    assert out.shape == (6, 1)
    assert out.dtype == np.float32
    expected = booster.predict(np.column_stack([rows[:, :2].astype(np.float32), rows[:, 2]]))
    np.testing.assert_allclose(out[:, 0], expected, rtol=1e-6)
    assert [spec.name for spec in runtime.describe().inputs] == booster.feature_name()
    with pytest.raises(InvalidInput, match="'colour': unknown value 'pink'"):
        runtime.predict({"x": rows[:1, :2], "colour": strings("pink")})


def test_lightgbm_checks_the_column_count_at_load(tmp_path: Path) -> None:
    lightgbm_booster(tmp_path)
    runtime = make_runtime(tmp_path, "lightgbm", LGBM_INPUTS[1:], [tensor("p")])
    with pytest.raises(ModelLoadError, match=r"takes 3 features but the inputs .* make 1 columns"):
        runtime.load()


def test_lightgbm_load_errors(tmp_path: Path) -> None:
    runtime = make_runtime(tmp_path, "lightgbm", LGBM_INPUTS, [tensor("p")])
    with pytest.raises(ModelLoadError, match=r"model 'm' version 3: .*model\.txt not found"):
        runtime.load()
    lightgbm_booster(tmp_path)
    inputs = [LGBM_INPUTS[0], tensor("colour", "BYTES")]
    runtime = make_runtime(tmp_path, "lightgbm", inputs, [tensor("p")])
    with pytest.raises(ModelLoadError, match="'colour' needs 'values'"):
        runtime.load()
    runtime = make_runtime(tmp_path, "lightgbm", LGBM_INPUTS, [tensor("p", shape=[2])])
    with pytest.raises(ModelLoadError, match="gives 1 value"):
        runtime.load()


# --- scikit-learn ---------------------------------------------------------------------------


def sklearn_pipeline(path: Path) -> Pipeline:
    rng = np.random.default_rng(1)
    features = np.empty((300, 2), dtype=object)
    features[:, 0] = rng.normal(size=300)
    features[:, 1] = rng.choice(COLOURS, 300)
    labels = ((features[:, 0] > 0) ^ (features[:, 1] == "red")).astype(int)
    prepare = ColumnTransformer(
        [("colour", OneHotEncoder(), [1])], remainder="passthrough", sparse_threshold=0
    )
    pipeline = Pipeline([("prepare", prepare), ("classify", LogisticRegression())])
    pipeline.fit(features, labels)
    path.mkdir(parents=True, exist_ok=True)
    joblib.dump(pipeline, path / "model.joblib")
    return pipeline


SKLEARN_INPUTS = [tensor("x"), tensor("colour", "BYTES", values=COLOURS)]


def test_sklearn_predicts_a_column_of_predict_proba(tmp_path: Path) -> None:
    pipeline = sklearn_pipeline(tmp_path)
    runtime = make_runtime(
        tmp_path, "sklearn", SKLEARN_INPUTS, [tensor("p")], trust=True, parameters={"column": 1}
    )
    runtime.load()
    x = np.array([[0.5], [-1.0], [2.0]], dtype=np.float32)
    out = runtime.predict({"x": x, "colour": strings(b"red", "blue", "green")})["p"]
    features = np.array([[0.5, "red"], [-1.0, "blue"], [2.0, "green"]], dtype=object)
    expected = pipeline.predict_proba(features)[:, 1]
    assert out.shape == (3, 1)
    np.testing.assert_allclose(out[:, 0], expected, rtol=1e-6)
    assert runtime.describe().inputs == ()


def test_sklearn_method_parameter(tmp_path: Path) -> None:
    pipeline = sklearn_pipeline(tmp_path)
    outputs = [tensor("label", "INT64")]
    runtime = make_runtime(
        tmp_path, "sklearn", SKLEARN_INPUTS, outputs, trust=True, parameters={"method": "predict"}
    )
    runtime.load()
    x = np.array([[0.5], [-1.0]], dtype=np.float32)
    out = runtime.predict({"x": x, "colour": strings("red", "blue")})["label"]
    features = np.array([[0.5, "red"], [-1.0, "blue"]], dtype=object)
    np.testing.assert_array_equal(out[:, 0], pipeline.predict(features))
    runtime = make_runtime(
        tmp_path, "sklearn", SKLEARN_INPUTS, outputs, trust=True, parameters={"method": "nope"}
    )
    with pytest.raises(ModelLoadError, match="no method 'nope'"):
        runtime.load()


def test_sklearn_refuses_untrusted_pickles(tmp_path: Path) -> None:
    sklearn_pipeline(tmp_path)
    runtime = make_runtime(tmp_path, "sklearn", SKLEARN_INPUTS, [tensor("p")])
    with pytest.raises(ModelLoadError, match=r"pickles run code on load.*'trust: true'"):
        runtime.load()


def test_sklearn_load_errors_name_the_file(tmp_path: Path) -> None:
    runtime = make_runtime(tmp_path, "sklearn", SKLEARN_INPUTS, [tensor("p")], trust=True)
    with pytest.raises(ModelLoadError, match=r"model 'm' version 3: .*model\.joblib not found"):
        runtime.load()
    (tmp_path / "model.joblib").write_bytes(b"garbage")
    with pytest.raises(ModelLoadError, match=r"cannot load .*model\.joblib"):
        runtime.load()


# --- Python ---------------------------------------------------------------------------------

MODEL_PY = """
import dataclasses
import pickle

import numpy as np

LOADS = []


@dataclasses.dataclass
class Scale:
    factor: float


class Model:
    def __init__(self, version_dir, config):
        self.scale = Scale(float(config.parameters.get("factor", 1.0)))
        self.version = int(version_dir.name)

    def load(self):
        LOADS.append(self.version)

    def predict(self, inputs):
        # pickle finds classes through sys.modules: each instance needs its module there.
        scale = pickle.loads(pickle.dumps(self.scale))
        return {"y": inputs["x"] * scale.factor + len(LOADS)}

    def unload(self):
        LOADS.clear()


class Plain:
    def predict(self, inputs):
        return {"y": -inputs["x"]}


class Broken:
    def load(self):
        raise RuntimeError("weights are missing")

    def predict(self, inputs):
        return inputs


class Lists:
    def predict(self, inputs):
        return [1, 2]
"""


def python_model(tmp_path: Path, code: str = MODEL_PY, **parameters: Any) -> Runtime:
    version_dir = tmp_path / "3"
    version_dir.mkdir(exist_ok=True)
    (version_dir / "model.py").write_text(textwrap.dedent(code))
    return make_runtime(version_dir, "python", [tensor("x")], [tensor("y")], parameters=parameters)


def test_python_builds_the_class_with_context_and_loads_it(tmp_path: Path) -> None:
    first = python_model(tmp_path, factor=3.0)
    second = python_model(tmp_path, factor=3.0)
    first.load()
    second.load()
    x = np.array([[1.0], [2.0]], dtype=np.float32)
    # Each instance imports its own module: one LOADS list each, so 1 is added, not 2.
    np.testing.assert_array_equal(first.predict({"x": x})["y"], [[4.0], [7.0]])
    before = set(sys.modules)
    first.unload()
    assert len(before - set(sys.modules)) == 1  # the instance's module is gone
    np.testing.assert_array_equal(second.predict({"x": x})["y"], [[4.0], [7.0]])
    assert second.describe().inputs == ()


def test_python_class_parameter_and_no_argument_constructor(tmp_path: Path) -> None:
    runtime = python_model(tmp_path, **{"class": "Plain"})
    runtime.load()
    y = runtime.predict({"x": np.array([[1.0]], dtype=np.float32)})["y"]
    np.testing.assert_array_equal(y, [[-1.0]])


def test_python_predict_must_return_a_dict(tmp_path: Path) -> None:
    runtime = python_model(tmp_path, **{"class": "Lists"})
    runtime.load()
    with pytest.raises(ModelExecutionError, match="returned list"):
        runtime.predict({"x": np.zeros((1, 1), dtype=np.float32)})


@pytest.mark.parametrize(
    ("code", "parameters", "message"),
    [
        (MODEL_PY, {"class": "Missing"}, r"model\.py defines no class 'Missing'"),
        (MODEL_PY, {"class": "Broken"}, "Broken .* failed to load: RuntimeError: weights are"),
        ("import numpy as np\nraise ValueError('bad import')\n", {}, "ValueError: bad import"),
        ("def broken(:\n", {}, "importing .*model\\.py failed: SyntaxError"),
    ],
)
def test_python_load_errors_name_model_version_and_cause(
    tmp_path: Path, code: str, parameters: dict[str, Any], message: str
) -> None:
    runtime = python_model(tmp_path, code, **parameters)
    before = set(sys.modules)
    with pytest.raises(ModelLoadError, match=f"model 'm' version 3: .*{message}"):
        runtime.load()
    assert set(sys.modules) == before  # a failed load leaves no module behind


def test_python_missing_file(tmp_path: Path) -> None:
    runtime = make_runtime(tmp_path / "3", "python", [tensor("x")], [tensor("y")])
    with pytest.raises(ModelLoadError, match=r"model\.py not found"):
        runtime.load()
