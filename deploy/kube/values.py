"""The values: the defaults file, overrides merged over it, and the checks a render needs.

Every key an override names must exist in the defaults (a misspelt key is an error, not a
silently ignored setting), except below the free-form maps (`FREE`). Errors name the key.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import yaml

DEFAULTS = Path(__file__).resolve().parent.parent / "values.yaml"
# Keys whose value is a map or list of the user's own: anything goes below them.
FREE = frozenset(
    {
        "models",
        "worker.resources",
        "worker.extraArgs",
        "worker.nodeSelector",
        "worker.tolerations",
        "frontdoor.modelBalance",
        "frontdoor.resources",
        "redis.resources",
        "monitoring.ruleLabels",
        "monitoring.dashboardLabels",
    }
)
# A DNS-1123 label: what a name becomes part of (object names, DNS names).
_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")

Values = dict[str, Any]


class ValuesError(Exception):
    """A values file or override that cannot be rendered; the message names the key."""


def load(files: Iterable[Path] = (), sets: Iterable[str] = ()) -> Values:
    """The defaults, then each file merged over them, then each ``path=value`` override."""
    values = _read(DEFAULTS)
    for path in files:
        values = merge(values, _read(path), source=str(path))
    for item in sets:
        values = merge(values, _parse_set(item), source=f"--set {item}")
    check(values)
    return values


def merge(base: Values, override: Mapping[str, Any], *, source: str, at: str = "") -> Values:
    """``override`` merged over ``base``: maps key by key, anything else replaced; inside a
    free-form map a null value removes its key (as Helm does)."""
    merged = copy.deepcopy(base)
    free = at in FREE or _under_free(at)
    for key, value in override.items():
        path = f"{at}.{key}" if at else str(key)
        if not free and key not in base and path not in FREE:
            raise ValuesError(f"{source}: unknown key {path!r}")
        if free and value is None:
            merged.pop(key, None)
        elif isinstance(value, Mapping) and isinstance(base.get(key), dict):
            merged[key] = merge(base[key], value, source=source, at=path)
        else:
            merged[key] = copy.deepcopy(value)
    return merged


def _under_free(path: str) -> bool:
    return any(path.startswith(f"{free}.") for free in FREE)


def _read(path: Path) -> Values:
    try:
        data = yaml.safe_load(path.read_text())
    except OSError as exc:
        raise ValuesError(f"cannot read values file {path}: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise ValuesError(f"{path}: not YAML: {exc}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ValuesError(f"{path}: a values file is a map of keys, not {type(data).__name__}")
    return data


def _parse_set(item: str) -> Values:
    path, sep, text = item.partition("=")
    if not sep or not path:
        raise ValuesError(f"--set {item!r}: expected PATH=VALUE, e.g. autoscaling.maxReplicas=8")
    value: Any = yaml.safe_load(text) if text else ""
    for key in reversed(path.split(".")):
        value = {key: value}
    return dict(value)


def get(values: Values, path: str) -> Any:
    node: Any = values
    for key in path.split("."):
        node = node[key]
    return node


def check(values: Values) -> None:
    """Raise ValuesError, naming the key, for values that cannot make a working deployment."""
    for path in ("name", "namespace"):
        value = values[path]
        if not isinstance(value, str) or not _LABEL.match(value):
            raise ValuesError(f"{path} must be a DNS label (a-z, 0-9, '-'), not {value!r}")
    ints = {
        "worker.httpPort": 1,
        "worker.grpcPort": 0,
        "worker.drainTimeoutSeconds": 1,
        "worker.preStopSleepSeconds": 0,
        "frontdoor.replicas": 1,
        "frontdoor.httpPort": 1,
        "frontdoor.grpcPort": 0,
        "frontdoor.metricsPort": 1,
        "frontdoor.serverSlots": 1,
        "frontdoor.drainTimeoutSeconds": 1,
        "frontdoor.preStopSleepSeconds": 0,
        "frontdoor.threads": 1,
        "autoscaling.inFlightPerPod": 1,
        "autoscaling.cpuPercent": 0,
        "autoscaling.scaleDownStabilizationSeconds": 0,
        "disruption.workersMinAvailable": 0,
        "redis.masters": 3,
        "redis.replicasPerMaster": 0,
    }
    for path, least in ints.items():
        value = get(values, path)
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise ValuesError(f"{path} must be a whole number of at least {least}, not {value!r}")
    scaling = values["autoscaling"]
    if scaling["enabled"]:
        low, high = scaling["minReplicas"], scaling["maxReplicas"]
        for path, value in (("minReplicas", low), ("maxReplicas", high)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValuesError(f"autoscaling.{path} must be at least 1, not {value!r}")
        if low > high:
            raise ValuesError(
                f"autoscaling.minReplicas ({low}) is above autoscaling.maxReplicas ({high})"
            )
        if scaling["provider"] not in ("prometheus-adapter", "keda"):
            raise ValuesError(
                f"autoscaling.provider must be prometheus-adapter or keda, "
                f"not {scaling['provider']!r}"
            )
        floor, ceiling = low, high
    else:
        replicas = values["worker"]["replicas"]
        if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 1:
            raise ValuesError(f"worker.replicas must be at least 1, not {replicas!r}")
        floor = ceiling = replicas
    slots = values["frontdoor"]["serverSlots"]
    if slots < ceiling:
        raise ValuesError(
            f"frontdoor.serverSlots ({slots}) must be at least the most workers ({ceiling}): "
            "the front door would not see the others"
        )
    keep = values["disruption"]["workersMinAvailable"]
    if keep and keep >= floor:
        raise ValuesError(
            f"disruption.workersMinAvailable ({keep}) must be below the fewest workers ({floor}), "
            "or no worker could ever be evicted (node drains would hang); 0 sets no budget"
        )
    models = values["models"]
    if not isinstance(models, dict):
        raise ValuesError("models must map each model's name to its p99 SLO in ms")
    for model, slo in models.items():
        if isinstance(slo, bool) or not isinstance(slo, int | float) or slo <= 0:
            raise ValuesError(f"models.{model}: the p99 SLO in ms must be positive, not {slo!r}")
    redis = values["redis"]
    if values["examples"]["loadFeatures"] and not (redis["enabled"] or redis["url"]):
        raise ValuesError("examples.loadFeatures needs Redis: redis.enabled or redis.url")
