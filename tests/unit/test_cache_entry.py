"""The binary form of a cached result round-trips every datatype and its lineage."""

from __future__ import annotations

import msgspec
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


@pytest.mark.parametrize(
    ("datatype", "shape", "data"),
    [("FP128", [1], b"\x00" * 16), ("FP32", [3], b"\x00" * 4), ("FP32", [2], b"\x00" * 6)],
)
def test_a_well_formed_value_of_another_making_is_refused_not_raised(
    datatype: str, shape: list[int], data: bytes
) -> None:
    # Another writer's value: an unknown datatype, or data that fits neither shape nor type.
    good = encode(
        CachedResult({"y": np.array([1.0], dtype=np.float32)}, Lineage(1, "", 1.0, "w"), 2.0)
    )
    wire = msgspec.msgpack.decode(good)
    wire[6][0][1:] = [datatype, shape, data]  # outputs[0]: name, datatype, shape, data
    with pytest.raises(ValueError, match="not a cached result: tensor 'y'"):
        decode(msgspec.msgpack.encode(wire))
