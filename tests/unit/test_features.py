"""The feature resolver against an in-memory store: ids in, model inputs out, with an
in-process cache in front of the store and errors that name the tensor."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import msgspec
import numpy as np
import pytest

from tailserve.cache.feature_store import EntityId
from tailserve.cache.features import (
    FeatureResolver,
    check_features,
    check_features_config,
)
from tailserve.engine.validation import InputPlan
from tailserve.errors import ConfigError, InvalidInput, Unavailable
from tailserve.examples import ranker
from tailserve.modelconfig import FeatureInput, FeaturesConfig, parse_model_config
from tailserve.tensors import Tensor


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class MemoryStore:
    """The store's read interface over dicts: (entity, version) -> {id: {field: value}}."""

    def __init__(self) -> None:
        self.rows: dict[tuple[str, str], dict[Any, dict[str, float]]] = {}
        self.reads: list[tuple[str, str, list[Any]]] = []
        self.prepared: list[tuple[str, str]] = []
        self.failure: Exception | None = None

    def put(self, entity: str, version: str, entity_id: Any, **fields: float) -> None:
        self.rows.setdefault((entity, version), {})[entity_id] = fields

    async def read(
        self,
        entity: str,
        version: str,
        ids: Sequence[EntityId],
        fields: Sequence[str],
        *,
        timeout_s: float | None = None,
    ) -> np.ndarray[Any, Any]:
        self.reads.append((entity, version, list(ids)))
        if self.failure is not None:
            raise self.failure
        table = self.rows.get((entity, version), {})
        missing = [i for i in ids if i not in table]
        if missing:
            raise InvalidInput(f"unknown {entity} id {missing[0]!r}")
        return np.array([[table[i][f] for f in fields] for i in ids], dtype=np.float32)

    async def prepare(self, entity: str, version: str, fields: Sequence[str]) -> None:
        self.prepared.append((entity, version))
        if (entity, version) not in self.rows:
            raise Unavailable(f"the store holds no {entity!r} features of version {version!r}")


USER = FeatureInput(input="user_features", key="user_id", entity="user", fields=["a", "b"])
ITEM = FeatureInput(
    input="item_features", key="item_ids", entity="item", fields=["x", "y", "z"], shape=[-1]
)


def config(*inputs: FeatureInput, ttl_s: float = 60.0, max_entries: int = 1000) -> FeaturesConfig:
    return FeaturesConfig(version="1", ttl_s=ttl_s, max_entries=max_entries, inputs=list(inputs))


@pytest.fixture
def store() -> MemoryStore:
    store = MemoryStore()
    for user in range(5):
        store.put("user", "1", user, a=user, b=-user)
    for item in range(100):
        store.put("item", "1", item, x=item, y=item + 0.5, z=-item)
    return store


def ids(name: str, values: list[int], shape: list[int] | None = None) -> Tensor:
    data = np.array(values, dtype=np.int64).reshape(shape or [len(values)])
    return Tensor(name, "INT64", data)


def by_name(tensors: list[Tensor]) -> dict[str, Tensor]:
    return {tensor.name: tensor for tensor in tensors}


async def test_the_user_row_repeats_for_every_row_and_items_fill_one_a_row(
    store: MemoryStore,
) -> None:
    resolver = FeatureResolver(config(USER, ITEM), store, Clock())
    context = Tensor("context", "FP32", np.zeros((3, 1), np.float32))
    out = await resolver.resolve([ids("user_id", [2]), ids("item_ids", [7, 3, 9]), context])
    assert [t.name for t in out] == ["user_features", "item_features", "context"]
    user, item = out[0], out[1]
    assert user.datatype == item.datatype == "FP32"
    np.testing.assert_array_equal(user.data, [[2, -2]] * 3)
    np.testing.assert_array_equal(item.data, [[7, 7.5, -7], [3, 3.5, -3], [9, 9.5, -9]])
    assert user.data.dtype == np.float32 and user.data.flags.writeable
    assert out[2] is context


@pytest.mark.parametrize(("user_shape", "item_shape"), [([1, 1], [4, 1]), ([1], [4])])
async def test_ids_come_as_flat_lists_or_columns(
    store: MemoryStore, user_shape: list[int], item_shape: list[int]
) -> None:
    resolver = FeatureResolver(config(USER, ITEM), store, Clock())
    out = by_name(
        await resolver.resolve(
            [ids("user_id", [4], user_shape), ids("item_ids", [1, 2, 3, 4], item_shape)]
        )
    )
    assert out["user_features"].shape == [4, 2]
    assert out["item_features"].shape == [4, 3]
    np.testing.assert_array_equal(out["item_features"].data[:, 0], [1, 2, 3, 4])


async def test_resolved_ranker_inputs_pass_the_models_own_checks(store: MemoryStore) -> None:
    model = parse_model_config({"name": "ranker", **ranker.model_config()}, source="ranker")
    assert model.features is not None
    for user in range(3):
        store.put("user", "1", user, **{f: float(user) for f in ranker.USER_FIELDS})
    for item in range(600):
        store.put("item", "1", item, **{f: item / 600 for f in ranker.ITEM_FIELDS})
    resolver = FeatureResolver(model.features, store, Clock())
    request = ranker.draw_request(np.random.default_rng(1), 500)
    request["user_id"] = np.array([2], dtype=np.int64)
    request["item_ids"] = request["item_ids"] % 600
    tensors = [Tensor(name, "INT64", array) for name, array in request.items()]
    checked = InputPlan(model).check(await resolver.resolve(tensors))
    assert checked.rows == 500
    assert (checked.arrays["user_features"] == 2.0).all()
    np.testing.assert_allclose(checked.arrays["item_features"][:, 0], request["item_ids"] / 600)


async def test_cached_rows_skip_the_store_and_only_misses_are_read(store: MemoryStore) -> None:
    resolver = FeatureResolver(config(USER, ITEM), store, Clock())
    await resolver.resolve([ids("user_id", [1]), ids("item_ids", [5, 6, 5, 6])])
    assert sorted(store.reads) == [("item", "1", [5, 6]), ("user", "1", [1])]  # each id once
    store.reads.clear()
    out = by_name(await resolver.resolve([ids("user_id", [1]), ids("item_ids", [6, 8, 5])]))
    assert store.reads == [("item", "1", [8])]
    np.testing.assert_array_equal(out["item_features"].data[:, 0], [6, 8, 5])


async def test_warm_prepares_every_input_and_names_what_is_not_there(
    store: MemoryStore,
) -> None:
    assert await FeatureResolver(config(USER, ITEM), store, Clock()).warm() == []
    assert sorted(store.prepared) == [("item", "1"), ("user", "1")]
    account = FeatureInput(input="account_features", key="account", entity="account", fields=["a"])
    problems = await FeatureResolver(config(USER, account), store, Clock()).warm()
    assert problems == ["input 'account': the store holds no 'account' features of version '1'"]
    assert store.reads == []  # nothing was read


async def test_rows_expire_after_the_ttl(store: MemoryStore) -> None:
    clock = Clock()
    resolver = FeatureResolver(config(USER, ttl_s=30), store, clock)
    first = await resolver.resolve([ids("user_id", [3])])
    store.put("user", "1", 3, a=33, b=-33)
    clock.now += 29
    assert (await resolver.resolve([ids("user_id", [3])]))[0].data.tolist() == [[3, -3]]
    assert len(store.reads) == 1
    clock.now += 2
    later = await resolver.resolve([ids("user_id", [3])])
    assert len(store.reads) == 2
    assert first[0].data.tolist() == [[3, -3]] and later[0].data.tolist() == [[33, -33]]


async def test_no_ttl_means_no_cache_and_the_cache_is_bounded(store: MemoryStore) -> None:
    uncached = FeatureResolver(config(ITEM, ttl_s=0), store, Clock())
    for _ in range(2):
        await uncached.resolve([ids("item_ids", [1, 2])])
    assert len(store.reads) == 2
    store.reads.clear()
    small = FeatureResolver(config(ITEM, max_entries=2), store, Clock())
    await small.resolve([ids("item_ids", [1, 2, 3])])
    await small.resolve([ids("item_ids", [1, 2, 3])])
    assert len(store.reads) == 2 and store.reads[1][2]  # some were evicted, read again
    assert small.clear() <= 2


async def test_bytes_ids_match_as_text_or_bytes(store: MemoryStore) -> None:
    account = FeatureInput(
        input="account_features", key="account", entity="account", fields=["a"], datatype="BYTES"
    )
    store.put("account", "1", "acme", a=7.0)
    resolver = FeatureResolver(config(account), store, Clock())
    for value in ("acme", b"acme"):
        data = np.empty(1, dtype=object)
        data[0] = value
        out = await resolver.resolve([Tensor("account", "BYTES", data)])
        assert out[0].data.tolist() == [[7.0]]
    assert len(store.reads) == 1  # the second came from the cache under the same key


async def test_a_user_only_model_takes_its_rows_from_the_other_inputs(store: MemoryStore) -> None:
    resolver = FeatureResolver(config(USER), store, Clock())
    spend = Tensor("spend", "FP32", np.ones((4, 1), np.float32))
    out = by_name(await resolver.resolve([ids("user_id", [1]), spend]))
    assert out["user_features"].shape == [4, 2]
    alone = await resolver.resolve([ids("user_id", [1])])
    assert alone[0].shape == [1, 2]


async def test_a_client_may_send_the_features_themselves(store: MemoryStore) -> None:
    resolver = FeatureResolver(config(USER, ITEM), store, Clock())
    given = Tensor("user_features", "FP32", np.ones((2, 2), np.float32))
    out = await resolver.resolve([given, ids("item_ids", [1, 2])])
    assert out[0] is given and out[1].name == "item_features"
    assert [entity for entity, _, _ in store.reads] == ["item"]
    with pytest.raises(InvalidInput, match="either 'user_id' or 'user_features'"):
        await resolver.resolve([given, ids("user_id", [1]), ids("item_ids", [1, 2])])


@pytest.mark.parametrize(
    ("tensors", "message"),
    [
        ([ids("item_ids", [1])], r"input 'user_id' is missing.*user ids"),
        (
            [Tensor("user_id", "FP32", np.ones(1, np.float32)), ids("item_ids", [1])],
            r"input 'user_id': datatype FP32 does not match the model's INT64",
        ),
        ([ids("user_id", [1, 2]), ids("item_ids", [1, 2])], r"'user_id'.*holds 2 user ids"),
        ([ids("user_id", [1]), ids("item_ids", [1, 2, 3, 4], [2, 2])], r"'item_ids': shape"),
        ([ids("user_id", [1]), ids("item_ids", [])], r"'item_ids': holds no item ids"),
        ([ids("user_id", [1]), ids("item_ids", [3, 4242])], r"'item_ids': unknown item id 4242"),
        ([ids("user_id", [77]), ids("item_ids", [3])], r"'user_id': unknown user id 77"),
    ],
)
async def test_bad_ids_are_a_400_naming_the_tensor(
    store: MemoryStore, tensors: list[Tensor], message: str
) -> None:
    resolver = FeatureResolver(config(USER, ITEM), store, Clock())
    with pytest.raises(InvalidInput, match=message):
        await resolver.resolve(tensors)


async def test_per_row_inputs_must_agree_on_rows(store: MemoryStore) -> None:
    other = FeatureInput(input="more", key="more_ids", entity="item", fields=["x"], shape=[-1])
    resolver = FeatureResolver(config(ITEM, other), store, Clock())
    with pytest.raises(InvalidInput, match=r"'more_ids': 2 ids, but 'item_ids' has 3"):
        await resolver.resolve([ids("item_ids", [1, 2, 3]), ids("more_ids", [1, 2])])


async def test_a_store_fault_passes_through_as_unavailable(store: MemoryStore) -> None:
    store.failure = Unavailable("the feature store failed")
    resolver = FeatureResolver(config(USER), store, Clock())
    with pytest.raises(Unavailable):
        await resolver.resolve([ids("user_id", [1])])


async def test_the_observer_hears_each_lookups_result(store: MemoryStore) -> None:
    heard: list[tuple[str, str, int]] = []

    class Observer:
        def on_feature_lookup(self, entity: str, result: str, count: int) -> None:
            heard.append((entity, result, count))

    resolver = FeatureResolver(config(ITEM), store, Clock(), observer=Observer())
    await resolver.resolve([ids("item_ids", [1, 2, 3])])
    await resolver.resolve([ids("item_ids", [1, 2, 4])])
    assert heard == [("item", "cold", 3), ("item", "hit", 2), ("item", "cold", 1)]


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"shape": [2]}, "features.inputs[0].shape"),
        ({"datatype": "FP32"}, "features.inputs[0].datatype"),
        ({"fields": []}, "features.inputs[0].fields"),
        ({"entity": "us{er}"}, "features.inputs[0].entity"),
    ],
)
def test_unworkable_feature_sections_name_the_field(change: dict[str, Any], field: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(f"field '{field}'")):
        check_features_config(config(msgspec.structs.replace(USER, **change)))


def test_a_features_section_must_match_the_models_inputs() -> None:
    raw = {"name": "ranker", **ranker.model_config()}
    check_features(parse_model_config(raw, source="ranker"))
    raw["inputs"] = [{"name": "user_features", "datatype": "FP32", "shape": [3]}, raw["inputs"][1]]
    with pytest.raises(ConfigError, match=r"'user_features' must be FP32 of shape \[16\]"):
        check_features(parse_model_config(raw, source="ranker"))
    raw["inputs"] = raw["inputs"][1:]
    with pytest.raises(ConfigError, match="'user_features' is not an input of the model"):
        check_features(parse_model_config(raw, source="ranker"))
