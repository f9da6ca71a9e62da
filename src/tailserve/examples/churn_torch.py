"""The churn example in PyTorch (``churn_torch``; needs the `torch` extra).

torch takes no strings, so its inputs are churn's numeric fields (the two categories are left
out). The model is an MLP with two hidden layers of 512, trained here on the synthetic customers
from fixed seeds: enough compute a row (~0.3 M multiply-adds) that the ``int8`` variant (dynamic
int8 quantisation of its linear layers) is measurably cheaper than ``fp32`` on a CPU. It is
written twice: ``model.pt``, TorchScript (what serves by default, and what ``int8`` quantises),
and ``model.pt2``, the same module as an exported program, which ``compile: inductor`` compiles
(torch.compile takes no TorchScript).
"""

# No `from __future__ import annotations`: TorchScript reads the annotations as objects.

import io
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from tailserve.examples.churn import FIELDS, Columns, model_config, training_data
from tailserve.examples.churn import write_config as write_model_config

MODEL = "churn_torch"
INPUTS = tuple(field for field in FIELDS if field.values is None)
HIDDEN = 512
SEED = 17
EPOCHS = 3
TRAINING_ROWS = 12_000
HELD_OUT_ROWS = 4000
_HEADER = (
    "# Written by `tailserve examples`: synthetic data, fixed seed. Variants: fp32 (the model)\n"
    "# and int8 (dynamic quantisation of its linear layers, CPU only), AUC on held-out rows.\n"
)


class ChurnMLP(nn.Module):
    """Numeric churn fields, one (rows, 1) tensor each, to the probability of churn."""

    mean: torch.Tensor
    std: torch.Tensor

    def __init__(self, mean: torch.Tensor, std: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("mean", mean)
        self.register_buffer("std", std)
        self.layers = nn.Sequential(
            nn.Linear(len(INPUTS), HIDDEN),
            nn.ReLU(),
            nn.Linear(HIDDEN, HIDDEN),
            nn.ReLU(),
            nn.Linear(HIDDEN, 1),
        )

    def forward(
        self,
        tenure_months: torch.Tensor,
        monthly_spend: torch.Tensor,
        support_tickets: torch.Tensor,
        feature_usage_pct: torch.Tensor,
        last_login_days_ago: torch.Tensor,
        num_integrations: torch.Tensor,
        is_enterprise: torch.Tensor,
    ) -> torch.Tensor:
        features = torch.cat(
            [
                tenure_months.float(),
                torch.log1p(monthly_spend.float()),
                support_tickets.float(),
                feature_usage_pct.float(),
                last_login_days_ago.float(),
                num_integrations.float(),
                is_enterprise.float(),
            ],
            dim=1,
        )
        return torch.sigmoid(self.layers((features - self.mean) / self.std))


def as_tensors(customers: Columns) -> list[torch.Tensor]:
    """The model's arguments: (rows, 1) tensors in INPUTS order, as the runtime builds them."""
    dtypes = {"INT64": torch.int64, "FP32": torch.float32}
    return [
        torch.as_tensor(np.asarray(customers[f.name]), dtype=dtypes[f.datatype]).reshape(-1, 1)
        for f in INPUTS
    ]


def train(rows: int = TRAINING_ROWS) -> ChurnMLP:
    """The model trained on the churn example's customers (fixed seeds, one thread: the same
    weights every time)."""
    customers, labels = training_data(rows=rows)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a sum split over threads rounds differently from run to run
    try:
        torch.manual_seed(SEED)
        inputs = as_tensors(customers)
        raw = torch.cat(
            [x.float() if i != 1 else torch.log1p(x.float()) for i, x in enumerate(inputs)], 1
        )
        model = ChurnMLP(raw.mean(0), raw.std(0) + 1e-6)
        target = torch.as_tensor(labels, dtype=torch.float32).reshape(-1, 1)
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
        loss_fn = nn.BCELoss()
        order = torch.Generator().manual_seed(SEED)
        for _ in range(EPOCHS):
            for batch in torch.split(torch.randperm(rows, generator=order), 256):
                optimizer.zero_grad()
                loss = loss_fn(model(*(x[batch] for x in inputs)), target[batch])
                loss.backward()
                optimizer.step()
        return model.eval()
    finally:
        torch.set_num_threads(threads)


def scripted(model: ChurnMLP) -> bytes:
    buffer = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # TorchScript's, since torch 2.13
        torch.jit.save(torch.jit.script(model), buffer)
    return buffer.getvalue()


def exported(model: ChurnMLP, path: Path) -> None:
    """The module as an exported program with a dynamic batch dimension."""
    example = as_tensors(training_data(rows=4)[0])
    batch = torch.export.Dim("batch", min=1, max=4096)
    program = torch.export.export(
        model, tuple(example), dynamic_shapes=tuple({0: batch} for _ in example)
    )
    torch.export.save(program, str(path))


def auc(scores: np.ndarray[Any, Any], labels: np.ndarray[Any, Any]) -> float:
    """Area under the ROC curve: the chance a positive scores above a negative (ties: half)."""
    order = np.argsort(scores, kind="stable")
    _, first, counts = np.unique(scores[order], return_index=True, return_counts=True)
    ranks = np.empty(len(scores))
    ranks[order] = np.repeat(first + (counts + 1) / 2, counts)  # tied scores share their rank
    positives = labels == 1
    count = int(positives.sum())
    pairs = count * (len(labels) - count)
    return float((ranks[positives].sum() - count * (count + 1) / 2) / pairs)


def held_out_auc(module: Any) -> float:
    customers, labels = training_data(rows=HELD_OUT_ROWS, seed=SEED + 1)
    with torch.inference_mode():
        scores = module(*as_tensors(customers)).numpy().reshape(-1)
    return round(auc(scores, labels), 4)


def write_churn_torch(directory: Path) -> str:
    """Train the model and write it (TorchScript and exported) with its model.yaml."""
    from tailserve.runtimes.torch import quantize_dynamic_int8

    model = train()
    content = scripted(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        script = torch.jit.load(io.BytesIO(content))  # type: ignore[no-untyped-call]
    fp32 = held_out_auc(script)
    int8 = held_out_auc(quantize_dynamic_int8(script))
    config = model_config("torch")
    config["inputs"] = [field.spec() for field in INPUTS]
    # Its batches (0.05-1.5 ms at 1-256 rows, fp32) run on the instance's thread, where torch
    # lets go of the GIL, not on the event loop's.
    config["instances"] = {"count": 1, "intra_op_threads": 1}
    config["variants"] = {
        "metric": "auc",
        "choices": [
            {"name": "fp32", "accuracy": fp32},
            {"name": "int8", "parameters": {"quantize": "dynamic_int8"}, "accuracy": int8},
        ],
    }
    model_dir = directory / MODEL
    write_model_config(model_dir, config, _HEADER)
    (model_dir / "1").mkdir(exist_ok=True)
    (model_dir / "1" / "model.pt").write_bytes(content)
    exported(model, model_dir / "1" / "model.pt2")
    return MODEL
