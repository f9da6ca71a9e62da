"""Children in sessions of their own keep the CPU priority of their parent's session (Linux
autogroups), tried in real processes: a parent in a session of its own, so that this test's
session keeps its priority."""

from __future__ import annotations

import json
import subprocess
import sys

from tailserve.process.sessions import session_nice

# A parent at session nice NICE starts a child with `start_session` and says what its own and
# its child's sessions are and what the child's session weighs.
PARENT = """
import asyncio, json, os, sys
from tailserve.process.sessions import session_nice, set_session_nice, start_session

nice = int(sys.argv[1])
if nice:
    set_session_nice(nice)

async def main():
    child = await start_session(sys.executable, "-c", "import time; time.sleep(30)")
    try:
        print(json.dumps({
            "parent": [os.getsid(0), session_nice()],
            "child": [os.getsid(child.pid), session_nice(child.pid)],
        }))
    finally:
        child.kill()
        await child.wait()

asyncio.run(main())
"""


def run_parent(nice: int) -> dict[str, list[int | None]]:
    done = subprocess.run(
        [sys.executable, "-c", PARENT, str(nice)],
        capture_output=True,
        text=True,
        timeout=60,
        start_new_session=True,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    found: dict[str, list[int | None]] = json.loads(done.stdout)
    return found


def test_a_child_in_a_session_of_its_own_weighs_what_its_parents_session_does() -> None:
    low = run_parent(7)
    assert low["child"][0] != low["parent"][0]  # a session of its own
    if session_nice() is None:  # no autogroups here: the child runs as started
        assert low["parent"][1] is None and low["child"][1] is None
        return
    assert low["parent"][1] == 7
    assert low["child"][1] == 7
    default = run_parent(0)
    assert default["parent"][1] == default["child"][1] == 0
