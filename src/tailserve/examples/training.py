"""Training and export of the churn models (needs the `examples` extra).

- ONNX: a scikit-learn pipeline (scaled numbers, one-hot categories, a small MLP) exported by
  skl2onnx with one graph input per field. skl2onnx 1.20 with onnx 1.23 fails on tree ensembles,
  so the tree model is LightGBM's own text format instead.
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


def churn_onnx(customers: Columns, labels: np.ndarray[Any, Any]) -> bytes:
    import onnxruntime as ort
    from skl2onnx import convert_sklearn
    from skl2onnx.common.data_types import FloatTensorType, Int64TensorType, StringTensorType
    from sklearn.compose import ColumnTransformer
    from sklearn.exceptions import ConvergenceWarning
    from sklearn.neural_network import MLPClassifier
    from sklearn.pipeline import Pipeline
    from sklearn.preprocessing import OneHotEncoder, StandardScaler

    numeric = [i for i, field in enumerate(FIELDS) if field.values is None]
    categorical = [i for i, field in enumerate(FIELDS) if field.values is not None]
    # Columns by position: without pandas, an object array carries numbers and strings together.
    features = np.empty((len(labels), len(FIELDS)), dtype=object)
    for i, field in enumerate(FIELDS):
        features[:, i] = customers[field.name]
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
        pipeline.fit(features, labels)

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
    expected = pipeline.predict_proba(features[:_CHECK_ROWS])[:, 1]
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
