"""Which models and versions serve: loading, warming, swapping and unloading them.

A load builds every chosen version anew (runtimes loaded and warmed in a loader thread) while the
versions already serving keep answering; only when all are warm does one assignment swap them in.
The old versions then drain: requests already queued on them finish. A failed load leaves what
was serving in place and records the reason.

Under a memory budget (``budget_bytes``; 0: none, every model loads at start) the catalogue
applies `residency.Residency`: it loads at start only what fits, loads one model at a time, and
before each load unloads the least recently used models until the new one fits. A model
unloaded for the budget is *cold*: a request for it (`acquire`) loads it again, and waits for
that load if it is expected to end before the request's deadline; else it is refused at once
(`ModelNotReady`, 503, with the expected wait as Retry-After) while the load goes on. Requests
for one cold model share its load. Each load's time and the memory it added
(`footprint.memory_now`) are measured and kept: they are the next estimates.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from enum import StrEnum
from functools import partial
from pathlib import Path
from typing import Generic, Protocol, TypeVar

from tailserve.errors import (
    ConfigError,
    DeadlineExceeded,
    InvalidInput,
    ModelLoadError,
    ModelNotFound,
    ModelNotReady,
    ModelNotServed,
    TailserveError,
)
from tailserve.modelconfig import ModelConfig, load_model_config
from tailserve.repository.discovery import choose_versions, model_dirs, versions_on_disk
from tailserve.repository.footprint import (
    Memory,
    artifact_bytes,
    memory_now,
    release_free_memory,
)
from tailserve.repository.residency import Eviction, Residency
from tailserve.runtimes import import_backend

log = logging.getLogger(__name__)

COLD_REASON = "unloaded to fit the worker's memory budget; a request loads it again"
NOT_STARTED_REASON = "not loaded at start, to fit the worker's memory budget; a request loads it"


class ModelStatus(StrEnum):
    LOADING = "LOADING"
    READY = "READY"
    UNLOADING = "UNLOADING"
    UNAVAILABLE = "UNAVAILABLE"


S = TypeVar("S")


class Builder(Protocol[S]):
    """Makes one served version of a model from its folder, and retires it (the catalogue
    knows models and versions; what a served version holds is the builder's business)."""

    async def build(self, config: ModelConfig, version: int, version_dir: Path) -> S: ...

    async def retire(self, served: S) -> None: ...

    def close(self) -> None: ...


class LoadObserver(Protocol):
    """Told of loads, unloads and the requests that found their model unloaded (metrics)."""

    def on_model_load(self, model: str, seconds: float) -> None: ...

    def on_model_unload(self, model: str, seconds: float, reason: str) -> None: ...

    def on_cold_request(self, model: str, outcome: str) -> None: ...


@dataclass(slots=True)
class ModelState(Generic[S]):
    name: str
    status: ModelStatus = ModelStatus.UNAVAILABLE
    reason: str = ""
    # Left out for want of a service the worker was not given (ModelNotServed): no failure.
    not_served: bool = False
    # Not loaded, to fit the memory budget: a request loads it (no failure either).
    cold: bool = False
    config: ModelConfig | None = None
    versions: dict[int, S] = field(default_factory=dict)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    @property
    def ready(self) -> bool:
        # Versions are present only once warm, and stay while a reload builds their successors.
        return bool(self.versions)


@dataclass(slots=True)
class _Pending:
    """A load asked for by requests (or a prefetch), queued or running."""

    task: asyncio.Task[None]
    expected_s: float
    started: float | None = None  # when it took its turn


class ModelManager(Generic[S]):
    """The catalogue: which models and versions serve, and their states."""

    def __init__(
        self,
        repository: Path,
        builder: Builder[S],
        *,
        on_ready_change: Callable[[str, bool], None] | None = None,
        budget_bytes: int = 0,
        pinned: Iterable[str] = (),
        eviction: Eviction = "lru",
        observer: LoadObserver | None = None,
        clock: Callable[[], float] = time.monotonic,
        memory: Callable[[], Memory] = memory_now,
    ) -> None:
        self.repository = repository
        self._builder = builder
        self._on_ready_change = on_ready_change
        self._models: dict[str, ModelState[S]] = {}
        self.residency = Residency(budget_bytes, pinned=pinned, eviction=eviction)
        self._observer = observer
        self._clock = clock
        self._memory = memory
        # Under a budget, one load at a time: room is made for it alone, and what it adds to
        # the process is measured without another build's allocations in it.
        self._turn = asyncio.Lock()
        self._pending: dict[str, _Pending] = {}  # in the order they take their turns
        self._closing = False

    # --- queries (on the request path: no awaits, no I/O) ---------------------------------

    def get(self, name: str, version: str | None = None) -> S:
        state = self._models.get(name)
        if state is None:
            raise ModelNotFound(f"unknown model {name!r}")
        if not state.versions:
            detail = f": {state.reason}" if state.reason else ""
            raise ModelNotReady(
                f"model {name!r} is not ready ({state.status.value.lower()}){detail}",
                retry_after_s=1.0,
            )
        if version is None:
            return state.versions[max(state.versions)]
        try:
            served = state.versions.get(int(version))
        except ValueError:
            raise InvalidInput(f"model version must be a whole number, got {version!r}") from None
        if served is None:
            serving = sorted(state.versions)
            raise ModelNotFound(
                f"model {name!r} has no version {version} serving (serving: {serving})"
            )
        return served

    def peek(self, name: str, version: str | None = None) -> S | None:
        """`get`, but None for a model unloaded to fit the memory budget (`acquire` loads it)."""
        state = self._models.get(name)
        if state is not None and state.cold and not state.versions:
            return None
        return self.get(name, version)

    def config(self, name: str) -> ModelConfig:
        """The model's configuration: the serving one's, or a cold model's as last read."""
        state = self.state(name)
        if state.config is None or not (state.versions or state.cold):
            self.get(name)  # not ready: says why
        assert state.config is not None
        return state.config

    def state(self, name: str) -> ModelState[S]:
        state = self._models.get(name)
        if state is None:
            raise ModelNotFound(f"unknown model {name!r}")
        return state

    def states(self) -> list[ModelState[S]]:
        return [self._models[name] for name in sorted(self._models)]

    def known_on_disk(self) -> dict[str, Path]:
        return model_dirs(self.repository)

    @property
    def all_ready(self) -> bool:
        """Every model that has been asked to load is serving (failed ones count as not)."""
        return all(state.ready for state in self._models.values())

    # --- a request's model ------------------------------------------------------------------

    async def acquire(
        self, name: str, version: str | None, deadline: Callable[[ModelConfig], float]
    ) -> S:
        """The served version a request uses (`get`'s). A cold model loads first: the request
        waits for it if the load is expected to end by ``deadline(config)`` (monotonic), else
        it is refused at once while the load goes on."""
        state = self._models.get(name)
        if state is not None and state.versions:
            if self.residency.limited:
                self.residency.used(name, self._clock())
            return self.get(name, version)
        if state is None or not state.cold or state.config is None:
            return self.get(name, version)  # unknown, or not ready: says why
        return await self._after_load(state, version, deadline(state.config))

    async def _after_load(self, state: ModelState[S], version: str | None, deadline: float) -> S:
        name = state.name
        while True:
            now = self._clock()
            self.residency.used(name, now)
            pending = self._demand(name)
            ready_at = self._ready_at(name, now)
            if ready_at > deadline:
                self._cold_request(name, "refused")
                raise ModelNotReady(
                    f"model {name!r} is not loaded on this worker ({COLD_REASON.split(';')[0]}): "
                    f"it is loading now, ready in about {(ready_at - now) * 1e3:.0f} ms, past "
                    f"this request's deadline ({max(0.0, deadline - now) * 1e3:.0f} ms left); "
                    "retry after it",
                    retry_after_s=max(1.0, math.ceil(ready_at - now)),
                )
            try:
                await asyncio.wait_for(asyncio.shield(pending.task), max(0.0, deadline - now))
            except TimeoutError:
                self._cold_request(name, "late")
                raise DeadlineExceeded(
                    f"model {name!r} was still loading at this request's deadline"
                ) from None
            except TailserveError:
                if not state.versions:
                    self._cold_request(name, "failed")
                    return self.get(name, version)  # raises: the load's error is its reason
            if state.versions:
                self._cold_request(name, "waited")
                return self.get(name, version)
            if not state.cold:
                return self.get(name, version)  # unloaded by hand meanwhile: says so
            # Unloaded again for another model before this request had it: its deadline
            # decides again.

    # --- changes ----------------------------------------------------------------------------

    async def load_all(self) -> list[str]:
        """Load every model in the repository (under a budget, those that fit; the rest are
        cold); return the names that failed (logged). A model the worker is not set up to serve
        is left out with an INFO line: it did not fail."""
        failed = []
        names = list(self.known_on_disk())
        for name in names:
            self._models.setdefault(name, ModelState(name, status=ModelStatus.LOADING))
        chosen = self._start_plan(names) if self.residency.limited else names
        for name in chosen:
            try:
                await self.load(name)
            except ModelNotServed as exc:
                log.info("%s", exc.message)
            except TailserveError as exc:
                log.error("model %r failed to load: %s", name, exc.message)
                failed.append(name)
        return failed

    async def load(self, name: str) -> None:
        """(Re)load a model from disk: new versions warm first, then swap, then drain the old.
        Under a budget, in its turn, once the least recently used models have made room."""
        if name not in self.known_on_disk():
            raise ModelNotFound(f"model {name!r} is not in the repository {self.repository}")
        state: ModelState[S] = self._models.setdefault(name, ModelState(name))
        if not self.residency.limited:
            await self._build(state)
            return
        async with self._turn:
            pending = self._pending.get(name)
            if pending is not None and pending.started is None:
                pending.started = self._clock()
            await self._within_budget(state)

    async def unload(self, name: str, *, evicted: bool = False) -> None:
        """Unload a model: new requests get 503 at once; queued ones finish. ``evicted``: for
        the memory budget, so the model is cold (a request loads it again)."""
        state = self.state(name)
        async with state.lock:
            if evicted and not state.versions:
                return  # unloaded meanwhile
            began = self._clock()
            old, state.versions = state.versions, {}
            state.status, state.reason, state.cold = ModelStatus.UNLOADING, "", evicted
            self._notify(state)
            await asyncio.gather(*(self._builder.retire(v) for v in old.values()))
            release_free_memory()
            state.status = ModelStatus.UNAVAILABLE
            state.reason = COLD_REASON if evicted else ""
            self.residency.unloaded(name)
            if old and self._observer is not None:
                self._observer.on_model_unload(
                    name, self._clock() - began, "budget" if evicted else "request"
                )
            log.info("model %r unloaded%s", name, " to fit the memory budget" if evicted else "")
        if not evicted:
            self._prefetch()

    async def close(self) -> None:
        self._closing = True
        loads = [pending.task for pending in self._pending.values()]
        for task in loads:
            task.cancel()
        await asyncio.gather(*loads, return_exceptions=True)
        for state in self._models.values():
            old, state.versions = state.versions, {}
            state.status = ModelStatus.UNAVAILABLE
            await asyncio.gather(*(self._builder.retire(v) for v in old.values()))
        self._builder.close()

    # --- loading ----------------------------------------------------------------------------

    def _read(self, name: str) -> tuple[ModelConfig, list[int]]:
        """The model's config and the versions its policy chooses (ConfigError if none)."""
        model_dir = self.repository / name
        config = load_model_config(model_dir)
        if config.name != name:
            raise ConfigError(
                f"{model_dir / 'model.yaml'}: field 'name': {config.name!r} does not "
                f"match its folder {name!r}"
            )
        source = str(model_dir / "model.yaml")
        chosen = choose_versions(config.version_policy, versions_on_disk(model_dir), source)
        self.residency.know(
            name,
            artifact_bytes((model_dir / str(v) for v in chosen), config.instances.count),
        )
        return config, chosen

    def _start_plan(self, names: list[str]) -> list[str]:
        """Under a budget: the models to load at start (those whose config cannot be read are
        among them, for the load to report); the others are marked cold."""
        readable = []
        for name in names:
            try:
                self._models[name].config = self._read(name)[0]
            except TailserveError:
                continue
            readable.append(name)
        start = set(self.residency.initial(readable))
        for name in readable:
            if name not in start:
                state = self._models[name]
                state.status, state.reason, state.cold = (
                    ModelStatus.UNAVAILABLE,
                    NOT_STARTED_REASON,
                    True,
                )
                self._notify(state)
        return [name for name in names if name in start or name not in readable]

    async def _build(self, state: ModelState[S]) -> None:
        name = state.name
        async with state.lock:
            state.status = ModelStatus.LOADING
            try:
                config, chosen = self._read(name)
                import_backend(config.runtime)  # the library is the process's, not the model's
                before, began = self._memory(), self._clock()
                fresh: dict[int, S] = {}
                try:
                    for version in chosen:
                        fresh[version] = await self._builder.build(
                            config, version, self.repository / name / str(version)
                        )
                except BaseException:
                    await asyncio.gather(*(self._builder.retire(v) for v in fresh.values()))
                    raise
                seconds = self._clock() - began
                release_free_memory()
                grown = before.growth_to(self._memory())
            except TailserveError as exc:
                state.reason = exc.message
                state.not_served = isinstance(exc, ModelNotServed)
                state.cold = False
                state.status = ModelStatus.READY if state.versions else ModelStatus.UNAVAILABLE
                self._notify(state)
                raise
            old = state.versions
            state.config, state.versions = config, fresh
            state.status, state.reason, state.not_served = ModelStatus.READY, "", False
            state.cold = False
            self.residency.loaded(name, self._clock(), seconds=seconds, measured_bytes=grown)
            if self._observer is not None:
                self._observer.on_model_load(name, seconds)
            self._notify(state)
            log.info(
                "model %r serving versions %s (%.0f ms, %.1f MiB)",
                name,
                sorted(fresh),
                seconds * 1e3,
                self.residency.cost(name) / 2**20,
            )
            await asyncio.gather(*(self._builder.retire(v) for v in old.values()))
            release_free_memory()

    async def _within_budget(self, state: ModelState[S]) -> None:
        """Unload the least wanted models until ``state``'s model fits, load it, and
        unload more if it turned out larger than estimated."""
        name = state.name
        for check in ("estimate", "measure"):
            victims = self.residency.victims(name, self._clock())
            if victims is None:
                if check == "measure":
                    await self.unload(name)
                raise self._too_large(state)
            for victim in victims:
                log.info("unloading %r to make room for %r", victim, name)
                await self.unload(victim, evicted=True)
            if check == "estimate":
                await self._build(state)

    def _too_large(self, state: ModelState[S]) -> ModelLoadError:
        residency = self.residency
        pinned = sum(
            cost
            for other, cost in residency.resident().items()
            if other in residency.pinned and other != state.name
        )
        message = (
            f"model {state.name!r} needs {residency.cost(state.name) / 2**20:.1f} MiB, more than "
            f"the worker's memory budget ({residency.budget / 2**20:.1f} MiB) holds"
            + (f" beside its pinned models ({pinned / 2**20:.1f} MiB)" if pinned else "")
        )
        state.reason, state.cold = message, False
        state.status = ModelStatus.READY if state.versions else ModelStatus.UNAVAILABLE
        self._notify(state)
        return ModelLoadError(message)

    # --- loads on demand --------------------------------------------------------------------

    def _demand(self, name: str) -> _Pending:
        """The load of ``name`` that requests wait for: the one queued or running, else a new
        one at the back of the queue."""
        pending = self._pending.get(name)
        if pending is None:
            task = asyncio.create_task(self.load(name), name=f"load {name}")
            pending = _Pending(task, self.residency.expected_load_s(name))
            self._pending[name] = pending
            task.add_done_callback(partial(self._loaded, name))
        return pending

    def _loaded(self, name: str, task: asyncio.Task[None]) -> None:
        if self._pending.get(name) is not None and self._pending[name].task is task:
            del self._pending[name]
        if task.cancelled():
            return
        error = task.exception()
        if isinstance(error, TailserveError):
            log.error("model %r failed to load on demand: %s", name, error.message)
        elif error is not None:
            log.error("model %r failed to load on demand", name, exc_info=error)
        self._prefetch()

    def _ready_at(self, name: str, now: float) -> float:
        """When ``name``'s queued load is expected to be done (monotonic)."""
        at = now
        for key, pending in self._pending.items():
            if pending.started is not None:
                at = max(at, pending.started + pending.expected_s)
            else:
                at += pending.expected_s
            if key == name:
                break
        return at

    def _prefetch(self) -> None:
        """With no load waiting, load the cold model with the most recent traffic that fits the
        room free now (unloading nothing), before its next request."""
        if self._closing or self._pending or not self.residency.limited:
            return
        cold = [state.name for state in self._models.values() if state.cold and not state.versions]
        chosen = self.residency.prefetch(self._clock(), cold)
        if chosen is not None:
            log.info("loading %r ahead of its requests (recent traffic, room free)", chosen)
            self._demand(chosen)

    def _cold_request(self, name: str, outcome: str) -> None:
        if self._observer is not None:
            self._observer.on_cold_request(name, outcome)

    # --- helpers ----------------------------------------------------------------------------

    def _notify(self, state: ModelState[S]) -> None:
        if self._on_ready_change is not None:
            self._on_ready_change(state.name, state.ready)
