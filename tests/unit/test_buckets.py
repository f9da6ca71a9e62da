"""Cost classes and padding: which requests may share a batch, and how they are padded."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from tailserve.engine.buckets import BucketRule, Pad, pad_parts
from tailserve.engine.validation import InputPlan
from tailserve.errors import ConfigError
from tailserve.modelconfig import ModelConfig, parse_model_config
from tailserve.tensors import Tensor


def config(**batching: Any) -> ModelConfig:
    raw = {
        "name": "seq",
        "runtime": "python",
        "max_batch_size": 32,
        "inputs": [
            {"name": "tokens", "datatype": "INT64", "shape": [-1]},
            {"name": "lang", "datatype": "INT64", "shape": [1]},
        ],
        "outputs": [{"name": "score", "datatype": "FP32", "shape": [1]}],
        "batching": batching,
    }
    return parse_model_config(raw, source="seq/model.yaml")


def request(cfg: ModelConfig, length: int, rows: int = 1) -> Any:
    tokens = np.ones((rows, length), dtype=np.int64)
    lang = np.zeros((rows, 1), dtype=np.int64)
    return InputPlan(cfg).check([Tensor("tokens", "INT64", tokens), Tensor("lang", "INT64", lang)])


def test_padded_lengths_share_their_class_and_pad_to_its_edge() -> None:
    cfg = config(pad_value=0, cost={"by": "tokens", "edges": [16, 64]})
    rule = BucketRule(cfg, classes=True)
    short, shorter, longer, over = (rule.classify(request(cfg, n)) for n in (9, 3, 17, 65))
    assert short.key == shorter.key != longer.key
    assert short.pad == Pad("tokens", 1, 16, 0) and short.label == "tokens<=16"
    assert longer.pad == Pad("tokens", 1, 64, 0)
    # Past the last edge: a class of its own shape, unpadded.
    assert over.pad is None and over.label == "tokens>64"
    assert rule.classify(request(cfg, 66)).key != over.key
    assert rule.warmup_lengths() == [16, 64]


def test_without_classes_every_length_batches_padded_to_the_longest() -> None:
    cfg = config(pad_value=0, cost={"by": "tokens", "edges": [16, 64]}, policy="size_or_timeout")
    rule = BucketRule(cfg, classes=False)
    a, b = rule.classify(request(cfg, 3)), rule.classify(request(cfg, 300))
    assert a.key == b.key and a.pad == Pad("tokens", 1, None, 0)


def test_without_padding_classes_still_batch_identical_shapes_only() -> None:
    cfg = config(cost={"by": "tokens", "edges": [16]})
    rule = BucketRule(cfg, classes=True)
    a, b = rule.classify(request(cfg, 3)), rule.classify(request(cfg, 4))
    assert a.key != b.key and a.pad is None and a.label == "tokens<=16"


def test_classes_by_rows_and_auto_edges() -> None:
    cfg = config(cost={"by": "rows"})
    rule = BucketRule(cfg, classes=True)
    assert rule.edges == [1, 2, 4, 8, 16, 32]
    assert rule.classify(request(cfg, 5, rows=3)).label == "rows<=4"
    assert rule.classify(request(cfg, 5, rows=1)).label == "rows<=1"


def test_a_padded_input_with_no_rule_is_classed_by_its_length_automatically() -> None:
    cfg = config(pad_value=0)
    rule = BucketRule(cfg, classes=True)
    assert rule.classify(request(cfg, 100)).label == "tokens<=128"


def test_pad_parts_widens_only_the_padded_input() -> None:
    parts = [
        {"tokens": np.array([[1, 2]]), "lang": np.array([[7]])},
        {"tokens": np.array([[3, 4, 5]]), "lang": np.array([[8]])},
    ]
    longest = pad_parts(parts, Pad("tokens", 1, None, 0))
    assert longest[0]["tokens"].tolist() == [[1, 2, 0]] and longest[1] is parts[1]
    edge = pad_parts(parts, Pad("tokens", 1, 5, -1))
    assert edge[1]["tokens"].tolist() == [[3, 4, 5, -1, -1]]
    assert edge[0]["lang"] is parts[0]["lang"]


def test_a_batch_is_padded_to_its_longest_rounded_up_to_eight_within_its_class_edge() -> None:
    def widths(lengths: list[int], edge: int) -> set[int]:
        parts = [{"tokens": np.ones((1, n), dtype=np.int64)} for n in lengths]
        padded = pad_parts(parts, Pad("tokens", 1, edge, 0))
        for part, n in zip(padded, lengths, strict=True):
            assert part["tokens"][0, :n].tolist() == [1] * n  # the data kept, in place
            assert not part["tokens"][0, n:].any()  # the rest is the pad value
        return {part["tokens"].shape[1] for part in padded}

    assert widths([2, 3], 64) == {8}
    assert widths([9, 3], 64) == {16}
    assert widths([33, 40], 64) == {40}
    assert widths([33, 60], 64) == {64}
    assert widths([3], 5) == {5}  # never past the edge


@pytest.mark.parametrize(
    ("batching", "field"),
    [
        ({"cost": {"by": "colour"}}, "batching.cost.by"),
        ({"cost": {"by": "lang"}}, "batching.cost.by"),
        ({"cost": {"by": "tokens", "edges": [64, 16]}}, "batching.cost.edges"),
        ({"pad_value": 0, "cost": {"by": "rows"}}, "batching.pad_value"),
        ({"priority_levels": 2, "default_priority": 3}, "batching.default_priority"),
        ({"target_utilization": 1.5}, "batching.target_utilization"),
        ({"policy": "fastest"}, "batching.policy"),
    ],
)
def test_bad_batching_settings_name_the_field(batching: dict[str, Any], field: str) -> None:
    with pytest.raises(ConfigError, match=f"field '{field}'"):
        config(**batching)
