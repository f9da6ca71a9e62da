"""The supervisor's restart backoff, with explicit times (no clock, no sleeps); what `up`'s
flags make of its configuration."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from tailserve.assembly.up import add_parser, fleet_config
from tailserve.errors import ConfigError
from tailserve.fleet.restarts import Backoff, RestartPolicy, front_door_backoff

BACKOFF = Backoff(first_s=0.5, cap_s=10.0, stable_s=30.0)


def crash_loop(policy: RestartPolicy, crashes: int, uptime_s: float = 1.0) -> list[float]:
    """The delays of ``crashes`` exits, each after ``uptime_s`` of running."""
    delays, now = [], 0.0
    for _ in range(crashes):
        delay = policy.delay(started_at=now, exited_at=now + uptime_s)
        delays.append(delay)
        now += uptime_s + delay
    return delays


def test_a_crash_loop_backs_off_doubling_up_to_the_cap() -> None:
    delays = crash_loop(RestartPolicy(BACKOFF), 8)
    assert delays == [0.5, 1.0, 2.0, 4.0, 8.0, 10.0, 10.0, 10.0]


def test_the_front_door_is_started_again_almost_at_once_then_backs_off() -> None:
    # Found by the chaos suite: the door down for the workers' 0.5 s is 0.5 s of every request.
    assert crash_loop(RestartPolicy(front_door_backoff(BACKOFF)), 4) == [0.1, 0.2, 0.4, 0.8]
    quicker = Backoff(first_s=0.05)
    assert front_door_backoff(quicker) == quicker


def test_a_worker_that_stayed_up_restarts_after_the_first_delay_again() -> None:
    policy = RestartPolicy(BACKOFF)
    assert crash_loop(policy, 5) == [0.5, 1.0, 2.0, 4.0, 8.0]
    assert policy.delay(started_at=100.0, exited_at=130.0) == 0.5
    assert policy.delay(started_at=131.0, exited_at=132.0) == 1.0


def test_a_run_just_short_of_stable_keeps_the_backoff() -> None:
    policy = RestartPolicy(BACKOFF)
    crash_loop(policy, 3)
    assert policy.delay(started_at=100.0, exited_at=129.9) == 4.0


def test_workers_back_off_independently() -> None:
    failing, healthy = RestartPolicy(BACKOFF), RestartPolicy(BACKOFF)
    crash_loop(failing, 4)
    assert healthy.delay(started_at=0.0, exited_at=1.0) == 0.5
    assert failing.delay(started_at=50.0, exited_at=51.0) == 8.0


@pytest.mark.parametrize(("first_s", "cap_s"), [(0.0, 10.0), (5.0, 1.0), (-1.0, 1.0)])
def test_a_backoff_that_cannot_work_is_refused(first_s: float, cap_s: float) -> None:
    with pytest.raises(ConfigError, match="backoff"):
        Backoff(first_s=first_s, cap_s=cap_s)


def test_up_takes_the_front_doors_policy_flags(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    args = parser.parse_args(
        [
            "up",
            "--repository",
            str(tmp_path),
            "--workers",
            "2",
            "--balance",
            "affinity",
            "--max-conn",
            "8",
            "--max-queue",
            "20",
            "--queue-share",
            "0.4",
            "--model-balance",
            "ranker=p2c",
            "--hedge-lane-ms",
            "150",
            "--hedge-model",
            "ranker",
        ]
    )
    config = fleet_config(args, {"TAILSERVE_ADMIN_TOKEN": "t"})
    policy = config.policy
    assert (policy.balance, policy.max_conn, policy.max_queue) == ("affinity", 8, 20)
    assert policy.queue_share == 0.4 and policy.model_balance == {"ranker": "p2c"}
    assert (config.hedge_lane_ms, config.hedge_models) == (150.0, ("ranker",))
    assert config.admin_token == "t" and config.workers == 2
    assert config.host == "127.0.0.1"


def test_an_empty_admin_token_is_none(tmp_path: Path) -> None:
    # `make run` passes TAILSERVE_ADMIN_TOKEN= when ADMIN_TOKEN is not set.
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    args = parser.parse_args(["up", "--repository", str(tmp_path)])
    assert fleet_config(args, {"TAILSERVE_ADMIN_TOKEN": ""}).admin_token is None


def up_args(tmp_path: Path, *flags: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    return parser.parse_args(["up", "--repository", str(tmp_path), *flags])


def test_min_and_max_workers_turn_autoscaling_on(tmp_path: Path) -> None:
    args = up_args(tmp_path, "--min-workers", "1", "--max-workers", "3", "--warm-pool", "1")
    config = fleet_config(args, {})
    assert config.scaling is not None and config.workers == 1
    assert (config.scaling.scaling.min_workers, config.scaling.scaling.max_workers) == (1, 3)
    assert config.scaling.warm_pool == 1 and config.scaling.slots == 4
    assert fleet_config(up_args(tmp_path, "--workers", "2"), {}).scaling is None


def test_scaling_flags_that_cannot_work_are_refused_in_plain_words(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="--warm-pool needs --max-workers"):
        fleet_config(up_args(tmp_path, "--warm-pool", "1"), {})
    with pytest.raises(ConfigError, match=r"max_workers \(1\) must be at least min_workers \(2\)"):
        fleet_config(up_args(tmp_path, "--min-workers", "2", "--max-workers", "1"), {})
    with pytest.raises(ConfigError, match="--warm-pool must be at least 0"):
        fleet_config(up_args(tmp_path, "--max-workers", "2", "--warm-pool", "-1"), {})


def test_up_passes_a_cluster_url_to_its_workers_and_refuses_an_unknown_scheme(
    tmp_path: Path,
) -> None:
    url = "redis+cluster://127.0.0.1:7000"
    assert fleet_config(up_args(tmp_path, "--redis-url", url), {}).worker_args == (
        "--redis-url",
        url,
    )
    with pytest.raises(ConfigError, match=r"'http://cache:6379': the scheme must be redis://"):
        fleet_config(up_args(tmp_path, "--redis-url", "http://cache:6379"), {})


def test_up_passes_the_model_memory_budget_to_its_workers(tmp_path: Path) -> None:
    args = up_args(tmp_path, "--model-memory-mb", "512", "--pinned-models", "churn")
    assert fleet_config(args, {}).worker_args == (
        "--model-memory-mb",
        "512.0",
        "--pinned-models",
        "churn",
    )
    assert fleet_config(up_args(tmp_path), {}).worker_args == ()
    with pytest.raises(ConfigError, match="--model-memory-mb must be at least 0"):
        fleet_config(up_args(tmp_path, "--model-memory-mb", "-1"), {})
