"""The example repository: both churn models load through their runtimes, agree, and stay fixed."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lightgbm
import numpy as np
import onnx
import pytest

from tailserve.engine.warmup import warmup_batches
from tailserve.examples.churn import (
    FIELDS,
    as_inputs,
    churn_labels,
    draw_customers,
    feature_matrix,
    sample_inputs,
    sample_rows,
    training_data,
)
from tailserve.modelconfig import ModelConfig, load_model_config
from tailserve.runtimes import Runtime, RuntimeContext, create_runtime

MODELS = ("churn", "churn_lgbm")


@pytest.fixture(scope="module")
def runtimes(example_repository: Path) -> Iterator[dict[str, Runtime]]:
    loaded = {}
    for name in MODELS:
        config = load_model_config(example_repository / name)
        context = RuntimeContext(config, 1, example_repository / name / "1")
        loaded[name] = create_runtime(context)
        loaded[name].load()
    yield loaded
    for runtime in loaded.values():
        runtime.unload()


def as_bytes(inputs: dict[str, np.ndarray[Any, Any]]) -> dict[str, np.ndarray[Any, Any]]:
    out = {}
    for name, array in inputs.items():
        if array.dtype.kind == "O":
            array = np.array([item.encode() for item in array.reshape(-1)], dtype=object)
            array = array.reshape(-1, 1)
        out[name] = array
    return out


def test_the_repository_holds_both_models_with_their_configs(example_repository: Path) -> None:
    for name in MODELS:
        config = load_model_config(example_repository / name)
        assert config.name == name
        assert [spec.name for spec in config.inputs] == [field.name for field in FIELDS]
        assert all(spec.shape == [1] for spec in config.inputs)
        assert [(o.name, o.datatype, o.shape) for o in config.outputs] == [
            ("churn_probability", "FP32", [1])
        ]
        assert config.max_batch_size == 256
        assert config.instances.intra_op_threads == 1
        assert config.warmup.batch_sizes == [1, 16, 256]
        contract = config.input("contract_type")
        assert contract is not None
        assert contract.values == ["monthly", "annual", "multi-year"]
    graph = onnx.load(str(example_repository / "churn" / "1" / "model.onnx")).graph
    assert [output.name for output in graph.output] == ["churn_probability"]


def test_the_onnx_graph_declares_the_configured_inputs(runtimes: dict[str, Runtime]) -> None:
    signature = runtimes["churn"].describe()
    assert [(s.name, s.datatype) for s in signature.inputs] == [
        (field.name, field.datatype) for field in FIELDS
    ]
    assert [(s.name, s.shape) for s in signature.outputs] == [("churn_probability", (-1, 1))]


@pytest.mark.parametrize("model", MODELS)
def test_probabilities_have_one_column_in_0_1_whatever_the_string_form(
    runtimes: dict[str, Runtime], model: str
) -> None:
    inputs = sample_inputs(300, seed=21)
    out = runtimes[model].predict(inputs)["churn_probability"]
    assert out.shape == (300, 1)
    assert out.dtype == np.float32
    assert ((out >= 0) & (out <= 1)).all()
    assert out.std() > 0.05  # the inputs matter
    np.testing.assert_array_equal(
        runtimes[model].predict(as_bytes(inputs))["churn_probability"], out
    )


def test_the_two_models_agree(runtimes: dict[str, Runtime]) -> None:
    inputs = sample_inputs(1000, seed=5)
    onnx_p = runtimes["churn"].predict(inputs)["churn_probability"][:, 0]
    lgbm_p = runtimes["churn_lgbm"].predict(inputs)["churn_probability"][:, 0]
    assert np.corrcoef(onnx_p, lgbm_p)[0, 1] > 0.8
    assert abs(float(onnx_p.mean() - lgbm_p.mean())) < 0.05


def test_models_rank_churners_above_stayers(runtimes: dict[str, Runtime]) -> None:
    rng = np.random.default_rng(123)
    customers = draw_customers(rng, 2000)
    labels = churn_labels(customers, rng)
    for runtime in runtimes.values():
        p = runtime.predict(as_inputs(customers))["churn_probability"][:, 0]
        assert p[labels == 1].mean() > p[labels == 0].mean() + 0.15


def test_lightgbm_runtime_encodes_inputs_as_training_did(
    example_repository: Path, runtimes: dict[str, Runtime]
) -> None:
    booster = lightgbm.Booster(
        model_file=str(example_repository / "churn_lgbm" / "1" / "model.txt")
    )
    customers = draw_customers(np.random.default_rng(9), 64)
    served = runtimes["churn_lgbm"].predict(as_inputs(customers))["churn_probability"][:, 0]
    # float32 inputs on the wire: the booster sees spend and usage rounded to float32.
    np.testing.assert_allclose(served, booster.predict(feature_matrix(customers)), atol=1e-3)


@pytest.mark.parametrize("model", MODELS)
def test_warmup_batches_from_the_config_run(
    example_repository: Path, runtimes: dict[str, Runtime], model: str
) -> None:
    config: ModelConfig = load_model_config(example_repository / model)
    sizes = []
    for batch in warmup_batches(config):
        sizes.append(len(runtimes[model].predict(batch)["churn_probability"]))
    assert sizes == [1, 16, 256, 1, 16, 256]


def test_sample_rows_are_deterministic_valid_and_plain() -> None:
    rows = sample_rows(200, seed=4)
    assert rows == sample_rows(200, seed=4)
    assert rows != sample_rows(200, seed=5)
    assert list(rows) == [field.name for field in FIELDS]
    for field in FIELDS:
        column = rows[field.name]
        assert len(column) == 200
        if field.values is not None:
            assert set(column) <= set(field.values)
            assert all(type(value) is str for value in column)
        else:
            assert field.range is not None
            low, high = field.range
            assert all(low <= value <= high for value in column)
            plain = float if field.datatype == "FP32" else int
            assert all(type(value) is plain for value in column)
    assert len(set(zip(*rows.values(), strict=True))) == 200  # unique requests
    inputs = sample_inputs(200, seed=4)
    assert inputs["tenure_months"][:, 0].tolist() == rows["tenure_months"]
    assert inputs["plan_tier"][:, 0].tolist() == rows["plan_tier"]


def test_training_data_is_fixed_and_balanced_enough() -> None:
    customers, labels = training_data(rows=2000)
    again, labels_again = training_data(rows=2000)
    np.testing.assert_array_equal(labels, labels_again)
    np.testing.assert_array_equal(customers["monthly_spend"], again["monthly_spend"])
    assert 0.15 < labels.mean() < 0.6


def test_the_pickled_pipeline_is_the_one_the_onnx_graph_was_exported_from(tmp_path: Path) -> None:
    from tailserve.examples.churn import write_churn

    assert write_churn(tmp_path, sklearn=True) == ["churn", "churn_lgbm", "churn_sklearn"]
    config = load_model_config(tmp_path / "churn_sklearn")
    assert config.runtime == "sklearn" and config.trust
    loaded = {}
    for name in ("churn", "churn_sklearn"):
        context = RuntimeContext(load_model_config(tmp_path / name), 1, tmp_path / name / "1")
        loaded[name] = create_runtime(context)
        loaded[name].load()
    inputs = sample_inputs(500, seed=9)
    onnx_p = loaded["churn"].predict(inputs)["churn_probability"]
    sklearn_p = loaded["churn_sklearn"].predict(as_bytes(inputs))["churn_probability"]
    assert sklearn_p.shape == (500, 1)
    np.testing.assert_allclose(sklearn_p, onnx_p, atol=1e-4)


def test_the_sentiment_model_learnt_and_padding_changes_nothing(
    example_repository: Path,
) -> None:
    from tailserve.examples.sentiment import (
        EDGES,
        INPUT,
        OUTPUT,
        SEED,
        draw_reviews,
        pad,
        review_lengths,
        word_sentiments,
    )

    config = load_model_config(example_repository / "sentiment")
    assert config.batching.pad_value == 0 and config.batching.cost is not None
    assert config.batching.cost.edges == EDGES
    runtime = create_runtime(RuntimeContext(config, 1, example_repository / "sentiment" / "1"))
    runtime.load()
    truth = word_sentiments()  # the same seed: what the written model was trained on
    reviews, labels = draw_reviews(np.random.default_rng(SEED + 1), 400, truth)
    tight = runtime.predict({INPUT: pad(reviews)})[OUTPUT][:, 0]
    padded = runtime.predict({INPUT: pad(reviews, 600)})[OUTPUT][:, 0]
    np.testing.assert_allclose(padded, tight, atol=1e-6)
    assert ((tight > 0.5) == labels).mean() > 0.7  # it learnt something (held-out reviews)
    lengths = review_lengths(np.random.default_rng(0), 10_000)
    assert 18 <= np.median(lengths) <= 30 and np.percentile(lengths, 99) > 150  # skewed

    runtime.unload()


def test_sentiment_comes_with_measured_variants_that_serve_alike(
    example_repository: Path,
) -> None:
    from tailserve.examples.sentiment import INPUT, OUTPUT, SEED, draw_reviews, pad, word_sentiments

    config = load_model_config(example_repository / "sentiment")
    choices = config.variants.choices
    assert [v.name for v in choices] == ["fp32", "int8", "small"]
    accuracy = [v.accuracy for v in choices]
    assert all(a is not None and a > 0.75 for a in accuracy)  # AUC on labelled held-out reviews
    assert all(v.latency_ms and v.size_bytes for v in choices)
    # The cheaper forms are cheaper where batches are large, and lose little.
    assert choices[1].latency_ms[64] < choices[0].latency_ms[64]
    assert choices[2].latency_ms[64] < choices[0].latency_ms[64]
    reviews, _ = draw_reviews(np.random.default_rng(SEED + 7), 200, word_sentiments())
    scores = {}
    for variant in choices:
        context = RuntimeContext(config, 1, example_repository / "sentiment" / "1", variant)
        runtime = create_runtime(context)
        runtime.load()
        scores[variant.name] = runtime.predict({INPUT: pad(reviews)})[OUTPUT][:, 0]
        runtime.unload()
    assert np.abs(scores["int8"] - scores["fp32"]).max() < 0.1
    agree = ((scores["small"] > 0.5) == (scores["fp32"] > 0.5)).mean()
    assert 0.6 < agree < 1.0  # another model, as accurate: often other decisions, not all
