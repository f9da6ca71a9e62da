"""model.yaml validation: good files load, bad ones fail naming the file and the field."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from tailserve.errors import ConfigError
from tailserve.modelconfig import VersionPolicy, load_model_config
from tailserve.repository.discovery import choose_versions

GOOD = {
    "runtime": "onnx",
    "max_batch_size": 64,
    "inputs": [
        {"name": "x", "datatype": "FP32", "shape": [4], "range": [0, 1]},
        {"name": "kind", "datatype": "BYTES", "shape": [1], "values": ["a", "b"]},
    ],
    "outputs": [{"name": "y", "datatype": "FP32", "shape": [1]}],
    "batching": {"max_queue_delay_ms": 2},
    "warmup": {"batch_sizes": [1, 64]},
}


def write(tmp_path: Path, config: dict[str, object], name: str = "m") -> Path:
    folder = tmp_path / name
    folder.mkdir()
    (folder / "model.yaml").write_text(yaml.safe_dump(config))
    return folder


def test_a_good_config_loads_with_defaults_filled(tmp_path: Path) -> None:
    config = load_model_config(write(tmp_path, GOOD))
    assert config.name == "m"  # from the folder
    assert config.batching.max_queue_delay_ms == 2
    assert config.batching.max_queue_size == 1024
    assert config.instances.count == 1
    assert config.full_shape(config.inputs[0]) == [-1, 4]


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"runtime": "tensorflow"}, "runtime"),
        ({"max_batch_size": "many"}, "max_batch_size"),
        ({"inputs": [{"name": "x", "datatype": "FP33", "shape": [1]}]}, "inputs[0].datatype"),
        ({"inputs": [{"name": "x", "datatype": "FP32", "shape": [0]}]}, "inputs[0].shape"),
        ({"inputs": [{"name": "x", "datatype": "FP32"}]}, "inputs[0]"),
        ({"outputs": []}, "outputs"),
        ({"batching": {"max_queue_size": 0}}, "batching.max_queue_size"),
        ({"batching": {"max_delay": 3}}, "batching"),
        ({"instances": {"count": 0}}, "instances.count"),
        ({"version_policy": {"latest": 1, "all": True}}, "version_policy"),
        ({"warmup": {"batch_sizes": [128]}}, "warmup.batch_sizes[0]"),
        ({"slo": {"p99_ms": -1}}, "slo.p99_ms"),
        ({"instances": {"providers": ["gpu"]}}, "instances.providers[0]"),
        (
            {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1], "values": ["a"]}]},
            "inputs[0].values",
        ),
    ],
)
def test_bad_configs_name_file_and_field(
    tmp_path: Path, change: dict[str, object], field: str
) -> None:
    folder = write(tmp_path, {**GOOD, **change})
    with pytest.raises(ConfigError) as info:
        load_model_config(folder)
    message = info.value.message
    assert str(folder / "model.yaml") in message
    assert f"'{field}" in message, message


def test_unknown_top_level_field_is_named(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="max_batch"):
        load_model_config(write(tmp_path, {**GOOD, "max_batch": 3}))


def test_not_yaml_and_missing_file(tmp_path: Path) -> None:
    folder = tmp_path / "broken"
    folder.mkdir()
    (folder / "model.yaml").write_text("inputs: [unclosed")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_model_config(folder)
    with pytest.raises(ConfigError, match="not found"):
        load_model_config(tmp_path / "absent")


def test_version_policies() -> None:
    assert choose_versions(VersionPolicy(), [1, 2, 3], "m") == [3]
    assert choose_versions(VersionPolicy(latest=2), [1, 2, 3], "m") == [2, 3]
    assert choose_versions(VersionPolicy(specific=[1, 3]), [1, 2, 3], "m") == [1, 3]
    assert choose_versions(VersionPolicy(all=True), [1, 2], "m") == [1, 2]
    with pytest.raises(ConfigError, match=r"versions \[4\] not found"):
        choose_versions(VersionPolicy(specific=[4]), [1, 2], "m")
    with pytest.raises(ConfigError, match="no numbered version folder"):
        choose_versions(VersionPolicy(), [], "m")
