"""The ``pipeline:`` section of a model.yaml: a model made of steps, each with a latency budget.

A pipeline's steps run in order over named tensors (its state): the request's inputs first,
then what each step adds. Every step has a budget carved from the request's deadline; a step
that would run late degrades as its ``on_late`` says instead of failing the request.

    pipeline:
      steps:
        - {name: retrieve, kind: retrieve, budget_ms: 4, query: user_id, top: 400, ...}
        - {name: features, kind: features, model: ranker, budget_ms: 6, ...}
        - {name: rank, kind: model, model: ranker, budget_ms: 20, on_late: [fewer, variant]}
        - {name: top, kind: topk, by: rank_score, k: 50, rows: [candidates, rank_score]}
        - {name: rerank, kind: model, model: rerank, budget_ms: 8, on_late: [fallback]}
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

StepKind = Literal["model", "features", "retrieve", "topk"]
# What a step may do when it would run late: pass fewer rows on (``fewer``), take the model's
# cheapest variant (``variant``), or give its declared fallback (``fallback``: state copied
# under the step's output names, or the retrieval's precomputed list).
Degradation = Literal["fewer", "variant", "fallback"]
DEGRADATIONS: tuple[str, ...] = ("fewer", "variant", "fallback")


class RetrievalIndex(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """Where a ``retrieve`` step's vectors live in the feature store."""

    # The entity whose rows are the query vectors (looked up by the step's ``query`` input).
    query_entity: str
    # The entity whose rows are the items searched (every row, read when the model loads).
    item_entity: str
    # The feature version both are stored under, and the fields that make a vector.
    version: str = "1"
    fields: list[str] = msgspec.field(default_factory=list)
    # How many items there are (ids 0..items-1), and the entity whose row 0 is the
    # precomputed fallback list (item ids, most popular first, in the fields
    # `fallback_fields(top)`: r0000, r0001, ...; empty: none).
    items: int = 0
    fallback_entity: str = ""


class PipelineStep(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    name: str
    kind: StepKind
    # The steps it waits for (declared before it). None: the step declared just before it (a
    # chain); []: none, it starts with the request. Steps that wait for none of each other run
    # at the same time.
    after: list[str] | None = None
    # The time the step may take when the request has its whole budget; when the total
    # is more than the deadline, every step's share shrinks in proportion.
    budget_ms: float = 0.0
    # model / features: the model the step calls (features: whose feature section it reads).
    model: str = ""
    # The step's inputs, by the name the step (or its model) wants -> the state's name.
    inputs: dict[str, str] = msgspec.field(default_factory=dict)
    # The step's outputs, by the model's (or step's) name -> the state's name.
    outputs: dict[str, str] = msgspec.field(default_factory=dict)
    on_late: list[Degradation] = msgspec.field(default_factory=list)
    # fewer: the state tensors that hold one row a candidate (cut together, best first), and
    # the fewest rows a cut leaves.
    rows: list[str] = msgspec.field(default_factory=list)
    min_rows: int = 1
    # fallback: state name -> state name, copied when the step gives up (e.g. keep the
    # ranker's order when the re-rank is late).
    fallback: dict[str, str] = msgspec.field(default_factory=dict)
    # retrieve: the query id input's state name, how many candidates, and the index.
    query: str = ""
    top: int = 0
    index: RetrievalIndex | None = None
    # topk: the score to sort by (descending) and how many rows to keep.
    by: str = ""
    k: int = 0


class PipelineConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    steps: list[PipelineStep]
    # false: no step has a budget of its own and none degrades (every step may use what is
    # left of the deadline): the same pipeline as a plain chain of calls, for comparison.
    budgets: bool = True


def check_pipeline(config: PipelineConfig, inputs: list[str], fail: Any) -> None:
    """Check a pipeline's steps against each other: names, kinds' fields, what each waits
    for, and that every state name a step reads was a request input or written by a step it
    waits for (directly or through others)."""
    if not config.steps:
        raise fail("pipeline.steps", "must list at least one step")
    seen: set[str] = set()
    # What each step makes (its outputs and fallback targets), and what is known once it ran.
    known_after: list[set[str]] = []
    for i, step in enumerate(config.steps):
        where = f"pipeline.steps[{i}]"
        if not step.name or step.name in seen:
            raise fail(f"{where}.name", f"must be a unique, non-empty name, got {step.name!r}")
        for name in step.after or []:
            if name not in seen:
                raise fail(
                    f"{where}.after",
                    f"{name!r} is not a step declared before {step.name!r}",
                )
        seen.add(step.name)
        waits = dependencies_of(config, i)
        known = set(inputs).union(*(known_after[j] for j in waits))
        if step.budget_ms < 0:
            raise fail(f"{where}.budget_ms", "must be >= 0")
        if step.min_rows < 1:
            raise fail(f"{where}.min_rows", "must be >= 1")
        for j, degradation in enumerate(step.on_late):
            if degradation == "fewer" and not step.rows and step.kind != "retrieve":
                raise fail(f"{where}.on_late[{j}]", "'fewer' needs 'rows': the tensors to cut")
            if degradation == "variant" and step.kind != "model":
                raise fail(f"{where}.on_late[{j}]", "'variant' applies to model steps only")
            if degradation == "fallback" and not step.fallback and step.kind != "retrieve":
                raise fail(f"{where}.on_late[{j}]", "'fallback' needs 'fallback': what to copy")
        reads = list(step.inputs.values()) + step.rows + list(step.fallback)
        if step.kind == "retrieve":
            if step.index is None or not step.index.fields or step.index.items < 1:
                raise fail(
                    f"{where}.index",
                    "a retrieve step needs its index: entities, fields and the number of items",
                )
            if step.top < 1:
                raise fail(f"{where}.top", "must be >= 1")
            if "ids" not in step.outputs:
                raise fail(f"{where}.outputs", "a retrieve step names its 'ids' output")
            reads.append(step.query)
        elif step.kind in ("model", "features"):
            if not step.model:
                raise fail(f"{where}.model", f"a {step.kind} step names the model it uses")
        elif step.kind == "topk":
            if step.k < 1 or not step.by or not step.rows:
                raise fail(f"{where}", "a topk step needs 'by', 'k' >= 1 and 'rows'")
            reads.append(step.by)
        for name in reads:
            if name not in known:
                raise fail(
                    f"{where}",
                    f"reads {name!r}, which neither the request nor a step it waits for gives",
                )
        known_after.append(known | set(step.outputs.values()) | set(step.fallback.values()))


def dependencies_of(config: PipelineConfig, index: int) -> list[int]:
    """Step ``index``'s dependencies among the steps declared before it (names checked)."""
    step = config.steps[index]
    if step.after is None:
        return [index - 1] if index else []
    names = {s.name: i for i, s in enumerate(config.steps[:index])}
    return [names[name] for name in step.after if name in names]


def fallback_fields(top: int) -> list[str]:
    """The field names of a retrieval's precomputed list, one a rank."""
    return [f"r{rank:04d}" for rank in range(top)]
