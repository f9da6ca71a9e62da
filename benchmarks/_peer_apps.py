"""The servers `peers.py` compares tailserve with: each framework's app over the churn pipeline,
as source text written into that framework's own environment (none of them is importable here).

Every app reads the pipeline from $MODEL (a `model.joblib`), takes one OIP v2 row a request and
answers its churn probability; `row_of` and `answer` are the same in each.
"""

from __future__ import annotations

FIELDS = (
    "tenure_months",
    "monthly_spend",
    "support_tickets",
    "feature_usage_pct",
    "last_login_days_ago",
    "num_integrations",
    "contract_type",
    "plan_tier",
    "is_enterprise",
)
# What a peer's handler does with an OIP v2 body: one row, in FIELDS order.
_ROW = f"""
FIELDS = {FIELDS!r}


def row_of(body):
    values = {{tensor["name"]: tensor["data"][0] for tensor in body["inputs"]}}
    return [values[name] for name in FIELDS]


def answer(probability):
    return {{"outputs": [{{"name": "churn_probability", "datatype": "FP32", "shape": [1, 1],
                          "data": [float(probability)]}}]}}
"""

FASTAPI_APP = (
    """
import os

import joblib
import numpy as np
from fastapi import FastAPI, Request
"""
    + _ROW
    + """
model = joblib.load(os.environ["MODEL"])
app = FastAPI()


@app.post("/v2/models/churn/infer")
async def infer(request: Request):
    row = row_of(await request.json())
    return answer(model.predict_proba(np.array([row], dtype=object))[0, 1])
"""
)

LITSERVE_APP = (
    """
import os
import sys

import joblib
import litserve as ls
import numpy as np
"""
    + _ROW
    + """

class ChurnAPI(ls.LitAPI):
    def setup(self, device):
        self.model = joblib.load(os.environ["MODEL"])

    def decode_request(self, request):
        return row_of(request)

    def batch(self, rows):
        return np.array(rows, dtype=object)

    def predict(self, rows):
        if not isinstance(rows, np.ndarray):  # unbatched: one row
            rows = np.array([rows], dtype=object)
            return self.model.predict_proba(rows)[0, 1]
        return self.model.predict_proba(rows)[:, 1]

    def unbatch(self, output):
        return list(output)

    def encode_response(self, output):
        return answer(output)


if __name__ == "__main__":
    batch = int(sys.argv[2])
    api = ChurnAPI(max_batch_size=batch, batch_timeout=0.002 if batch > 1 else 0.0)
    ls.LitServer(api, accelerator="cpu", workers_per_device=1).run(port=int(sys.argv[1]))
"""
)


MLSERVER_APP = (
    """
import os

import joblib
import numpy as np
from mlserver import MLModel
from mlserver.types import InferenceRequest, InferenceResponse, ResponseOutput
"""
    + _ROW
    + """

class ChurnModel(MLModel):
    async def load(self):
        self.model = joblib.load(os.environ["MODEL"])
        return True

    async def predict(self, payload: InferenceRequest) -> InferenceResponse:
        columns = {}
        for tensor in payload.inputs:
            data = getattr(tensor.data, "root", tensor.data)
            columns[tensor.name] = [v.decode() if isinstance(v, bytes) else v for v in data]
        rows = len(columns[FIELDS[0]])
        features = np.empty((rows, len(FIELDS)), dtype=object)
        for i, name in enumerate(FIELDS):
            features[:, i] = columns[name]
        scores = self.model.predict_proba(features)[:, 1]
        output = ResponseOutput(
            name="churn_probability", shape=[rows, 1], datatype="FP32", data=scores.tolist()
        )
        return InferenceResponse(model_name=self.name, outputs=[output])
"""
)

# `python app.py PORT BATCH REPLICAS`: a Ray of its own (no dashboard) with Serve's HTTP proxy on
# PORT, access logs off, until SIGTERM (Ray's handler; the group's signal reaches GCS and the
# raylet, and the raylet's workers end with it).
RAY_APP = (
    """
import os
import sys
import threading

import joblib
import numpy as np
import ray
from ray import serve
from starlette.requests import Request
"""
    + _ROW
    + """

@serve.deployment
class Churn:
    def __init__(self, path):
        self.model = joblib.load(path)

    async def __call__(self, request: Request):
        row = row_of(await request.json())
        return answer(self.model.predict_proba(np.array([row], dtype=object))[0, 1])


@serve.deployment
class BatchedChurn:
    def __init__(self, path):
        self.model = joblib.load(path)

    @serve.batch(max_batch_size=16, batch_wait_timeout_s=0.002)
    async def score(self, rows):
        return list(self.model.predict_proba(np.array(rows, dtype=object))[:, 1])

    async def __call__(self, request: Request):
        return answer(await self.score(row_of(await request.json())))


if __name__ == "__main__":
    port, batch, replicas = (int(arg) for arg in sys.argv[1:4])
    quiet = {"enable_access_log": False, "log_level": "WARNING"}
    ray.init(num_cpus=replicas, include_dashboard=False, log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": port}, logging_config=quiet)
    if batch > 1:  # (Serve's advice: at least max_batch_size requests in flight a replica)
        app = BatchedChurn.options(num_replicas=replicas, max_ongoing_requests=batch)
    else:
        app = Churn.options(num_replicas=replicas)
    serve.run(app.bind(os.environ["MODEL"]), route_prefix="/", logging_config=quiet)
    threading.Event().wait()
"""
)

# `bentoml serve app:Churn` (each request alone) or `app:BatchedChurn`: its docs' way to batch a
# request of several fields, a service that sends each row to a batchable API of another.
# $WORKERS worker processes a service, access logs off. max_latency_ms is its docs' example: it
# is a deadline, not a batch window (a request that would pass it is answered 503: at the SLO's
# 50 ms it shed requests under light load); the wait for a batch adapts to the time a batch takes.
BENTOML_APP = (
    """
import os
from typing import Any

import bentoml
import joblib
import numpy as np
"""
    + _ROW
    + """
WORKERS = int(os.environ["WORKERS"])
QUIET = {"access": {"enabled": False}}


@bentoml.service(workers=WORKERS, logging=QUIET)
class Churn:
    def __init__(self):
        self.model = joblib.load(os.environ["MODEL"])

    @bentoml.api(route="/v2/models/churn/infer")
    def infer(self, inputs: list[dict[str, Any]]) -> dict[str, Any]:
        row = row_of({"inputs": inputs})
        return answer(self.model.predict_proba(np.array([row], dtype=object))[0, 1])


@bentoml.service(workers=WORKERS, logging=QUIET)
class ChurnModel:
    def __init__(self):
        self.model = joblib.load(os.environ["MODEL"])

    @bentoml.api(batchable=True, max_batch_size=16, max_latency_ms=1000)
    def score(self, rows: list[list[Any]]) -> list[float]:
        return self.model.predict_proba(np.array(rows, dtype=object))[:, 1].tolist()


@bentoml.service(workers=WORKERS, logging=QUIET)
class BatchedChurn:
    model = bentoml.depends(ChurnModel)

    @bentoml.api(route="/v2/models/churn/infer")
    async def infer(self, inputs: list[dict[str, Any]]) -> dict[str, Any]:
        scores = await self.model.to_async.score([row_of({"inputs": inputs})])
        return answer(scores[0])
"""
)
