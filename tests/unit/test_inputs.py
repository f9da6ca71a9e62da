"""Generated requests are valid for the model (checked by the server's own codecs and rules),
and key spaces repeat inputs as they promise."""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np
import orjson
import pytest

from tailserve.engine.validation import InputPlan
from tailserve.errors import ConfigError
from tailserve.examples.churn import model_config
from tailserve.loadgen.inputs import fields_for, prepare, request_path
from tailserve.loadgen.workload import parse_workload
from tailserve.modelconfig import parse_model_config
from tailserve.protocols.http.kserve_v1 import decode_records
from tailserve.protocols.http.oip import decode_request

CONFIG = {"name": "churn", **model_config("onnx")}
PLAN_CONFIG = parse_model_config(CONFIG, source="churn")
PLAN = InputPlan(PLAN_CONFIG)


def workload(**fields: Any) -> Any:
    raw = {"model": "churn", "fields": {"monthly_spend": {"lognormal": [4, 0.5], "clip": [0, 900]}}}
    return parse_workload({**raw, **fields}, source="test")


@pytest.mark.parametrize("protocol", ["v2-json", "v2-binary", "v1-records"])
def test_every_generated_request_passes_the_servers_checks(protocol: str) -> None:
    w = workload(protocol=protocol, classes=[{"rows": 1}, {"name": "bulk", "rows": 8}])
    plan = prepare(w, fields_for(CONFIG, w.fields), 60)
    assert {p.cls for p in plan} == {0, 1}
    for prepared in plan:
        headers = dict(prepared.headers)
        if protocol == "v1-records":
            request = decode_records("churn", PLAN_CONFIG, prepared.body)
        else:
            length = headers.get("Inference-Header-Content-Length")
            request = decode_request("churn", None, prepared.body, int(length) if length else None)
        checked = PLAN.check(request.inputs)
        assert checked.rows == w.classes[prepared.cls].rows
        spend = checked.arrays["monthly_spend"]
        assert (spend >= 0).all() and (spend <= 900).all()


def test_unique_keys_never_repeat_and_zipf_keys_do() -> None:
    unique = prepare(workload(), fields_for(CONFIG, {}), 500)
    assert len({p.body for p in unique}) == 500
    zipf = prepare(
        workload(keys={"space": "zipf", "size": 1000, "s": 1.1}), fields_for(CONFIG, {}), 2000
    )
    counts = Counter(p.key for p in zipf)
    top_key, top_count = counts.most_common(1)[0]
    assert top_key == 0  # rank 1 is the most popular
    assert top_count > 2000 / 1000 * 10
    bodies = {p.key: p.body for p in zipf}
    assert all(bodies[p.key] == p.body for p in zipf)  # one key, one input
    assert len(set(bodies.values())) == len(bodies)  # different keys, different inputs


def test_options_travel_as_parameters_and_headers() -> None:
    w = workload(options={"deadline_ms": 80, "priority": 2, "cache": "bypass"})
    prepared = prepare(w, fields_for(CONFIG, {}), 1)[0]
    assert dict(prepared.headers)["X-Deadline-Ms"] == "80"
    assert orjson.loads(prepared.body)["parameters"] == {"priority": 2, "cache": "bypass"}
    assert request_path(w) == "/v2/models/churn/infer"


def test_bad_workloads_name_the_field() -> None:
    with pytest.raises(ConfigError, match=r"field 'schedule\.kind'"):
        parse_workload({"model": "m", "schedule": {"kind": "burst"}}, source="w.yaml")
    with pytest.raises(ConfigError, match="field 'classes"):
        parse_workload({"model": "m", "classes": [{"rows": 0}]}, source="w.yaml")
    with pytest.raises(ConfigError, match="'colour' is not an input"):
        fields_for(CONFIG, {"colour": {"constant": 1}})


def test_variable_lengths_are_drawn_per_request_and_pass_the_servers_checks() -> None:
    from tailserve.examples.sentiment import model_config as sentiment_config

    config = {"name": "sentiment", **sentiment_config()}
    plan = InputPlan(parse_model_config(config, source="sentiment"))
    w = parse_workload(
        {
            "model": "sentiment",
            "protocol": "v2-binary",
            "fields": {
                "token_ids": {
                    "int": [1, 1999],
                    "length": {"lognormal": [3.18, 0.95], "clip": [1, 512]},
                },
            },
        },
        source="test",
    )
    prepared = prepare(w, fields_for(config, w.fields), 400)
    lengths = []
    for item in prepared:
        length = int(dict(item.headers)["Inference-Header-Content-Length"])
        checked = plan.check(decode_request("sentiment", None, item.body, length).inputs)
        lengths.append(checked.arrays["token_ids"].shape[1])
    assert 15 <= float(np.median(lengths)) <= 35 and max(lengths) > 100 and min(lengths) >= 1
    with pytest.raises(ConfigError, match="'length' needs a variable dimension"):
        fields_for(CONFIG, {"tenure_months": {"int": [1, 5], "length": {"constant": 3}}})


def test_zipf_ids_stay_in_their_space_and_favour_the_first() -> None:
    w = workload(fields={"support_tickets": {"zipf": [50, 1.2]}})
    plan = prepare(w, fields_for(CONFIG, w.fields), 3000)
    drawn = [orjson.loads(p.body)["inputs"][2]["data"][0] for p in plan]
    counts = Counter(drawn)
    assert min(drawn) >= 0 and max(drawn) <= 49
    assert counts.most_common(1)[0][0] == 0
    assert counts[0] > 3000 / 50 * 5  # rank 1 of Zipf(1.2) over 50: ~29% of draws
    assert len(counts) > 25  # and the tail is drawn too


async def test_a_feature_store_model_is_sent_a_user_id_and_one_item_id_a_row() -> None:
    """The ranker's workload: one user id a request, 500 item ids; what the generator sends
    resolves (through a store's read interface) into inputs the model accepts."""
    from tailserve.cache.features import FeatureResolver
    from tailserve.examples import ranker

    config = {"name": "ranker", **ranker.model_config()}
    model = parse_model_config(config, source="ranker")
    assert model.features is not None

    class Store:
        async def read(self, entity: str, version: str, ids: Any, fields: Any) -> Any:
            return np.tile(np.asarray(ids, np.float32)[:, None], (1, len(fields)))

    w = parse_workload(
        {
            "model": "ranker",
            "protocol": "v2-binary",
            "fields": {
                "user_id": {"zipf": [100_000, 1.1]},
                "item_ids": {"int": [0, 49_999]},
            },
            "classes": [{"rows": 500}],
        },
        source="test",
    )
    fields = fields_for(config, w.fields)
    assert [(f.name, f.per_request) for f in fields] == [("user_id", True), ("item_ids", False)]
    resolver = FeatureResolver(model.features, Store(), lambda: 0.0)
    users = []
    for item in prepare(w, fields, 20):
        length = int(dict(item.headers)["Inference-Header-Content-Length"])
        request = decode_request("ranker", None, item.body, length)
        shapes = {t.name: t.shape for t in request.inputs}
        assert shapes == {"user_id": [1, 1], "item_ids": [500, 1]}
        checked = InputPlan(model).check(await resolver.resolve(request.inputs))
        assert checked.rows == 500
        user = checked.arrays["user_features"]
        assert (user == user[0, 0]).all() and 0 <= user[0, 0] < 100_000
        users.append(float(user[0, 0]))
    assert len(set(users)) > 1
