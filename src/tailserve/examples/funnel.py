"""The funnel example: retrieval, feature lookup, ranking and a re-rank, each within a budget.

``funnel`` is a pipeline model (``runtime: pipeline``): a request names one user and gets the
50 items to show them, best first.

1. ``retrieve`` (4 ms): the 400 items whose vectors score highest against the user's. The
   vectors are precomputed into the feature store (`write_vectors`): a user's is the first 8 of
   their ranker features and a 1; an item's, the first 8 of its features and its quality (the
   9th), so the dot product is the ranker's own signal, cheaply. Late: fewer candidates, or the
   precomputed most popular items.
2. ``features`` (6 ms): the ranker's inputs for the user and the candidates, from the store.
   Late: fewer candidates looked up.
3. ``rank`` (20 ms): the ``ranker`` model over the candidates. Late: fewer candidates (as many
   as its cost model and queue say fit), or, refused or out of time, the retrieval's order.
4. ``top``: the 50 best by the ranker's score.
5. ``rerank`` (6 ms): ``rerank``, a Python model, spreads the 50 over tastes (a greedy maximal
   marginal relevance over the item vectors). Late: the ranker's order.

The SLO is 50 ms; the budgets add up to 36, leaving room for the steps' own overhead.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from tailserve.examples.churn import write_config
from tailserve.examples.ranker import CATALOG, ITEMS, TASTE, USERS
from tailserve.modelconfig.pipeline import fallback_fields

MODEL = "funnel"
RERANK = "rerank"
VERSION = "1"
USER_VECTORS, ITEM_VECTORS, POPULAR = "user_vec", "item_vec", "popular_items"
VECTOR_FIELDS = [f"v{i}" for i in range(TASTE + 1)]
CANDIDATES = 400
SHOWN = 50
ITEM_VECTOR_FILE = "item_vectors.npy"

Array = np.ndarray[Any, Any]

_HEADER = "# Written by `tailserve examples`: a pipeline over ranker and rerank.\n"


def vectors(user: Array, item: Array) -> tuple[Array, Array]:
    """Retrieval vectors from the ranker's feature rows (see the module's docstring)."""
    users = np.hstack([user[:, :TASTE], np.ones((len(user), 1))]).astype(np.float32)
    items = np.hstack([item[:, :TASTE], item[:, TASTE : TASTE + 1]]).astype(np.float32)
    return users, items


def popular(items: Array, top: int = CANDIDATES) -> Array:
    """The precomputed list: the items of highest quality, best first."""
    order: Array = np.argsort(-items[:, TASTE], kind="stable")[:top]
    return order.astype(np.int64)


def pipeline_config(*, budgets: bool = True) -> dict[str, Any]:
    rows = ["candidates", "retrieval_score"]
    features = ["user_features", "item_features"]
    return {
        "runtime": "pipeline",
        "inputs": [{"name": "user_id", "datatype": "INT64", "shape": [1], "range": [0, USERS - 1]}],
        "outputs": [
            {"name": "item_ids", "datatype": "INT64", "shape": [-1]},
            {"name": "scores", "datatype": "FP32", "shape": [-1]},
        ],
        "slo": {"p99_ms": 50},
        "pipeline": {
            "budgets": budgets,
            "steps": [
                {
                    "name": "retrieve",
                    "kind": "retrieve",
                    "budget_ms": 4,
                    "query": "user_id",
                    "top": CANDIDATES,
                    "min_rows": 100,
                    "index": {
                        "query_entity": USER_VECTORS,
                        "item_entity": ITEM_VECTORS,
                        "version": VERSION,
                        "fields": VECTOR_FIELDS,
                        "items": ITEMS,
                        "fallback_entity": POPULAR,
                    },
                    "outputs": {"ids": "candidates", "scores": "retrieval_score"},
                    "on_late": ["fewer", "fallback"],
                },
                {
                    "name": "features",
                    "kind": "features",
                    "model": "ranker",
                    "budget_ms": 6,
                    "inputs": {"user_id": "user_id", "item_ids": "candidates"},
                    "outputs": {name: name for name in features},
                    "rows": rows,
                    "min_rows": 100,
                    "on_late": ["fewer"],
                },
                {
                    "name": "rank",
                    "kind": "model",
                    "model": "ranker",
                    "budget_ms": 20,
                    "inputs": {name: name for name in features},
                    "outputs": {"score": "rank_score"},
                    "rows": [*rows, *features],
                    "min_rows": SHOWN,
                    "fallback": {"retrieval_score": "rank_score"},
                    "on_late": ["fewer", "fallback"],
                },
                {
                    "name": "top",
                    "kind": "topk",
                    "by": "rank_score",
                    "k": SHOWN,
                    "rows": ["candidates", "rank_score"],
                },
                {
                    "name": "rerank",
                    "kind": "model",
                    "model": RERANK,
                    "budget_ms": 6,
                    "inputs": {"item_ids": "candidates", "score": "rank_score"},
                    "outputs": {"item_ids": "item_ids", "score": "scores"},
                    "fallback": {"candidates": "item_ids", "rank_score": "scores"},
                    "on_late": ["fallback"],
                },
            ],
        },
    }


def rerank_config() -> dict[str, Any]:
    return {
        "runtime": "python",
        "inputs": [
            {"name": "item_ids", "datatype": "INT64", "shape": [-1], "range": [0, ITEMS - 1]},
            {"name": "score", "datatype": "FP32", "shape": [-1]},
        ],
        "outputs": [
            {"name": "item_ids", "datatype": "INT64", "shape": [-1]},
            {"name": "score", "datatype": "FP32", "shape": [-1]},
        ],
        "slo": {"p99_ms": 20},
        "parameters": {"diversity": 0.3},
    }


_RERANK_CODE = '''"""Re-rank: spread a ranked list over tastes (maximal marginal relevance)."""

from pathlib import Path

import numpy as np


class Model:
    def __init__(self, version_dir, config):
        self.vectors_path = Path(version_dir) / "item_vectors.npy"
        self.diversity = float(config.parameters.get("diversity", 0.3))

    def load(self):
        vectors = np.load(self.vectors_path).astype(np.float32)
        norms = np.linalg.norm(vectors, axis=1, keepdims=True)
        self.unit = vectors / np.maximum(norms, 1e-6)

    def predict(self, inputs):
        ids = np.asarray(inputs["item_ids"], dtype=np.int64).reshape(-1)
        score = np.asarray(inputs["score"], dtype=np.float32).reshape(-1)
        if len(ids) < 2:
            return {"item_ids": ids, "score": score}
        unit = self.unit[ids]
        similar = unit @ unit.T
        chosen = [int(np.argmax(score))]
        closest = similar[chosen[0]].copy()
        free = np.ones(len(ids), dtype=bool)
        free[chosen[0]] = False
        for _ in range(len(ids) - 1):
            value = (1 - self.diversity) * score - self.diversity * closest
            value[~free] = -np.inf
            pick = int(np.argmax(value))
            chosen.append(pick)
            free[pick] = False
            closest = np.maximum(closest, similar[pick])
        order = np.array(chosen)
        return {"item_ids": ids[order], "score": score[order]}
'''


def write_funnel(directory: Path) -> list[str]:
    """``funnel`` and ``rerank``, beside the ``ranker`` (whose catalog they read)."""
    with np.load(directory / "ranker" / CATALOG) as saved:
        _, items = vectors(saved["user"][:1].astype(np.float32), saved["item"].astype(np.float32))
    funnel_dir = directory / MODEL
    write_config(funnel_dir, pipeline_config(), header=_HEADER)
    (funnel_dir / "1").mkdir(exist_ok=True)
    rerank_dir = directory / RERANK
    write_config(rerank_dir, rerank_config(), header=_HEADER)
    (rerank_dir / "1").mkdir(exist_ok=True)
    (rerank_dir / "1" / "model.py").write_text(_RERANK_CODE, encoding="utf-8")
    np.save(rerank_dir / "1" / ITEM_VECTOR_FILE, items.astype(np.float16))
    return [MODEL, RERANK]


async def write_vectors(ranker_dir: Path, store: Any) -> dict[str, int]:
    """Precompute the retrieval vectors and the popular list into ``store`` (a
    ``FeatureStore``) from the ranker's catalog; how many rows of each."""
    with np.load(ranker_dir / CATALOG) as saved:
        users, items = vectors(saved["user"].astype(np.float32), saved["item"].astype(np.float32))
    counts = {
        USER_VECTORS: await store.write_matrix(
            USER_VECTORS, VERSION, range(len(users)), VECTOR_FIELDS, users
        ),
        ITEM_VECTORS: await store.write_matrix(
            ITEM_VECTORS, VERSION, range(len(items)), VECTOR_FIELDS, items
        ),
    }
    ranked = popular(items).astype(np.float32)[None, :]
    counts[POPULAR] = await store.write_matrix(
        POPULAR, VERSION, [0], fallback_fields(CANDIDATES), ranked
    )
    return counts
