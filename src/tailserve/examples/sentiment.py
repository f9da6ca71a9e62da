"""The sentiment example: a small sequence model whose cost grows with the review's length.

Synthetic reviews: token ids 1..VOCAB-1 (0 is padding), lengths skewed (lognormal: most are a
few dozen tokens, a few run to hundreds), a fifth of the vocabulary carrying a sentiment. A
review is positive when its opinion words lean positive (plus noise).

The model (ONNX, built here): embed each token, two tanh layers per token, mean over the
tokens that are not padding, a logistic head. The per-token layers make the cost grow with
rows x length, and the masked mean makes padding with 0 change no answer, which is what lets
the batchers pad requests of different lengths into one batch. The embeddings and per-token
layers are fixed random projections (the embedding's first dimension holds each token's
sentiment); the head is trained by logistic regression on the synthetic reviews, fixed seeds.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from tailserve.examples.churn import write_config

MODEL = "sentiment"
INPUT = "token_ids"
OUTPUT = "positive_probability"
VOCAB = 2000
EMBED, HIDDEN = 128, 1024
# The smaller variant (model.small.onnx): the same design, a quarter as wide per token.
SMALL_HIDDEN = 256
MAX_LENGTH = 512
EDGES = [16, 32, 64, 128, 256, 512]
SEED = 11
TRAINING_REVIEWS = 2000

_HEADER = "# Written by `tailserve examples`: synthetic data, fixed seed.\n"


def review_lengths(rng: np.random.Generator, n: int) -> np.ndarray[Any, Any]:
    """Skewed lengths: median ~24 tokens, one in twenty over ~120, capped at MAX_LENGTH."""
    lengths = np.rint(rng.lognormal(np.log(24), 0.95, size=n))
    return np.clip(lengths, 1, MAX_LENGTH).astype(np.int64)


def draw_reviews(
    rng: np.random.Generator, n: int, sentiment: np.ndarray[Any, Any]
) -> tuple[list[np.ndarray[Any, Any]], np.ndarray[Any, Any]]:
    """``n`` reviews (token id arrays) and their 0/1 labels."""
    ranks = np.arange(1, VOCAB, dtype=float)
    popularity = ranks**-0.9 / (ranks**-0.9).sum()
    reviews, labels = [], []
    for length in review_lengths(rng, n).tolist():
        tokens = rng.choice(np.arange(1, VOCAB), size=length, p=popularity)
        lean = sentiment[tokens].sum() / np.sqrt(length) + rng.normal(0, 0.3)
        reviews.append(tokens.astype(np.int64))
        labels.append(int(lean > 0))
    return reviews, np.array(labels, dtype=np.int64)


def _weights(rng: np.random.Generator, hidden: int = HIDDEN) -> dict[str, np.ndarray[Any, Any]]:
    sentiment = np.where(rng.random(VOCAB) < 0.2, rng.normal(0, 1, VOCAB), 0.0)
    sentiment[0] = 0.0
    embedding = rng.normal(0, 0.5, (VOCAB, EMBED))
    embedding[:, 0] = sentiment
    embedding[0] = 0.0
    return {
        "sentiment": sentiment,
        "embedding": embedding.astype(np.float32),
        "w1": (rng.normal(0, 1, (EMBED, hidden)) / np.sqrt(EMBED)).astype(np.float32),
        "b1": np.zeros(hidden, np.float32),
        "w2": (rng.normal(0, 1, (hidden, EMBED)) / np.sqrt(hidden)).astype(np.float32),
        "b2": np.zeros(EMBED, np.float32),
    }


def pooled_features(weights: dict[str, np.ndarray[Any, Any]], tokens: np.ndarray[Any, Any]) -> Any:
    """What the graph computes before its head, in numpy: rows of [B, L] token ids -> [B, E]."""
    mask = (tokens > 0).astype(np.float32)
    hidden = np.tanh(weights["embedding"][tokens] @ weights["w1"] + weights["b1"])
    per_token = np.tanh(hidden @ weights["w2"] + weights["b2"]) * mask[..., None]
    return per_token.sum(axis=1) / np.maximum(mask.sum(axis=1, keepdims=True), 1.0)


def pad(reviews: list[np.ndarray[Any, Any]], length: int | None = None) -> Any:
    length = length or max(len(r) for r in reviews)
    out = np.zeros((len(reviews), length), dtype=np.int64)
    for i, review in enumerate(reviews):
        out[i, : len(review)] = review
    return out


def word_sentiments() -> np.ndarray[Any, Any]:
    """Each word's sentiment, the truth the synthetic reviews are drawn from (``draw_reviews``):
    the same as ``train`` starts from, without its seconds of fitting."""
    return _weights(np.random.default_rng(SEED))["sentiment"]


def train(hidden: int = HIDDEN) -> tuple[dict[str, np.ndarray[Any, Any]], float]:
    """The fixed weights (``hidden`` wide per token), the head fitted on synthetic reviews; and
    its training accuracy."""
    from sklearn.linear_model import LogisticRegression

    rng = np.random.default_rng(SEED)
    weights = _weights(rng, hidden)
    reviews, labels = draw_reviews(rng, TRAINING_REVIEWS, weights["sentiment"])
    # Reviews of similar length together, so the forward pass pads little.
    order = np.argsort([len(review) for review in reviews], kind="stable")
    features = np.empty((len(reviews), EMBED), dtype=np.float32)
    for start in range(0, len(order), 64):
        chosen = order[start : start + 64]
        features[chosen] = pooled_features(weights, pad([reviews[i] for i in chosen]))
    head = LogisticRegression(C=10.0, max_iter=1000).fit(features, labels)
    weights["head_w"] = head.coef_.reshape(EMBED, 1).astype(np.float32)
    weights["head_b"] = head.intercept_.astype(np.float32)
    return weights, float(head.score(features, labels))


def graph(weights: dict[str, np.ndarray[Any, Any]]) -> bytes:
    from onnx import TensorProto, helper

    from tailserve.examples.onnx_graph import build_model

    nodes = [
        helper.make_node("Gather", ["embedding", INPUT], ["embedded"]),
        helper.make_node("MatMul", ["embedded", "w1"], ["h1_mm"]),
        helper.make_node("Add", ["h1_mm", "b1"], ["h1_pre"]),
        helper.make_node("Tanh", ["h1_pre"], ["h1"]),
        helper.make_node("MatMul", ["h1", "w2"], ["h2_mm"]),
        helper.make_node("Add", ["h2_mm", "b2"], ["h2_pre"]),
        helper.make_node("Tanh", ["h2_pre"], ["h2"]),
        helper.make_node("Greater", [INPUT, "zero"], ["is_token"]),
        helper.make_node("Cast", ["is_token"], ["mask"], to=TensorProto.FLOAT),
        helper.make_node("Unsqueeze", ["mask", "last_axis"], ["mask3"]),
        helper.make_node("Mul", ["h2", "mask3"], ["masked"]),
        helper.make_node("ReduceSum", ["masked", "length_axis"], ["summed"], keepdims=0),
        helper.make_node("ReduceSum", ["mask", "length_axis"], ["count"], keepdims=1),
        helper.make_node("Max", ["count", "one"], ["count_safe"]),
        helper.make_node("Div", ["summed", "count_safe"], ["pooled"]),
        helper.make_node("MatMul", ["pooled", "head_w"], ["logit_mm"]),
        helper.make_node("Add", ["logit_mm", "head_b"], ["logit"]),
        helper.make_node("Sigmoid", ["logit"], [OUTPUT]),
    ]
    constants = {
        **{
            name: weights[name]
            for name in ("embedding", "w1", "b1", "w2", "b2", "head_w", "head_b")
        },
        "zero": np.array(0, np.int64),
        "one": np.array([1.0], np.float32),
        "last_axis": np.array([-1], np.int64),
        "length_axis": np.array([1], np.int64),
    }
    inputs = [(INPUT, TensorProto.INT64, [None, None])]
    return build_model(MODEL, nodes, inputs, OUTPUT, constants)


def model_config() -> dict[str, Any]:
    return {
        "runtime": "onnx",
        "max_batch_size": 64,
        "inputs": [{"name": INPUT, "datatype": "INT64", "shape": [-1], "range": [0, VOCAB - 1]}],
        "outputs": [{"name": OUTPUT, "datatype": "FP32", "shape": [1]}],
        "batching": {
            "pad_value": 0,
            "cost": {"by": INPUT, "edges": EDGES},
            "max_queue_size": 2048,
            "max_queue_delay_ms": 2,
        },
        "instances": {"count": 1, "intra_op_threads": 1},
        "version_policy": {"latest": 1},
        "warmup": {"batch_sizes": [1, 8, 64], "repeat": 2},
        "slo": {"p99_ms": 100},
        # The full model, its dynamic INT8 quantisation and the smaller model (their accuracy
        # and latency measured by `tailserve optimize` as the example is written).
        "variants": {
            "metric": "auc",
            "choices": [
                {"name": "fp32"},
                {"name": "int8", "artifact": INT8_ARTIFACT},
                {"name": "small", "artifact": SMALL_ARTIFACT},
            ],
        },
    }


INT8_ARTIFACT = "model.int8-dynamic.onnx"
SMALL_ARTIFACT = "model.small.onnx"
# Held-out reviews for the variants' accuracy: labelled, of at most this many tokens (the
# full model scores them in about a second).
HELD_OUT_REVIEWS, HELD_OUT_LENGTH = 600, 128


def held_out(weights: dict[str, np.ndarray[Any, Any]], path: Path) -> Path:
    """Labelled reviews no training saw (a seed of their own), as `tailserve optimize` reads
    them: token ids padded with 0 (which the model reads as padding), and their labels."""
    rng = np.random.default_rng(SEED + 1)
    reviews, labels = draw_reviews(rng, HELD_OUT_REVIEWS, weights["sentiment"])
    kept = [i for i, review in enumerate(reviews) if len(review) <= HELD_OUT_LENGTH]
    tokens = pad([reviews[i] for i in kept], HELD_OUT_LENGTH)
    np.savez(path, **{INPUT: tokens, "labels": labels[kept]})
    return path


def write_sentiment(directory: Path, *, measure: bool = True) -> str:
    """The model, its smaller sibling and (``measure``) its INT8 variant, each measured."""
    weights, _ = train()
    model_dir = directory / MODEL
    write_config(model_dir, model_config(), header=_HEADER)
    version_dir = model_dir / "1"
    version_dir.mkdir(exist_ok=True)
    (version_dir / "model.onnx").write_bytes(graph(weights))
    small, _ = train(SMALL_HIDDEN)
    (version_dir / SMALL_ARTIFACT).write_bytes(graph(small))
    if measure:
        from tailserve.optimize import Options, optimize

        with tempfile.TemporaryDirectory() as scratch:
            optimize(
                model_dir,
                Options(
                    held_out=held_out(weights, Path(scratch) / "held_out.npz"),
                    kinds=("dynamic",),
                    keep=("fp32", "int8", "small"),
                    batch_sizes=(1, 8, 64),
                    repeat=5,
                ),
            )
    return MODEL
