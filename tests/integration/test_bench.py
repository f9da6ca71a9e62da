"""The load generator against real servers on loopback: it keeps its schedule, its tail tells
the truth about a stalling server, its capacity search converges, and it replays traces."""

from __future__ import annotations

import base64
import gc
import statistics
import time
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import orjson
import pytest

from support.models import doubler_config, write_model
from support.servers import free_port, run_worker
from support.stub import CONFIG, StubApp, run_stub
from tailserve.cli import main
from tailserve.loadgen.bench import run_bench
from tailserve.loadgen.plan import build_plan
from tailserve.loadgen.runner import Runner
from tailserve.loadgen.sending import Link
from tailserve.loadgen.workload import parse_workload
from tailserve.observability.trace_log import read_trace
from tailserve.process.loops import run
from tailserve.settings import Settings


def workload(url: str, **fields: Any) -> Any:
    raw: dict[str, Any] = {
        "name": "stub",
        "target": url,
        "model": "m",
        "schedule": {"kind": "constant", "rate": 200},
        "duration_s": 2.0,
        "warmup_s": 0.0,
        "slo": {"p99_ms": 50},
    }
    raw.update(fields)
    return parse_workload(raw, source="test")


def test_a_constant_rate_is_kept_in_count_and_spacing() -> None:
    with run_stub(StubApp()) as stub:
        result = run_bench(workload(stub.url), progress=None)
        arrivals = [a.at for a in stub.app.arrivals]
    assert len(arrivals) == 400 == result["overall"]["count"]
    gaps_ms = np.diff(arrivals) * 1000.0
    # One send every 5 ms; single gaps jitter with the machine's scheduling.
    assert statistics.median(gaps_ms) == pytest.approx(5.0, abs=0.6)
    # No drift from the schedule (arrival i at t0 + i * 5 ms): each arrival's lateness
    # against the least late one. A stall makes a few late, the sends after it catch up
    # (open loop); a generator that slept 5 ms after each send would fall further behind
    # with each, 0.1 s by the last tenth at 5% slow.
    late_ms = (np.asarray(arrivals) - np.arange(400) * 0.005) * 1000.0
    late_ms -= late_ms.min()
    assert statistics.median(late_ms) < 20.0, late_ms
    assert statistics.median(late_ms[-40:]) < 20.0, late_ms
    assert result["overall"]["errors"] == 0
    assert result["overall"]["achieved_rps"] == pytest.approx(200, rel=0.05)
    # Most sends leave on time. (Not the p99 or the "behind" flag: one stall of the machine
    # delays a dozen of these 400 sends, and tests/unit/test_bench_stats.py covers the flag.)
    assert result["generator"]["lag_p50_ms"] < 1.0
    assert result["generator"]["timer"] == "fine"


def _clumps(url: str, timer: str) -> tuple[int, int]:
    """Of 1,000 requests due 0.5 ms apart, the ones sent on time (not over 0.2 ms late), and
    how many of those had the next one sent with them (within 0.1 ms)."""
    spec = workload(url, schedule={"kind": "constant", "rate": 2000}, duration_s=0.5, timer=timer)
    target = url.removeprefix("http://")
    host, port = target.split(":")
    plan = build_plan(spec, CONFIG, target)
    link = Link(protocol="http", host=host, port=int(port), timeout_s=10.0, connections=64)
    runner = Runner(plan, link, fine_timer=timer == "fine")
    samples = run(runner.run())
    assert not np.isnan(samples.done).any()
    on_time = (samples.dispatched - samples.intended)[:-1] <= 0.2e-3
    together = np.diff(samples.dispatched) < 0.1e-3
    return int(on_time.sum()), int((on_time & together).sum())


def test_the_fine_timer_sends_each_request_at_its_time_not_in_millisecond_clumps() -> None:
    # The loop's timers count whole milliseconds: each fire sends what is due within one, so
    # requests 0.5 ms apart leave in pairs and triples, and the server is blamed for the
    # wait. The fine timer sends each on its own. (Only the sends that left on time tell:
    # a sender that a loaded machine holds back sends what is overdue together, whatever
    # its timer.)
    with run_stub(StubApp()) as stub:
        fine, fine_clumped = _clumps(stub.url, "fine")
        loop, loop_clumped = _clumps(stub.url, "loop")
    assert fine >= 10 and loop >= 10, (fine, loop)
    assert fine_clumped == 0
    assert loop_clumped > 0.3 * loop, (loop_clumped, loop)


def test_the_plan_is_kept_out_of_full_collections_before_the_run() -> None:
    # A full collection over the plan stalled the sender for 13 ms, counted as the server's.
    gc.unfreeze()
    with run_stub(StubApp()) as stub:
        result = run_bench(workload(stub.url, duration_s=0.2), progress=None)
    assert result["overall"]["count"] == 40
    assert gc.get_freeze_count() > 0


def test_a_stall_shows_in_the_tail_where_a_closed_loop_would_hide_it() -> None:
    stall_s = 0.6
    # Open loop: the 100th request (at ~1 s) stalls the server for 0.6 s; the ~60 requests
    # scheduled during the stall each wait for its end.
    with run_stub(StubApp(stall_after=100, stall_s=stall_s)) as stub:
        result = run_bench(
            workload(stub.url, schedule={"kind": "constant", "rate": 100}), progress=None
        )
    overall = result["overall"]
    assert overall["count"] == 200 and overall["errors"] == 0
    assert overall["p99_ms"] >= 0.8 * stall_s * 1000
    assert overall["max_ms"] >= 0.9 * stall_s * 1000
    # The same stall measured closed-loop (one connection, the next request sent when the
    # last returns) lands in one sample: its p99 stays far below the stall.
    closed = []
    with run_stub(StubApp(stall_after=100, stall_s=stall_s)) as stub, httpx.Client() as client:
        ends = time.monotonic() + 2.0
        while time.monotonic() < ends:
            began = time.monotonic()
            client.post(f"{stub.url}/v2/models/m/infer", content=b"{}")
            closed.append(time.monotonic() - began)
    closed_p99_ms = float(np.percentile(closed, 99)) * 1000
    assert max(closed) >= 0.9 * stall_s  # it did see the stall, once
    assert closed_p99_ms < 0.25 * overall["p99_ms"]


def test_capacity_search_converges_on_a_known_capacity() -> None:
    # Served one at a time, 10 ms each: no more than 100 req/s can ever be answered.
    with run_stub(StubApp(service_s=0.010)) as stub:
        w = workload(
            stub.url,
            schedule={"kind": "poisson", "rate": 30},
            duration_s=2.0,
            warmup_s=0.3,
            slo={"p99_ms": 150},
        )
        result = run_bench(w, find_capacity=True, progress=None, capacity_precision=0.1)
    capacity = result["capacity"]["rps"]
    steps = result["steps"]
    # What this machine serves depends on what else it runs (the stub and the generator share
    # its cores): the bounds are the ones physics sets, not a speed.
    assert capacity is not None and 0 < capacity <= 105
    assert any(not step["passes"] for step in steps)  # it found where the server fails
    over = [step for step in steps if step["rate"] >= 110]
    assert over and all(not step["passes"] for step in over)
    # The capacity is a rate that passed, and nothing above it that was tried passed.
    passed = [step["rate"] for step in steps if step["passes"]]
    assert passed and max(passed) <= capacity * 1.01


def test_several_processes_share_one_schedule() -> None:
    with run_stub(StubApp()) as stub:
        result = run_bench(workload(stub.url, processes=2, duration_s=1.5), progress=None)
        arrivals = sorted(a.at for a in stub.app.arrivals)
    assert len(arrivals) == 300 == result["overall"]["count"]
    assert result["generator"]["processes"] == 2
    assert statistics.median(np.diff(arrivals) * 1000.0) == pytest.approx(5.0, abs=0.8)


def test_a_recorded_trace_replays_with_its_timing_and_bodies(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    write_model(repo, "doubler", doubler_config())
    trace = tmp_path / "trace.jsonl"
    settings = Settings(repository=str(repo), trace_file=str(trace))
    sent = []
    with run_worker(settings) as running, httpx.Client() as client:
        for i in range(12):
            body = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1], "data": [i]}]}
            sent.append(orjson.dumps(body))
            response = client.post(
                f"{running.url}/v2/models/doubler/infer",
                content=sent[-1],
                headers={"x-deadline-ms": "80"},
            )
            assert response.status_code == 200
            time.sleep(0.05 if i % 2 else 0.02)  # uneven gaps the replay must keep
    recorded = read_trace(trace)
    assert [entry["body"] for entry in recorded] == sent
    with run_stub(StubApp()) as stub:
        w = workload(
            stub.url,
            model="",
            schedule={"kind": "trace", "trace": str(trace)},
            duration_s=None,
            warmup_s=0.0,
        )
        result = run_bench(w, progress=None)
        arrivals = stub.app.arrivals
    assert [a.body for a in arrivals] == sent
    assert all(a.path == "/v2/models/doubler/infer" for a in arrivals)
    assert all(a.headers.get("x-deadline-ms") == "80" for a in arrivals)
    recorded_gaps = np.diff([entry["t"] for entry in recorded])
    replayed_gaps = np.diff([a.at for a in arrivals])
    # The replay keeps the recorded gaps (20 and 50 ms). One stall of the machine can stretch
    # a gap and shorten the next (the schedule catches up): two of the eleven may be off.
    errors = np.abs(replayed_gaps - recorded_gaps)
    assert np.median(errors) < 0.003 and (errors < 0.006).sum() >= len(errors) - 2, errors
    assert result["overall"]["count"] == 12
    assert list(result["classes"]) == ["/v2/models/doubler/infer"]


class _Images(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.sources: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "img":
            self.sources.append(dict(attrs).get("src") or "")


def test_cli_writes_result_and_report_and_compares_runs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    spec = tmp_path / "w.yaml"
    with run_stub(StubApp()) as stub:
        spec.write_text(
            orjson.dumps(
                {
                    "name": "stub",
                    "target": stub.url,
                    "model": "m",
                    "schedule": {"kind": "poisson", "rate": 150},
                    "duration_s": 1.0,
                    "warmup_s": 0.2,
                }
            ).decode()
        )
        for name, rate in (("slow", "100"), ("fast", "200")):
            code = main(
                [
                    "bench",
                    str(spec),
                    "--rate",
                    rate,
                    "--name",
                    name,
                    "--quiet",
                    "--out",
                    str(tmp_path / f"{name}.json"),
                    "--report",
                    str(tmp_path / f"{name}.html"),
                ]
            )
            assert code == 0
    printed = capsys.readouterr().out
    assert "p99_ms" in printed and "overall" in printed
    result = orjson.loads((tmp_path / "fast.json").read_bytes())
    for key in (
        "offered_rps",
        "achieved_rps",
        "p50_ms",
        "p90_ms",
        "p99_ms",
        "p999_ms",
        "max_ms",
        "errors",
    ):
        assert key in result["overall"]
        assert key in result["classes"]["default"]
    assert result["overall"]["offered_rps"] == pytest.approx(200, rel=0.3)

    code = main(
        [
            "bench",
            "compare",
            str(tmp_path / "slow.json"),
            str(tmp_path / "fast.json"),
            "--report",
            str(tmp_path / "compare.html"),
        ]
    )
    assert code == 0
    table = capsys.readouterr().out
    assert "slow" in table and "fast" in table and "x)" in table

    for page in ("fast.html", "compare.html"):
        parser = _Images()
        parser.feed((tmp_path / page).read_text())
        assert len(parser.sources) == 3
        for source in parser.sources:
            prefix, data = source.split(",", 1)
            assert prefix == "data:image/png;base64"
            png = base64.b64decode(data)
            assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 5000
        assert (tmp_path / page.replace(".html", "-latency_cdf.png")).is_file()


def test_a_server_that_is_down_counts_as_connection_errors(tmp_path: Path) -> None:
    config = tmp_path / "model.yaml"
    config.write_text(orjson.dumps(CONFIG).decode())  # JSON is YAML
    w = workload(f"http://127.0.0.1:{free_port()}", duration_s=0.5, model_config=str(config))
    result = run_bench(w, progress=None)
    overall = result["overall"]
    assert overall["count"] == 100
    assert overall["errors"] == 100
    assert overall["errors_by_kind"] == {"connection": 100}
    assert overall["p99_ms"] is None
