"""The worker's route table: static paths, paths with parameters, and the memo of the latter."""

from __future__ import annotations

import pytest

from tailserve.protocols.http import routes
from tailserve.protocols.http.routes import Router


def test_a_path_with_parameters_matches_the_same_way_the_second_time() -> None:
    router = Router()
    for _ in range(2):
        route, params, known = router.match("POST", "/v2/models/churn/infer")
        assert route is not None and route.handler == "infer" and known
        assert params == {"model": "churn"}
        route, params, _ = router.match("POST", "/v2/models/ranker/versions/2/infer")
        assert route is not None and route.handler == "infer"
        assert params == {"model": "ranker", "version": "2"}
    # The same path under a method it does not take: no route, but the path is known.
    assert router.match("DELETE", "/v2/models/churn/infer") == (None, {}, True)
    assert router.match("POST", "/v2/nothing/here") == (None, {}, False)


def test_the_memo_of_matched_paths_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(routes, "_SEEN", 3)
    router = Router()
    for k in range(10):
        route, params, _ = router.match("POST", f"/v2/models/m{k}/infer")
        assert route is not None and params == {"model": f"m{k}"}
    assert router.remembered == 3
    # Past the bound, paths still match: they are only not kept.
    assert router.match("POST", "/v2/models/m9/infer")[1] == {"model": "m9"}
