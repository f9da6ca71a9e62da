"""The steps of a capacity search: new arrivals and key draws, the same inputs per key."""

from __future__ import annotations

from typing import Any

from tailserve.examples.churn import model_config
from tailserve.loadgen.bench import at_rate
from tailserve.loadgen.inputs import fields_for, prepare
from tailserve.loadgen.workload import parse_workload

CONFIG = {"name": "churn", **model_config("onnx")}


def workload(**fields: Any) -> Any:
    return parse_workload({"model": "churn", **fields}, source="test")


def test_a_key_keeps_its_inputs_across_steps_while_the_draws_change() -> None:
    base = workload(keys={"space": "zipf", "size": 1_000_000, "s": 1.0})
    fields = fields_for(CONFIG, {})
    one = prepare(at_rate(base, 100, seed=11), fields, 3000)
    two = prepare(at_rate(base, 100, seed=12), fields, 3000)
    assert [p.key for p in one] != [p.key for p in two]
    first = {p.key: p.body for p in one}
    second = {p.key: p.body for p in two}
    shared = set(first) & set(second)
    assert len(shared) > 50  # the popular keys come back ...
    assert all(first[k] == second[k] for k in shared)  # ... as the same requests


def test_unique_keys_stay_unique_across_steps() -> None:
    base = workload()
    fields = fields_for(CONFIG, {})
    one = prepare(at_rate(base, 100, seed=11), fields, 500)
    two = prepare(at_rate(base, 100, seed=12), fields, 500)
    assert not {p.body for p in one} & {p.body for p in two}
