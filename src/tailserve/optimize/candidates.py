"""The forms of a model the command weighs: the full model, those it makes, those already named.

A candidate is a `Variant` without measurements. ONNX models get files of their own next to
``model.onnx`` (onnx_variants.py); a torch model's INT8 form is a runtime setting
(``quantize: dynamic_int8``) on the same artifact. Entries of model.yaml's ``variants`` the
command did not make this time (a smaller model trained by hand) are weighed as they are.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from tailserve.modelconfig import ModelConfig, Variant
from tailserve.optimize.datasets import Dataset

BASELINE = "fp32"
GRAPH, DYNAMIC, STATIC = "graph", "dynamic", "static"
KINDS = (GRAPH, DYNAMIC, STATIC)
# The names of what this command makes: ONNX files (onnx_variants.py), a torch setting.
NAMES = {GRAPH: "fp32-opt", DYNAMIC: "int8-dynamic", STATIC: "int8-static"}
TORCH_INT8 = Variant(name="int8", parameters={"quantize": "dynamic_int8"})


@dataclass(frozen=True, slots=True)
class Candidate:
    variant: Variant
    # Made (or remade) by this run, as opposed to an entry model.yaml already had.
    made: bool
    note: str = ""


@dataclass(frozen=True, slots=True)
class Skipped:
    name: str
    reason: str


def baseline() -> Candidate:
    return Candidate(Variant(name=BASELINE), made=True, note="the model as it is")


def make_candidates(
    config: ModelConfig, version_dir: Path, kinds: Sequence[str], calibration: Dataset | None
) -> list[Candidate | Skipped]:
    """The variants of ``kinds`` this runtime can have, made where they need a file."""
    if config.runtime == "onnx":
        from tailserve.optimize.onnx_variants import make_onnx_variants

        return make_onnx_variants(version_dir, kinds, calibration)
    if config.runtime == "torch":
        return torch_candidates(kinds)
    return [Skipped(kind, f"runtime {config.runtime!r} has no variants here") for kind in kinds]


def torch_candidates(kinds: Sequence[str]) -> list[Candidate | Skipped]:
    found: list[Candidate | Skipped] = []
    for kind in kinds:
        if kind != DYNAMIC:
            found.append(Skipped(kind, "ONNX models only (a torch model has dynamic INT8 only)"))
        else:
            note = "Linear layers quantised to INT8 at load (quantize: dynamic_int8)"
            found.append(Candidate(TORCH_INT8, made=True, note=note))
    return found


def adopt_names(made: Sequence[Candidate], existing: Sequence[Variant]) -> list[Candidate]:
    """A made variant that model.yaml already names (the same file, the same settings) keeps
    that name, so what refers to it by name (pinning, dashboards) still finds it."""
    adopted = []
    for candidate in made:
        variant = candidate.variant
        same = next(
            (
                old
                for old in existing
                if not _is_plain(old)
                and old.artifact == variant.artifact
                and old.parameters == variant.parameters
            ),
            None,
        )
        if same is not None and same.name != BASELINE:
            variant = Variant(
                name=same.name, artifact=variant.artifact, parameters=variant.parameters
            )
        adopted.append(Candidate(variant, candidate.made, candidate.note))
    return adopted


def existing_candidates(config: ModelConfig, making: set[str]) -> list[Candidate]:
    """model.yaml's own variants, except those this run makes again (and the full model)."""
    return [
        Candidate(strip(variant), made=False, note="from model.yaml")
        for variant in config.variants.choices
        if variant.name not in making and variant.name != BASELINE and not _is_plain(variant)
    ]


def strip(variant: Variant) -> Variant:
    """The variant without its old measurements."""
    return Variant(
        name=variant.name, artifact=variant.artifact, parameters=dict(variant.parameters)
    )


def _is_plain(variant: Variant) -> bool:
    # An entry with no file and no settings of its own is the full model under another name.
    return variant.artifact is None and not variant.parameters
