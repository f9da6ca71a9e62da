"""The ranker example: its model.yaml, its catalog, and a model that loads, ranks liked items
above the rest, and is the same on every run."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tailserve.cache.features import check_features
from tailserve.engine.warmup import warmup_batches
from tailserve.examples import ranker
from tailserve.modelconfig import load_model_config
from tailserve.runtimes import Runtime, RuntimeContext, create_runtime


@pytest.fixture(scope="module")
def model_dir(example_repository: Path) -> Path:
    return example_repository / ranker.MODEL


@pytest.fixture(scope="module")
def runtime(model_dir: Path) -> Iterator[Runtime]:
    loaded = create_runtime(RuntimeContext(load_model_config(model_dir), 1, model_dir / "1"))
    loaded.load()
    yield loaded
    loaded.unload()


@pytest.fixture(scope="module")
def saved(model_dir: Path) -> dict[str, np.ndarray[Any, Any]]:
    with np.load(model_dir / ranker.CATALOG) as catalog:
        return dict(catalog)


def auc(scores: np.ndarray[Any, Any], labels: np.ndarray[Any, Any]) -> float:
    """The chance a liked pair scores above one not liked (Mann-Whitney)."""
    ranks = np.empty(len(scores))
    ranks[np.argsort(scores)] = np.arange(1, len(scores) + 1)
    liked = labels == 1
    n_pos, n_neg = int(liked.sum()), int((~liked).sum())
    return float((ranks[liked].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def test_the_config_reads_ids_from_the_feature_store(model_dir: Path) -> None:
    config = load_model_config(model_dir)
    check_features(config)
    assert [(s.name, s.datatype, s.shape) for s in config.inputs] == [
        ("user_features", "FP32", [16]),
        ("item_features", "FP32", [16]),
    ]
    assert [(o.name, o.shape) for o in config.outputs] == [("score", [1])]
    assert config.features is not None
    lookups = {(f.key, f.entity, tuple(f.shape), f.datatype) for f in config.features.inputs}
    assert lookups == {("user_id", "user", (1,), "INT64"), ("item_ids", "item", (-1,), "INT64")}
    assert config.batching.cost is not None and config.batching.cost.by == "rows"
    assert config.max_batch_size >= ranker.MAX_CANDIDATES
    assert config.cache.enabled


def test_the_catalog_is_saved_compactly_beside_the_model(
    model_dir: Path, saved: dict[str, np.ndarray[Any, Any]]
) -> None:
    assert saved["user"].shape == (ranker.USERS, ranker.FEATURES)
    assert saved["item"].shape == (ranker.ITEMS, ranker.FEATURES)
    assert saved["user"].dtype == np.float16
    assert saved["user_fields"].tolist() == ranker.USER_FIELDS
    assert (model_dir / ranker.CATALOG).stat().st_size < 6_000_000
    np.testing.assert_array_equal(saved["item"].astype(np.float32), ranker.catalog()["item"])


def test_the_model_ranks_liked_items_above_the_rest(
    runtime: Runtime, saved: dict[str, np.ndarray[Any, Any]]
) -> None:
    data = ranker.catalog()
    users, items, labels = ranker.draw_pairs(data, 4000, np.random.default_rng(77))  # held out
    out = runtime.predict(
        {
            "user_features": saved["user"][users].astype(np.float32),
            "item_features": saved["item"][items].astype(np.float32),
        }
    )["score"]
    assert out.shape == (4000, 1) and out.dtype == np.float32
    assert ((out >= 0) & (out <= 1)).all()
    assert auc(out[:, 0], labels) > 0.75


def test_one_users_candidates_and_the_warmup_batches_run(
    runtime: Runtime, model_dir: Path, saved: dict[str, np.ndarray[Any, Any]]
) -> None:
    request = ranker.draw_request(np.random.default_rng(3), 1000)
    assert len(set(request["item_ids"].tolist())) == 1000
    user = saved["user"][request["user_id"]].astype(np.float32)
    items = saved["item"][request["item_ids"]].astype(np.float32)
    out = runtime.predict({"user_features": np.repeat(user, 1000, 0), "item_features": items})
    assert out["score"].shape == (1000, 1) and out["score"].std() > 0.01
    sizes = [len(b["item_features"]) for b in warmup_batches(load_model_config(model_dir))]
    assert max(sizes) == 4096
    for batch in warmup_batches(load_model_config(model_dir)):
        assert runtime.predict(batch)["score"].shape == (len(batch["item_features"]), 1)


def test_training_again_writes_the_same_model(model_dir: Path) -> None:
    weights, accuracy = ranker.train()
    assert ranker.graph(weights) == (model_dir / "1" / "model.onnx").read_bytes()
    assert accuracy > 0.7
