"""The stack's one /metrics (`tailserve up`): the workers' series with the new ones among them
(computational debt, batch efficiency, latency a row, each model's SLO, memory per model) at
values that agree with what happened, the supervisor's own series (a killed worker counts a
restart), and every series and label the Grafana dashboard and the alert rules in deploy/ use."""

from __future__ import annotations

import os
import shutil
import signal
import time
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families
from test_up import churn_request

from support.observability import expressions, series
from support.servers import wait_for
from support.up import tailserve_up
from tailserve.observability.loop_metrics import LoopCounter, LoopHistogram
from tailserve.observability.metrics import Metrics
from tailserve.router.router_metrics import RouterMetrics

Page = dict[str, list[tuple[str, dict[str, str], float]]]


def scrape(url: str) -> Page:
    """Each family's samples (name, labels, value) on the stack's /metrics."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    page: Page = {}
    for family in text_string_to_metric_families(text):
        page[family.name] = [(s.name, s.labels, s.value) for s in family.samples]
    return page


def total(page: Page, sample: str, **labels: str) -> float:
    family = sample.removesuffix("_total").removesuffix("_sum").removesuffix("_count")
    rows = page.get(family, [])
    return sum(
        value
        for name, have, value in rows
        if name == sample and all(have.get(k) == v for k, v in labels.items())
    )


def declared_labels() -> dict[str, set[str]]:
    """The labels each loop-kept series of a worker and of the router is declared with."""
    metrics = Metrics()
    kept = [*vars(metrics).values(), *vars(metrics.work).values()]
    kept += vars(RouterMetrics(lambda: [])).values()
    # The L2 breaker's state (no labels of its own) has samples only with Redis.
    out: dict[str, set[str]] = {"tailserve_cache_l2_breaker_state": {"worker"}}
    for metric in kept:
        if isinstance(metric, LoopHistogram):
            for suffix in ("_bucket", "_sum", "_count"):
                out[metric.name + suffix] = {*metric.labels, "worker"}
        elif isinstance(metric, LoopCounter):
            out[metric.name + "_total"] = {*metric.labels, "worker"}
    return out


def sample_names(page: Page) -> dict[str, set[str]]:
    """Each sample name on the page, with every label its samples carry."""
    out: dict[str, set[str]] = {}
    for rows in page.values():
        for name, labels, _ in rows:
            out.setdefault(name, set()).update(labels)
    return out


def families_of(page: Page) -> set[str]:
    names = set()
    for family, rows in page.items():
        names.add(family)
        names.update(f"{family}{suffix}" for suffix in ("_total", "_bucket", "_sum", "_count"))
        names.update(name for name, _, _ in rows)
    return names


def test_one_metrics_page_holds_the_stack_and_agrees_with_what_happened(
    example_repository: Path, tmp_path: Path
) -> None:
    repository = tmp_path / "repository"  # churn alone: the stack is ready in seconds
    shutil.copytree(example_repository / "churn", repository / "churn")
    options = ("--workers", "2", "--hedge-model", "churn", "--drain-timeout", "2")
    with tailserve_up(repository, tmp_path, *options) as up:
        # (`up` says its workers are ready; the hedging lane may come a moment later, and
        # HAProxy sends churn to it once its own check of the lane has passed.)
        wait_for(
            lambda: total(scrape(up.url), "haproxy_backend_active_servers", proxy="lane") > 0,
            what="the front door to route to the hedging lane",
        )
        sent, per_row_bound = 0, 0.0
        with httpx.Client(base_url=up.url, timeout=10) as client:
            for seed in range(40):
                rows = 1 + seed % 4
                began = time.monotonic()
                reply = client.post("/v2/models/churn/infer", json=churn_request(rows, seed + 100))
                assert reply.status_code == 200, reply.text
                per_row_bound += (time.monotonic() - began) / rows
                sent += 1
        page = scrape(up.url)

        # Latency a row: one observation a request answered, each at most what the client saw.
        served = total(page, "tailserve_request_duration_per_row_seconds_count", model="churn")
        assert served == sent
        per_row = total(page, "tailserve_request_duration_per_row_seconds_sum", model="churn")
        assert 0 < per_row <= per_row_bound
        # Debt: one observation a computed request (each queued once), never more than the
        # compute spent; efficiency: one a batch, each within 0..1.
        queued = total(page, "tailserve_queue_duration_seconds_count", model="churn")
        assert queued > 0
        assert total(page, "tailserve_compute_debt_seconds_count", model="churn") == queued
        debt = total(page, "tailserve_compute_debt_seconds_sum", model="churn")
        compute = total(page, "tailserve_compute_duration_seconds_sum", model="churn")
        assert 0 < debt <= compute
        batches = total(page, "tailserve_batch_size_rows_count", model="churn")
        assert total(page, "tailserve_batch_efficiency_ratio_count", model="churn") == batches
        efficiency = total(page, "tailserve_batch_efficiency_ratio_sum", model="churn")
        assert 0 < efficiency <= batches
        # Lone small requests on a model that batches 256 rows: far from the best batch.
        assert efficiency / batches < 0.5 and debt > compute / 2
        # Each worker says each model's SLO and the memory each loaded model holds.
        workers = {labels["worker"] for _, labels, _ in page["tailserve_model_slo_seconds"]}
        assert workers == {"worker-0", "worker-1"}
        slo = {(m["worker"], m["model"]): v for _, m, v in page["tailserve_model_slo_seconds"]}
        assert slo[("worker-0", "churn")] == 0.05
        ready = {(m["worker"], m["model"]) for _, m, v in page["tailserve_model_ready"] if v == 1}
        memory = {(m["worker"], m["model"]): v for _, m, v in page["tailserve_model_memory_bytes"]}
        assert ready and ready <= set(memory)
        assert all(memory[key] > 0 for key in ready)

        # The supervisor's own series, and the hedging lane's.
        assert total(page, "tailserve_workers", state="serving") == 2
        assert total(page, "tailserve_worker_restarts_total", worker="worker-0") == 0
        assert total(page, "tailserve_frontdoor_running") == 1
        assert total(page, "tailserve_hedge_lane_ready") == 1
        assert total(page, "tailserve_router_requests_total", worker="lane", model="churn") > 0

        # Every series the dashboard and the rules use is here, with the labels they use.
        names, labelled, declared = families_of(page), sample_names(page), declared_labels()
        for expr in expressions():
            for name, labels in series(expr).items():
                assert name in names, f"{name} (in {expr!r}) is not on /metrics"
                have = labelled[name] if name in labelled else declared.get(name)
                assert have is not None, f"{name}: no samples and no declared labels"
                assert labels <= have, f"{name} has no {labels - have} (in {expr!r})"

        victim = up.worker_pids()["worker-1"]
        os.kill(victim, signal.SIGKILL)
        wait_for(
            lambda: (
                total(scrape(up.url), "tailserve_worker_restarts_total", worker="worker-1") == 1
            ),
            timeout=60,
            what="the killed worker's restart on /metrics",
        )
