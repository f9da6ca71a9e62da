"""The test run's `tailserve examples` (tests/conftest.py's fixtures): trained once for the
source and packages it was trained with, kept in pytest's cache folder, and copied into each
test session's own folder (a test that changes its copy changes no other session's).

Each process of `make test`'s two lanes (tests/phases.py) would otherwise train the same
repository again (13-15 s each). The key is every source file of the package and the versions
of the libraries that train and export the models; a process that finds another building
waits for it (a lock file). Only a build that succeeded is kept.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.metadata
import json
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import tailserve

_LIBRARIES = ("numpy", "onnx", "onnxruntime", "scikit-learn", "skl2onnx", "lightgbm")


@dataclass(frozen=True)
class ExamplesRun:
    directory: Path
    done: subprocess.CompletedProcess[str]


def examples_once(cache: Path, into: Path) -> ExamplesRun:
    """The example repository, copied to ``into`` from ``cache`` (built there first when it
    holds none for this source)."""
    built, done = ensure_built(cache)
    if done.returncode != 0:
        return ExamplesRun(built, done)
    shutil.copytree(built, into)
    return ExamplesRun(into, done)


def ensure_built(cache: Path) -> tuple[Path, subprocess.CompletedProcess[str]]:
    """This source's build in ``cache`` and what the command said: built now unless another
    process built it before (or builds it meanwhile: this one waits)."""
    key = _source_key()
    built = cache / key
    cache.mkdir(parents=True, exist_ok=True)
    with (cache / "lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        record = built / "done.json"
        if not record.exists():
            done = _build(built / "repo")
            if done.returncode != 0:
                return built / "repo", done
            record.write_text(json.dumps([done.returncode, done.stdout, done.stderr]))
            for other in cache.iterdir():
                if other.is_dir() and other.name != key:
                    shutil.rmtree(other, ignore_errors=True)
        code, stdout, stderr = json.loads(record.read_text())
    return built / "repo", subprocess.CompletedProcess([], code, stdout, stderr)


def _build(directory: Path) -> subprocess.CompletedProcess[str]:
    shutil.rmtree(directory.parent, ignore_errors=True)
    directory.parent.mkdir(parents=True)
    command = [sys.executable, "-m", "tailserve.cli", "examples", str(directory)]
    return subprocess.run(command, capture_output=True, text=True, timeout=600, check=False)


def _source_key() -> str:
    digest = hashlib.sha256(sys.version.encode())
    for name in _LIBRARIES:
        try:
            digest.update(f"{name}={importlib.metadata.version(name)}".encode())
        except importlib.metadata.PackageNotFoundError:
            digest.update(f"{name}=-".encode())
    root = Path(tailserve.__file__).parent
    for path in sorted(root.rglob("*.py")):
        digest.update(path.relative_to(root).as_posix().encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


if __name__ == "__main__":
    # `python tests/support/examples.py CACHE`: build ahead of the tests (tests/phases.py).
    _, finished = ensure_built(Path(sys.argv[1]))
    sys.stderr.write(finished.stderr if finished.returncode else "")
    sys.exit(finished.returncode)
