"""`tailserve optimize MODEL_DIR`: make a model's variants, measure them, keep the useful ones.

1. Load the full model (``fp32``) as a worker would and score the held-out inputs with it.
2. Make the variants (candidates.py), and take model.yaml's other variants as they are.
3. Score each on the same inputs against ``fp32`` (accuracy.py), then time them all, taking turns.
4. Choose which to keep and their order (choose.py); write ``MODEL_DIR/optimize/report.{md,json}``,
   the plot, and (unless told not to) model.yaml's ``variants`` block.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, TypeVar

import msgspec
import numpy as np

from tailserve.errors import ConfigError, ModelExecutionError, TailserveError
from tailserve.modelconfig import Metric, ModelConfig, Variant, load_model_config
from tailserve.optimize import accuracy, datasets, measure
from tailserve.optimize.candidates import (
    BASELINE,
    DYNAMIC,
    KINDS,
    NAMES,
    STATIC,
    TORCH_INT8,
    Candidate,
    Skipped,
    adopt_names,
    baseline,
    existing_candidates,
    make_candidates,
)
from tailserve.optimize.choose import Result, choose
from tailserve.optimize.modelyaml import rewrite, variants_block
from tailserve.optimize.plot import latency_plot
from tailserve.optimize.report import PLOT, Outcome, as_json, as_markdown
from tailserve.repository.discovery import choose_versions, versions_on_disk
from tailserve.runtimes import Runtime

REPORT_DIR = "optimize"
RUNTIMES = ("onnx", "torch")
DEFAULT_BATCH_SIZES = (1, 8, 64)
DEFAULT_REPEAT = 20


@dataclass(frozen=True, slots=True, kw_only=True)
class Options:
    version: int | None = None  # None: the newest on disk
    calibration: Path | None = None
    held_out: Path | None = None
    batch_sizes: tuple[int, ...] | None = None
    metric: Metric | None = None  # None: chosen from the full model's outputs
    repeat: int = DEFAULT_REPEAT
    write_config: bool = True
    kinds: tuple[str, ...] = KINDS
    keep: tuple[str, ...] | None = None  # None: choose.py's rule


def optimize(
    model_dir: Path, options: Options | None = None, progress: Callable[[str], None] | None = None
) -> Outcome:
    options = options or Options()
    say = progress or (lambda _: None)
    config = load_model_config(model_dir)
    _check_runtime(config)
    version = _version(model_dir, options.version)
    version_dir = model_dir / str(version)
    sizes = _batch_sizes(config, options.batch_sizes)
    if options.repeat < 1:
        raise ConfigError("--repeat must be >= 1")
    unknown = sorted(set(options.kinds) - set(KINDS))
    if unknown:
        raise ConfigError(f"--variants: unknown kind {unknown[0]!r} (known: {', '.join(KINDS)})")
    held_out = _dataset(config, options.held_out, datasets.HELD_OUT_SEED, "--held-out", sizes)
    calibration = None
    if STATIC in options.kinds and config.runtime == "onnx":
        seed = datasets.CALIBRATION_SEED
        calibration = _dataset(config, options.calibration, seed, "--calibration", sizes)

    evaluated = _evaluate(config, version, version_dir, options, held_out, calibration, sizes, say)
    candidates, skipped, metric, metric_note, scored, latency = evaluated

    default_file = _default_artifact(config)
    results = [
        Result(
            msgspec.structs.replace(
                candidate.variant,
                accuracy=scored[candidate.variant.name],
                latency_ms=latency[candidate.variant.name],
                size_bytes=measure.artifact_size(version_dir, candidate.variant, default_file),
            ),
            made=candidate.made,
            note=candidate.note,
        )
        for candidate in candidates
        if candidate.variant.name in latency
    ]
    results = choose(results, metric, options.keep)
    return _finish(
        model_dir,
        config,
        options,
        Outcome(
            model=config.name,
            version=version,
            runtime=config.runtime,
            metric=metric,
            metric_note=metric_note,
            held_out=held_out.source,
            held_out_rows=held_out.rows,
            labels=held_out.labels is not None,
            calibration=calibration.source if calibration is not None else None,
            batch_sizes=sizes,
            repeat=options.repeat,
            timing_note=_timing_note(config, options.repeat),
            results=results,
            skipped=skipped,
            config="",
        ),
    )


def _evaluate(
    config: ModelConfig,
    version: int,
    version_dir: Path,
    options: Options,
    held_out: datasets.Dataset,
    calibration: datasets.Dataset | None,
    sizes: list[int],
    say: Callable[[str], None],
) -> tuple[list[Candidate], list[Skipped], Metric, str, dict[str, float], dict[str, Any]]:
    """Make the variants, score each against the model as it is, and time them all: the
    candidates, those skipped, the metric (and its note), the scores and the latencies."""
    runtimes: dict[str, Runtime] = {}
    skipped: list[Skipped] = []
    try:
        say(f"loading {config.name} version {version} as it is ({BASELINE})")
        runtimes[BASELINE] = measure.load(config, version, version_dir, None)
        reference = _checked(lambda: measure.score(runtimes[BASELINE], config, held_out))
        metric, metric_note = _metric(config, options.metric, reference, held_out)
        say(f"making variants: {', '.join(options.kinds) or 'none'}")
        made = make_candidates(config, version_dir, options.kinds, calibration)
        skipped += [found for found in made if isinstance(found, Skipped)]
        new = adopt_names(
            [found for found in made if isinstance(found, Candidate)], config.variants.choices
        )
        attempted = _attempted_names(config, options.kinds) | {c.variant.name for c in new}
        candidates = [baseline(), *new, *existing_candidates(config, attempted)]
        outputs = {BASELINE: reference}
        for candidate in candidates[1:]:
            say(f"scoring {candidate.variant.name}")
            found = _score(config, version, version_dir, candidate.variant, held_out, runtimes)
            if isinstance(found, Skipped):
                skipped.append(found)
            else:
                outputs[candidate.variant.name] = found
        labels, score_name = held_out.labels, config.outputs[0].name
        scored = {
            name: float(f"{accuracy.measure(metric, got, reference, score_name, labels):.6g}")
            for name, got in outputs.items()
        }
        say(f"timing {len(runtimes)} variants at batch sizes {sizes}, {options.repeat} runs each")
        batches = datasets.timing_batches(config, sizes)
        latency = _checked(lambda: measure.time_batches(runtimes, batches, options.repeat))
    finally:
        measure.unload_all(runtimes)

    return candidates, skipped, metric, metric_note, scored, latency


def _score(
    config: ModelConfig,
    version: int,
    version_dir: Path,
    variant: Variant,
    held_out: datasets.Dataset,
    runtimes: dict[str, Runtime],
) -> dict[str, np.ndarray[Any, Any]] | Skipped:
    """A variant's held-out outputs, its instance left in ``runtimes`` to be timed; or why not.

    Any failure (a missing file, a kernel the runtime lacks) leaves out this variant only."""
    try:
        runtime = measure.load(config, version, version_dir, variant)
    except Exception as exc:
        return Skipped(variant.name, _reason(exc))
    try:
        outputs = measure.score(runtime, config, held_out)
    except Exception as exc:
        measure.unload_all({variant.name: runtime})
        return Skipped(variant.name, _reason(exc))
    runtimes[variant.name] = runtime
    return outputs


T = TypeVar("T")


def _checked(run: Callable[[], T]) -> T:
    """The full model's runs: a runtime's own exception becomes one line (exit 2)."""
    try:
        return run()
    except TailserveError:
        raise
    except Exception as exc:
        raise ModelExecutionError(f"the model failed: {type(exc).__name__}: {exc}") from exc


def _finish(model_dir: Path, config: ModelConfig, options: Options, outcome: Outcome) -> Outcome:
    """Write model.yaml (when asked), then the report saying what became of it."""
    failure: ConfigError | None = None
    kept = [result.variant for result in outcome.results if result.kept]
    warnings = _version_warnings(model_dir, config, outcome.version, kept)
    if options.write_config:
        block = variants_block(outcome.metric, config.variants.floor, kept)
        try:
            rewrite(model_dir, block)
            status = f"variants rewritten, {len(kept)} kept: {', '.join(v.name for v in kept)}"
        except ConfigError as exc:
            failure = exc
            status = f"not updated: {exc.message}"
        except OSError as exc:
            failure = ConfigError(str(exc))
            status = f"not updated: {exc}"
    else:
        status = "left as it was (--no-write-config)"
    report_dir = model_dir / REPORT_DIR
    try:
        report_dir.mkdir(exist_ok=True)
        title = f"{config.name} v{outcome.version}: latency by batch size"
        reason = latency_plot(outcome.results, report_dir / PLOT, title)
        outcome = replace(
            outcome,
            config=status,
            plot=PLOT if reason is None else None,
            plot_note=reason or "",
            warnings=warnings,
        )
        (report_dir / "report.json").write_text(as_json(outcome), encoding="utf-8")
        (report_dir / "report.md").write_text(as_markdown(outcome), encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot write the report in {report_dir}: {exc}") from None
    if failure is not None:
        raise ConfigError(f"model.yaml {status} (the report is in {report_dir})")
    return outcome


def report_path(model_dir: Path) -> Path:
    return model_dir / REPORT_DIR / "report.md"


def _check_runtime(config: ModelConfig) -> None:
    if config.runtime not in RUNTIMES:
        raise ConfigError(
            f"model {config.name!r} has runtime {config.runtime!r}: tailserve optimize makes "
            f"variants of {' and '.join(RUNTIMES)} models only"
        )
    if config.runtime == "torch" and importlib.util.find_spec("tailserve.runtimes.torch") is None:
        raise ConfigError(
            f"model {config.name!r} has runtime 'torch', which this tailserve cannot load yet "
            "(no tailserve.runtimes.torch): skipped"
        )


def _version(model_dir: Path, wanted: int | None) -> int:
    found = versions_on_disk(model_dir)
    if not found:
        raise ConfigError(f"{model_dir}: no numbered version folder (such as 1/) found")
    if wanted is None:
        return found[-1]
    if wanted not in found:
        raise ConfigError(f"{model_dir}: no version {wanted} (on disk: {found})")
    return wanted


def _batch_sizes(config: ModelConfig, wanted: Sequence[int] | None) -> list[int]:
    if not config.batched:
        if wanted is not None and list(wanted) != [1]:
            raise ConfigError(f"model {config.name!r} takes no batch dimension: --batch-sizes 1")
        return [1]
    if wanted is None:
        warm = config.warmup.batch_sizes
        # A model that warms at one size only says little about batching: time the usual three.
        chosen = warm if len(set(warm)) > 1 else DEFAULT_BATCH_SIZES
        return sorted({size for size in chosen if size <= config.max_batch_size}) or [1]
    bad = [size for size in wanted if not 1 <= size <= config.max_batch_size]
    if bad or not wanted:
        raise ConfigError(
            f"--batch-sizes: each must be within 1..{config.max_batch_size} (max_batch_size)"
        )
    return sorted(set(wanted))


def _dataset(
    config: ModelConfig, path: Path | None, seed: int, flag: str, sizes: list[int]
) -> datasets.Dataset:
    if path is None:
        return datasets.synthetic(config, seed, flag.strip("-"))
    return datasets.load_npz(path, config, chunk=max(sizes), what=flag)


def _metric(
    config: ModelConfig,
    wanted: Metric | None,
    reference: dict[str, np.ndarray[Any, Any]],
    held_out: datasets.Dataset,
) -> tuple[Metric, str]:
    name = config.outputs[0].name
    scores = reference[name]
    one_a_row = scores.size == held_out.rows and len(config.outputs) == 1
    metric = wanted or accuracy.default_metric(scores if one_a_row else None, held_out.labels)
    accuracy.check_scores(metric, scores, held_out.rows, name)
    if metric == "max_abs_error":
        return metric, "the largest absolute difference from the fp32 model's outputs"
    labels = held_out.labels
    truth = labels if labels is not None else accuracy.decisions(scores)
    if metric == "auc" and np.unique(truth).size < 2:
        against = "labels" if labels is not None else "fp32 model's decisions"
        raise ConfigError(f"--metric auc: the held-out {against} are all one class")
    if labels is not None:
        return metric, f"of each variant's {name} against the held-out labels"
    return metric, (
        f"of each variant's {name} against the fp32 model's decisions ({name} >= 0.5), "
        "as no labels were given"
    )


def _attempted_names(config: ModelConfig, kinds: Sequence[str]) -> set[str]:
    """Names this run makes anew: an old entry of one of them is stale whether or not the
    new one could be made."""
    if config.runtime == "torch":
        return {TORCH_INT8.name} if DYNAMIC in kinds else set()
    return {NAMES[kind] for kind in kinds}


def _default_artifact(config: ModelConfig) -> str | None:
    module = importlib.import_module(f"tailserve.runtimes.{config.runtime}")
    artifact = getattr(module, "ARTIFACT", None)
    return artifact if isinstance(artifact, str) else None


def _timing_note(config: ModelConfig, repeat: int) -> str:
    threads = config.instances.intra_op_threads
    shape = datasets.shape_of(config)
    note = (
        f"the median of {repeat} runs a batch after {measure.WARM_RUNS} warm-up runs, the "
        f"variants taking turns; one instance, intra_op_threads {threads}"
    )
    if shape.vary is not None:
        note += f"; {shape.vary} {shape.timing_length} long"
    return note


def _version_warnings(
    model_dir: Path, config: ModelConfig, version: int, kept: list[Variant]
) -> list[str]:
    if not any(variant.artifact for variant in kept):
        return []
    try:
        serving = choose_versions(config.version_policy, versions_on_disk(model_dir), "")
    except ConfigError:
        return []
    others = [v for v in serving if v != version]
    if not others:
        return []
    return [
        f"model.yaml's version policy also serves version(s) {others}, whose folders need "
        f"the kept variants' files too: run tailserve optimize --version N for each"
    ]


def _reason(exc: Exception) -> str:
    message = getattr(exc, "message", None) or str(exc).strip() or type(exc).__name__
    return message.splitlines()[0][:300]
