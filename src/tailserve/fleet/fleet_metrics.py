"""The supervisor's own series on the stack's one ``/metrics``: its workers' restarts and
states, the autoscaler's counts, the front door's reloads and the hedging lane.

Read from the admin lane's view of the fleet (`fleet.admin.Fleet`) when the page is scraped;
their ``worker`` label (where they have one) names the worker they are about, not a source.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

if TYPE_CHECKING:
    from tailserve.fleet.admin_lane import Fleet

# Every state a worker slot may be in (fleet.processes.ManagedWorker.state): each is exported,
# 0 or not, so a graph of them has every line from the start.
STATES = ("warming", "standby", "serving", "draining", "restarting", "off")


def fleet_families(fleet: Fleet) -> list[Metric]:
    slots = fleet.slots()
    restarts = CounterMetricFamily(
        "tailserve_worker_restarts",
        "Times the supervisor started each worker again after it exited or was killed.",
        labels=["worker"],
    )
    ready = GaugeMetricFamily(
        "tailserve_worker_ready", "1 while the worker answers ready.", labels=["worker"]
    )
    counts = dict.fromkeys(STATES, 0)
    for slot in slots:
        restarts.add_metric([slot.name], slot.restarts)
        ready.add_metric([slot.name], 1 if slot.ready else 0)
        state = slot.state or ("restarting" if not slot.running else "serving")
        counts[state] = counts.get(state, 0) + 1
    states = GaugeMetricFamily(
        "tailserve_workers", "The supervisor's worker slots, by state.", labels=["state"]
    )
    for state, count in counts.items():
        states.add_metric([state], count)
    door = fleet.front_door()
    families: list[Metric] = [
        restarts,
        ready,
        states,
        CounterMetricFamily(
            "tailserve_frontdoor_reloads",
            "Times the front door (HAProxy) was reloaded with a new configuration.",
            value=door.get("reloads", 0),
        ),
        GaugeMetricFamily(
            "tailserve_frontdoor_running",
            "1 while the front door's process runs.",
            value=1 if door.get("running") else 0,
        ),
    ]
    lane = door.get("lane")
    if lane is not None:
        families.append(
            GaugeMetricFamily(
                "tailserve_hedge_lane_ready",
                "1 while the hedging lane (tailserve route) answers ready.",
                value=1 if lane.get("ready") else 0,
            )
        )
    # Without an autoscaler (a fixed --workers N), every slot is wanted, serving.
    scaler = fleet.autoscaler() or {"serving": counts["serving"], "wanted": len(slots)}
    serving = scaler.get("serving") or 0
    wanted = scaler.get("wanted")
    families += [
        GaugeMetricFamily(
            "tailserve_autoscaler_serving_workers",
            "Worker slots in the serving role (ready or not).",
            value=serving,
        ),
        GaugeMetricFamily(
            "tailserve_autoscaler_wanted_workers",
            "The serving workers the autoscaler last asked for (before its first decision: "
            "those serving; with no autoscaler: every worker).",
            value=serving if wanted is None else wanted,
        ),
    ]
    if "min_workers" in scaler:
        families += [
            GaugeMetricFamily(
                "tailserve_autoscaler_min_workers",
                "The least serving workers allowed.",
                value=scaler.get("min_workers") or 0,
            ),
            GaugeMetricFamily(
                "tailserve_autoscaler_max_workers",
                "The most serving workers allowed.",
                value=scaler.get("max_workers") or 0,
            ),
        ]
    return families
