"""The schema of ``model.yaml``, validated at load with errors that name the file and the field.

A model folder holds ``model.yaml`` and numbered version folders::

    name: churn
    runtime: onnx                 # onnx | lightgbm | sklearn | python | torch | pipeline
    max_batch_size: 256           # 0: the model takes no batch dimension
    inputs:
      - {name: tenure_months, datatype: INT64, shape: [1], range: [1, 120]}
      - {name: contract_type, datatype: BYTES, shape: [1], values: [monthly, annual]}
    outputs:
      - {name: churn_probability, datatype: FP32, shape: [1]}
    batching: {enabled: true, max_queue_delay_ms: 1, max_queue_size: 1024}
    instances: {count: 1, intra_op_threads: 1}
    version_policy: {latest: 1}   # or {specific: [1, 2]} or {all: true}
    warmup: {batch_sizes: [1, 8, 64], repeat: 2}
    slo: {p99_ms: 50}

Shapes in ``inputs``/``outputs`` leave out the batch dimension when ``max_batch_size > 0``;
``-1`` marks a variable dimension.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import msgspec
import yaml

from tailserve.errors import ConfigError, field_message
from tailserve.modelconfig.pipeline import PipelineConfig, check_pipeline
from tailserve.tensors import DATATYPES

RuntimeName = Literal["onnx", "lightgbm", "sklearn", "python", "torch", "pipeline"]
# How a variant's accuracy was measured against the full model on held-out inputs: area under
# the ROC curve, the share of labels right (classifiers), or the largest absolute error of a
# score (lower is better).
Metric = Literal["auc", "accuracy", "max_abs_error"]


class TensorSpec(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    name: str
    datatype: str
    shape: list[int]
    # Value constraints checked on every request (400 naming the tensor when violated).
    range: tuple[float, float] | None = None
    values: list[str] | None = None
    optional: bool = False


class CostRule(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    # What a request's cost class is measured by: its rows, or the length of the variable
    # dimension of one input (a sequence length, a candidate count).
    by: str = "rows"
    # Class edges: a request goes to the first edge at or above its measure (past the last,
    # a class of its own shape); "auto": powers of two.
    edges: list[int] | Literal["auto"] = "auto"


class Batching(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    enabled: bool = True
    # deadline: cost classes, earliest deadline first, dispatch as late as deadlines allow
    # and only as late as throughput needs; size_or_timeout: a batch goes when full or when
    # its oldest request has waited max_queue_delay_ms; none: every request alone.
    policy: Literal["deadline", "size_or_timeout", "none"] = "deadline"
    max_queue_delay_ms: float = 1.0
    max_queue_size: int = 1024
    # Cost classes (deadline policy): requests of different classes never share a batch.
    cost: CostRule | None = None
    # Variable-length input padding, so requests of different lengths can batch: with a
    # value, the cost input is padded with it to the longest request in the batch (deadline:
    # rounded up to a multiple of 8, within its class's edge). The model must read that value
    # as padding.
    pad_value: float | None = None
    # Priority levels 1 (highest) .. priority_levels; a request without one gets the default.
    priority_levels: int = 1
    default_priority: int = 1
    # The share of the instances' time the deadline policy plans to use: below it, batches
    # go as soon as an instance is free; above it, they wait to grow (never past a deadline).
    target_utilization: float = 0.8
    # Admit a request only when its answer is expected within this share of the time left to
    # its deadline: the rest is headroom for what the worker cannot see (the network, the
    # kernel's queue, the client) and for the tail.
    admission_target: float = 0.3


class Instances(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    count: int = 1
    intra_op_threads: int = 1
    # A batch predicted to run in at most this long runs on the event loop's thread, not
    # handed to the instance's thread (whose hand-off costs the loop about as much as such a
    # batch); 0: never. Steady runtimes only (runtimes/base.py).
    inline_below_ms: float = 0.2
    # ONNX Runtime execution providers in order of preference, e.g. [cuda, cpu].
    providers: list[str] = msgspec.field(default_factory=lambda: ["cpu"])


class VersionPolicy(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    latest: int | None = None
    specific: list[int] | None = None
    all: bool = False


class WarmupRequest(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    inputs: dict[str, Any]
    count: int = 1


class Warmup(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    # Synthetic batches drawn from the input specs (ranges and allowed values), at these sizes.
    batch_sizes: list[int] = msgspec.field(default_factory=lambda: [1])
    repeat: int = 1
    requests: list[WarmupRequest] = msgspec.field(default_factory=list)


class Slo(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    p99_ms: float = 50.0


class CacheKeyRule(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    # Inputs left out of the key (volatile fields that do not change the answer).
    exclude: list[str] = msgspec.field(default_factory=list)
    # Inputs snapped to a grid before hashing: {monthly_spend: 0.5} keys 10.2 and 10.3 alike.
    round: dict[str, float] = msgspec.field(default_factory=dict)
    # Request parameters that change the output (each becomes part of the key).
    parameters: list[str] = msgspec.field(default_factory=list)


class L1Cache(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    # false: no in-process tier (every lookup goes to Redis), for comparison.
    enabled: bool = True
    max_entries: int = 100_000
    max_bytes: int = 64 * 1024 * 1024
    # tinylfu (W-TinyLFU admission) or lru; benchmarks/cache_tiers.py compares them.
    policy: Literal["tinylfu", "lru"] = "tinylfu"
    ttl_s: float | None = None  # default: the cache's ttl_s


class CacheConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    enabled: bool = False
    ttl_s: float = 300.0
    l1: L1Cache = L1Cache()
    # Share results through Redis (when the worker has one), for this long (default ttl_s).
    l2: bool = True
    l2_ttl_s: float | None = None
    # Grace window after the TTL: the stale value is served while it is refreshed once.
    stale_s: float = 0.0
    # Under overload (the model refusing requests, or its queue past what admission allows),
    # a value up to this long past its TTL is served as stale instead of recomputed.
    stale_if_overloaded_s: float = 0.0
    key: CacheKeyRule = CacheKeyRule()
    # > 0: identical requests on different workers wait up to this long for the one
    # holding a short Redis lease to compute, instead of all computing.
    lease_ms: float = 0.0
    # Part of every key: bump it when the features behind the inputs change meaning.
    feature_version: str = ""


class FeatureInput(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    # The model input filled from the store ...
    input: str
    # ... with the features of the entities whose ids the request sends in this tensor ...
    key: str
    # ... looked up under this entity type (Redis hashes per entity and feature version).
    entity: str
    # The entity's feature names, in the order the model input's last dimension takes them.
    fields: list[str] = msgspec.field(default_factory=list)
    datatype: str = "INT64"  # the id tensor's datatype (INT64 or BYTES)
    # Ids per request: [1] for one entity (repeated per row), [-1] for one per row.
    shape: list[int] = msgspec.field(default_factory=lambda: [1])


class FeaturesConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    version: str = "1"
    ttl_s: float = 60.0  # the in-process feature cache's TTL
    max_entries: int = 200_000
    inputs: list[FeatureInput] = msgspec.field(default_factory=list)


class JobsConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    # Whether the model takes jobs (`POST /v2/models/{m}/jobs`).
    enabled: bool = True
    # 1 is the highest: a worker takes the jobs of the most urgent model first.
    priority: int = 1
    # Jobs waiting or running at once; beyond it a submission gets 429 with Retry-After.
    max_queued: int = 10_000
    # How long a finished job's result (or error) is kept.
    result_ttl_s: float = 3600.0
    # The most rows one job's request may hold (it runs in pieces of what fits the budget).
    max_rows: int = 100_000
    # A job's batch runs only on an idle instance with no online request queued, and holds
    # the instance at most this share of the time the SLO gives an online request to queue
    # (slo.p99_ms x batching.admission_target).
    budget_share: float = 0.25


class Variant(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """One form of the model: the full one, a quantised or compiled one, a smaller one."""

    name: str
    # The file in each version folder (default: the runtime's own, e.g. model.onnx).
    artifact: str | None = None
    # Runtime settings for this variant, over the model's ``parameters`` (e.g. a torch
    # model's {quantize: dynamic_int8}).
    parameters: dict[str, Any] = msgspec.field(default_factory=dict)
    # As `tailserve optimize` measured it against the full model (``variants.metric``).
    accuracy: float | None = None
    # Measured milliseconds a batch by its size (the worker measures its own at warm-up).
    latency_ms: dict[int, float] = msgspec.field(default_factory=dict)
    size_bytes: int | None = None


class Variants(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """Forms of the model the worker chooses between per request, by deadline and load."""

    metric: Metric = "auc"
    # A variant less accurate than this (for max_abs_error: with a larger error) never serves.
    floor: float | None = None
    # The variants, the most accurate first (that order is the order of preference).
    choices: list[Variant] = msgspec.field(default_factory=list)


class ModelConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    name: str
    runtime: RuntimeName
    inputs: list[TensorSpec]
    outputs: list[TensorSpec]
    max_batch_size: int = 0
    batching: Batching = Batching()
    instances: Instances = Instances()
    version_policy: VersionPolicy = VersionPolicy()
    warmup: Warmup = Warmup()
    slo: Slo = Slo()
    cache: CacheConfig = CacheConfig()
    # Inputs looked up in the feature store by entity id instead of sent by the client.
    features: FeaturesConfig | None = None
    jobs: JobsConfig = JobsConfig()
    variants: Variants = Variants()
    # runtime: pipeline: the steps it runs (modelconfig/pipeline.py).
    pipeline: PipelineConfig | None = None
    # Runtimes that execute code from the artifact on load (pickles) refuse unless trusted.
    trust: bool = False
    # Runtime-specific settings, e.g. {method: predict_proba, column: 1} for sklearn.
    parameters: dict[str, Any] = msgspec.field(default_factory=dict)

    @property
    def batched(self) -> bool:
        return self.max_batch_size > 0

    def full_shape(self, spec: TensorSpec) -> list[int]:
        """The shape clients see in metadata: a leading -1 when the model batches."""
        return [-1, *spec.shape] if self.batched else list(spec.shape)

    def input(self, name: str) -> TensorSpec | None:
        for spec in self.inputs:
            if spec.name == name:
                return spec
        return None


CONFIG_FILE = "model.yaml"
PROVIDERS = ("cpu", "cuda", "tensorrt")


def load_model_config(model_dir: Path) -> ModelConfig:
    """Read and validate ``model_dir/model.yaml``; the folder name is the model's name."""
    path = model_dir / CONFIG_FILE
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"{path}: not found") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: must be a mapping of fields, got {type(raw).__name__}")
    raw.setdefault("name", model_dir.name)
    return parse_model_config(raw, source=str(path))


def parse_model_config(raw: dict[str, Any], *, source: str) -> ModelConfig:
    try:
        config = msgspec.convert(raw, ModelConfig, strict=False)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"{source}: {field_message(str(exc))}") from None
    _check(config, source)
    return config


def _check(config: ModelConfig, source: str) -> None:
    def fail(field: str, message: str) -> ConfigError:
        return ConfigError(f"{source}: field '{field}': {message}")

    if config.max_batch_size < 0:
        raise fail("max_batch_size", "must be >= 0")
    for kind, specs in (("inputs", config.inputs), ("outputs", config.outputs)):
        if not specs:
            raise fail(kind, "must list at least one tensor")
        seen: set[str] = set()
        for i, spec in enumerate(specs):
            where = f"{kind}[{i}]"
            if spec.name in seen:
                raise fail(f"{where}.name", f"duplicate tensor name {spec.name!r}")
            seen.add(spec.name)
            if spec.datatype not in DATATYPES:
                raise fail(f"{where}.datatype", f"unknown datatype {spec.datatype!r}")
            if any(d < -1 or d == 0 for d in spec.shape):
                raise fail(f"{where}.shape", "dimensions must be positive or -1 (variable)")
            if spec.range is not None and spec.range[0] > spec.range[1]:
                raise fail(f"{where}.range", "lower bound is above the upper bound")
            if spec.values is not None and spec.datatype != "BYTES":
                raise fail(f"{where}.values", "allowed values apply to BYTES tensors only")
    _check_batching(config, fail)
    jobs = config.jobs
    if jobs.priority < 1:
        raise fail("jobs.priority", "must be >= 1 (1 is the highest)")
    if jobs.max_queued < 1:
        raise fail("jobs.max_queued", "must be >= 1")
    if jobs.max_rows < 1:
        raise fail("jobs.max_rows", "must be >= 1")
    if jobs.result_ttl_s <= 0:
        raise fail("jobs.result_ttl_s", "must be > 0")
    if not 0 < jobs.budget_share <= 1:
        raise fail("jobs.budget_share", "must be in (0, 1]")
    if config.batching.max_queue_delay_ms < 0:
        raise fail("batching.max_queue_delay_ms", "must be >= 0")
    if config.batching.max_queue_size < 1:
        raise fail("batching.max_queue_size", "must be >= 1")
    if config.instances.count < 1:
        raise fail("instances.count", "must be >= 1")
    for i, provider in enumerate(config.instances.providers):
        if provider.lower() not in PROVIDERS:
            raise fail(
                f"instances.providers[{i}]",
                f"unknown provider {provider!r} (known: {', '.join(PROVIDERS)})",
            )
    if config.instances.intra_op_threads < 0:
        raise fail("instances.intra_op_threads", "must be >= 0 (0: the runtime decides)")
    if not 0 <= config.instances.inline_below_ms <= 10:
        raise fail("instances.inline_below_ms", "must be within [0, 10] (0: never inline)")
    policy = config.version_policy
    chosen = sum([policy.latest is not None, policy.specific is not None, policy.all])
    if chosen > 1:
        raise fail("version_policy", "set one of 'latest', 'specific' or 'all'")
    if policy.latest is not None and policy.latest < 1:
        raise fail("version_policy.latest", "must be >= 1")
    if policy.specific is not None and not policy.specific:
        raise fail("version_policy.specific", "must list at least one version")
    for i, size in enumerate(config.warmup.batch_sizes):
        if size < 1 or (config.batched and size > config.max_batch_size):
            raise fail(f"warmup.batch_sizes[{i}]", f"{size} is outside 1..max_batch_size")
    if config.slo.p99_ms <= 0:
        raise fail("slo.p99_ms", "must be > 0")
    _check_cache(config, fail)
    _check_variants(config, fail)
    if (config.runtime == "pipeline") != (config.pipeline is not None):
        raise fail("pipeline", "a model has 'pipeline:' steps exactly when its runtime is pipeline")
    if config.pipeline is not None:
        check_pipeline(config.pipeline, [spec.name for spec in config.inputs], fail)


def _check_variants(config: ModelConfig, fail: Any) -> None:
    variants = config.variants
    seen: set[str] = set()
    for i, variant in enumerate(variants.choices):
        where = f"variants.choices[{i}]"
        if not variant.name or not variant.name.replace("-", "").replace("_", "").isalnum():
            raise fail(f"{where}.name", "letters, digits, '-' and '_' only")
        if variant.name in seen:
            raise fail(f"{where}.name", f"duplicate variant name {variant.name!r}")
        seen.add(variant.name)
        if variant.artifact is not None and (
            not variant.artifact or "/" in variant.artifact or variant.artifact.startswith(".")
        ):
            raise fail(f"{where}.artifact", "a file name in the version folder")
        if variants.floor is not None and variant.accuracy is None:
            raise fail(f"{where}.accuracy", "needed when variants.floor is set")
    if variants.floor is not None and not served_variants(config):
        raise fail("variants.floor", "every variant is below it: none could serve")


def served_variants(config: ModelConfig) -> list[Variant]:
    """The variants that may serve, in order of preference: those the floor allows (with no
    variants, the model itself as one, named ``default``)."""
    variants = config.variants
    if not variants.choices:
        return [Variant(name="default")]
    floor = variants.floor
    if floor is None:
        return list(variants.choices)
    if variants.metric == "max_abs_error":
        return [v for v in variants.choices if v.accuracy is not None and v.accuracy <= floor]
    return [v for v in variants.choices if v.accuracy is not None and v.accuracy >= floor]


def _check_cache(config: ModelConfig, fail: Any) -> None:
    cache = config.cache
    names = {spec.name for spec in config.inputs}
    if config.features is not None:
        names |= {f.key for f in config.features.inputs}
    if cache.ttl_s <= 0:
        raise fail("cache.ttl_s", "must be > 0")
    for field_name in ("l2_ttl_s",):
        value = getattr(cache, field_name)
        if value is not None and value <= 0:
            raise fail(f"cache.{field_name}", "must be > 0")
    if cache.l1.ttl_s is not None and cache.l1.ttl_s <= 0:
        raise fail("cache.l1.ttl_s", "must be > 0")
    if cache.l1.max_entries < 1 or cache.l1.max_bytes < 1024:
        raise fail("cache.l1", "max_entries must be >= 1 and max_bytes >= 1024")
    if cache.stale_s < 0 or cache.lease_ms < 0 or cache.stale_if_overloaded_s < 0:
        raise fail("cache", "stale_s, stale_if_overloaded_s and lease_ms must be >= 0")
    for i, name in enumerate(cache.key.exclude):
        if name not in names:
            raise fail(f"cache.key.exclude[{i}]", f"{name!r} is not an input of the model")
    for name, grid in cache.key.round.items():
        if name not in names:
            raise fail(f"cache.key.round.{name}", f"{name!r} is not an input of the model")
        if not grid > 0:
            raise fail(f"cache.key.round.{name}", "the grid step must be > 0")


def variable_inputs(config: ModelConfig) -> list[TensorSpec]:
    """Inputs with exactly one variable dimension in their per-row shape."""
    return [spec for spec in config.inputs if spec.shape.count(-1) == 1]


def cost_rule(config: ModelConfig) -> CostRule | None:
    """The cost rule in force: the configured one, or by the one padded variable-length input."""
    batching = config.batching
    if batching.cost is not None:
        return batching.cost
    variable = variable_inputs(config)
    if batching.pad_value is not None and len(variable) == 1:
        return CostRule(by=variable[0].name)
    return None


def _check_batching(config: ModelConfig, fail: Any) -> None:
    batching = config.batching
    if batching.priority_levels < 1:
        raise fail("batching.priority_levels", "must be >= 1")
    if not 1 <= batching.default_priority <= batching.priority_levels:
        raise fail("batching.default_priority", f"must be in 1..{batching.priority_levels}")
    if not 0 < batching.target_utilization <= 1:
        raise fail("batching.target_utilization", "must be in (0, 1]")
    if not 0 < batching.admission_target <= 1:
        raise fail("batching.admission_target", "must be in (0, 1]")
    rule = batching.cost
    if rule is not None:
        if rule.by != "rows":
            spec = config.input(rule.by)
            if spec is None:
                raise fail("batching.cost.by", f"{rule.by!r} is neither 'rows' nor an input")
            if spec.shape.count(-1) != 1:
                raise fail(
                    "batching.cost.by",
                    f"input {rule.by!r} needs exactly one variable dimension (-1) in its shape",
                )
        if rule.edges != "auto" and (
            not rule.edges
            or any(e < 1 for e in rule.edges)
            or list(rule.edges) != sorted(set(rule.edges))
        ):
            raise fail("batching.cost.edges", "list ascending positive edges, or 'auto'")
    if batching.pad_value is not None:
        padded = cost_rule(config)
        if padded is None or padded.by == "rows":
            raise fail(
                "batching.pad_value",
                "padding needs one variable-length input to pad: set batching.cost.by to it",
            )
