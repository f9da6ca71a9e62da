"""Finding models and their versions on disk, and choosing which versions serve."""

from __future__ import annotations

from pathlib import Path

from tailserve.errors import ConfigError
from tailserve.modelconfig import CONFIG_FILE, VersionPolicy


def model_dirs(repository: Path) -> dict[str, Path]:
    """Every folder of the repository that holds a model.yaml, by name."""
    if not repository.is_dir():
        raise ConfigError(f"model repository {repository} is not a folder")
    return {
        child.name: child
        for child in sorted(repository.iterdir())
        if child.is_dir() and (child / CONFIG_FILE).is_file()
    }


def versions_on_disk(model_dir: Path) -> list[int]:
    return sorted(
        int(child.name)
        for child in model_dir.iterdir()
        if child.is_dir() and child.name.isdigit() and int(child.name) > 0
    )


def choose_versions(policy: VersionPolicy, available: list[int], source: str) -> list[int]:
    """Apply the version policy; an empty choice is an error naming what was found."""
    if policy.all:
        chosen = list(available)
    elif policy.specific is not None:
        missing = sorted(set(policy.specific) - set(available))
        if missing:
            raise ConfigError(
                f"{source}: field 'version_policy.specific': versions {missing} not found "
                f"(on disk: {available})"
            )
        chosen = sorted(policy.specific)
    else:
        chosen = available[-(policy.latest or 1) :]
    if not chosen:
        raise ConfigError(f"{source}: no numbered version folder (such as 1/) found")
    return chosen
