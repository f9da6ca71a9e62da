"""The binary form of a cached result round-trips every datatype and its lineage."""

from __future__ import annotations

import numpy as np
import pytest

from tailserve.cache.entry import CachedResult, Lineage, decode, encode


def test_round_trip() -> None:
    outputs = {
        "score": np.array([[0.25], [0.5]], dtype=np.float32),
        "half": np.array([1.5], dtype=np.float16),
        "ids": np.array([1, 2, 3], dtype=np.int64),
        "label": np.array([b"yes", b"no"], dtype=object),
    }
    lineage = Lineage(3, "f2", 1700000000.5, "host:1", precomputed=True)
    result = decode(encode(CachedResult(outputs, lineage, 1700000300.0)))
    assert result.lineage == lineage and result.fresh_until == 1700000300.0
    for name, array in outputs.items():
        assert result.outputs[name].shape == array.shape
        assert result.outputs[name].dtype == array.dtype
        assert result.outputs[name].tolist() == array.tolist()


def test_a_churn_score_is_small() -> None:
    result = CachedResult(
        {"churn_probability": np.array([0.1], dtype=np.float32)},
        Lineage(1, "", 1.0, "worker-1"),
        2.0,
    )
    assert len(encode(result)) < 100


def test_garbage_is_refused() -> None:
    with pytest.raises(ValueError, match="not a cached result"):
        decode(b"\x01\x02garbage")
