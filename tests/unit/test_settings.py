"""The settings a worker starts with: loopback unless asked."""

from __future__ import annotations

from pathlib import Path

from tailserve.settings import Settings, load_settings


def test_a_worker_listens_on_loopback_unless_asked(tmp_path: Path) -> None:
    assert Settings().host == "127.0.0.1"
    assert load_settings().host == "127.0.0.1"
    assert load_settings(env={"TAILSERVE_HOST": "0.0.0.0"}).host == "0.0.0.0"
    config = tmp_path / "settings.yaml"
    config.write_text("host: '::'\n")
    assert load_settings(config_file=config).host == "::"
    flags = {"host": "192.168.1.20"}
    assert load_settings(config_file=config, overrides=flags).host == "192.168.1.20"
