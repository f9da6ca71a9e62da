"""Training and export of the churn models (needs the `examples` extra).

- scikit-learn: a pipeline (scaled numbers, one-hot categories, a small MLP), pickled with
  joblib for the sklearn runtime (``churn_sklearn``, written on request: a pickle runs code on
  load, so its model.yaml says ``trust: true``).
- ONNX: the same pipeline exported by skl2onnx with one graph input per field. skl2onnx 1.20
  with onnx 1.23 fails on tree ensembles, so the tree model is LightGBM's own text format.
- LightGBM: a binary booster on the matrix `feature_matrix` builds, categories as indices.
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np

from tailserve.examples.churn import FIELDS, OUTPUT, Columns, as_inputs, feature_matrix
from tailserve.examples.onnx_graph import probability_column

# Probabilities of the exported graph and of the pipeline may differ by float32 rounding only.
_TOLERANCE = 1e-4
_CHECK_ROWS = 512


def churn_pipeline(customers: Columns, labels: np.ndarray[Any, Any]) -> Any:
    """The fitted scikit-learn pipeline: scaled numbers, one-hot categories, a small MLP.

    It takes one object array of the fields in FIELDS order (columns by position: without
    pandas, one array carries numbers and strings together), as `SklearnRuntime` builds it.
    """
    from sklearn.compose import ColumnTransformer
    from sklearn.exceptions import ConvergenceWarning
    from sklearn.neural_network import MLPClassifier
    from sklearn.pipeline import Pipeline
    from sklearn.preprocessing import OneHotEncoder, StandardScaler

    numeric = [i for i, field in enumerate(FIELDS) if field.values is None]
    categorical = [i for i, field in enumerate(FIELDS) if field.values is not None]
    classifier = MLPClassifier(
        hidden_layer_sizes=(32, 16), early_stopping=True, max_iter=200, random_state=7
    )
    prepare = ColumnTransformer(
        [
            ("numbers", StandardScaler(), numeric),
            ("categories", OneHotEncoder(handle_unknown="ignore"), categorical),
        ]
    )
    pipeline = Pipeline([("prepare", prepare), ("classify", classifier)])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        pipeline.fit(by_position(customers), labels)
    return pipeline


def pickled(pipeline: Any) -> bytes:
    import io

    import joblib

    buffer = io.BytesIO()
    joblib.dump(pipeline, buffer)
    return buffer.getvalue()


def by_position(customers: Columns) -> np.ndarray[Any, Any]:
    """The fields as one object array, columns in FIELDS order."""
    rows = len(customers[FIELDS[0].name])
    features = np.empty((rows, len(FIELDS)), dtype=object)
    for i, field in enumerate(FIELDS):
        features[:, i] = customers[field.name]
    return features


def churn_onnx(pipeline: Any, customers: Columns) -> bytes:
    """The pipeline as an ONNX graph with one input per field, checked against the pipeline."""
    import onnxruntime as ort
    from skl2onnx import convert_sklearn
    from skl2onnx.common.data_types import FloatTensorType, Int64TensorType, StringTensorType

    classifier = pipeline.named_steps["classify"]
    tensor_types = {"FP32": FloatTensorType, "INT64": Int64TensorType, "BYTES": StringTensorType}
    initial_types = [(field.name, tensor_types[field.datatype]([None, 1])) for field in FIELDS]
    model = convert_sklearn(
        pipeline,
        initial_types=initial_types,
        options={id(classifier): {"zipmap": False}},
        target_opset=17,
    )
    model = probability_column(model, source="probabilities", column=1, output=OUTPUT)
    model.graph.name = "churn"  # skl2onnx draws a random one; the file should not change
    content: bytes = model.SerializeToString()

    session = ort.InferenceSession(content, providers=["CPUExecutionProvider"])
    sample = {name: array[:_CHECK_ROWS] for name, array in customers.items()}
    feed = {name: _ort_ready(array) for name, array in as_inputs(sample).items()}
    (exported,) = session.run([OUTPUT], feed)
    expected = pipeline.predict_proba(by_position(sample))[:, 1]
    error = float(np.abs(exported[:, 0] - expected).max())
    if exported.shape != (len(expected), 1) or error > _TOLERANCE:
        raise RuntimeError(f"the exported churn graph differs from the pipeline by {error}")
    return content


def _ort_ready(array: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    return array.astype(str) if array.dtype.kind == "O" else array


def churn_lightgbm(customers: Columns, labels: np.ndarray[Any, Any]) -> bytes:
    import lightgbm

    names = [field.name for field in FIELDS]
    categorical = [field.name for field in FIELDS if field.values is not None]
    params = {
        "objective": "binary",
        "num_leaves": 15,
        "learning_rate": 0.1,
        "min_data_in_leaf": 40,
        "num_threads": 1,
        "seed": 7,
        "deterministic": True,
        "force_row_wise": True,
        "verbose": -1,
    }
    dataset = lightgbm.Dataset(
        feature_matrix(customers),
        label=labels,
        feature_name=names,
        categorical_feature=categorical,
        free_raw_data=True,
    )
    booster = lightgbm.train(params, dataset, num_boost_round=100)
    text: str = booster.model_to_string()
    return text.encode("utf-8")
