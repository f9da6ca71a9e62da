"""The dashboard in headless Chromium on a real stack: it renders, stays on its own origin,
and its numbers agree with the stack's /metrics (totals exactly once the load has stopped and
one more sample came; the request rate within a tolerance while the load runs)."""

from __future__ import annotations

import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from playwright.sync_api import Page, sync_playwright
from prometheus_client.parser import text_string_to_metric_families

from support.up import tailserve_up
from tailserve.examples.churn import FIELDS, sample_rows

CHROMIUM = "/usr/bin/chromium"
SCREENSHOT = Path(__file__).parents[2] / "benchmarks" / "dashboard_screenshot.py"
RATE = 25.0  # requests a second, paced
# Whole samples the dashboard shows while the load runs (the load goes on until it has): the
# first may be partial, the middle ones are compared with the rate sent.
SAMPLES = 4
DISTINCT = 40  # inputs: the rest repeat them (cache hits, where affinity sends them)


def churn_body(seed: int) -> dict[str, Any]:
    sample = sample_rows(1, seed)
    inputs = [
        {"name": f.name, "datatype": f.datatype, "shape": [1, 1], "data": sample[f.name]}
        for f in FIELDS
    ]
    return {"inputs": inputs}


@pytest.fixture(scope="module")
def churn_only(example_repository: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A repository of churn alone: the stack starts in seconds."""
    repository = tmp_path_factory.mktemp("churn-only")
    shutil.copytree(example_repository / "churn", repository / "churn")
    return repository


def send_paced(
    url: str, answered: list[int], span: list[float], stop: threading.Event, said: list[str]
) -> None:
    """Requests at RATE until ``stop`` is set, and at least twice DISTINCT of them; what any
    reply but a 200 said goes in ``said``."""
    with httpx.Client(base_url=url, timeout=10) as client:
        span.append(time.monotonic())
        i = 0
        while not stop.is_set() or i < 2 * DISTINCT:
            time.sleep(max(0.0, span[0] + i / RATE - time.monotonic()))
            reply = client.post("/v2/models/churn/infer", json=churn_body(i % DISTINCT))
            answered.append(reply.status_code)
            if reply.status_code != 200:
                said.append(f"{i}: {reply.status_code} {reply.text}")
            i += 1
        span.append(time.monotonic())


def from_metrics(url: str) -> tuple[float, dict[str, float]]:
    """The stack's churn requests answered and its cache hits by tier, from /metrics."""
    requests, hits = 0.0, {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics").text):
        for s in family.samples:
            if s.name == "tailserve_requests_total" and s.labels.get("model") == "churn":
                requests += s.value
            if s.name == "tailserve_cache_lookups_total" and s.labels.get("result") == "hit":
                hits[s.labels["tier"]] = hits.get(s.labels["tier"], 0.0) + s.value
    return requests, hits


def seq(page: Page) -> int:
    return int(page.get_by_test_id("sample-seq").inner_text())


def next_sample(page: Page, after: int) -> int:
    page.wait_for_function(
        "n => Number(document.querySelector('[data-testid=sample-seq]').textContent) > n",
        arg=after,
        timeout=10_000,
    )
    return seq(page)


def test_the_dashboard_renders_and_agrees_with_metrics(churn_only: Path, tmp_path: Path) -> None:
    with (
        tailserve_up(churn_only, tmp_path, "--workers", "2") as up,
        sync_playwright() as playwright,
    ):
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        page = browser.new_page()
        errors: list[str] = []
        elsewhere: list[str] = []
        failed: list[str] = []
        page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.on("request", lambda r: None if r.url.startswith(up.url) else elsewhere.append(r.url))
        page.on("requestfailed", lambda r: failed.append(f"{r.url}: {r.failure}"))
        page.goto(f"{up.url}/dashboard")
        for worker in ("worker-0", "worker-1"):
            page.get_by_test_id(f"worker-{worker}").wait_for()
            assert "serving" in page.get_by_test_id(f"worker-{worker}").inner_text()

        answered: list[int] = []
        span: list[float] = []
        said: list[str] = []
        stop = threading.Event()
        load = threading.Thread(target=send_paced, args=(up.url, answered, span, stop, said))
        load.start()
        page.get_by_test_id("rps-churn").wait_for()
        # The rate each sample shows while the load runs (the first may be partial).
        rates: list[float] = []
        at = seq(page)
        while len(rates) < SAMPLES:
            at = next_sample(page, at)
            rates.append(float(page.get_by_test_id("rps-churn").get_attribute("data-value") or 0))
        stop.set()
        load.join()
        sent = len(answered)
        assert answered == [200] * sent, said
        sent_rate = sent / (span[1] - span[0])
        assert statistics.median(rates[1:-1] or rates) == pytest.approx(sent_rate, rel=0.5), rates

        # Totals: the same as /metrics once one more whole sample came after the load.
        next_sample(page, next_sample(page, seq(page)))
        requests, hits = from_metrics(up.url)
        assert requests == sent and 0 < hits["l1"] <= sent - DISTINCT
        shown = float(page.get_by_test_id("total-requests-churn").inner_text())
        assert shown == requests
        assert float(page.get_by_test_id("total-cache-hits-l1").inner_text()) == hits["l1"]

        # The charts have points: latency against the SLO, throughput, the cache's hit ratio.
        for chart in ("latency", "throughput", "cache", "batch"):
            figure = page.get_by_test_id(f"chart-{chart}-churn")
            assert int(figure.get_attribute("data-points") or 0) >= 2, chart
            assert figure.locator("polyline").count() >= 1, chart
        slo = page.get_by_test_id("chart-latency-churn").locator("polyline.slo")
        assert slo.count() >= 1
        assert page.get_by_test_id("slo-churn").get_attribute("data-value") == "0.05"
        assert page.get_by_test_id("status").inner_text() == "live"
        browser.close()
        assert errors == [] and elsewhere == [] and failed == []

        # The screenshot helper, on the same stack.
        png = tmp_path / "dashboard.png"
        done = subprocess.run(
            [sys.executable, str(SCREENSHOT), up.url, "--out", str(png)],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 0, done.stderr
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000

        # Bad requests say what is wrong.
        reply = httpx.get(f"{up.url}/dashboard/series", params={"since": "abc"})
        assert reply.status_code == 400
        assert "since must be a point's number" in reply.json()["error"]
        assert httpx.get(f"{up.url}/dashboard/nothing.js").status_code == 404
        assert httpx.post(f"{up.url}/dashboard/series").status_code == 405
