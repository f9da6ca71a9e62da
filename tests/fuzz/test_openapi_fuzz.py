"""schemathesis against the worker's own /openapi.json: every route and method, with generated
paths, queries, headers and bodies. No 5xx, responses as the document says, and no request
left hanging (each must answer within a few seconds)."""

from __future__ import annotations

from typing import Any

import httpx
import hypothesis.strategies as st
import orjson
import pytest
import schemathesis
from hypothesis import settings
from schemathesis.checks import CHECKS

from support import fuzzing
from support.fuzzing import FUZZ_MODELS
from support.servers import WorkerProcess
from tailserve.protocols.http.openapi import openapi_document
from tailserve.protocols.http.routes import ROUTES

_ADMIN = {(r.method, r.template) for r in ROUTES if r.admin}

pytestmark = pytest.mark.timeout(900 if fuzzing.LONG else 120)


# The document the worker serves (a test below checks that it is this one), loaded at
# collection so that each operation is a test of its own.
schema = schemathesis.openapi.from_dict(openapi_document())


@schema.hook("flatmap_path_parameters")
def real_models(context: Any, path_parameters: dict[str, Any]) -> Any:
    # Mostly a model the worker serves, so that the requests reach past the 404 (an admin
    # route keeps what was generated: it could unload the models under test).
    if not path_parameters or "model" not in path_parameters or _admin(context.operation):
        return st.just(path_parameters)
    names = [*FUZZ_MODELS, path_parameters["model"]]
    return st.sampled_from(names).map(lambda name: {**path_parameters, "model": name})


@schema.auth()
class AdminToken:
    """The admin token on every request (schemathesis also sends each admin one without it,
    and with a wrong one, and expects 401)."""

    def get(self, case: schemathesis.Case, context: Any) -> str:
        return fuzzing.ADMIN_TOKEN

    def set(self, case: schemathesis.Case, data: str, context: Any) -> None:
        case.headers = {**(case.headers or {}), "Authorization": f"Bearer {data}"}


def test_the_worker_serves_this_document(fuzz_worker: WorkerProcess) -> None:
    served = httpx.get(f"{fuzz_worker.url}/openapi.json", timeout=fuzzing.TIMEOUT_S).json()
    assert served == orjson.loads(orjson.dumps(openapi_document()))


@schema.parametrize()
@settings(fuzzing.PROFILE)
def test_every_route_answers_without_a_server_error(
    case: schemathesis.Case, fuzz_worker: WorkerProcess
) -> None:
    label = f"openapi {case.operation.method.upper()} {case.operation.path}"
    fuzzing.CASES[label] += 1
    params = case.path_parameters or {}
    if _admin(case.operation) and params.get("model") in FUZZ_MODELS:
        # An admin route never names a model under test, whatever phase made the case (a
        # long run once unloaded rerank, and every later case for it answered 503).
        case.path_parameters = {**params, "model": f"unserved-{params['model']}"}
    try:
        case.call_and_validate(
            base_url=fuzz_worker.url, timeout=fuzzing.TIMEOUT_S, excluded_checks=_excluded(case)
        )
    except BaseException:
        fuzzing.FAILURES[label] += 1
        raise


def _excluded(case: schemathesis.Case) -> list[Any]:
    # A body may be all the document says and still be refused: the document cannot say which
    # tensors each model takes (a model's metadata does), so a 400 there is no failure.
    # Nor is the 400 of a model (or version) that is not ready: it is how readiness says no.
    if case.operation.body or case.operation.path.endswith("/ready"):
        return [CHECKS.get_by_names(["positive_data_acceptance"])[0]]
    return []


def _admin(operation: Any) -> bool:
    return (operation.method.upper(), operation.path) in _ADMIN
