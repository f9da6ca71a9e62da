"""The settings a worker starts with: loopback unless asked, and log levels checked once."""

from __future__ import annotations

from pathlib import Path

import pytest

from tailserve.errors import ConfigError
from tailserve.settings import LOG_LEVELS, Settings, load_settings


def test_a_worker_listens_on_loopback_unless_asked(tmp_path: Path) -> None:
    assert Settings().host == "127.0.0.1"
    assert load_settings().host == "127.0.0.1"
    assert load_settings(env={"TAILSERVE_HOST": "0.0.0.0"}).host == "0.0.0.0"
    config = tmp_path / "settings.yaml"
    config.write_text("host: '::'\n")
    assert load_settings(config_file=config).host == "::"
    flags = {"host": "192.168.1.20"}
    assert load_settings(config_file=config, overrides=flags).host == "192.168.1.20"


def test_log_levels_are_checked_and_read_in_any_case() -> None:
    for level in LOG_LEVELS:
        assert load_settings(overrides={"log_level": level}).log_level == level
    assert load_settings(env={"TAILSERVE_LOG_LEVEL": "WARNING"}).log_level == "warning"
    with pytest.raises(ConfigError, match="log_level must be one of debug, info, warning"):
        load_settings(env={"TAILSERVE_LOG_LEVEL": "verbose"})


def test_the_model_memory_budget_and_pinned_models() -> None:
    assert load_settings().model_memory_mb == 0  # no budget: every model loads at start
    settings = load_settings(
        env={"TAILSERVE_MODEL_MEMORY_MB": "512", "TAILSERVE_PINNED_MODELS": "churn, ranker,"}
    )
    assert settings.model_memory_mb == 512
    assert settings.pinned() == ("churn", "ranker")
    with pytest.raises(ConfigError, match="model_memory_mb must be at least 0"):
        load_settings(overrides={"model_memory_mb": -5})
