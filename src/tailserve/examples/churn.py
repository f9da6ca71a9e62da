"""The churn example: synthetic customers, their model.yaml, and two models trained on them.

The customers and their labels come from a fixed seed, so every `tailserve examples` run trains
on the same data. `sample_rows` draws fresh customers from the same distribution (any seed) for
load generators and tests; it needs only numpy, while training needs the `examples` extra.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from tailserve.modelconfig import CONFIG_FILE, load_model_config
from tailserve.tensors import numpy_dtype

Columns = dict[str, np.ndarray[Any, Any]]

ONNX_MODEL = "churn"
LIGHTGBM_MODEL = "churn_lgbm"
SKLEARN_MODEL = "churn_sklearn"
OUTPUT = "churn_probability"
TRAINING_SEED = 7
TRAINING_ROWS = 20_000

_HEADER = "# Written by `tailserve examples`: synthetic data, fixed seed.\n"

CONTRACTS = ("monthly", "annual", "multi-year")
TIERS = ("starter", "growth", "enterprise")


@dataclass(frozen=True, slots=True)
class Field:
    name: str
    datatype: str
    range: tuple[float, float] | None = None
    values: tuple[str, ...] | None = None

    def spec(self) -> dict[str, Any]:
        """The input as model.yaml lists it."""
        spec: dict[str, Any] = {"name": self.name, "datatype": self.datatype, "shape": [1]}
        if self.range is not None:
            spec["range"] = list(self.range)
        if self.values is not None:
            spec["values"] = list(self.values)
        return spec


FIELDS: tuple[Field, ...] = (
    Field("tenure_months", "INT64", range=(1, 120)),
    Field("monthly_spend", "FP32", range=(0, 100_000)),
    Field("support_tickets", "INT64", range=(0, 50)),
    Field("feature_usage_pct", "FP32", range=(0.0, 1.0)),
    Field("last_login_days_ago", "INT64", range=(0, 365)),
    Field("num_integrations", "INT64", range=(0, 50)),
    Field("contract_type", "BYTES", values=CONTRACTS),
    Field("plan_tier", "BYTES", values=TIERS),
    Field("is_enterprise", "INT64", range=(0, 1)),
)


# --- synthetic customers --------------------------------------------------------------------


def draw_customers(rng: np.random.Generator, rows: int) -> Columns:
    """Plausible customers as 1-D columns: numbers as int64/float64, categories as str."""
    plan = rng.choice(np.array(TIERS), size=rows, p=[0.5, 0.35, 0.15])
    enterprise_plan = plan == "enterprise"
    is_enterprise = np.where(enterprise_plan, rng.random(rows) < 0.85, rng.random(rows) < 0.05)
    base_spend = np.select([plan == "starter", plan == "growth"], [30.0, 150.0], 900.0)
    usage = np.round(rng.beta(2.0, 2.5, size=rows), 4)
    return {
        "tenure_months": rng.integers(1, 121, size=rows),
        "monthly_spend": np.round(np.clip(base_spend * rng.lognormal(0, 0.5, rows), 0, 1e5), 2),
        "support_tickets": np.minimum(rng.poisson(1.5 + 2.0 * enterprise_plan), 50),
        "feature_usage_pct": usage,
        "last_login_days_ago": np.minimum(rng.exponential(5 + 40 * (1 - usage)), 365).astype(
            np.int64
        ),
        "num_integrations": np.minimum(rng.poisson(1 + 4 * usage + 3 * is_enterprise), 50),
        "contract_type": rng.choice(np.array(CONTRACTS), size=rows, p=[0.5, 0.32, 0.18]),
        "plan_tier": plan,
        "is_enterprise": is_enterprise.astype(np.int64),
    }


def churn_labels(customers: Columns, rng: np.random.Generator) -> np.ndarray[Any, Any]:
    """0/1 labels from a logistic function of the fields plus noise."""
    c = customers
    rows = len(c["tenure_months"])
    contract = np.select(
        [c["contract_type"] == "monthly", c["contract_type"] == "annual"], [0.9, -0.4], -1.4
    )
    tier = np.select([c["plan_tier"] == "starter", c["plan_tier"] == "growth"], [0.3, 0.0], -0.3)
    logit = (
        -0.4
        - 0.025 * (c["tenure_months"] - 24)
        + 0.3 * (c["support_tickets"] - 2)
        - 2.5 * (c["feature_usage_pct"] - 0.45)
        + 0.015 * (c["last_login_days_ago"] - 15)
        - 0.3 * (c["num_integrations"] - 3)
        + 0.15 * np.log1p(c["monthly_spend"] / 100)
        - 0.4 * c["is_enterprise"]
        + contract
        + tier
        + rng.normal(0.0, 0.6, size=rows)
    )
    probability = 1.0 / (1.0 + np.exp(-logit))
    labels: np.ndarray[Any, Any] = (rng.random(rows) < probability).astype(np.int64)
    return labels


def training_data(
    rows: int = TRAINING_ROWS, seed: int = TRAINING_SEED
) -> tuple[Columns, np.ndarray[Any, Any]]:
    rng = np.random.default_rng(seed)
    customers = draw_customers(rng, rows)
    return customers, churn_labels(customers, rng)


def sample_rows(n: int, seed: int) -> dict[str, list[Any]]:
    """``n`` valid customers as plain-Python columns (JSON-ready), the same for the same seed."""
    customers = draw_customers(np.random.default_rng(seed), n)
    return {field.name: customers[field.name].tolist() for field in FIELDS}


def sample_inputs(n: int, seed: int) -> Columns:
    """``n`` valid customers as the (n, 1) arrays a worker hands its runtimes (BYTES as str)."""
    return as_inputs(draw_customers(np.random.default_rng(seed), n))


def as_inputs(customers: Columns) -> Columns:
    inputs: Columns = {}
    for field in FIELDS:
        column = customers[field.name]
        if field.datatype == "BYTES":
            array = np.empty(len(column), dtype=object)
            array[:] = column.tolist()
        else:
            array = column.astype(numpy_dtype(field.datatype))
        inputs[field.name] = array.reshape(-1, 1)
    return inputs


def feature_matrix(customers: Columns) -> np.ndarray[Any, Any]:
    """Float64 columns in FIELDS order, categories as their index: what LightGBMRuntime builds."""
    columns = []
    for field in FIELDS:
        column = customers[field.name]
        if field.values is not None:
            index = {value: i for i, value in enumerate(field.values)}
            column = np.array([index[value] for value in column.tolist()])
        columns.append(np.asarray(column, dtype=np.float64))
    return np.column_stack(columns)


# --- the model repository -------------------------------------------------------------------


def model_config(runtime: str) -> dict[str, Any]:
    return {
        "runtime": runtime,
        "max_batch_size": 256,
        "inputs": [field.spec() for field in FIELDS],
        "outputs": [{"name": OUTPUT, "datatype": "FP32", "shape": [1]}],
        "batching": {"enabled": True, "max_queue_delay_ms": 1, "max_queue_size": 2048},
        # Its batches (0.06-0.5 ms, 1 to 256 rows, as fast or slow as the machine runs) cost
        # the loop less run there than handed to the instance's thread, whose results come back
        # late behind a busy loop (docs/decisions/0006-worker-event-loop.md).
        "instances": {"count": 1, "intra_op_threads": 1, "inline_below_ms": 1.0},
        "version_policy": {"latest": 1},
        "warmup": {"batch_sizes": [1, 16, 256], "repeat": 2},
        "slo": {"p99_ms": 50},
        # Customers come back: their scores are cached for 5 minutes (then served stale for
        # up to a minute while one request recomputes them), in-process and in Redis.
        "cache": {
            "enabled": True,
            "ttl_s": 300,
            "stale_s": 60,
            "l1": {"max_entries": 100_000, "max_bytes": 64 * 1024 * 1024, "policy": "tinylfu"},
        },
    }


def write_config(model_dir: Path, config: dict[str, Any], header: str = _HEADER) -> None:
    """model.yaml under a comment header, checked as a worker would load it."""
    model_dir.mkdir(parents=True, exist_ok=True)
    text = yaml.safe_dump(config, sort_keys=False, default_flow_style=None)
    (model_dir / CONFIG_FILE).write_text(f"{header}{text}", "utf-8")
    load_model_config(model_dir)  # what we wrote must be what a worker accepts


def write_churn(directory: Path, *, sklearn: bool = False) -> list[str]:
    """Train the churn models and write them with their model.yaml; return the model names.

    ``sklearn`` adds ``churn_sklearn``: the pipeline the ONNX graph was exported from, pickled.
    It is what most tutorials serve (and costs ~1.3 ms a call whatever the batch size).
    """
    from tailserve.examples import training

    customers, labels = training_data()
    pipeline = training.churn_pipeline(customers, labels)
    models = {
        ONNX_MODEL: ("onnx", "model.onnx", training.churn_onnx(pipeline, customers)),
        LIGHTGBM_MODEL: ("lightgbm", "model.txt", training.churn_lightgbm(customers, labels)),
    }
    if sklearn:
        models[SKLEARN_MODEL] = ("sklearn", "model.joblib", training.pickled(pipeline))
    for name, (runtime, artifact, content) in models.items():
        model_dir = directory / name
        config = model_config(runtime)
        if runtime == "sklearn":
            config.update(trust=True, parameters={"method": "predict_proba", "column": 1})
        write_config(model_dir, config)
        (model_dir / "1").mkdir(exist_ok=True)
        (model_dir / "1" / artifact).write_bytes(content)
    return list(models)
