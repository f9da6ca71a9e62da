"""The GPUs `tailserve up` spreads its workers over: one worker per GPU by default.

Worker ``i`` sees one GPU, ``devices[i mod N]``, through ``CUDA_VISIBLE_DEVICES``: inside it
that GPU is device 0, which is where a model whose ``instances.providers`` puts ``cuda`` first
runs (torch and ONNX Runtime alike). ``--gpus`` takes ``auto`` (the GPUs this process may use),
``none`` (every worker on the CPU), a count (``2``: GPUs 0 and 1) or a list of ids or UUIDs
(``0,2``). ``auto`` reads ``CUDA_VISIBLE_DEVICES`` where it is set, else asks ``nvidia-smi -L``,
else the driver's ``/proc/driver/nvidia/gpus``; importing torch for a count would cost the
supervisor a second and hundreds of megabytes.
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Mapping
from pathlib import Path

from tailserve.errors import ConfigError

VISIBLE = "CUDA_VISIBLE_DEVICES"
PROC_GPUS = Path("/proc/driver/nvidia/gpus")


def parse_gpus(value: str, env: Mapping[str, str]) -> tuple[str, ...] | None:
    """The devices ``--gpus`` names, or None for ``auto`` (detect them)."""
    text = value.strip().lower()
    if text == "auto":
        return visible_devices(env)
    if text in ("none", "0", ""):
        return ()
    if text.isdigit():
        return tuple(str(i) for i in range(int(text)))
    devices = tuple(part.strip() for part in value.split(",") if part.strip())
    if not devices:
        raise ConfigError(f"--gpus: {value!r} is not auto, none, a count or a list of GPU ids")
    return devices


def visible_devices(env: Mapping[str, str]) -> tuple[str, ...] | None:
    """What ``CUDA_VISIBLE_DEVICES`` allows (None: it is not set). CUDA stops reading the list
    at the first entry that is not a device, so "-1" or "" means none."""
    if VISIBLE not in env:
        return None
    devices: list[str] = []
    for part in env[VISIBLE].split(","):
        entry = part.strip()
        if not entry or entry.startswith("-"):
            break
        devices.append(entry)
    return tuple(devices)


def detect_gpus(timeout_s: float = 5.0) -> tuple[str, ...]:
    """The machine's GPUs as ids "0".."N-1": ``nvidia-smi -L`` where it runs, else the driver's
    entries in /proc; none where neither answers."""
    smi = shutil.which("nvidia-smi")
    if smi is not None:
        try:
            listing = subprocess.run(
                [smi, "-L"], capture_output=True, text=True, timeout=timeout_s, check=True
            ).stdout
        except (OSError, subprocess.SubprocessError):
            listing = ""
        count = sum(line.startswith("GPU ") for line in listing.splitlines())
        if count:
            return tuple(str(i) for i in range(count))
    try:
        return tuple(str(i) for i in range(sum(1 for _ in PROC_GPUS.iterdir())))
    except OSError:
        return ()


def worker_env(index: int, devices: tuple[str, ...]) -> dict[str, str]:
    """What worker ``index`` adds to its environment: its one GPU (nothing with no GPUs)."""
    if not devices:
        return {}
    return {VISIBLE: devices[index % len(devices)]}


def describe(devices: tuple[str, ...], workers: int) -> str:
    """The line `tailserve up` logs at start."""
    if not devices:
        return "no GPU found: workers use the CPU"
    pairs = ", ".join(f"worker {i} → GPU {devices[i % len(devices)]}" for i in range(workers))
    return f"GPUs: {len(devices)} ({pairs})"
