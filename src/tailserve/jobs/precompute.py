"""Precompute: score known inputs in batches and store each result where a worker looks first.

Each line of the input is one request's inputs as a record, ``{"field": value, ...}`` (a KServe v1
instance); for a model that reads inputs from the feature store, the entity ids instead
(``{"user_id": 7, "item_ids": [1, 2, 3]}``), whose features are looked up in the workers' Redis
as a worker would. The job loads the model as a worker does, scores the lines a batch at a
time through its runtime, and stores every result in Redis under the key a worker computes for
that request sent as OIP v2 JSON, each input a tensor of shape ``[1, *shape]`` in the model's
datatype (the shape KServe v1 records and `tailserve bench` send; ids as ``[1, 1]``, or
``[N, 1]`` for one a row). The value is marked precomputed, so a worker
answers the request with ``cache: precomputed`` and runs nothing.

A checkpoint file, replaced atomically after each batch is stored, says how many lines are done;
a rerun with it starts after them. A bad line stops the job with its line number and field once
the lines before it are stored, so the rerun starts at it; with ``skip_bad`` it is counted and
passed over instead.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys
import time
import urllib.parse
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, TextIO

import numpy as np
import orjson

from tailserve.cache import entry as codec
from tailserve.cache.entry import CachedResult, Lineage, Outputs
from tailserve.cache.feature_store import FeatureStore
from tailserve.cache.features import FeatureResolver
from tailserve.cache.redis import RedisTier, connect, parse_url
from tailserve.cache.tiered import ModelView, ResultCache
from tailserve.engine.served import ServedVersion, VersionBuilder
from tailserve.engine.validation import Checked
from tailserve.errors import (
    ConfigError,
    InvalidInput,
    ModelExecutionError,
    TailserveError,
    UpstreamError,
)
from tailserve.jobs.progress import Checkpoint, Progress
from tailserve.modelconfig import FeatureInput, FeaturesConfig, ModelConfig
from tailserve.repository.manager import ModelManager
from tailserve.tensors import Tensor, from_json

COMPUTED_BY = "precompute"
_WRITE_TRIES = 3


@dataclass(frozen=True, slots=True, kw_only=True)
class Job:
    repository: Path
    model: str
    input: Path
    redis_url: str
    cluster: bool = False
    batch_size: int = 256
    ttl_s: float | None = None  # default: the model's L2 TTL
    checkpoint: Path | None = None
    version: int | None = None  # default: the newest version the model serves
    skip_bad: bool = False
    # Request parameters sent with every line (those in the model's cache.key.parameters
    # are part of the key).
    parameters: dict[str, Any] = field(default_factory=dict)


@dataclass(slots=True)
class Report:
    model: str
    version: int
    lines: int = 0  # lines in the input
    resumed_at: int = 0  # lines done before this run (from the checkpoint)
    written: int = 0  # results stored by this run
    bad: int = 0  # bad lines passed over (skip_bad)
    seconds: float = 0.0
    bad_lines: list[str] = field(default_factory=list)  # the first few, with their reasons
    stopped_at: int | None = None  # the last line done when a signal stopped the job early


# --- records to tensors (pure) --------------------------------------------------------------


def record_tensors(config: ModelConfig, record: Any) -> list[Tensor]:
    """A record's inputs as the tensors a worker decodes from the same request in OIP v2 JSON:
    shape ``[1, *shape]`` (no batch dimension for a model that does not batch), variable
    dimensions from the value. For a model that reads inputs from the feature store, the
    record holds the entity ids instead, as `tailserve bench` sends them: one id of a
    ``shape: [1]`` entity as ``[1, 1]``, a list of one id a row as ``[N, 1]``. Raises
    InvalidInput naming the field."""
    if not isinstance(record, dict):
        raise InvalidInput(
            f'must be a record object {{"field": value, ...}}, got {type(record).__name__}'
        )
    looked_up = {item.input: item for item in (config.features.inputs if config.features else [])}
    names = {
        looked_up[spec.name].key if spec.name in looked_up else spec.name for spec in config.inputs
    }
    unknown = sorted(set(record) - names)
    if unknown:
        raise InvalidInput(f"unknown field {unknown[0]!r} (inputs: {', '.join(sorted(names))})")
    tensors = []
    for spec in config.inputs:
        entity = looked_up.get(spec.name)
        if entity is not None:
            tensors.append(_id_tensor(entity, record.get(entity.key)))
            continue
        if spec.name not in record:
            if spec.optional:
                continue
            raise InvalidInput(f"missing field {spec.name!r}")
        value = record[spec.name]
        shape = _shape(config, spec.name, spec.shape, value)
        try:
            data = from_json(spec.name, spec.datatype, shape, value)
        except InvalidInput as exc:
            raise InvalidInput(_as_field(spec.name, exc.message)) from None
        tensors.append(Tensor(spec.name, spec.datatype, data))
    return tensors


def _id_tensor(entity: FeatureInput, value: Any) -> Tensor:
    """An entity id field as the tensor a client sends: ``[1, 1]``, or ``[N, 1]`` for a list
    of one id a row."""
    name = entity.key
    if value is None:
        raise InvalidInput(
            f"missing field {name!r} (the {entity.entity} ids the model's "
            f"{entity.input!r} is looked up by)"
        )
    per_row = entity.shape == [-1]
    if per_row and not isinstance(value, list):
        value = [value]
    if not per_row and isinstance(value, list):
        if len(value) != 1:
            raise InvalidInput(
                f"field {name!r}: one {entity.entity} id a request, got {len(value)}"
            )
        value = value[0]
    ids = value if per_row else [value]
    if not ids:
        raise InvalidInput(f"field {name!r}: holds no {entity.entity} ids")
    try:
        data = from_json(name, entity.datatype, [len(ids), 1], [[i] for i in ids])
    except InvalidInput as exc:
        raise InvalidInput(_as_field(name, exc.message)) from None
    return Tensor(name, entity.datatype, data)


def _shape(config: ModelConfig, name: str, declared: list[int], value: Any) -> list[int]:
    lead = [1] if config.batched else []
    if -1 not in declared:
        return [*lead, *declared]
    given = _nested_shape(value)
    if len(given) == len(declared) + 1 and given[0] == 1 and config.batched:
        given = given[1:]  # the value holds the batch dimension of one row itself
    if len(given) != len(declared) or any(
        want not in (-1, got) for want, got in zip(declared, given, strict=True)
    ):
        raise InvalidInput(
            f"field {name!r}: a value of shape {given} does not fit the "
            f"model's per-row shape {declared}"
        )
    return [*lead, *given]


def _nested_shape(value: Any) -> list[int]:
    shape = []
    while isinstance(value, list):
        shape.append(len(value))
        value = value[0] if value else None
    return shape


def _as_field(name: str, message: str) -> str:
    prefix = f"tensor {name!r}: "
    return f"field {name!r}: {message.removeprefix(prefix)}"


def score(served: ServedVersion, checked: Sequence[Checked]) -> list[Outputs]:
    """Each request's outputs (the model's declared ones), as the worker's batches split them:
    requests whose inputs have the same per-row shapes go together, up to the largest batch in
    rows (a request of many rows, a ranker's candidates, goes whole)."""
    config = served.config
    runtime = served.runtimes[0]
    results: list[Outputs] = [{} for _ in checked]
    if not config.batched:
        for index, one in enumerate(checked):
            results[index] = _declared(config, runtime.predict(one.arrays), None)
        return results
    groups: dict[Any, list[int]] = {}
    for index, one in enumerate(checked):
        groups.setdefault(one.group, []).append(index)
    for members in groups.values():
        for chunk in _by_rows(members, checked, config.max_batch_size):
            names = checked[chunk[0]].arrays
            merged = {
                name: np.concatenate([checked[i].arrays[name] for i in chunk]) for name in names
            }
            rows = sum(checked[i].rows for i in chunk)
            outputs = _declared(config, runtime.predict(merged), rows)
            offset = 0
            for index in chunk:
                end = offset + checked[index].rows
                results[index] = {name: array[offset:end] for name, array in outputs.items()}
                offset = end
    return results


def _by_rows(members: list[int], checked: Sequence[Checked], max_rows: int) -> Iterator[list[int]]:
    """Consecutive requests of up to ``max_rows`` rows together (each request whole)."""
    chunk: list[int] = []
    rows = 0
    for index in members:
        size = checked[index].rows
        if chunk and rows + size > max_rows:
            yield chunk
            chunk, rows = [], 0
        chunk.append(index)
        rows += size
    if chunk:
        yield chunk


def _declared(config: ModelConfig, outputs: Outputs, rows: int | None) -> Outputs:
    chosen: Outputs = {}
    for spec in config.outputs:
        array = outputs.get(spec.name)
        if array is None:
            raise ModelExecutionError(f"model {config.name!r} gave no output {spec.name!r}")
        if rows is not None and len(array) != rows:
            raise ModelExecutionError(
                f"model {config.name!r}: output {spec.name!r} has "
                f"{len(array)} rows for a batch of {rows}"
            )
        chosen[spec.name] = array
    return chosen


# --- the job --------------------------------------------------------------------------------


async def precompute(job: Job, *, progress: TextIO | None = sys.stderr) -> Report:
    if job.batch_size < 1:
        raise ConfigError("--batch-size must be >= 1")
    if job.ttl_s is not None and not job.ttl_s > 0:
        raise ConfigError("--ttl-s must be > 0")
    url, cluster = parse_url(job.redis_url, cluster=job.cluster)  # redis+cluster://
    job = replace(job, redis_url=url, cluster=cluster)
    total = _count_lines(job.input)
    store: FeatureStore | None = None

    def features(config: FeaturesConfig) -> FeatureResolver:
        # Entity ids are looked up in the workers' feature store, as a worker does.
        nonlocal store
        if store is None:
            client = connect(job.redis_url, cluster=job.cluster, timeout_s=5.0)
            store = FeatureStore(client, timeout_s=5.0, cluster=job.cluster)
        return FeatureResolver(config, store, time.monotonic)

    builder = VersionBuilder(cache=ResultCache(), feature_resolver=features)
    manager = ModelManager(job.repository, builder)
    tier: RedisTier | None = None
    try:
        await manager.load(job.model)
        served = manager.get(job.model, None if job.version is None else str(job.version))
        if not isinstance(served, ServedVersion):
            raise InvalidInput(f"model {job.model!r} is a pipeline: precompute its steps' models")
        view = _cache_view(served)
        tier = await _open_redis(job)
        checkpoint = None
        if job.checkpoint is not None:
            identity = {
                "model": job.model,
                "version": served.version,
                "input": str(job.input.resolve()),
            }
            checkpoint = Checkpoint(job.checkpoint, identity)
        writer = _Writer(job, served, view, tier, checkpoint, total)
        with _stop_on_signals(writer):
            return await writer.run(progress)
    finally:
        if tier is not None:
            await tier.close()
        await manager.close()
        if store is not None:
            await store.close()


@contextlib.contextmanager
def _stop_on_signals(writer: _Writer) -> Iterator[None]:
    """SIGINT or SIGTERM: finish and checkpoint the batch in hand, then stop; a second one acts
    at once (the default handlers are back)."""
    loop = asyncio.get_running_loop()
    installed: list[signal.Signals] = []

    def stop() -> None:
        writer.stopping = True
        for number in installed:
            loop.remove_signal_handler(number)

    for number in (signal.SIGINT, signal.SIGTERM):
        try:
            loop.add_signal_handler(number, stop)
        except (ValueError, RuntimeError, NotImplementedError):
            continue  # not the main thread (an embedding program keeps its own handling)
        installed.append(number)
    try:
        yield
    finally:
        for number in installed:
            loop.remove_signal_handler(number)


def _cache_view(served: ServedVersion) -> ModelView:
    config = served.config
    unread = "a worker would never read what precompute stores"
    if not config.cache.enabled or served.cache is None:
        raise ConfigError(
            f"model {config.name!r} does not cache (cache.enabled is false in its "
            f"model.yaml): {unread}"
        )
    if not config.cache.l2:
        raise ConfigError(
            f"model {config.name!r} keeps results out of Redis (cache.l2 is false in its "
            f"model.yaml): {unread}"
        )
    return served.cache


async def _open_redis(job: Job) -> RedisTier:
    client = connect(job.redis_url, cluster=job.cluster, timeout_s=5.0)
    tier = RedisTier(client, cluster=job.cluster)
    try:
        async with asyncio.timeout(10.0):
            await client.ping()
    except Exception as exc:  # any fault of the client or the socket: say where and why
        await tier.close()
        reason = str(exc) or type(exc).__name__
        raise UpstreamError(f"Redis at {_where(job.redis_url)} does not answer: {reason}") from None
    return tier


def _where(url: str) -> str:
    """The URL's host and port (never its password)."""
    parts = urllib.parse.urlsplit(url)
    return f"{parts.hostname}:{parts.port or 6379}"


def _count_lines(path: Path) -> int:
    count = 0
    last = b"\n"
    try:
        with path.open("rb") as source:
            while chunk := source.read(1 << 20):
                count += chunk.count(b"\n")
                last = chunk[-1:]
    except OSError as exc:
        raise ConfigError(f"cannot read the input {path}: {exc.strerror or exc}") from None
    return count + (last != b"\n")


class _Writer:
    def __init__(
        self,
        job: Job,
        served: ServedVersion,
        view: ModelView,
        tier: RedisTier,
        checkpoint: Checkpoint | None,
        total: int,
    ) -> None:
        self.job = job
        self.served = served
        self.view = view
        self.tier = tier
        self.checkpoint = checkpoint
        policy = view.policy
        self.fresh_s = job.ttl_s if job.ttl_s is not None else policy.l2_ttl_s
        self.keep_s = self.fresh_s + policy.keep_s  # as a worker stores: fresh, then kept
        self.report = Report(job.model, served.version, lines=total)
        self.stopping = False  # set by SIGINT/SIGTERM: stop after the batch being stored

    async def run(self, stream: TextIO | None) -> Report:
        report = self.report
        started = time.monotonic()
        done = report.resumed_at = self.checkpoint.load() if self.checkpoint is not None else 0
        label = f"precompute {self.job.model} v{self.served.version}"
        progress = Progress(label, report.lines, stream, start=done)
        batch: list[tuple[int, Checked, str]] = []
        for number, raw in _lines(self.job.input, after=done):
            if raw.strip():  # a blank line holds no record
                try:
                    batch.append(await self._parse(number, raw))
                except InvalidInput as exc:
                    await self._bad(number, exc.message, batch)
            if number % self.job.batch_size == 0:
                await self._store(batch, number)
                batch = []
                progress.update(number, self._note())
                if self.stopping:
                    report.stopped_at = number
                    break
        else:
            await self._store(batch, report.lines)
        report.seconds = time.monotonic() - started
        progress.update(report.stopped_at or report.lines, self._note(), final=True)
        return report

    async def _bad(self, number: int, message: str, batch: list[tuple[int, Checked, str]]) -> None:
        """Count and pass over a bad line, or (the default) store the lines before it, then
        stop naming it."""
        reason = f"{self.job.input}:{number}: {message}"
        if not self.job.skip_bad:
            await self._store(batch, number - 1)
            raise InvalidInput(reason + self._resume_hint(number))
        self.report.bad += 1
        if len(self.report.bad_lines) < 10:
            self.report.bad_lines.append(reason)

    async def _parse(self, number: int, raw: bytes) -> tuple[int, Checked, str]:
        try:
            record = orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            raise InvalidInput(f"not valid JSON: {exc}") from None
        tensors = record_tensors(self.served.config, record)
        key = self.view.keys.key(tensors, self.job.parameters)  # (of the request as sent)
        if self.served.features is not None:
            # Ids to features as a worker looks them up (an unknown id: a bad line naming it).
            tensors = await self.served.features.resolve(tensors)
        # The worker's own check, so what it would refuse is refused here, naming the input.
        checked = self.served.plan.check(tensors)
        return number, checked, key

    async def _store(self, batch: list[tuple[int, Checked, str]], lines_done: int) -> None:
        if batch:
            first, last = batch[0][0], batch[-1][0]
            try:
                results = score(self.served, [checked for _, checked, _ in batch])
            except TailserveError as exc:
                raise self._failed(first, last, exc.message) from exc
            except Exception as exc:  # runtimes raise anything
                raise self._failed(first, last, f"{type(exc).__name__}: {exc}") from exc
            now = time.time()
            policy = self.view.policy
            lineage = Lineage(
                self.served.version, policy.feature_version, now, COMPUTED_BY, precomputed=True
            )
            items = [
                (key, codec.encode(CachedResult(outputs, lineage, now + self.fresh_s)), self.keep_s)
                for (_, _, key), outputs in zip(batch, results, strict=True)
            ]
            await self._put(items, first)
            self.report.written += len(items)
        if self.checkpoint is not None and lines_done > self.report.resumed_at:
            self.checkpoint.save(lines_done, complete=lines_done >= self.report.lines)

    async def _put(self, items: list[tuple[str, bytes, float]], first: int) -> None:
        pause = 0.2
        for attempt in range(1, _WRITE_TRIES + 1):
            try:
                await self.tier.put_now(items)
                return
            except Exception as exc:
                if attempt == _WRITE_TRIES:
                    raise UpstreamError(
                        f"writing to Redis at {_where(self.job.redis_url)} failed "
                        f"{_WRITE_TRIES} times ({type(exc).__name__}: {exc})"
                        f"{self._resume_hint(first)}"
                    ) from None
            await asyncio.sleep(pause)
            pause *= 2

    def _failed(self, first: int, last: int, reason: str) -> ModelExecutionError:
        return ModelExecutionError(
            f"{self.job.input}: lines {first}-{last}: the model failed: "
            f"{reason}{self._resume_hint(first)}"
        )

    def _resume_hint(self, line: int) -> str:
        if self.checkpoint is None:
            return f"; lines before {line} are stored"
        return (
            f"; lines before {line} are stored: rerun with --checkpoint "
            f"{self.checkpoint.path} to resume at line {line}"
        )

    def _note(self) -> str:
        report = self.report
        note = f"stored {report.written:,}"
        return note + (f"  bad {report.bad:,}" if report.bad else "")


def _lines(path: Path, *, after: int) -> Iterator[tuple[int, bytes]]:
    """The input's lines numbered from 1, those up to ``after`` left out."""
    with path.open("rb") as source:
        for number, raw in enumerate(source, start=1):
            if number > after:
                yield number, raw


def summary(report: Report) -> str:
    rate = report.written / report.seconds if report.seconds > 0 else 0.0
    text = (
        f"precomputed {report.written:,} results for {report.model} v{report.version} "
        f"in {report.seconds:.1f} s ({rate:,.0f}/s)"
    )
    if report.resumed_at:
        text += f"; resumed after line {report.resumed_at:,}"
    if report.stopped_at is not None:
        text += f"; stopped by a signal after line {report.stopped_at:,}"
    if report.bad:
        text += f"; {report.bad:,} bad lines passed over"
    return text
