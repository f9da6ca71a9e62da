"""Which models take the hedging lane: by their cost models' one-row predictions, or by name."""

from __future__ import annotations

from typing import Any

from tailserve.frontdoor.render import FrontDoorPolicy, Listen, Member, render
from tailserve.router.lanes import predicted_ms, slow_models


def stats(*classes: tuple[float, int]) -> dict[str, Any]:
    """A stats document with one cost class a (one-row ms, observations) pair."""
    cost_model = {
        f"c{i}": {"predicted_ms": {"1": ms, "64": ms * 10}, "observations": seen}
        for i, (ms, seen) in enumerate(classes)
    }
    return {"model_stats": [{"batching": {"cost_model": cost_model}}]}


def test_a_model_is_as_slow_as_its_cheapest_observed_class() -> None:
    assert predicted_ms(stats((250.0, 3), (900.0, 3))) == 250.0
    assert predicted_ms(stats((5.0, 0), (300.0, 2))) == 300.0  # an unobserved class is no guess
    assert predicted_ms(stats()) is None
    assert predicted_ms({"model_stats": [{"batching": {}}]}) is None


def test_slow_models_are_those_over_the_threshold_and_those_named() -> None:
    predictions = {"ranker": 350.0, "churn": 0.3, "new": None}
    assert slow_models(predictions, 200.0) == {"ranker"}
    assert slow_models(predictions, 200.0, named=("churn",)) == {"ranker", "churn"}
    assert slow_models(predictions, 0.0, named=("churn",)) == {"churn"}


def test_a_slow_model_is_routed_to_the_lane_and_the_rest_direct() -> None:
    listen = Listen(host="127.0.0.1", port=8080, lane_port=9300)
    members = [Member("worker-0", "127.0.0.1", 9001)]
    models = {"churn": 50.0, "ranker": 1000.0}
    config = render(listen, members, models, FrontDoorPolicy(), frozenset({"ranker"}))
    # Through the lane while it is up; else (the next rule) straight to the workers.
    assert "    use_backend lane if { nbsrv(lane) gt 0 } is.ranker\n" in config
    assert "    use_backend m.ranker if { nbsrv(m.ranker) gt 0 } is.ranker\n" in config
    assert "    use_backend lane if { nbsrv(lane) gt 0 } is.churn" not in config
    assert "    server lane 127.0.0.1:9300 check" in config
    # Without a lane, a slow model goes direct.
    direct = render(
        Listen(host="127.0.0.1", port=8080),
        members,
        models,
        FrontDoorPolicy(),
        frozenset({"ranker"}),
    )
    assert "use_backend lane" not in direct and "use_backend m.ranker" in direct
