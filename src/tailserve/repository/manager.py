"""Which models and versions serve: loading, warming, swapping and unloading them.

A load builds every chosen version anew (runtimes loaded and warmed in a loader thread) while the
versions already serving keep answering; only when all are warm does one assignment swap them in.
The old versions then drain: requests already queued on them finish. A failed load leaves what
was serving in place and records the reason.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Generic, Protocol, TypeVar

from tailserve.errors import (
    ConfigError,
    InvalidInput,
    ModelNotFound,
    ModelNotReady,
    ModelNotServed,
    TailserveError,
)
from tailserve.modelconfig import ModelConfig, load_model_config
from tailserve.repository.discovery import choose_versions, model_dirs, versions_on_disk

log = logging.getLogger(__name__)


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


@dataclass(slots=True)
class ModelState(Generic[S]):
    name: str
    status: ModelStatus = ModelStatus.UNAVAILABLE
    reason: str = ""
    # Left out for want of a service the worker was not given (ModelNotServed): no failure.
    not_served: bool = False
    config: ModelConfig | None = None
    versions: dict[int, S] = field(default_factory=dict)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    @property
    def ready(self) -> bool:
        # Versions are present only once warm, and stay while a reload builds their successors.
        return bool(self.versions)


class ModelManager(Generic[S]):
    """The catalogue: which models and versions serve, and their states."""

    def __init__(
        self,
        repository: Path,
        builder: Builder[S],
        *,
        on_ready_change: Callable[[str, bool], None] | None = None,
    ) -> None:
        self.repository = repository
        self._builder = builder
        self._on_ready_change = on_ready_change
        self._models: dict[str, ModelState[S]] = {}

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

    # --- changes ----------------------------------------------------------------------------

    async def load_all(self) -> list[str]:
        """Load every model in the repository; return the names that failed (logged). A model
        the worker is not set up to serve is left out with an INFO line: it did not fail."""
        failed = []
        for name in self.known_on_disk():
            self._models.setdefault(name, ModelState(name, status=ModelStatus.LOADING))
        for name in self.known_on_disk():
            try:
                await self.load(name)
            except ModelNotServed as exc:
                log.info("%s", exc.message)
            except TailserveError as exc:
                log.error("model %r failed to load: %s", name, exc.message)
                failed.append(name)
        return failed

    async def load(self, name: str) -> None:
        """(Re)load a model from disk: new versions warm first, then swap, then drain the old."""
        model_dir = self.repository / name
        if name not in self.known_on_disk():
            raise ModelNotFound(f"model {name!r} is not in the repository {self.repository}")
        state: ModelState[S] = self._models.setdefault(name, ModelState(name))
        async with state.lock:
            state.status = ModelStatus.LOADING
            try:
                config = load_model_config(model_dir)
                if config.name != name:
                    raise ConfigError(
                        f"{model_dir / 'model.yaml'}: field 'name': {config.name!r} does not "
                        f"match its folder {name!r}"
                    )
                source = str(model_dir / "model.yaml")
                chosen = choose_versions(config.version_policy, versions_on_disk(model_dir), source)
                fresh: dict[int, S] = {}
                try:
                    for version in chosen:
                        fresh[version] = await self._builder.build(
                            config, version, model_dir / str(version)
                        )
                except BaseException:
                    await asyncio.gather(*(self._builder.retire(v) for v in fresh.values()))
                    raise
            except TailserveError as exc:
                state.reason = exc.message
                state.not_served = isinstance(exc, ModelNotServed)
                state.status = ModelStatus.READY if state.versions else ModelStatus.UNAVAILABLE
                self._notify(state)
                raise
            old = state.versions
            state.config, state.versions = config, fresh
            state.status, state.reason, state.not_served = ModelStatus.READY, "", False
            self._notify(state)
            log.info("model %r serving versions %s", name, sorted(fresh))
            await asyncio.gather(*(self._builder.retire(v) for v in old.values()))

    async def unload(self, name: str) -> None:
        state = self.state(name)
        async with state.lock:
            old, state.versions = state.versions, {}
            state.status, state.reason = ModelStatus.UNLOADING, ""
            self._notify(state)
            await asyncio.gather(*(self._builder.retire(v) for v in old.values()))
            state.status = ModelStatus.UNAVAILABLE
            log.info("model %r unloaded", name)

    async def close(self) -> None:
        for state in self._models.values():
            old, state.versions = state.versions, {}
            state.status = ModelStatus.UNAVAILABLE
            await asyncio.gather(*(self._builder.retire(v) for v in old.values()))
        self._builder.close()

    # --- helpers ----------------------------------------------------------------------------

    def _notify(self, state: ModelState[S]) -> None:
        if self._on_ready_change is not None:
            self._on_ready_change(state.name, state.ready)
