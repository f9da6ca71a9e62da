"""What the autoscaler reads of each worker: HAProxy's statistics, latency histograms, CPU."""

from __future__ import annotations

import math
import os

from tailserve.fleet.load import LoadSampler, cpu_seconds, histogram, parse_stat, quantile

HEADER = "# pxname,svname,qcur,scur,stot,dreq,hrsp_5xx,qtime,\n"


def stat(*rows: str) -> str:
    return HEADER + "".join(f"{row}\n" for row in rows)


def page(counts: dict[str, int]) -> str:
    lines = ["# TYPE tailserve_request_duration_seconds histogram"]
    for model in ("a", "b"):  # two label sets: summed
        for le, count in counts.items():
            lines.append(
                f'tailserve_request_duration_seconds_bucket{{model="{model}",le="{le}"}} {count}'
            )
    lines.append('tailserve_requests_total{model="a"} 9')
    return "\n".join(lines)


def test_show_stat_parses_by_proxy_and_server() -> None:
    rows = parse_stat(stat("m.a,w0,1,3,10,,2,4,", "m.a,BACKEND,0,3,10,7,2,4,"))
    assert rows["m.a", "w0"]["scur"] == "3"
    assert rows["m.a", "BACKEND"]["dreq"] == "7"
    assert parse_stat("Unknown command\n") == {}


def test_a_histogram_sums_its_label_sets_and_a_quantile_reads_what_it_gained() -> None:
    before = histogram(page({"0.01": 10, "0.05": 10, "+Inf": 10}))
    after = histogram(page({"0.01": 60, "0.05": 109, "+Inf": 110}))
    assert after == {0.01: 120.0, 0.05: 218.0, math.inf: 220.0}
    # Gained 200: 100 under 10 ms, 98 more under 50 ms, 2 beyond.
    assert quantile(before, after, 0.5) == 0.01
    assert quantile(before, after, 0.99) == 0.05
    assert quantile(before, after, 0.999) == math.inf
    assert quantile(after, after, 0.99) is None  # nothing came in


def test_the_sampler_turns_counters_into_rates_and_shares_the_door_s_refusals() -> None:
    sampler = LoadSampler()
    backends = ["m.a", "workers"]
    first = stat("m.a,w0,0,2,5,,1,3,", "m.a,w1,0,1,5,,0,0,", "m.a,BACKEND,0,3,10,4,1,3,")
    loads = sampler.sample(10.0, parse_stat(first), backends, ["w0", "w1"], {}, {})
    assert loads["w0"].in_flight == 2 and loads["w0"].refusals_per_s == 0.0
    second = stat(
        "m.a,w0,4,6,25,,11,30,",
        "workers,w0,0,1,1,,0,0,",
        "m.a,w1,0,1,9,,0,0,",
        "m.a,BACKEND,4,7,34,24,11,30,",
    )
    pages = {"w0": page({"0.01": 0, "+Inf": 0}), "w1": None}
    loads = sampler.sample(12.0, parse_stat(second), backends, ["w0", "w1"], pages, {})
    w0, w1 = loads["w0"], loads["w1"]
    assert w0.in_flight == 4 + 6 + 1  # queued and in flight, over both backends
    assert w0.queue_delay_s == 0.030
    # Its own 503s (10 in 2 s) and half of the door's (20 in 2 s, over two workers).
    assert w0.refusals_per_s == 5.0 + 5.0
    assert w1.refusals_per_s == 5.0
    assert w0.p99_s is None  # no histogram before this sample


def test_cpu_time_is_read_from_proc() -> None:
    used = cpu_seconds(os.getpid())
    assert used is not None and used > 0
    assert cpu_seconds(2**22 + 12345) is None
