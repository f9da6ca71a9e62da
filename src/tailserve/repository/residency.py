"""Which models a worker keeps loaded under its memory budget: a pure policy.

The catalogue (`repository.manager`) tells it what happens (a request for a model, a load with
its time and measured size, an unload) and asks it what to do:

- what a model costs: the larger of its artifact files' bytes (the estimate before it has
  loaded here) and what its last build was measured to add to the process;
- which models to load at start: the pinned ones, then the rest in repository order while
  their estimates fit;
- which loaded models to unload so that another fits (pinned ones never): by default
  (``lru``) the least recently used first (a load counts as a use); or (``traffic``) those with
  the least recent traffic (requests, each counting half after `half_life_s`), so that the hot
  models stay and a cold model loaded for one request is the next out. Neither wins
  everywhere: ``benchmarks/many_models.py`` measures both;
- how long a model's load is expected to take: its last load here, else the mean of the other
  models' loads, else `DEFAULT_LOAD_S`;
- which unloaded model to load ahead of its next request: the one with the most recent traffic
  (a count of requests that halves every `half_life_s`) that fits the room free now, without
  unloading anything.

A budget of 0 is no budget: everything fits and nothing is unloaded. Pure: the caller passes
``now`` (a monotonic clock); nothing here does I/O.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

from tailserve.errors import ConfigError

# A model's expected load time before any load has been measured on this worker.
DEFAULT_LOAD_S = 1.0
# Recent traffic below this (requests, decayed: one request within the last half-life) is no
# reason to load a model ahead of demand.
PREFETCH_MIN_RECENT = 0.5

Eviction = Literal["traffic", "lru"]
EVICTIONS: tuple[str, ...] = ("traffic", "lru")


@dataclass(slots=True)
class _Model:
    estimate: int  # bytes of its artifact files (every chosen version, every instance)
    measured: int = 0  # bytes its last build added to the process (0: not measured yet)
    load_s: float | None = None  # its last load's seconds here
    loaded: bool = False
    last_used: float = -math.inf  # its last request, or its last load
    recent: float = 0.0  # requests, halving every half_life_s, as of counted_at
    counted_at: float = 0.0


class Residency:
    def __init__(
        self,
        budget_bytes: int,
        *,
        pinned: Iterable[str] = (),
        half_life_s: float = 30.0,
        default_load_s: float = DEFAULT_LOAD_S,
        eviction: Eviction = "lru",
    ) -> None:
        if budget_bytes < 0:
            raise ConfigError(f"the model memory budget must be at least 0, not {budget_bytes}")
        if half_life_s <= 0:
            raise ConfigError(f"half_life_s must be over 0, not {half_life_s}")
        if eviction not in EVICTIONS:
            raise ConfigError(
                f"the model eviction policy must be one of {', '.join(EVICTIONS)}, not {eviction!r}"
            )
        self.eviction = eviction
        self.budget = budget_bytes
        self.pinned = frozenset(pinned)
        self._half_life_s = half_life_s
        self._default_load_s = default_load_s
        self._models: dict[str, _Model] = {}

    @property
    def limited(self) -> bool:
        return self.budget > 0

    # --- what happens ----------------------------------------------------------------------

    def know(self, name: str, estimate: int) -> None:
        """A model on disk, with its artifact bytes (kept measurements stay)."""
        model = self._models.get(name)
        if model is None:
            self._models[name] = _Model(estimate=max(0, estimate))
        else:
            model.estimate = max(0, estimate)

    def used(self, name: str, now: float) -> None:
        """A request for ``name`` came (loaded or not)."""
        model = self._model(name)
        model.recent = self._decayed(model, now) + 1.0
        model.counted_at = now
        model.last_used = now

    def loaded(self, name: str, now: float, *, seconds: float, measured_bytes: int) -> None:
        model = self._model(name)
        model.loaded = True
        model.load_s = seconds
        model.measured = max(0, measured_bytes)
        model.last_used = max(model.last_used, now)

    def unloaded(self, name: str) -> None:
        self._model(name).loaded = False

    # --- what it says ----------------------------------------------------------------------

    def cost(self, name: str) -> int:
        model = self._model(name)
        return max(model.estimate, model.measured)

    def measured(self, name: str) -> bool:
        return self._model(name).measured > 0

    def resident(self) -> dict[str, int]:
        """The loaded models and what each costs."""
        return {name: self.cost(name) for name, model in self._models.items() if model.loaded}

    def held(self) -> int:
        return sum(self.resident().values())

    def free(self) -> int:
        """Bytes of the budget not held (without a budget: none to speak of, 0)."""
        return max(0, self.budget - self.held()) if self.limited else 0

    def fits(self, name: str) -> bool:
        """Whether ``name`` fits beside what is loaded now, unloading nothing."""
        return not self.limited or self.held() + self._extra(name) <= self.budget

    def initial(self, names: Iterable[str]) -> list[str]:
        """The models to load at start, in order: the pinned ones, then the others in the order
        given while their estimates fit beside those before them."""
        ordered = list(names)
        chosen = [name for name in ordered if name in self.pinned]
        if not self.limited:
            return chosen + [name for name in ordered if name not in self.pinned]
        held = sum(self.cost(name) for name in chosen)
        for name in ordered:
            if name in self.pinned:
                continue
            if held + self.cost(name) <= self.budget:
                chosen.append(name)
                held += self.cost(name)
        return chosen

    def victims(self, keep: str, now: float) -> list[str] | None:
        """The loaded models to unload, the least wanted first (see the module's docstring),
        so that ``keep`` (loaded or about to load) fits within the budget; never ``keep`` nor
        a pinned model. None: it cannot fit even with every other unpinned model unloaded."""
        if not self.limited:
            return []
        over = self.held() + self._extra(keep) - self.budget
        chosen: list[str] = []
        order = sorted(
            (
                self._decayed(model, now) if self.eviction == "traffic" else 0.0,
                model.last_used,
                name,
            )
            for name, model in self._models.items()
            if model.loaded and name != keep and name not in self.pinned
        )
        for _, _, name in order:
            if over <= 0:
                break
            chosen.append(name)
            over -= self.cost(name)
        return chosen if over <= 0 else None

    def expected_load_s(self, name: str) -> float:
        own = self._model(name).load_s
        if own is not None:
            return own
        others = [m.load_s for m in self._models.values() if m.load_s is not None]
        return sum(others) / len(others) if others else self._default_load_s

    def recent(self, name: str, now: float) -> float:
        """Requests for ``name`` lately (each counts half after ``half_life_s``)."""
        return self._decayed(self._model(name), now)

    def prefetch(self, now: float, candidates: Iterable[str]) -> str | None:
        """Of ``candidates`` (unloaded models that may load), the one with the most recent
        traffic that fits the room free now; None when none has traffic enough or fits."""
        best: tuple[float, float, str] | None = None
        for name in candidates:
            model = self._model(name)
            if model.loaded or not self.fits(name):
                continue
            recent = self._decayed(model, now)
            if recent < PREFETCH_MIN_RECENT:
                continue
            key = (recent, model.last_used, name)
            if best is None or key > best:
                best = key
        return None if best is None else best[2]

    # --- helpers ---------------------------------------------------------------------------

    def _extra(self, name: str) -> int:
        """What loading ``name`` adds to what is held (a reload of a loaded model: nothing
        beyond what it holds already)."""
        return 0 if self._model(name).loaded else self.cost(name)

    def _decayed(self, model: _Model, now: float) -> float:
        if model.recent == 0.0:
            return 0.0
        elapsed = max(0.0, now - model.counted_at)
        return model.recent * math.pow(0.5, elapsed / self._half_life_s)

    def _model(self, name: str) -> _Model:
        model = self._models.get(name)
        if model is None:
            model = self._models[name] = _Model(estimate=0)
        return model
