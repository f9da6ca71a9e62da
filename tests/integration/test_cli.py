"""The command line: examples, serve's errors for what it cannot start with, and a default
start of the examples that logs no error and stays lean."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import yaml

from support.examples import ExamplesRun
from support.servers import worker_process
from tailserve import __version__
from tailserve.cli import build_parser
from tailserve.settings import LOG_LEVELS

# A line of the worker's log: "2026-11-25 23:20:51,259 INFO tailserve.assembly.worker: HTTP on ..."
LOG_LINE = re.compile(r"^\S+ \S+ (?P<level>[A-Z]+) (?P<logger>[\w.]+): (?P<message>.*)$")


def tailserve(*args: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "tailserve.cli", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)


def test_version_names_the_package_version() -> None:
    done = tailserve("--version")
    assert done.returncode == 0, done.stderr
    assert done.stdout == f"tailserve {__version__}\n"


def test_examples_writes_a_repository_that_validates(examples_command: ExamplesRun) -> None:
    # (The session's example repository is this command's: trained once, checked here.)
    done, repo = examples_command.done, examples_command.directory
    assert done.returncode == 0, done.stderr
    assert "churn" in done.stdout
    for name in ("churn", "churn_lgbm"):
        config = yaml.safe_load((repo / name / "model.yaml").read_text())
        assert config["outputs"][0]["name"] == "churn_probability"
    assert (repo / "churn" / "1" / "model.onnx").stat().st_size > 0
    assert (repo / "churn_lgbm" / "1" / "model.txt").stat().st_size > 0


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


def test_serve_and_up_take_the_same_log_levels(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    absent = str(tmp_path / "absent")
    parser = build_parser()
    for command in ("serve", "up"):
        for level in LOG_LEVELS:
            args = parser.parse_args([command, "--repository", absent, "--log-level", level])
            assert args.log_level == level
        with pytest.raises(SystemExit):
            parser.parse_args([command, "--repository", absent, "--log-level", "verbose"])
        assert "invalid choice: 'verbose' (choose from 'debug', 'info'" in capsys.readouterr().err
    # As a process: the flags pass, and each stops at the missing repository.
    done = tailserve("serve", "--repository", absent, "--log-level", "debug")
    assert done.returncode == 2 and "is not a folder" in done.stderr, done.stderr
    done = tailserve("up", "--repository", absent, "--log-level", "warning")
    assert done.returncode == 2 and "no model repository" in done.stderr, done.stderr


# One worker of the examples, warmed: its resident set (it was ~2 GB with ORT's arenas).
LEAN_WORKER_BYTES = 400 * 2**20


def test_a_default_start_of_the_examples_logs_no_error_and_stays_lean(
    example_repository: Path, tmp_path: Path
) -> None:
    # No --redis-url: the ranker, which reads its inputs from the feature store, is left out.
    with worker_process(example_repository, tmp_path) as running:
        assert httpx.get(f"{running.url}/v2/health/ready").status_code == 200
        churn = httpx.get(f"{running.url}/v2/models/churn/ready")
        assert churn.status_code == 200
        pid = running.process.pid
        # `serve` started itself again, same pid, with huge pages for malloc (hugepages.py).
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        assert b"GLIBC_TUNABLES=glibc.malloc.hugetlb=1" in environ
        pages = int(Path(f"/proc/{pid}/statm").read_text().split()[1])
        resident = pages * os.sysconf("SC_PAGE_SIZE")
        assert resident <= LEAN_WORKER_BYTES, f"{resident / 2**20:.0f} MiB resident"
        page = httpx.get(f"{running.url}/metrics").text
        sentiment = _sample(page, 'tailserve_model_memory_bytes{model="sentiment"}')
        files = sum(f.stat().st_size for f in (example_repository / "sentiment" / "1").iterdir())
        assert files <= sentiment <= resident - 32 * 2**20
        assert running.terminate() == 0
    log = running.log()
    records = [m for m in map(LOG_LINE.match, log.splitlines()) if m is not None]
    assert records, log
    assert [m.group(0) for m in records if m["level"] in ("ERROR", "CRITICAL")] == []
    assert "Traceback" not in log
    left_out = [m for m in records if "'ranker'" in m["message"]]
    assert len(left_out) == 1, log
    assert left_out[0]["level"] == "INFO"
    assert "not served" in left_out[0]["message"] and "--redis-url" in left_out[0]["message"]


def _sample(page: str, series: str) -> float:
    lines = [line for line in page.splitlines() if line.startswith(series + " ")]
    assert len(lines) == 1, f"{series} not in the metrics"
    return float(lines[0].split()[1])
