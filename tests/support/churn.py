"""The `churn` example's inputs, as a client builds them (columns of one value a row)."""

from __future__ import annotations

from typing import Any

import numpy as np

from tailserve.examples.churn import sample_rows

FIELDS = {
    "tenure_months": "INT64",
    "monthly_spend": "FP32",
    "support_tickets": "INT64",
    "feature_usage_pct": "FP32",
    "last_login_days_ago": "INT64",
    "num_integrations": "INT64",
    "contract_type": "BYTES",
    "plan_tier": "BYTES",
    "is_enterprise": "INT64",
}


def columns(rows: int, seed: int = 3) -> dict[str, np.ndarray[Any, Any]]:
    sample = sample_rows(rows, seed)
    out = {}
    for name, datatype in FIELDS.items():
        values = sample[name]
        if datatype == "BYTES":
            out[name] = np.array([str(v).encode() for v in values], dtype=object).reshape(-1, 1)
        else:
            dtype = np.float32 if datatype == "FP32" else np.int64
            out[name] = np.asarray(values, dtype=dtype).reshape(-1, 1)
    return out


def grpc_inputs(rows: int, seed: int = 3) -> list[Any]:
    """The same rows as `tritonclient.grpc` inputs."""
    import tritonclient.grpc as triton_grpc

    inputs = []
    for name, values in columns(rows, seed).items():
        tensor = triton_grpc.InferInput(name, list(values.shape), FIELDS[name])
        tensor.set_data_from_numpy(values)
        inputs.append(tensor)
    return inputs
