"""The session's run of `tailserve examples` (tests/conftest.py's fixtures)."""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class ExamplesRun:
    directory: Path
    done: subprocess.CompletedProcess[str]
