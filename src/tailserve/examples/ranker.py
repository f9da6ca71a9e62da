"""The ranker example: score a user's candidate items from features kept in the feature store.

A request names one user and 10 to 1,000 candidate items (``user_id``, ``item_ids``); the
worker looks up their features (``features:`` in model.yaml) and the model scores every
candidate, so its cost grows with the candidate count.

Synthetic catalog, fixed seed: 100,000 users and 50,000 items with 16 features each. The first
8 of each are a noisy view of a hidden taste vector; an item's 9th is its quality; the rest
are noise. A user likes an item more when their tastes align and the item is good. The
catalog is saved beside the model (``features.npz``, float16, ~4.8 MB) so that
``load_features`` can put it into Redis, and it is what the model was trained on.

The model (ONNX, built here): the user row, the item row and their elementwise product (48
values), a fixed random tanh layer of 256 units over them, and a logistic head over both,
fitted on 40,000 synthetic (user, item, liked) examples.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from tailserve.errors import ConfigError
from tailserve.examples.churn import write_config
from tailserve.modelconfig import load_model_config

MODEL = "ranker"
USER_INPUT, ITEM_INPUT = "user_features", "item_features"
USER_KEY, ITEM_KEY = "user_id", "item_ids"
OUTPUT = "score"
USERS, ITEMS = 100_000, 50_000
FEATURES = 16
TASTE = 8
HIDDEN = 256
USER_FIELDS = [f"u{i:02d}" for i in range(FEATURES)]
ITEM_FIELDS = [f"i{i:02d}" for i in range(FEATURES)]
CATALOG = "features.npz"
EDGES = [64, 128, 256, 512, 1024]
MAX_CANDIDATES = 1000
SEED = 23
TRAINING_PAIRS = 40_000

Array = np.ndarray[Any, Any]

_HEADER = "# Written by `tailserve examples`: synthetic data, fixed seed.\n"


# --- the synthetic catalog ------------------------------------------------------------------


def catalog(seed: int = SEED) -> dict[str, Array]:
    """Users and items as float32 feature rows (ids are row numbers), with the hidden tastes
    and qualities the labels come from."""
    rng = np.random.default_rng(seed)
    user_taste = rng.normal(0, 1, (USERS, TASTE))
    item_taste = rng.normal(0, 1, (ITEMS, TASTE))
    quality = rng.normal(0, 1, ITEMS)
    users = np.hstack(
        [
            user_taste + rng.normal(0, 0.3, user_taste.shape),
            rng.normal(0, 1, (USERS, FEATURES - TASTE)),
        ]
    )
    items = np.hstack(
        [
            item_taste + rng.normal(0, 0.3, item_taste.shape),
            (quality + rng.normal(0, 0.3, ITEMS))[:, None],
            rng.normal(0, 1, (ITEMS, FEATURES - TASTE - 1)),
        ]
    )
    # Stored as float16 (half the file): the rounded values are the features, for training too.
    return {
        "user": users.astype(np.float16).astype(np.float32),
        "item": items.astype(np.float16).astype(np.float32),
        "user_taste": user_taste,
        "item_taste": item_taste,
        "quality": quality,
    }


def liked(data: dict[str, Array], users: Array, items: Array, rng: np.random.Generator) -> Array:
    """0/1: did the user like the item (aligned tastes and quality, plus noise)."""
    affinity = (data["user_taste"][users] * data["item_taste"][items]).sum(axis=1)
    logit = 0.6 * affinity + 0.8 * data["quality"][items] - 1.0 + rng.normal(0, 0.5, len(users))
    labels: Array = (rng.random(len(users)) < 1.0 / (1.0 + np.exp(-logit))).astype(np.int64)
    return labels


def draw_pairs(data: dict[str, Array], n: int, rng: np.random.Generator) -> tuple[Array, ...]:
    """``n`` random (user id, item id, liked) examples."""
    users = rng.integers(0, USERS, n)
    items = rng.integers(0, ITEMS, n)
    return users, items, liked(data, users, items, rng)


def draw_request(rng: np.random.Generator, candidates: int) -> dict[str, Array]:
    """One request's ids: a user and ``candidates`` distinct items."""
    return {
        USER_KEY: np.array([rng.integers(0, USERS)], dtype=np.int64),
        ITEM_KEY: rng.choice(ITEMS, size=candidates, replace=False).astype(np.int64),
    }


# --- the model ------------------------------------------------------------------------------


def hidden_layer(rng: np.random.Generator) -> dict[str, Array]:
    inputs = 3 * FEATURES
    return {
        "w1": (rng.normal(0, 1, (inputs, HIDDEN)) / np.sqrt(inputs)).astype(np.float32),
        "b1": rng.normal(0, 0.1, HIDDEN).astype(np.float32),
    }


def pair_features(weights: dict[str, Array], users: Array, items: Array) -> Array:
    """What the graph computes before its head, in numpy: [N, 16] x [N, 16] -> [N, 48 + H]."""
    x = np.hstack([users, items, users * items]).astype(np.float32)
    hidden = np.tanh(x @ weights["w1"] + weights["b1"])
    return np.hstack([x, hidden])


def train(data: dict[str, Array] | None = None) -> tuple[dict[str, Array], float]:
    """The fixed hidden layer and the head fitted on synthetic examples; the head's training
    accuracy."""
    from sklearn.linear_model import LogisticRegression

    data = data if data is not None else catalog()
    rng = np.random.default_rng(SEED + 1)
    weights = hidden_layer(rng)
    users, items, labels = draw_pairs(data, TRAINING_PAIRS, rng)
    features = pair_features(weights, data["user"][users], data["item"][items])
    head = LogisticRegression(C=1.0, max_iter=500).fit(features, labels)
    weights["head_w"] = head.coef_.reshape(-1, 1).astype(np.float32)
    weights["head_b"] = head.intercept_.astype(np.float32)
    return weights, float(head.score(features, labels))


def scores(weights: dict[str, Array], users: Array, items: Array) -> Array:
    """The graph's output in numpy (float64 on float32 weights), [N, 1]."""
    logit = pair_features(weights, users, items) @ weights["head_w"] + weights["head_b"]
    result: Array = 1.0 / (1.0 + np.exp(-logit))
    return result


def graph(weights: dict[str, Array]) -> bytes:
    from onnx import TensorProto, helper

    from tailserve.examples.onnx_graph import build_model

    nodes = [
        helper.make_node("Mul", [USER_INPUT, ITEM_INPUT], ["cross"]),
        helper.make_node("Concat", [USER_INPUT, ITEM_INPUT, "cross"], ["pair"], axis=1),
        helper.make_node("MatMul", ["pair", "w1"], ["h_mm"]),
        helper.make_node("Add", ["h_mm", "b1"], ["h_pre"]),
        helper.make_node("Tanh", ["h_pre"], ["hidden"]),
        helper.make_node("Concat", ["pair", "hidden"], ["both"], axis=1),
        helper.make_node("MatMul", ["both", "head_w"], ["logit_mm"]),
        helper.make_node("Add", ["logit_mm", "head_b"], ["logit"]),
        helper.make_node("Sigmoid", ["logit"], [OUTPUT]),
    ]
    constants = {name: weights[name] for name in ("w1", "b1", "head_w", "head_b")}
    inputs = [
        (USER_INPUT, TensorProto.FLOAT, [None, FEATURES]),
        (ITEM_INPUT, TensorProto.FLOAT, [None, FEATURES]),
    ]
    return build_model(MODEL, nodes, inputs, OUTPUT, constants)


def model_config() -> dict[str, Any]:
    def features(name: str) -> dict[str, Any]:
        return {"name": name, "datatype": "FP32", "shape": [FEATURES]}

    return {
        "runtime": "onnx",
        # Rows are candidates: a batch holds a few requests of hundreds each.
        "max_batch_size": 4096,
        "inputs": [features(USER_INPUT), features(ITEM_INPUT)],
        "outputs": [{"name": OUTPUT, "datatype": "FP32", "shape": [1]}],
        "batching": {
            "cost": {"by": "rows", "edges": EDGES},
            "max_queue_delay_ms": 2,
            "max_queue_size": 1024,
        },
        "instances": {"count": 1, "intra_op_threads": 1},
        "version_policy": {"latest": 1},
        "warmup": {"batch_sizes": [1, *EDGES, 2048, 4096], "repeat": 2},
        "slo": {"p99_ms": 30},
        # The same user with the same candidates gets the same scores for a minute.
        "cache": {
            "enabled": True,
            "ttl_s": 60,
            "l1": {"max_entries": 20_000, "max_bytes": 64 * 1024 * 1024, "policy": "tinylfu"},
        },
        # The client sends ids; the worker fills the inputs from the feature store.
        "features": {
            "version": "1",
            "ttl_s": 300,
            "max_entries": 200_000,
            "inputs": [
                {
                    "input": USER_INPUT,
                    "key": USER_KEY,
                    "entity": "user",
                    "fields": USER_FIELDS,
                    "datatype": "INT64",
                    "shape": [1],
                },
                {
                    "input": ITEM_INPUT,
                    "key": ITEM_KEY,
                    "entity": "item",
                    "fields": ITEM_FIELDS,
                    "datatype": "INT64",
                    "shape": [-1],
                },
            ],
        },
    }


def write_ranker(directory: Path) -> str:
    data = catalog()
    weights, _ = train(data)
    model_dir = directory / MODEL
    write_config(model_dir, model_config(), header=_HEADER)
    (model_dir / "1").mkdir(exist_ok=True)
    (model_dir / "1" / "model.onnx").write_bytes(graph(weights))
    with (model_dir / CATALOG).open("wb") as file:
        np.savez(
            file,
            user=data["user"].astype(np.float16),
            item=data["item"].astype(np.float16),
            user_fields=np.array(USER_FIELDS),
            item_fields=np.array(ITEM_FIELDS),
        )
    return MODEL


# --- loading the features into Redis --------------------------------------------------------


async def write_features(model_dir: Path, store: Any) -> dict[str, int]:
    """Put the catalog beside the model into ``store`` (a ``FeatureStore``) under the model's
    feature version; how many rows of each entity."""
    config = load_model_config(model_dir)
    if config.features is None:
        raise ConfigError(f"{model_dir}: the model reads no features (no 'features:')")
    with np.load(model_dir / CATALOG) as saved:
        counts: dict[str, int] = {}
        for spec in config.features.inputs:
            if spec.entity in counts:
                continue
            rows = saved[spec.entity].astype(np.float32)
            fields = [str(name) for name in saved[f"{spec.entity}_fields"]]
            counts[spec.entity] = await store.write_matrix(
                spec.entity, config.features.version, range(len(rows)), fields, rows
            )
    return counts


def load_features(
    model_dir: Path | str, redis_url: str, *, cluster: bool = False
) -> dict[str, int]:
    """Load the ranker's synthetic features into the Redis at ``redis_url`` (~150,000 rows,
    2,000 a command), and the funnel's retrieval vectors made from them (as many again); how many
    rows of each entity. Raises ``Unavailable`` when Redis fails."""
    from tailserve.process.loops import run

    return run(_load(Path(model_dir), redis_url, cluster))


async def _load(model_dir: Path, redis_url: str, cluster: bool) -> dict[str, int]:
    from tailserve.cache.feature_store import FeatureStore
    from tailserve.cache.redis import connect
    from tailserve.examples.funnel import write_vectors

    client = connect(redis_url, cluster=cluster, timeout_s=2.0)
    try:
        store = FeatureStore(client)
        counts = await write_features(model_dir, store)
        counts.update(await write_vectors(model_dir, store))
        return counts
    finally:
        await client.aclose()
