"""`tailserve up --gpus`: which GPUs, which worker sees which, and how many workers by default."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from tailserve.assembly.up import add_parser, fleet_config, usable_cores
from tailserve.errors import ConfigError
from tailserve.fleet.gpus import describe, parse_gpus, visible_devices, worker_env


def test_workers_take_the_gpus_in_turn() -> None:
    devices = ("0", "1", "2")
    assert [worker_env(i, devices) for i in range(5)] == [
        {"CUDA_VISIBLE_DEVICES": "0"},
        {"CUDA_VISIBLE_DEVICES": "1"},
        {"CUDA_VISIBLE_DEVICES": "2"},
        {"CUDA_VISIBLE_DEVICES": "0"},
        {"CUDA_VISIBLE_DEVICES": "1"},
    ]
    assert worker_env(0, ()) == {}


def test_the_flag_takes_none_a_count_or_ids() -> None:
    assert parse_gpus("none", {}) == ()
    assert parse_gpus("0", {}) == ()
    assert parse_gpus("2", {}) == ("0", "1")
    assert parse_gpus("1,3", {}) == ("1", "3")
    assert parse_gpus("GPU-8f1c,GPU-22aa", {}) == ("GPU-8f1c", "GPU-22aa")
    with pytest.raises(ConfigError, match="--gpus"):
        parse_gpus(",", {})


def test_auto_keeps_to_the_devices_this_process_may_use() -> None:
    assert parse_gpus("auto", {"CUDA_VISIBLE_DEVICES": "2,5"}) == ("2", "5")
    assert visible_devices({"CUDA_VISIBLE_DEVICES": ""}) == ()
    assert visible_devices({"CUDA_VISIBLE_DEVICES": "-1"}) == ()
    # CUDA stops at the first entry that is not a device.
    assert visible_devices({"CUDA_VISIBLE_DEVICES": "0,-1,1"}) == ("0",)
    assert visible_devices({}) is None  # not set: detect them


def test_the_start_line_says_which_worker_has_which_gpu() -> None:
    assert describe(("0", "1"), 3) == (
        "GPUs: 2 (worker 0 → GPU 0, worker 1 → GPU 1, worker 2 → GPU 0)"
    )
    assert describe((), 2) == "no GPU found: workers use the CPU"


def up_args(tmp_path: Path, *flags: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    return parser.parse_args(["up", "--repository", str(tmp_path), *flags])


def test_one_worker_per_gpu_unless_workers_says_otherwise(tmp_path: Path) -> None:
    config = fleet_config(up_args(tmp_path, "--gpus", "0,1"), {})
    assert (config.workers, config.gpus) == (2, ("0", "1"))
    config = fleet_config(up_args(tmp_path, "--gpus", "2", "--workers", "4"), {})
    assert (config.workers, config.gpus) == (4, ("0", "1"))
    config = fleet_config(up_args(tmp_path), {"CUDA_VISIBLE_DEVICES": "3"})
    assert (config.workers, config.gpus) == (1, ("3",))
    config = fleet_config(up_args(tmp_path, "--gpus", "none"), {"CUDA_VISIBLE_DEVICES": "3"})
    assert (config.workers, config.gpus) == (usable_cores(), ())
