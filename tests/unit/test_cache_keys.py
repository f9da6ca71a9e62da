"""Cache keys: what must change a key and what must not."""

from __future__ import annotations

import hashlib
import struct

import numpy as np

from tailserve.cache.keys import KeyBuilder, KeyRule, model_prefix, schema_hash, version_prefix
from tailserve.tensors import Tensor

SCHEMA = schema_hash([("a", "FP32", [1]), ("b", "INT64", [1])])


def builder(version: int = 1, feature_version: str = "", rule: KeyRule | None = None) -> KeyBuilder:
    return KeyBuilder("churn", version, SCHEMA, feature_version, rule)


def tensors(a: object = (1.5, 2.5), b: object = (3, 4), a_type: str = "FP32") -> list[Tensor]:
    dtype = {"FP32": np.float32, "FP64": np.float64}[a_type]
    return [
        Tensor("a", a_type, np.array(a, dtype=dtype)),
        Tensor("b", "INT64", np.array(b, dtype=np.int64)),
    ]


def test_the_same_inputs_give_the_same_key_whatever_their_order() -> None:
    one = builder().key(tensors())
    assert one == builder().key(list(reversed(tensors())))
    assert one.startswith(version_prefix("churn", 1))
    assert one.startswith(model_prefix("churn"))


def test_data_shape_datatype_version_and_features_change_the_key() -> None:
    base = builder().key(tensors())
    variants = {
        "data": builder().key(tensors(a=(1.5, 2.6))),
        "shape": builder().key(tensors(a=((1.5, 2.5),), b=((3, 4),))),
        "datatype": builder().key(tensors(a_type="FP64")),
        "version": builder(version=2).key(tensors()),
        "feature version": builder(feature_version="2").key(tensors()),
    }
    assert len({base, *variants.values()}) == len(variants) + 1, variants


def test_the_schema_is_part_of_the_key() -> None:
    other = schema_hash([("a", "FP32", [2]), ("b", "INT64", [1])])
    assert other != SCHEMA
    assert KeyBuilder("churn", 1, other).key(tensors()) != builder().key(tensors())


def test_framing_keeps_adjacent_fields_apart() -> None:
    # The same bytes split differently between two BYTES elements must not collide.
    left = [Tensor("t", "BYTES", np.array([b"ab", b"c"], dtype=object))]
    right = [Tensor("t", "BYTES", np.array([b"a", b"bc"], dtype=object))]
    assert builder().key(left) != builder().key(right)
    # str (JSON) and bytes (binary) of the same text are one value.
    text = [Tensor("t", "BYTES", np.array(["ab", "c"], dtype=object))]
    assert builder().key(text) == builder().key(left)


def test_memory_layout_does_not_change_the_key() -> None:
    data = np.arange(6, dtype=np.float32).reshape(2, 3)
    fortran = np.asfortranarray(data)
    big_endian = data.astype(">f4")
    keys = {builder().key([Tensor("a", "FP32", array)]) for array in (data, fortran, big_endian)}
    assert len(keys) == 1


def test_excluded_inputs_are_left_out() -> None:
    rule = KeyRule(exclude=frozenset({"b"}))
    assert builder(rule=rule).key(tensors(b=(3, 4))) == builder(rule=rule).key(tensors(b=(9, 9)))
    assert builder(rule=rule).key(tensors(a=(1, 1))) != builder(rule=rule).key(tensors())


def test_rounded_inputs_share_a_key_within_their_grid_cell() -> None:
    rule = KeyRule(round={"a": 0.5})
    near = builder(rule=rule).key(tensors(a=(1.6, 2.4)))
    assert near == builder(rule=rule).key(tensors(a=(1.4, 2.6)))
    assert near != builder(rule=rule).key(tensors(a=(2.1, 2.4)))


def test_parameters_named_by_the_rule_change_the_key_and_others_do_not() -> None:
    rule = KeyRule(parameters=("top_k",))
    key = builder(rule=rule).key
    assert key(tensors(), {"top_k": 5}) != key(tensors(), {"top_k": 6})
    assert key(tensors(), {"top_k": 5, "timeout": 1}) == key(tensors(), {"top_k": 5})
    # A parameter outside the rule (a deadline, a priority) never splits the cache.
    assert builder().key(tensors(), {"timeout": 10}) == builder().key(tensors())


def test_the_key_is_the_documented_framing_so_stored_results_outlive_a_worker() -> None:
    # Rebuilt by hand from the module's description: results written to Redis (precomputed,
    # or by another worker) are found only if every worker frames a key the same way.
    def framed(data: bytes) -> bytes:
        return struct.pack("<Q", len(data)) + data

    digest = hashlib.blake2b(digest_size=16)
    for part in ("churn", "1", SCHEMA, ""):
        digest.update(framed(part.encode()))
    for name, datatype, array in (
        ("a", "FP32", np.array([1.5, 2.5], dtype=np.float32)),
        ("b", "INT64", np.array([3, 4], dtype=np.int64)),
    ):
        digest.update(framed(f"{name}\x00{datatype}\x00{array.shape}".encode()))
        digest.update(framed(array.tobytes()))
    expected = version_prefix("churn", 1) + digest.hexdigest()
    keys = builder()
    assert keys.key(tensors()) == expected
    # Again, from the builder's remembered framing of those tensors' names and shapes.
    assert keys.key(tensors()) == expected
    # A new shape of a known tensor is framed anew, not taken for the old one.
    assert keys.key(tensors(a=((1.5, 2.5),))) != expected


def test_a_kind_of_request_met_before_is_keyed_as_the_documented_framing() -> None:
    # A builder keeps, per kind of request (names, datatypes and shapes in the order given),
    # each input's framing; every kind, met first or again, in any order, with an input left
    # out, of another memory layout or byte order, keys as the framing says.
    def expected(arrays: dict[str, np.ndarray]) -> str:
        digest = hashlib.blake2b(digest_size=16)
        for part in ("churn", "1", SCHEMA, ""):
            digest.update(struct.pack("<Q", len(part)) + part.encode())
        for name in sorted(arrays):
            if name == "skip":
                continue
            array = arrays[name]
            head = f"{name}\x00{'FP32' if array.dtype.kind == 'f' else 'INT64'}\x00{array.shape}"
            raw = np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("<")).tobytes()
            for data in (head.encode(), raw):
                digest.update(struct.pack("<Q", len(data)) + data)
        return version_prefix("churn", 1) + digest.hexdigest()

    keys = builder(rule=KeyRule(exclude=frozenset({"skip"})))
    rng = np.random.default_rng(7)
    for step in range(60):
        arrays = {
            "b": rng.integers(0, 9, size=(1 + step % 2, 2)),
            "a": rng.random((1 + step % 3, 2), dtype=np.float32),
            "skip": rng.random((1,), dtype=np.float32),
        }
        if step % 4 == 1:
            arrays["a"] = np.asfortranarray(arrays["a"])
        if step % 5 == 2:
            arrays["b"] = arrays["b"].astype(">i8")
        given = [
            Tensor(n, "FP32" if a.dtype.kind == "f" else "INT64", a) for n, a in arrays.items()
        ]
        if step % 2:
            given.reverse()
        assert keys.key(given) == expected(arrays), step
