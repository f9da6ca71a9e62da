"""The baseline of the worker benchmark: a FastAPI server written the way most tutorials write
one. Pydantic parses the Open Inference Protocol JSON body and each request is scored alone,
inside the event loop. It serves one model folder of a tailserve repository (ONNX or a pickled
scikit-learn pipeline), with the same one-thread setting tailserve gives the model.

With ``BASELINE_REDIS_URL`` it also caches results in Redis the way the tutorials add a cache
(the cache benchmark's "Redis only, as the tutorials build it"): the key is a hash of the parsed
request, each request GETs it, and a miss computes and SETs it with a TTL. (It answers
``x-cache: l2`` or ``miss`` so the benchmark can count the hits.)

    BASELINE_MODEL_DIR=repo/churn uvicorn fastapi_naive:app --port 8200
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import yaml
from fastapi import FastAPI, HTTPException, Response
from pydantic import BaseModel

MODEL_DIR = Path(os.environ["BASELINE_MODEL_DIR"])
CONFIG = yaml.safe_load((MODEL_DIR / "model.yaml").read_text())
NAME = MODEL_DIR.name
FIELDS = [spec["name"] for spec in CONFIG["inputs"]]
OUTPUT = CONFIG["outputs"][0]["name"]


def _load() -> Any:
    version = MODEL_DIR / "1"
    if CONFIG["runtime"] == "onnx":
        import onnxruntime as ort

        options = ort.SessionOptions()
        options.intra_op_num_threads = 1
        options.inter_op_num_threads = 1
        session = ort.InferenceSession(
            str(version / "model.onnx"), options, providers=["CPUExecutionProvider"]
        )
        types = {i.name: i.type for i in session.get_inputs()}

        def predict_onnx(columns: dict[str, list[Any]]) -> list[float]:
            feed = {}
            for name, values in columns.items():
                if types[name] == "tensor(string)":
                    feed[name] = np.array(values, dtype=object).reshape(-1, 1)
                elif types[name] == "tensor(float)":
                    feed[name] = np.array(values, dtype=np.float32).reshape(-1, 1)
                else:
                    feed[name] = np.array(values, dtype=np.int64).reshape(-1, 1)
            (out,) = session.run([OUTPUT], feed)
            return [float(v) for v in out.reshape(-1)]

        return predict_onnx
    import joblib
    from threadpoolctl import threadpool_limits

    threadpool_limits(1)
    pipeline = joblib.load(version / "model.joblib")

    def predict_sklearn(columns: dict[str, list[Any]]) -> list[float]:
        rows = len(columns[FIELDS[0]])
        features = np.empty((rows, len(FIELDS)), dtype=object)
        for i, name in enumerate(FIELDS):
            features[:, i] = columns[name]
        return [float(p) for p in pipeline.predict_proba(features)[:, 1]]

    return predict_sklearn


predict = _load()
app = FastAPI()
REDIS_URL = os.environ.get("BASELINE_REDIS_URL")
if REDIS_URL:
    import redis.asyncio as aioredis

    cache = aioredis.Redis.from_url(REDIS_URL)


class Tensor(BaseModel):
    name: str
    datatype: str
    shape: list[int]
    data: list[Any]


class InferRequest(BaseModel):
    inputs: list[Tensor]


@app.get("/v2/health/ready")
async def ready() -> dict[str, bool]:
    return {"ready": True}


@app.post("/v2/models/{model}/infer")
async def infer(model: str, request: InferRequest, response: Response) -> dict[str, Any]:
    if model != NAME:
        raise HTTPException(404, f"unknown model {model!r}")
    if not REDIS_URL:
        return _score(request)
    key = f"{NAME}:" + hashlib.sha256(request.model_dump_json().encode()).hexdigest()
    cached = await cache.get(key)
    if cached is not None:
        response.headers["x-cache"] = "l2"
        result: dict[str, Any] = json.loads(cached)
        return result
    result = _score(request)
    await cache.set(key, json.dumps(result), ex=600)
    response.headers["x-cache"] = "miss"
    return result


def _score(request: InferRequest) -> dict[str, Any]:
    columns = {tensor.name: tensor.data for tensor in request.inputs}
    missing = [name for name in FIELDS if name not in columns]
    if missing:
        raise HTTPException(400, f"input {missing[0]!r} is missing")
    probabilities = predict(columns)
    return {
        "model_name": NAME,
        "outputs": [
            {
                "name": OUTPUT,
                "datatype": "FP32",
                "shape": [len(probabilities), 1],
                "data": probabilities,
            }
        ],
    }
