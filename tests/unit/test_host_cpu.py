"""The machine's idle CPU, read from the kernel's counters (a file written here)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tailserve.engine.variants import loop_pressure
from tailserve.observability.host_cpu import HostCpu


def write(path: Path, idle: int, busy: int) -> None:
    # cpu user nice system idle iowait irq softirq steal
    path.write_text(f"cpu  {busy} 0 0 {idle} 0 0 0 0 0 0\ncpu0 1 2 3 4 5 6 7 8 9 10\n")


def test_the_idle_share_follows_what_passed_between_readings(tmp_path: Path) -> None:
    stat = tmp_path / "stat"
    host = HostCpu(stat)
    write(stat, idle=1000, busy=1000)
    host.sample()
    assert host.idle == 1.0  # one reading: nothing passed yet
    for step in range(1, 30):  # the machine saturated: every jiffy busy
        write(stat, idle=1000, busy=1000 + 100 * step)
        host.sample()
    assert host.idle < 0.01
    assert loop_pressure(0.0, 0.0, host.idle) == 1.0
    write(stat, idle=1000 + 100, busy=1000 + 2900 + 100)  # then half idle
    for step in range(2, 30):
        write(stat, idle=1000 + 50 * step, busy=3900 + 50 * step)
        host.sample()
    assert host.idle == pytest.approx(0.5, abs=0.01)
    assert loop_pressure(0.0, 0.0, host.idle) == 0.0


def test_counters_that_cannot_be_read_leave_the_machine_idle(tmp_path: Path) -> None:
    host = HostCpu(tmp_path / "absent")
    host.sample()
    garbled = tmp_path / "garbled"
    garbled.write_text("intr 1 2 3\n")
    HostCpu(garbled).sample()
    assert host.idle == 1.0
