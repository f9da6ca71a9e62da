"""The example model repository that `tailserve examples DIR` writes.

Models are trained on synthetic data from fixed seeds, so every run writes the same models.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from tailserve.examples.churn import write_churn
from tailserve.examples.funnel import write_funnel
from tailserve.examples.ranker import load_features, write_ranker
from tailserve.examples.sentiment import write_sentiment

__all__ = ["load_features", "write_examples"]


def write_examples(
    directory: Path | str, *, sklearn: bool = False, torch: bool = False
) -> list[str]:
    """Write every example model (model.yaml and version 1) into ``directory``; return names.

    ``sklearn`` also writes ``churn_sklearn``, a pickled scikit-learn pipeline (trusted);
    ``torch`` also writes ``churn_torch`` where torch is installed (the `torch` extra).
    ``ranker`` reads its inputs from the feature store: ``load_features(DIR / "ranker", url)``
    puts its synthetic catalog into Redis, and the vectors the ``funnel`` pipeline searches.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    names = [
        *write_churn(directory, sklearn=sklearn),
        write_sentiment(directory),
        write_ranker(directory),
    ]
    names += write_funnel(directory)
    if torch and importlib.util.find_spec("torch") is not None:
        from tailserve.examples.churn_torch import write_churn_torch

        names.append(write_churn_torch(directory))
    return names
