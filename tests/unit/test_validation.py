"""Request tensors against the model's declared inputs."""

from __future__ import annotations

import numpy as np
import pytest

from tailserve.engine.validation import check_inputs
from tailserve.errors import InvalidInput
from tailserve.modelconfig import parse_model_config
from tailserve.tensors import Tensor, from_json

CONFIG = parse_model_config(
    {
        "name": "m",
        "runtime": "python",
        "max_batch_size": 8,
        "inputs": [
            {"name": "age", "datatype": "INT64", "shape": [1], "range": [1, 120]},
            {"name": "plan", "datatype": "BYTES", "shape": [1], "values": ["a", "b"]},
            {"name": "vec", "datatype": "FP32", "shape": [-1]},
        ],
        "outputs": [{"name": "y", "datatype": "FP32", "shape": [1]}],
    },
    source="test",
)


def tensors(rows: int = 2, **override: object) -> list[Tensor]:
    data: dict[str, tuple[str, list[int], object]] = {
        "age": ("INT64", [rows, 1], [30] * rows),
        "plan": ("BYTES", [rows, 1], ["a"] * rows),
        "vec": ("FP32", [rows, 3], [0.5] * (rows * 3)),
    }
    out = []
    for name, (datatype, shape, values) in data.items():
        if name in override:
            value = override[name]
            if value is None:
                continue
            datatype, shape, values = value  # type: ignore[misc]
        out.append(Tensor(name, datatype, from_json(name, datatype, shape, values)))
    return out


def test_good_request_gives_rows_and_a_group_by_row_shape() -> None:
    a = check_inputs(CONFIG, tensors(2))
    b = check_inputs(CONFIG, tensors(5))
    c = check_inputs(CONFIG, tensors(2, vec=("FP32", [2, 4], [0.5] * 8)))
    assert a.rows == 2 and b.rows == 5
    assert a.group == b.group != c.group
    assert a.arrays["age"].shape == (2, 1)


def test_flat_column_is_accepted_for_per_row_shape_one() -> None:
    checked = check_inputs(CONFIG, tensors(3, age=("INT64", [3], [1, 2, 3])))
    assert checked.arrays["age"].shape == (3, 1)
    np.testing.assert_array_equal(checked.arrays["age"][:, 0], [1, 2, 3])


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ({"age": None}, "input 'age' is missing"),
        ({"age": ("FP32", [2, 1], [1.0, 2.0])}, "datatype FP32 does not match the model's INT64"),
        (
            {"age": ("INT64", [2, 2], [1, 2, 3, 4])},
            "shape [2, 2] does not match the model's [-1, 1]",
        ),
        ({"age": ("INT64", [2, 1], [1, 500])}, "value 500 is outside the allowed range [1, 120]"),
        ({"plan": ("BYTES", [2, 1], ["a", "zzz"])}, "unknown value 'zzz' (allowed: a, b)"),
        ({"age": ("INT64", [3, 1], [1, 2, 3])}, "has 2 rows, other inputs have 3"),
    ],
)
def test_bad_requests_name_the_input(override: dict[str, object], message: str) -> None:
    with pytest.raises(InvalidInput) as info:
        check_inputs(CONFIG, tensors(2, **override))
    assert message in info.value.message


def test_unknown_input_duplicate_and_oversized_batch() -> None:
    extra = Tensor("bogus", "FP32", np.zeros((2, 1), np.float32))
    with pytest.raises(InvalidInput, match="no input named 'bogus'"):
        check_inputs(CONFIG, [*tensors(2), extra])
    with pytest.raises(InvalidInput, match="given twice"):
        check_inputs(CONFIG, [*tensors(2), tensors(2)[0]])
    with pytest.raises(InvalidInput, match="1 to 8 rows, got 9"):
        check_inputs(CONFIG, tensors(9))


def test_nan_is_outside_any_range() -> None:
    config = parse_model_config(
        {
            "name": "f",
            "runtime": "python",
            "max_batch_size": 4,
            "inputs": [{"name": "p", "datatype": "FP32", "shape": [1], "range": [0, 1]}],
            "outputs": [{"name": "y", "datatype": "FP32", "shape": [1]}],
        },
        source="test",
    )
    bad = Tensor("p", "FP32", np.array([[0.5], [np.nan]], dtype=np.float32))
    with pytest.raises(InvalidInput, match="'p': value nan is outside"):
        check_inputs(config, [bad])
