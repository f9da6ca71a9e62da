"""The command line: examples, and serve's errors for what it cannot start with."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import yaml


def tailserve(*args: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "tailserve.cli", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)


def test_examples_writes_a_repository_that_validates(tmp_path: Path) -> None:
    done = tailserve("examples", str(tmp_path / "repo"))
    assert done.returncode == 0, done.stderr
    assert "churn" in done.stdout
    for name in ("churn", "churn_lgbm"):
        config = yaml.safe_load((tmp_path / "repo" / name / "model.yaml").read_text())
        assert config["outputs"][0]["name"] == "churn_probability"
    assert (tmp_path / "repo" / "churn" / "1" / "model.onnx").stat().st_size > 0
    assert (tmp_path / "repo" / "churn_lgbm" / "1" / "model.txt").stat().st_size > 0


def test_serve_without_a_repository_says_so(tmp_path: Path) -> None:
    done = tailserve("serve")
    assert done.returncode == 2
    assert "no model repository given" in done.stderr
    done = tailserve("serve", "--repository", str(tmp_path / "absent"), "--http-port", "0")
    assert done.returncode != 0
    assert "absent" in done.stderr


def test_bad_settings_file_names_the_setting(tmp_path: Path) -> None:
    settings = tmp_path / "settings.yaml"
    settings.write_text("http_prot: 9000\n")
    done = tailserve("serve", "--config", str(settings), "--repository", str(tmp_path))
    assert done.returncode == 2
    assert "unknown setting 'http_prot'" in done.stderr


def test_bench_errors_name_the_file_field_or_server(tmp_path: Path) -> None:
    done = tailserve("bench", str(tmp_path / "absent.yaml"))
    assert done.returncode == 2
    assert "absent.yaml: cannot read the workload" in done.stderr
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: m\nschedule: {kind: burst}\n")
    done = tailserve("bench", str(bad))
    assert done.returncode == 2
    assert "field 'schedule.kind'" in done.stderr
    down = tmp_path / "down.yaml"
    down.write_text("model: m\ntarget: http://127.0.0.1:9\n")
    done = tailserve("bench", str(down))
    assert done.returncode == 2
    assert "cannot read the model's configuration from http://127.0.0.1:9" in done.stderr
    done = tailserve("bench", "compare", str(tmp_path / "a.json"))
    assert done.returncode == 2
    assert "two or more result files" in done.stderr
