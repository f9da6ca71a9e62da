"""Properties of the model.yaml loader (modelconfig/): any document, and
any mutation of a valid one, loads or gives a ConfigError naming the file, never another
exception."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import hypothesis.strategies as st
import pytest
import yaml
from hypothesis import given, settings

from support import fuzzing
from tailserve.errors import ConfigError
from tailserve.modelconfig import load_model_config, parse_model_config

_scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats()
    | st.text(max_size=6)
    | st.sampled_from(["INT64", "FP32", "BYTES", "onnx", "pipeline", "python", "-1", "use"])
)
_values = st.recursive(
    _scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4)
    ),
    max_leaves=16,
)


@pytest.fixture(scope="module")
def valid_configs(example_repository: Path) -> list[dict[str, Any]]:
    """Every example's model.yaml (pipelines included): the documents to mutate."""
    return [yaml.safe_load(p.read_text()) for p in sorted(example_repository.glob("*/model.yaml"))]


def _paths(document: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    found = [prefix]
    if isinstance(document, dict):
        for key, value in document.items():
            found += _paths(value, (*prefix, key))
    elif isinstance(document, list):
        for index, value in enumerate(document):
            found += _paths(value, (*prefix, index))
    return found


def _load(raw: Any) -> None:
    try:
        if isinstance(raw, dict):
            parse_model_config({"name": "m", **raw}, source="m/model.yaml")
        else:
            raise ConfigError("m/model.yaml: must be a mapping of fields")
    except ConfigError as exc:
        assert "m/model.yaml" in str(exc)


@given(st.data())
@settings(fuzzing.PROFILE)
def test_a_mutated_valid_config_loads_or_says_why(
    valid_configs: list[dict[str, Any]], data: st.DataObject
) -> None:
    fuzzing.CASES["config mutated model.yaml"] += 1
    document = copy.deepcopy(data.draw(st.sampled_from(valid_configs)))
    for _ in range(data.draw(st.integers(1, 3))):
        path = data.draw(st.sampled_from(_paths(document)))
        if not path:
            continue
        *parents, last = path
        holder: Any = document
        for key in parents:
            holder = holder[key]
        action = data.draw(st.sampled_from(["replace", "delete", "add"]))
        if action == "delete":
            del holder[last]
        elif action == "replace":
            holder[last] = data.draw(_values)
        elif isinstance(holder, dict):
            holder[data.draw(st.text(max_size=8))] = data.draw(_values)
        else:
            holder.append(data.draw(_values))
    _load(document)


@given(_values)
@settings(fuzzing.PROFILE)
def test_any_document_loads_or_says_why(raw: Any) -> None:
    fuzzing.CASES["config any document"] += 1
    _load(raw)


@given(st.text(max_size=200))
@settings(fuzzing.PROFILE, max_examples=min(fuzzing.PROFILE.max_examples, 200))
def test_any_text_loads_or_says_why(tmp_path_factory: pytest.TempPathFactory, text: str) -> None:
    fuzzing.CASES["config any text"] += 1
    model = tmp_path_factory.mktemp("m", numbered=True)
    (model / "model.yaml").write_text(text, encoding="utf-8")
    try:
        load_model_config(model)
    except ConfigError as exc:
        assert str(model / "model.yaml") in str(exc)
