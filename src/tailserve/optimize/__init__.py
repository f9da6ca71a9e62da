"""`tailserve optimize`: faster variants of a model (graph-optimised, INT8), measured against it.

See docs/optimize.md. `optimize(model_dir, Options(...))` makes and measures the variants,
writes the report, and rewrites model.yaml's ``variants`` block; `summary` is its short table.
"""

from tailserve.optimize.optimizer import Options, optimize, report_path
from tailserve.optimize.report import Outcome, summary

__all__ = ["Options", "Outcome", "optimize", "report_path", "summary"]
